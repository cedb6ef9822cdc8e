"""The engine: builds the model, KV pool, attention backend and kernel set, and runs one batch.

:meth:`Engine.prepare` turns a batch and the scheduler's new page-table entries into :class:`StepInputs`;
:meth:`Engine.launch` mirrors them into the device page table and runs the batch. The engine never reads
the scheduler's KV manager; its device state (page table, last sampled tokens) changes only in ``launch``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..attention import AttentionContext, BaseAttnBackend, HybridAttnBackend
from ..config import EngineConfig
from ..core import Batch, TokenLogprob, ValidationError
from ..distributed import Communicator, SingleCommunicator, TPInfo
from ..kernel import select_kernels
from ..kvcache import QUANTIZED_KV_DTYPES, BaseKVPool, KVLayout, kv_dtype_name
from ..layers import ForwardContext, QuantMethod
from ..models import CausalLM, ModelContext, ModelLoadError, ModelSource, iter_weights, load_config
from ..moe import BaseMoEBackend
from ..plugins import (
    AttentionBackendSpec,
    ComponentSpec,
    PluginRegistry,
    UnknownComponentError,
    choose_quantization,
    load_plugins,
)
from .graph import CudaGraphRunner, PrefillGraphRunner
from .sampling import Sampler

if TYPE_CHECKING:
    from .grammar import TokenMask

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepResult:
    """Sampled tokens of one batch, in the order of the requests that sampled."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if declared in (torch.bfloat16, torch.float16) else torch.bfloat16


class Engine:
    """Owns the model and its memory on one device (one tensor-parallel rank)."""

    def __init__(
        self,
        config: EngineConfig,
        registry: PluginRegistry | None = None,
        *,
        tp: TPInfo = TPInfo(),
        comm: Communicator | None = None,
    ):
        self.config = config
        self.registry = registry if registry is not None else load_plugins(config.plugins, paths=config.plugin_paths)
        self.tp = tp
        self.comm = comm or SingleCommunicator()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValidationError("device", "CUDA was requested but torch sees no CUDA device")

        if config.load_format == "dummy" and config.hf_config_path:  # random weights: no checkpoint is read
            self.source = None
            self.hf_config = load_config(ModelSource(path=Path(config.model or ".")), config.hf_config_path)
        else:
            self.source = ModelSource.from_path(config.model)
            self.hf_config = load_config(self.source, config.hf_config_path)
        archs = list(getattr(self.hf_config, "architectures", None) or []) or _causal_lm_for(self.hf_config)
        if not archs:
            raise ModelLoadError(
                f"the config of '{config.model}' names no architecture (config.architectures is empty)"
            )
        self.architecture = archs[0]
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.kv_dtype = QUANTIZED_KV_DTYPES.get(config.kv_cache_dtype, self.dtype)  # what the KV pool stores
        self.kernels = select_kernels(self.device, self.dtype, config.kernels, self.registry)  # once, for every layer
        if self.device.type == "cuda" and config.kernels == "auto" and self.kernels.name == "torch":
            logger.warning("kernels: no GPU kernel set installed, the PyTorch reference runs (slower); see docs/gpu.md")

        self._build_components()
        t0 = time.perf_counter()
        self.model = self._build_model()
        logger.info("model %s loaded in %.1fs", self.architecture, time.perf_counter() - t0)
        limit, wanted = self.model.max_positions, config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValidationError("max_model_len", f"{wanted} exceeds the model's maximum context {limit}")
        self.max_model_len = limit if wanted is None else wanted
        self.kv_pool = self._build_kv_pool()
        # The device mirror of the scheduler's page table (row -> token slots), filled by launch.
        cols = -(-self.max_model_len // config.page_size) * config.page_size
        self.page_table = torch.zeros((config.max_running_requests, cols), dtype=torch.int32, device=self.device)
        self.attn = self._build_attention()
        self.sampler = Sampler(self.device, config.seed, kernels=self.kernels)
        # The token each request sampled last, by table row: the input of its next decode step.
        self.last_token = torch.zeros(config.max_running_requests, dtype=torch.int64, device=self.device)
        self.graphs = self._build_graphs()
        self.prefill_graphs = self._build_prefill_graphs()
        #: Whether the last :meth:`launch` replayed CUDA graphs (a decode batch that could not is a graph miss;
        #: a prefill batch replays its work outside attention when it has at most ``cuda_graph_max_tokens``).
        self.last_launch_replayed = False

    # ------------------------------------------------------------------ build
    def _build_components(self) -> None:
        """Look up every component before the (slow) model load, so that a bad name fails at once."""
        reg, dev = self.registry, self.device.type
        self.model_spec = reg.get("model", self.architecture)
        self.kv_pool_spec = reg.pick("kv_pool", self.config.kv_pool, dev)
        self.prefix_cache_spec = reg.pick("prefix_cache", self.config.prefix_cache, dev)
        names = [n.strip() for n in self.config.attention_backend.split(",")]
        if len(names) not in (1, 2) or not all(names):
            raise ValidationError(
                "attention_backend", f"expected NAME or PREFILL,DECODE, got '{self.config.attention_backend}'"
            )
        self._attn_names = names
        self.attn_specs = [reg.pick("attention", n, dev) for n in names]
        kv_name = self.config.kv_cache_dtype
        for name, spec in zip(names, self.attn_specs, strict=True):
            if name != "auto" and not _reads_kv_cache(spec, kv_name):
                readers = [s.name for s in reg.ranked("attention", dev) if _reads_kv_cache(s, kv_name)]
                raise ValidationError(
                    "kv_cache_dtype",
                    f"{spec.label} cannot read a {kv_name} KV cache; installed backends that can: "
                    f"{', '.join(readers) or 'none'} (use --attn {readers[0] if readers else 'torch'} or "
                    "--kv-cache-dtype auto; docs/gpu.md, FP8 KV cache)",
                )
        self.moe_backend: BaseMoEBackend | None = None
        if getattr(self.hf_config, "num_experts", 0) or getattr(self.hf_config, "num_local_experts", 0):
            self.moe_backend = reg.pick("moe", self.config.moe_backend, dev).build()
        self.quant = self._build_quant()

    def _build_quant(self) -> QuantMethod:
        """The checkpoint's (or ``--quantization``'s) method; it refuses what it cannot load by name, here."""
        qc = getattr(self.hf_config, "quantization_config", None)
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
        try:
            choice = choose_quantization(self.registry, self.config.quantization, qc or None, self.device.type)
        except UnknownComponentError as exc:
            raise ValidationError("quantization", str(exc)) from None
        to_dict = getattr(self.hf_config, "to_dict", None)
        model_config = to_dict() if callable(to_dict) else dict(vars(self.hf_config))
        try:
            choice.spec.check(choice.config, model_config)  # what the server's preflight asks too
            quant = choice.spec.build(choice.config, self.dtype, self.device)
        except ValueError as exc:
            raise ValidationError("quantization", f"{choice.spec.label}: {exc}") from None
        if self.moe_backend is not None and not quant.supports_moe:
            instead = (
                f"leave out --quantization {self.config.quantization} to serve it unquantized"
                if choice.config is None
                else "serve the model's unquantized (bf16) checkpoint instead"
            )
            raise ValidationError(
                "quantization",
                f"{choice.spec.label} cannot load this mixture-of-experts model ({self.architecture}): its quantized "
                f"experts are not supported yet; {instead}",
            )
        return quant

    def _build_model(self) -> CausalLM:
        ctx = ModelContext(
            self.hf_config,
            self.dtype,
            self.device,
            self.tp,
            self.comm,
            self.moe_backend,
            kernels=self.kernels,
            quant=self.quant,
        )
        model = self.model_spec.build(ctx)
        if not isinstance(model, CausalLM):
            raise TypeError(f"model factory for {self.architecture} returned {type(model).__name__}, not a CausalLM")
        if self.config.load_format == "dummy":
            # Drawn on the device: a 0.6B model takes seconds on the host, milliseconds on a GPU.
            gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
            for p in model.parameters():
                if p.element_size() == 1:  # float8 weights: drawn in float32, then cast
                    p.data.copy_(torch.empty(p.shape, device=self.device).normal_(0.0, 0.02, generator=gen))
                else:
                    p.data.normal_(0.0, 0.02, generator=gen)
            model.process_weights_after_loading()
        else:
            assert self.source is not None
            model.load_weights(iter_weights(self.source))
        return model.eval()

    def _heads(self) -> tuple[int, int, int]:
        """Query heads, KV heads (both of this rank) and head_dim."""
        hf, tp = self.hf_config, self.tp.size
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        return heads // tp, max(1, kv_heads // tp), getattr(hf, "head_dim", None) or hf.hidden_size // heads

    def _build_kv_pool(self) -> BaseKVPool:
        cfg = self.config
        _, kv_heads, head_dim = self._heads()
        layers = self.hf_config.num_hidden_layers
        k_scales, v_scales = self.model.kv_cache_scales()
        if k_scales and self.kv_dtype not in QUANTIZED_KV_DTYPES.values():
            logger.info(
                "the checkpoint's KV cache scales are unused: the KV cache stores %s", kv_dtype_name(self.dtype)
            )
            k_scales, v_scales = (), ()
        elif self.kv_dtype in QUANTIZED_KV_DTYPES.values():
            logger.info("KV cache scales: %s", "from the checkpoint" if k_scales else "1.0 (the checkpoint has none)")
        layout = KVLayout(
            layers, 2, cfg.page_size, kv_heads, head_dim, self.kv_dtype, self.device, self.kernels, k_scales, v_scales
        )
        num_pages = cfg.num_pages
        if num_pages is None:
            if self.device.type == "cuda":
                # Blocks the caching allocator holds but no tensor uses (a float weight quantized at load, the
                # load-time GEMM tuning's buffers) count as taken in mem_get_info: hand them back first.
                torch.cuda.empty_cache()
                budget = int(torch.cuda.mem_get_info(self.device)[0] * cfg.mem_fraction)
            else:
                budget = int(cfg.cpu_kv_cache_gb * (1 << 30))
            tokens = min(cfg.max_running_requests * self.max_model_len, budget // layout.bytes_per_token())
            num_pages = max(2, tokens // cfg.page_size + 1)
        layout = replace(layout, num_pages=num_pages)
        pool = self.kv_pool_spec.build(layout)
        gib = layout.bytes_per_token() * layout.num_slots / (1 << 30)
        dtype = kv_dtype_name(self.kv_dtype)
        logger.info("KV pool: %d pages of %d tokens, %s (%.2f GiB)", num_pages, cfg.page_size, dtype, gib)
        return pool

    def _build_attention(self) -> BaseAttnBackend:
        cfg, table = self.config, self.page_table
        limits = (cfg.max_running_requests, table.shape[1])  # batch size, sequence length
        ctx = AttentionContext(*self._heads(), cfg.page_size, self.kv_pool, table, *limits, self.dtype, self.device)
        backends = [self._build_attention_backend(i, ctx) for i in range(len(self.attn_specs))]
        if self._attn_names == ["auto"] and (decode := self._build_auto_decode(ctx)) is not None:
            backends.append(decode)
        if len(backends) == 1 or self.attn_specs[0].name == self.attn_specs[1].name:
            return backends[0]
        return HybridAttnBackend(backends[0], backends[1])

    def _build_auto_decode(self, ctx: AttentionContext) -> BaseAttnBackend | None:
        """``--attn auto``: the best-ranked backend that asks to decode this KV cache dtype
        (``AttentionBackendSpec.decode_kv_cache_dtypes``) decodes, unless it is the one that prefills; where
        none does, or none can run this model (``ValueError``), the prefill backend decodes too."""
        kv, prefill = self.config.kv_cache_dtype, self.attn_specs[0]
        for spec in self.registry.ranked("attention", self.device.type):
            if not isinstance(spec, AttentionBackendSpec) or kv not in spec.decode_kv_cache_dtypes:
                continue
            if spec.name == prefill.name:
                return None
            try:
                backend = spec.build(ctx)
            except ValueError as exc:
                logger.info("attention 'auto': %s cannot decode this model (%s)", spec.name, exc)
                continue
            logger.info("attention 'auto': %s prefills, %s decodes the %s KV cache", prefill.name, spec.name, kv)
            self.attn_specs.append(spec)
            self._attn_names.append("auto")
            return backend  # type: ignore[no-any-return]
        return None

    def _build_attention_backend(self, i: int, ctx: AttentionContext) -> BaseAttnBackend:
        """Build the ``i``-th configured backend. Under ``auto``, a backend that rejects this
        model (``ValueError``: head size, dtype...) gives way to the next best one."""
        if self._attn_names[i] != "auto":
            return self.attn_specs[i].build(ctx)
        reasons: list[str] = []
        for spec in self.registry.ranked("attention", self.device.type):
            if not _reads_kv_cache(spec, self.config.kv_cache_dtype):
                reasons.append(f"{spec.name}: cannot read a {self.config.kv_cache_dtype} KV cache")
                continue
            try:
                backend = spec.build(ctx)
            except ValueError as exc:
                reasons.append(f"{spec.name}: {exc}")
                continue
            if reasons:
                logger.info("attention 'auto' chose %s (%s)", spec.name, "; ".join(reasons))
            if self.device.type == "cuda" and spec.name == "torch":
                self._warn_reference_on_cuda(reasons)
            self.attn_specs[i] = spec
            return backend
        raise ValidationError(
            "attention_backend", "no installed attention backend can run this model: " + "; ".join(reasons)
        )

    def _warn_reference_on_cuda(self, rejected: list[str]) -> None:
        """``auto`` fell back to the reference backend on a GPU: slow, and no CUDA graphs. Say why."""
        why = list(rejected)
        for other in self.registry.specs("attention"):
            if (reason := other.unsupported_reason("cuda")) is not None:
                why.append(f"{other.name}: {reason or 'not supported on cuda'}")
        hint = "install a GPU attention backend, e.g. pip install ./plugins/minisgl-plugin-flashinfer (see docs/gpu.md)"
        logger.warning(
            "attention 'auto' fell back to the torch reference backend on CUDA (slow, no CUDA graphs): %s",
            "; ".join(why) if why else hint,
        )

    def _build_graphs(self) -> CudaGraphRunner | None:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        if self.device.type != "cuda" or max_bs <= 0:
            return None
        if not self._moe_capturable():
            logger.info("CUDA graphs off: the MoE backend %s cannot be captured", type(self.moe_backend).__name__)
            return None
        if not self.attn.supports_cuda_graph:
            logger.info("CUDA graphs off: the decode attention backend does not support them")
            return None
        return CudaGraphRunner(
            self.model, self.attn, max_bs=max_bs, max_seq_len=self.page_table.shape[1], device=self.device
        )

    def _build_prefill_graphs(self) -> PrefillGraphRunner | None:
        # A step holds at most a prompt chunk and one token of every other running request.
        cfg = self.config
        max_tokens = min(cfg.cuda_graph_max_tokens, cfg.chunked_prefill_size + cfg.max_running_requests)
        if self.device.type != "cuda" or max_tokens <= 0 or not self._moe_capturable():
            return None  # attention runs eagerly between the graphs: any backend will do
        return PrefillGraphRunner(
            self.model, self.attn, max_tokens=max_tokens, device=self.device, kv_pool=self.kv_pool
        )

    def prefill_step_tokens(self, tokens: int) -> int:
        """The rows a prefill or mixed step of ``tokens`` new tokens computes: the prefill graph size it pads
        to (whose padding rows run the whole forward but attention), or ``tokens`` when it runs eagerly."""
        graphs = self.prefill_graphs
        return graphs.padded_tokens(tokens) if graphs is not None and tokens <= graphs.max_tokens else tokens

    @property
    def prefill_graph_max_tokens(self) -> int:
        """The largest prefill or mixed step (tokens) that replays prefill graphs; 0 without them."""
        return self.prefill_graphs.max_tokens if self.prefill_graphs is not None else 0

    def _moe_capturable(self) -> bool:
        return self.moe_backend is None or self.moe_backend.supports_cuda_graph

    # ------------------------------------------------------------------- step
    def prepare(self, batch: Batch, new_entries: torch.Tensor | None) -> StepInputs:
        """The device inputs of ``batch``; ``new_entries``: the scheduler's page-table entries not
        yet mirrored (:meth:`~minisgl.kvcache.KVCacheManager.take_new_entries`)."""
        return StepInputs.build(batch, new_entries, self.device)

    @torch.inference_mode()
    def launch(
        self, batch: Batch, inputs: StepInputs, before_sample: Callable[[], TokenMask | None] | None = None
    ) -> PendingStep:
        """Enqueue ``batch``; sampled tokens arrive in the returned handle. On CUDA nothing here waits for
        the device. ``before_sample``, called once the forward is enqueued, returns the grammar mask of the
        rows that sample (the scheduler may wait there for the previous step's tokens while this one runs)."""
        inputs.apply(batch, self.page_table, self.last_token)
        reqs = [r for r, s in zip(batch.reqs, batch.sample_mask, strict=False) if s]
        if batch.is_decode and self.graphs is not None and self.graphs.can_run(batch):
            self.last_launch_replayed = True
            logits = self.graphs.replay(batch)
        else:
            hidden = self._forward(batch)
            if not reqs:
                return PendingStep(torch.empty(0, dtype=torch.int64), [], None)
            logits = self.model.compute_logits(hidden if inputs.sample_idx is None else hidden[inputs.sample_idx])
        mask = before_sample() if before_sample is not None else None
        result = self.sampler.sample(logits, reqs, mask)
        rows = inputs.rows if inputs.sample_idx is None else inputs.rows[inputs.sample_idx]
        self.last_token[rows] = result.tokens
        if self.device.type == "cpu":
            return PendingStep(result.tokens, result.logprobs, None)
        host = torch.empty(result.tokens.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(result.tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(host, result.logprobs, event)

    @torch.inference_mode()
    def prefill_logits(self, batch: Batch, inputs: StepInputs) -> torch.Tensor:
        """Logits at every new position of ``batch`` (for tests and scoring)."""
        inputs.apply(batch, self.page_table, self.last_token)
        return self.model.compute_logits(self._forward(batch))

    def _forward(self, batch: Batch) -> torch.Tensor:
        """The forward without the LM head, eager or from prefill graphs: hidden states at every new position."""
        assert batch.input_ids is not None and batch.positions is not None
        self.attn.prepare_metadata(batch)
        self.last_launch_replayed = self.prefill_graphs is not None and self.prefill_graphs.can_run(batch)
        if self.last_launch_replayed:
            assert self.prefill_graphs is not None
            return self.prefill_graphs.replay(batch)
        return self.model(batch.input_ids, batch.positions, ForwardContext(batch, self.attn))


@dataclass
class StepInputs:
    """One batch's inputs on the device, from :meth:`Engine.prepare` to :meth:`Engine.launch`."""

    rows: torch.Tensor  # page-table row of each new token
    positions: torch.Tensor  # position of each new token
    input_ids: torch.Tensor | None  # None (decode): the token each row sampled last
    sample_idx: torch.Tensor | None  # the tokens whose logits are sampled (None: all)
    #: Tokens of a prefill batch that are decoding requests' last sampled tokens (a mixed batch): on the device.
    decode_idx: torch.Tensor | None
    new_entries: torch.Tensor | None  # [3, n] (row, column, slot) to mirror into the page table

    @classmethod
    def build(cls, batch: Batch, new_entries: torch.Tensor | None, device: torch.device) -> StepInputs:
        """Host work and one host-to-device copy (pinned, non-blocking on CUDA)."""
        rows: list[int] = []
        pos: list[int] = []
        ids: list[int] = []
        sample: list[int] = []
        decode: list[int] = []
        if batch.is_decode:
            rows = [r.table_idx for r in batch.reqs]
            pos = [r.cached_len for r in batch.reqs]
        else:
            for req, samples in zip(batch.reqs, batch.sample_mask, strict=False):
                rows.extend([req.table_idx] * req.extend_len)
                pos.extend(range(req.cached_len, req.device_len))
                if req.is_decoding:  # its input is the token it sampled last, maybe not on the host yet
                    decode.append(len(ids))
                    ids.append(0)
                else:
                    ids.extend(req.fill_ids(req.cached_len, req.device_len))
                if samples:
                    sample.append(len(pos) - 1)
        flat = rows + pos + ids + sample + decode
        host = torch.tensor(flat, dtype=torch.int64)
        if new_entries is not None:
            host = torch.cat([host, new_entries.view(-1)])
        if device.type != "cpu":
            host = host.pin_memory().to(device, non_blocking=True)
        sizes = [len(rows), len(pos), len(ids), len(sample), len(decode), host.numel() - len(flat)]
        rows_t, pos_t, ids_t, sample_t, decode_t, entries = host.split(sizes)
        return cls(
            rows=rows_t,
            positions=pos_t,
            input_ids=ids_t if batch.is_prefill else None,
            sample_idx=sample_t if batch.is_prefill else None,
            decode_idx=decode_t if decode else None,
            new_entries=entries.view(3, -1) if new_entries is not None else None,
        )

    def apply(self, batch: Batch, page_table: torch.Tensor, last_token: torch.Tensor) -> None:
        """Mirror the new entries into ``page_table`` and give ``batch`` its tensors."""
        if self.new_entries is not None:
            page_table[self.new_entries[0], self.new_entries[1]] = self.new_entries[2].to(page_table.dtype)
        batch.positions = self.positions
        batch.out_loc = page_table[self.rows, self.positions].to(torch.int64)
        if self.input_ids is None:
            batch.input_ids = last_token[self.rows]
        else:
            if self.decode_idx is not None:  # this step's own copy of the ids: filled in place
                self.input_ids[self.decode_idx] = last_token[self.rows[self.decode_idx]]
            batch.input_ids = self.input_ids


@dataclass
class PendingStep:
    """Tokens sampled by a launched batch; :meth:`result` waits for them."""

    tokens: torch.Tensor
    logprobs: list[TokenLogprob | None]
    event: torch.cuda.Event | None

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        return StepResult(self.tokens.tolist(), self.logprobs)


def _reads_kv_cache(spec: ComponentSpec, kv_cache_dtype: str) -> bool:
    """Whether attention backend ``spec`` reads a KV cache of ``kv_cache_dtype`` (see AttentionBackendSpec)."""
    return isinstance(spec, AttentionBackendSpec) and spec.reads_kv_cache(kv_cache_dtype)


def _causal_lm_for(hf_config: Any) -> list[str]:
    """Architecture name for a config that names none (GGUF files), from its model_type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""))
    return [name] if isinstance(name, str) else []
