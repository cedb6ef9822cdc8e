"""Engine settings, defined once (:class:`EngineFields`) for ``LLM(...)``, ``minisgl serve`` flags and ``MINISGL_*``
variables: :class:`EngineConfig` is the validated configuration an engine is built from, and
``minisgl.server.settings.ServeSettings`` adds the server's own settings (deriving a flag and a variable from each).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticValidationError


class EngineFields(BaseModel):
    """Every setting of an engine: the one definition of names, types, bounds, defaults and help."""

    model_config = ConfigDict(protected_namespaces=())

    model: str = Field(description="Hugging Face model directory, .gguf file or dist:NAME")
    device: str = Field("cpu", description="cpu, cuda or cuda:N; auto = cuda when a GPU is visible")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight and activation dtype; auto = float32 on CPU, the model's dtype on GPU"
    )
    attention_backend: str = Field(
        "auto", description="attention backend: NAME or PREFILL,DECODE; auto = best installed"
    )
    prefix_cache: str = Field("auto", description="prefix cache (e.g. naive, radix); auto = best installed")
    kv_pool: str = Field("mha", description="KV cache pool layout")
    moe_backend: str = Field("auto", description="mixture-of-experts backend (MoE models only)")
    kernels: str = Field(
        "auto", description="layer kernel set (e.g. torch, native, triton); auto = best installed for the device"
    )
    grammar_backend: str = Field(
        "auto", description="structured-output grammar backend (e.g. xgrammar); auto = best installed"
    )
    grammar_compile_timeout: float = Field(
        10.0,
        ge=0,
        description="seconds one request's grammar may take to compile (it compiles off the step loop); past "
        "that the request is refused with a 400; 0 = no limit",
    )
    grammar_compile_memory: float = Field(
        1024,
        ge=0,
        description="MiB of memory one grammar's compile may use (the backend compiles in a child process); past "
        "that the request is refused with a 400; 0 = no limit (and no child process)",
    )
    grammar_mask_timeout: float = Field(
        0.25,
        ge=0,
        description="seconds one request's grammar may take to compute its next-token mask in a step; past that "
        "the request ends with finish_reason grammar_error, the others go on; 0 = no limit",
    )
    quantization: str = Field(
        "auto",
        description="how linear weights are stored (e.g. none, fp8); auto = what the checkpoint's "
        "quantization_config names, else none; fp8 on an unquantized checkpoint quantizes at load",
    )
    page_size: int = Field(16, ge=1, description="tokens per KV cache page")
    max_running_requests: int | None = Field(
        None, ge=1, description="most requests decoded together; default: 256 on a GPU, 64 on CPU"
    )
    chunked_prefill_size: int | None = Field(
        None, ge=1, description="prompt tokens computed per step; default: 8192 on a GPU, 512 on CPU"
    )
    mixed_prefill: bool = Field(
        True,
        description="while prompt tokens wait, a step decodes every running request and computes up to "
        "chunked_prefill_size prompt tokens (running streams never pause for a long prompt); off: a step is a "
        "prefill while prompt tokens wait, else a decode",
    )
    schedule_policy: Literal["fcfs", "throughput"] = Field(
        "fcfs",
        description="which waiting prompts a step computes: fcfs = in arrival order, as many as "
        "chunked_prefill_size allows (first tokens soonest); throughput = longest max_tokens first, paced into "
        "the decode steps so that each step carries about throughput_step_tokens tokens and no request should end "
        "later than the longest one running (batch jobs of large models: their prompts' compute hides under the "
        "decode steps' weight reads; where a mixed step costs more on the host than a decode step on the device, "
        "as for small models, it is slower)",
    )
    throughput_step_tokens: int = Field(
        256,
        ge=1,
        description="with schedule_policy throughput: the tokens (decodes plus prompt tokens) a step aims at, about "
        "where the GPU's GEMMs turn from reading weights to computing; prompt tokens go past it only to keep the "
        "longest request's pace",
    )
    admit_reserve_tokens: int = Field(
        512,
        ge=0,
        description="output tokens a request reserves KV pages for at admission (at most its max_tokens); it "
        "grows past them on demand and, when the pool runs out, the newest request is preempted (its pages freed, "
        "recomputed later); at least the context length reserves the worst case and never preempts",
    )
    max_model_len: int | None = Field(None, ge=1, description="context length; default: the model's")
    num_pages: int | None = Field(None, ge=2, description="KV cache pages; default: sized from memory")
    mem_fraction: float = Field(0.85, gt=0, le=1, description="share of free GPU memory for the KV cache")
    cpu_kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU, in GiB")
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8", "fp8_e5m2"] = Field(
        "auto",
        description="KV cache storage: auto = the model dtype; fp8_e4m3 (alias fp8) = one byte per value (twice "
        "the pages), with the checkpoint's per-layer k/v scales or 1.0; fp8_e5m2 = one byte with a wider range "
        "and one mantissa bit less (the same scales)",
    )
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy = random weights (benchmarks)")
    hf_config_path: str | None = Field(
        None, description="config.json to use instead of the model's (with load_format dummy: no weights needed)"
    )
    seed: int = Field(0, description="seed of the sampler for requests without their own seed")
    cuda_graph_max_bs: int = Field(256, ge=0, description="largest decode batch captured in a CUDA graph; 0 = none")
    cuda_graph_max_tokens: int = Field(
        4096,
        ge=0,
        description="largest prefill or mixed step, in tokens, whose work outside attention replays from CUDA "
        "graphs (attention runs between them); 0 = none",
    )
    overlap_schedule: bool = Field(True, description="overlap scheduling with the GPU step")
    trace_steps: str | None = Field(
        None,
        description="write one JSON line per scheduler step to this file (timings, batch, stalls)",
        json_schema_extra={"metavar": "FILE"},
    )
    tp: int = Field(1, ge=1, description="tensor-parallel size (number of GPUs; processes on CPU)")
    nnodes: int = Field(1, ge=1, description="nodes the tensor-parallel ranks span")
    node_rank: int = Field(0, ge=0, description="this node's index; nodes other than 0 run ranks only, no API")
    dist_init_addr: str | None = Field(None, description="HOST:PORT of rank 0's rendezvous (several nodes)")
    plugin_paths: str | None = Field(
        None,
        description="plugins that are not installed: comma-separated .py files, folders of .py files or module "
        "names, each loaded like an installed plugin named after its file or module",
    )

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_dtype_alias(cls, value: str) -> str:
        return "fp8_e4m3" if value == "fp8" else value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("must be cpu, cuda, cuda:N or auto")
        return value


class EngineConfig(EngineFields):
    """The validated configuration of one engine; bad values raise :class:`minisgl.core.ValidationError`.

    ``device="auto"`` becomes ``cuda`` when torch sees a GPU. ``plugins`` names the plugin entries to load
    (``None``: the environment's choice).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    # Resolved per device in __init__, so never None afterwards.
    max_running_requests: int = Field(ge=1)
    chunked_prefill_size: int = Field(ge=1)
    plugins: tuple[str, ...] | None = None

    def __init__(self, **values: Any) -> None:
        from .core import ValidationError

        if values.get("device", "cpu") == "auto":
            import torch

            values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        # A GPU step costs about the same for 1 or 256 decoding requests and for 512 or 8192 prompt tokens, so a
        # GPU admits a whole burst at once; a CPU step costs in proportion to its tokens, so it keeps steps short.
        gpu = str(values.get("device", "cpu")).startswith("cuda")
        defaults = {"max_running_requests": 256 if gpu else 64, "chunked_prefill_size": 8192 if gpu else 512}
        for name, value in defaults.items():
            if values.get(name) is None:
                values[name] = value
        try:
            super().__init__(**values)
        except PydanticValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(map(str, err["loc"])) or "config"
            got = "" if err["type"] == "missing" else f", got {err.get('input')!r}"
            hint = " (not an engine setting)" if err["type"] == "extra_forbidden" else ""
            raise ValidationError(field, f"{err['msg']}{got}{hint}") from None
        if self.tp % self.nnodes:
            raise ValidationError("nnodes", f"must divide tp ({self.tp}), got {self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValidationError("node_rank", f"must be in [0, {self.nnodes}), got {self.node_rank}")

    def with_changes(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied and validated again."""
        return EngineConfig(**{**self.model_dump(), **changes})
