"""Which GPUs each TensorRT-LLM kernel family runs on, checked without importing torch.

FlashInfer 0.5.3 exposes two families of TensorRT-LLM attention kernels:

* **trtllm-gen** (``trtllm_batch_context_with_kv_cache``, and
  ``trtllm_batch_decode_with_kv_cache(backend="trtllm-gen")``): precompiled cubins
  that FlashInfer's runner accepts on compute capability 10.0 and 10.3 only
  (``include/flashinfer/trtllm/fmha/fmhaRunner.cuh``). The cubins are not in the
  ``flashinfer-python`` wheel: they come from the ``flashinfer-cubin`` package, a
  folder named by ``FLASHINFER_CUBIN_DIR``, or a download from NVIDIA's artifactory
  at first use (``flashinfer/jit/cubin_loader.py``).
* **XQA** (``trtllm_batch_decode_with_kv_cache(backend="xqa")``): decode only,
  compiled on first use from CUDA sources shipped in the wheel
  (``flashinfer/jit/xqa.py``); FlashInfer runs it on compute capability 9.x, 10.x
  and 12.x (``flashinfer/xqa.py``), so on Hopper too.

The checks here back the specs' ``is_supported`` (they raise
:class:`~minisgl.plugins.specs.Unsupported` with the reason) and the factories'
build-time checks (which raise ``ValueError`` with the same words). The device
query goes through NVML, so ``minisgl plugins --device cuda`` and ``minisgl
serve`` learn the GPU generation without creating a CUDA context.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

from minisgl.plugins import Unsupported, cuda_capabilities

Capability = tuple[int, int]

TRTLLM_GEN_CAPABILITIES: tuple[Capability, ...] = ((10, 0), (10, 3))
XQA_MAJORS: tuple[int, ...] = (9, 10, 12)
INSTALL_HINT = "pip install 'minisgl-plugin-trtllm[cuda]'"


def flashinfer_installed() -> bool:
    """Whether FlashInfer can be imported (without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def _shown(caps: Sequence[Capability]) -> str:
    found = sorted(set(caps))
    return ", ".join(f"{a}.{b}" for a, b in found)


def trtllm_gen_problem(caps: Sequence[Capability]) -> str | None:
    """Why the trtllm-gen kernels cannot run on GPUs of these capabilities (``None``: they can)."""
    if not caps:
        return "no CUDA GPU is visible"
    if all(c in TRTLLM_GEN_CAPABILITIES for c in caps):
        return None
    hint = "use --attn flashinfer"
    if xqa_problem(caps) is None:
        hint += ", or TensorRT-LLM's XQA decode kernel with --attn flashinfer,trtllm-xqa"
    return (
        "TensorRT-LLM-gen attention kernels (trtllm_batch_context_with_kv_cache) run only on compute capability "
        f"10.0 or 10.3 (B200/GB200, B300/GB300); this machine's GPU is {_shown(caps)}; {hint}"
    )


def xqa_problem(caps: Sequence[Capability]) -> str | None:
    """Why the XQA decode kernel cannot run on GPUs of these capabilities (``None``: it can)."""
    if not caps:
        return "no CUDA GPU is visible"
    if all(major in XQA_MAJORS for major, _ in caps):
        return None
    return (
        "TensorRT-LLM's XQA decode kernel runs on compute capability 9.x, 10.x or 12.x (Hopper, Blackwell); "
        f"this machine's GPU is {_shown(caps)}; use --attn flashinfer"
    )


def _check(device: str, problem_of: Callable[[Sequence[Capability]], str | None]) -> bool:
    if device != "cuda":
        raise Unsupported("TensorRT-LLM attention kernels need a CUDA GPU; use --attn torch")
    if not flashinfer_installed():
        raise Unsupported(f"FlashInfer, which provides the TensorRT-LLM kernels, is not installed: {INSTALL_HINT}")
    problem = problem_of(cuda_capabilities())
    if problem:
        raise Unsupported(problem)
    return True


def trtllm_gen_supported(device: str) -> bool:
    """``is_supported`` of the ``trtllm`` backend: CUDA, FlashInfer installed, every GPU 10.0 or 10.3."""
    return _check(device, trtllm_gen_problem)


def xqa_supported(device: str) -> bool:
    """``is_supported`` of the ``trtllm-xqa`` backend: CUDA, FlashInfer installed, every GPU 9.x/10.x/12.x."""
    return _check(device, xqa_problem)
