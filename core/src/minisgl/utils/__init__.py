"""Small helpers with no heavy imports (usable from the command line's fast paths)."""
