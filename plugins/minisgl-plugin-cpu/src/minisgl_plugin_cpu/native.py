"""The native CPU kernels: C source in ``csrc/``, built on first use, called through ctypes.

PyTorch's CPU operators cover what the engine needs, but not everything at a good
speed: decode attention over a paged KV pool has to gather every request's K/V into
a padded copy first, MKL's GEMM with a decode batch's few rows reaches about half of
memory bandwidth, and chains of small elementwise ops cost more in dispatch than in
arithmetic. These kernels do those steps directly: decode attention reading the pool
in place, a few-row GEMM, RMSNorm (+ residual), SiLU x up, rope (+ q/k norm), the KV
store and argmax (see docs/design.md, "CPU kernels").

:func:`load_cpu_kernels` compiles ``csrc/cpu_kernels.c`` with the system's C compiler
(``$CC``, else ``cc``/``gcc``/``clang``) for this machine's CPU (``-march=native``)
into a per-user cache (``$MINISGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/minisgl`` or
``~/.cache/minisgl``), keyed on the source, compiler, flags and CPU, so it runs once
per machine; a build takes under a second. Without a working compiler it logs one
warning and returns ``None``, and the layers keep their PyTorch paths (``EngineConfig(kernels="torch")``
uses those without trying).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
ABI_VERSION = 1
BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-ffp-contract=fast")

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# argtypes and restype of each exported function (see csrc/cpu_kernels.c).
_SIGNATURES = {
    "minisgl_decode_attention": (
        [_I64] * 4 + [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _F32, _PTR, _I64, _INT],
        _INT,
    ),
    "minisgl_rmsnorm": ([_I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _INT], None),
    "minisgl_silu_mul": ([_I64, _I64, _PTR, _I64, _I64, _PTR, _INT], None),
    "minisgl_rope": ([_I64] * 4 + [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _F32, _PTR, _PTR, _INT], None),
    "minisgl_store_kv": ([_I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR], None),
    "minisgl_argmax_rows": ([_I64, _I64, _PTR, _I64, _I64, _PTR, _INT], None),
    "minisgl_gemm_nt": ([_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT], None),
}


class CpuKernelBuildError(RuntimeError):
    """The C compiler is missing or rejected the kernels; the message has its output."""


def cache_root() -> Path:
    if os.environ.get("MINISGL_CACHE_DIR"):
        return Path(os.environ["MINISGL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "minisgl"


def find_compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cc: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile the kernels (or find them already built); return the shared library's path.

    OpenMP is used when the compiler supports it (``-fopenmp``); otherwise the kernels
    are built single-threaded. Raises :class:`CpuKernelBuildError` when nothing builds.
    """
    cc = cc or find_compiler()
    if cc is None:
        raise CpuKernelBuildError("no C compiler found (set $CC, or install gcc or clang)")
    source = SOURCE.read_bytes()
    machine = "\0".join([cc, _compiler_version(cc), _cpu_signature()])
    errors = []
    for extra in (("-fopenmp",), ()):
        flags = (*BASE_FLAGS, *extra)
        text = machine + "\0" + " ".join(flags)
        key = hashlib.sha256(source + b"\0" + text.encode()).hexdigest()[:16]
        target = (out_dir or cache_root() / "cpu-kernels") / key / "libminisgl_cpu.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: processes building at once (tensor-parallel
        # ranks) each get a whole library, never a half-written one.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run(
                [cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
            )
            if proc.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{cc} {' '.join(flags)}: {exc}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if not any(target.parent.iterdir()):
            target.parent.rmdir()
    raise CpuKernelBuildError("could not build the CPU kernels:\n" + "\n".join(errors))


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library, with typed wrappers that check their arguments."""

    path: Path
    lib: ctypes.CDLL
    # Up to this many rows `linear` beats MKL's GEMM (2 threads, AMD EPYC, the layer shapes of a
    # 135M model: 1.1-1.9x at 1-12 rows, even at 24, slower at 32); above it callers use MKL.
    GEMM_MAX_ROWS: ClassVar[int] = 20

    @classmethod
    def open(cls, path: Path) -> CpuKernels:
        lib = ctypes.CDLL(str(path))
        lib.minisgl_abi_version.restype = ctypes.c_int
        if lib.minisgl_abi_version() != ABI_VERSION:
            raise CpuKernelBuildError(f"{path} is a build of another version of the kernels")
        for name, (argtypes, restype) in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
        return cls(path, lib)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` (rows contiguous) and ``weight`` ``[N, K]``
        (rows contiguous) -> ``[M, N]`` row-major. Meant for few rows (see ``GEMM_MAX_ROWS``)."""
        m, k = x.shape
        n = weight.shape[0]
        if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
            raise ValueError("linear: x and weight need contiguous rows of the same length")
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        out = torch.empty(m, n)
        self.lib.minisgl_gemm_nt(
            m,
            n,
            k,
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        return out

    def rmsnorm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(norm(x + residual) * weight, x + residual)`` (the second ``None`` without a residual).

        ``x``: ``[M, N]``, rows or columns contiguous; ``residual``: contiguous. Outputs are row-major.
        """
        m, n = x.shape
        out = torch.empty(m, n)
        res_out = None
        if residual is not None:
            if not residual.is_contiguous():
                residual = residual.contiguous()
            res_out = torch.empty(m, n)
        self.lib.minisgl_rmsnorm(
            m,
            n,
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            None if res_out is None else res_out.data_ptr(),
            torch.get_num_threads(),
        )
        return out, res_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[M, 2N]`` -> ``[M, N]``, in
        ``gate_up``'s layout (row-major, or column-major when ``gate_up`` is)."""
        m, n2 = gate_up.shape
        column_major = gate_up.stride(0) == 1 and m > 1
        out = torch.empty(n2 // 2, m).t() if column_major else torch.empty(m, n2 // 2)
        rs, cs = gate_up.stride()
        self.lib.minisgl_silu_mul(m, n2 // 2, gate_up.data_ptr(), rs, cs, out.data_ptr(), torch.get_num_threads())
        return out

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        q_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rope of ``q`` ``[T, hq, d]`` and ``k`` ``[T, hkv, d]`` -> contiguous copies.

        Both are views of one GEMM output (same element stride along heads and head_dim);
        ``cos_sin[pos]``: ``d/2`` cosines then ``d/2`` sines; ``q_norm``: ``(q weight, k weight,
        eps)`` of a per-head RMSNorm applied first.
        """
        t, hq, d = q.shape
        hkv = k.shape[1]
        if q.stride(1) != d * q.stride(2) or k.stride(1) != d * k.stride(2) or q.stride(2) != k.stride(2):
            raise ValueError("rope: q and k must be [T, heads, head_dim] views with one element stride")
        if positions.dtype != torch.int64 or not positions.is_contiguous() or not cos_sin.is_contiguous():
            raise ValueError("rope: positions must be contiguous int64 and the cos/sin table contiguous")
        q_out, k_out = torch.empty(t, hq, d), torch.empty(t, hkv, d)
        qw, kw, eps = q_norm if q_norm is not None else (None, None, 0.0)
        self.lib.minisgl_rope(
            t,
            hq,
            hkv,
            d,
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            q.stride(2),
            positions.data_ptr(),
            cos_sin.data_ptr(),
            None if qw is None else qw.data_ptr(),
            None if kw is None else kw.data_ptr(),
            eps,
            q_out.data_ptr(),
            k_out.data_ptr(),
            torch.get_num_threads(),
        )
        return q_out, k_out

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """``k_cache[loc[t]] = k[t]``, same for v: ``k``/``v`` ``[T, W]`` (any strides), caches
        ``[slots, W]`` contiguous, ``loc`` contiguous int64."""
        t, w = k.shape
        if loc.dtype != torch.int64 or not loc.is_contiguous():
            raise ValueError("store_kv: loc must be contiguous int64")
        self.lib.minisgl_store_kv(
            t,
            w,
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            loc.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of a ``[M, N]`` matrix, rows or columns contiguous (first maximum, NaN first)."""
        m, n = x.shape
        out = torch.empty(m, dtype=torch.int64)
        if m and n:
            self.lib.minisgl_argmax_rows(
                m, n, x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), torch.get_num_threads()
            )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        table_rows: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per request attending to its first ``kv_lens[b]`` positions, K/V read in place.

        ``q``: ``[B, hq, d]`` (any strides with ``d`` contiguous); ``k_cache``/``v_cache``: the pool's
        ``[..., hkv, d]`` buffers of one layer, contiguous; ``page_table[table_rows[b], t]``: the slot
        of position ``t`` (int32); ``table_rows``/``kv_lens``: int64 ``[B]``. Returns ``[B, hq * d]``.
        float32 on CPU only.
        """
        bsz, hq, d = q.shape
        hkv = k_cache.shape[-2]
        if out is None:
            out = q.new_empty(bsz, hq * d)
        if bsz == 0:
            return out
        if q.stride(2) != 1 or out.stride(1) != 1 or hq % hkv:
            raise ValueError("decode_attention: q and out need a contiguous head_dim and hq divisible by hkv")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and page_table.stride(1) == 1):
            raise ValueError("decode_attention: the K/V buffers and page table must be contiguous")
        if table_rows.dtype != torch.int64 or kv_lens.dtype != torch.int64 or page_table.dtype != torch.int32:
            raise ValueError("decode_attention: table_rows/kv_lens must be int64 and the page table int32")
        rc = self.lib.minisgl_decode_attention(
            bsz,
            hq,
            hkv,
            d,
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            hkv * d,
            page_table.data_ptr(),
            page_table.stride(0),
            table_rows.data_ptr(),
            kv_lens.data_ptr(),
            scale,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("decode_attention: out of memory for the score buffers")
        return out


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The kernels for this process (built or found once: every engine shares them), or ``None``
    where they cannot be built."""
    try:
        return CpuKernels.open(build())
    except (CpuKernelBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable, using PyTorch paths: %s", exc)
        return None
