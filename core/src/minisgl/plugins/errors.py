"""Exceptions and warnings of the plugin layer (standard library only)."""

from __future__ import annotations


class PluginError(RuntimeError):
    """A plugin could not be loaded, two plugins conflict, or a component cannot be built."""


class UnknownComponentError(LookupError):
    """A requested component name is not provided by any active plugin (or not for this device)."""

    def __str__(self) -> str:  # LookupError would quote the message like a key; keep it readable
        return str(self.args[0]) if self.args else ""


class PluginWarning(UserWarning):
    """A plugin was skipped, overridden or misconfigured; start-up goes on without it.

    Filter it like any warning (``-W error::minisgl.plugins.PluginWarning``), or set
    ``MINISGL_STRICT_PLUGINS=1`` to make a plugin that fails to load fatal.
    """
