"""Entry module: minisgl imports this at start-up, so it declares and never builds.

It imports only ``minisgl.plugins`` (no torch, no kernels): ``minisgl plugins``
and ``--help`` stay fast, and a machine without the kernel library can still list
the plugin. The backend class is named as a lazy ``"module:attribute"`` string and
imported only when an engine actually builds it.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.plugins import AttentionBackendSpec, hookimpl


def is_supported(device: str) -> bool:
    """``device`` is a device type: ``"cpu"`` or ``"cuda"``. The torch code underneath runs on both."""
    return device in ("cpu", "cuda")


# No auto=True in the spec: "--attn auto" never picks this example; ask for it by name (--attn hello).
# trylast: were it ever made an auto candidate, it would still rank after every other backend.
@hookimpl(trylast=True)
def minisgl_attention_backends() -> Iterable[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="hello",
            factory="minisgl_plugin_hello.backend:HelloAttnBackend",
            aliases=("hi",),
            is_supported=is_supported,
            description="the torch reference backend, counting the tokens it attends",
        )
    ]
