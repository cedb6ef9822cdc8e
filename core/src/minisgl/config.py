"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: "auto": the fastest kernels the device has (Triton on CUDA, the native C kernels on CPU);
#: "torch": plain PyTorch everywhere (the reference, and for ablations).
KERNEL_SETS = ("auto", "torch")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how an engine is built.

    ``attention_backend`` is a backend name, ``"auto"``, or ``"PREFILL,DECODE"``
    for a hybrid. ``num_pages`` overrides KV pool sizing (otherwise: a share of
    free GPU memory, or ``cpu_kv_cache_gb`` on CPU).
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    prefix_cache: str = "auto"
    kv_pool: str = "mha"
    moe_backend: str = "auto"
    page_size: int = 16
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    max_model_len: int | None = None
    num_pages: int | None = None
    mem_fraction: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    load_format: str = "auto"
    model_config: str | None = None
    seed: int = 0
    cuda_graph_max_bs: int = 256
    overlap_schedule: bool = True
    kernels: str = "auto"
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    plugins: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        from .core import ValidationError

        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValidationError(name, message)

        check(
            self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            f"must be 'cpu' or 'cuda', got '{self.device}'",
        )
        check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        check(self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        check(self.max_running_requests >= 1, "max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        check(self.chunked_prefill_size >= 1, "chunked_prefill_size", f"must be >= 1, got {self.chunked_prefill_size}")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        check(self.num_pages is None or self.num_pages >= 2, "num_pages", "must be >= 2")
        check(0 < self.mem_fraction <= 1, "mem_fraction", f"must be in (0, 1], got {self.mem_fraction}")
        check(
            self.load_format in ("auto", "dummy"), "load_format", f"must be 'auto' or 'dummy', got '{self.load_format}'"
        )
        check(self.cuda_graph_max_bs >= 0, "cuda_graph_max_bs", "must be >= 0 (0 disables CUDA graphs)")
        check(
            self.kernels in KERNEL_SETS, "kernels", f"must be one of {', '.join(KERNEL_SETS)}, got '{self.kernels}'"
        )
        check(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        check(
            self.nnodes >= 1 and self.tp % self.nnodes == 0, "nnodes", f"must divide tp ({self.tp}), got {self.nnodes}"
        )
        check(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes}), got {self.node_rank}")

    def with_changes(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
