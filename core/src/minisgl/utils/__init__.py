"""Small helpers with no heavy imports (usable from the command line's fast paths)."""

#: The release of this source tree; core/pyproject.toml carries the same number.
VERSION = "0.3.0"
