"""Which FlashAttention generation runs on which GPU, found without importing the kernels.

Three generations of FlashAttention read a paged KV cache, each from its own
package:

========== ============================ ======================= =====================
generation import                       package                 GPUs (paged KV cache)
========== ============================ ======================= =====================
2          ``flash_attn``               ``flash-attn`` 2.x      sm80 and newer
3          ``flash_attn_interface``     FlashAttention's        sm90 (Hopper)
                                        ``hopper/`` build
4          ``flash_attn.cute``          ``flash-attn-4``        sm90, sm100/sm103
                                        (CuTe DSL)              (Hopper, Blackwell)
========== ============================ ======================= =====================

FlashAttention 2 reads paged K/V only with pages of a multiple of 256 tokens;
FlashAttention 4 has no paged KV on sm80 or sm120. The ``is_supported`` checks
here back the plugin's specs: they raise :class:`~minisgl.plugins.specs.Unsupported`
with what is missing and what to do. The GPU generation comes from NVML when this
process has no CUDA context yet, so listing the plugins does not create one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from minisgl.plugins import Unsupported, cuda_capabilities

Capability = tuple[int, int]

# What to install per generation (pinned where a set was run on real hardware; see the README).
INSTALL_HINTS = {
    2: "pip install 'flash-attn>=2.6,<3' (builds from source against your torch)",
    3: "build FlashAttention 3 from the hopper/ folder of Dao-AILab/flash-attention",
    4: "pip install 'minisgl-plugin-fa[fa4]' (flash-attn-4 4.0.0b36 with nvidia-cutlass-dsl 4.8.1)",
}

RUNS_ON = {2: "sm80 and newer", 3: "sm90 (Hopper)", 4: "sm90, sm100 and sm103 (Hopper, Blackwell)"}

# Preference order per compute-capability major: the generation written for that GPU first.
_BY_MAJOR: dict[int, tuple[int, ...]] = {
    8: (2,),  # Ampere, Ada: FlashAttention 4 has no paged KV on sm80
    9: (3, 4, 2),  # Hopper
    10: (4, 2),  # Blackwell (B200, GB200, B300)
    11: (4, 2),
    12: (2,),  # consumer Blackwell: FlashAttention 4 has no paged KV on sm120
}


def generations_for(capability: Capability) -> tuple[int, ...]:
    """The generations that can run paged attention on a GPU of ``capability``, best first."""
    return _BY_MAJOR.get(capability[0], ())


def _namespace_has(package: str, relative: str) -> bool:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return False
    return any((Path(p) / relative).is_file() for p in spec.submodule_search_locations)


def installed_generations() -> tuple[int, ...]:
    """The FlashAttention generations whose packages are installed (nothing is imported)."""
    found = []
    if importlib.util.find_spec("flash_attn_2_cuda") is not None:  # flash-attn 2's compiled extension
        found.append(2)
    if importlib.util.find_spec("flash_attn_interface") is not None:
        found.append(3)
    if _namespace_has("flash_attn", "cute/interface.py"):
        found.append(4)
    return tuple(found)


def choose_generation(
    capability: Capability, installed: Iterable[int], wanted: int | None = None, page_size: int | None = None
) -> int:
    """The generation to run on a GPU of ``capability``, or :class:`Unsupported` saying why none can.

    ``wanted`` restricts the choice to that generation. ``page_size``, when known, rules
    out FlashAttention 2 unless the pages hold a multiple of 256 tokens.
    """
    gpu = f"compute capability {capability[0]}.{capability[1]}"
    fits = [g for g in generations_for(capability) if wanted in (None, g)]
    if not fits:
        if wanted is None:
            raise Unsupported(
                f"no FlashAttention generation reads a paged KV cache on this GPU ({gpu}); use --attn flashinfer"
            )
        raise Unsupported(
            f"FlashAttention {wanted} does not read a paged KV cache on this GPU ({gpu}; it does on "
            f"{RUNS_ON[wanted]}); use --attn fa or --attn flashinfer"
        )
    have = set(installed)
    usable = [g for g in fits if g in have]
    if not usable:
        listed = ", ".join(str(g) for g in sorted(have)) or "none"
        hints = "; or ".join(INSTALL_HINTS[g] for g in fits)
        raise Unsupported(
            f"no FlashAttention package for this GPU ({gpu}) is installed (installed generations: {listed}): {hints}"
        )
    if page_size is not None and page_size % 256 != 0:
        usable = [g for g in usable if g != 2]
        if not usable:
            raise Unsupported(
                f"flash-attn 2 reads a paged KV cache only in pages of a multiple of 256 tokens (the page size "
                f"here is {page_size}); start with --page-size 256, or use --attn flashinfer"
            )
    return usable[0]


def _check(device: str, wanted: int | None, caps: Callable[[], Sequence[Capability]]) -> bool:
    if device != "cuda":
        raise Unsupported(f"FlashAttention runs on NVIDIA GPUs (CUDA), not on {device}; use --attn torch")
    found = caps()
    if not found:
        raise Unsupported("no CUDA GPU is visible; use --attn torch")
    installed = installed_generations()
    for cap in sorted(set(found)):  # every visible GPU must run it
        choose_generation(cap, installed, wanted)
    return True


def is_supported(device: str) -> bool:
    """``is_supported`` of ``fa``: CUDA, and an installed generation that runs on every visible GPU."""
    return _check(device, None, cuda_capabilities)


def fa2_supported(device: str) -> bool:
    """``is_supported`` of ``fa2``."""
    return _check(device, 2, cuda_capabilities)


def fa3_supported(device: str) -> bool:
    """``is_supported`` of ``fa3``."""
    return _check(device, 3, cuda_capabilities)


def fa4_supported(device: str) -> bool:
    """``is_supported`` of ``fa4``."""
    return _check(device, 4, cuda_capabilities)
