"""GGUF files, dequantized on first load (tens of seconds) into a Hugging Face directory under
``$MINISGL_CACHE_DIR/gguf/`` (default ``~/.cache/minisgl``), keyed by the file's path, size and mtime;
later loads and every worker process read that directory."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..utils.model_path import ModelLoadError


def cache_root() -> Path:
    return Path(os.environ.get("MINISGL_CACHE_DIR", Path.home() / ".cache" / "minisgl"))


def _key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def gguf_to_hf_dir(path: Path) -> Path:
    """The cached HF-format directory for GGUF ``path``, converting it on first use."""
    target = cache_root() / "gguf" / _key(path)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait, then reuse
        if (target / "config.json").exists():
            return target
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise ModelLoadError("loading .gguf files needs the 'gguf' package: pip install gguf accelerate") from exc
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
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
            plain.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
            os.replace(tmp, target)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read GGUF file '{path}': {exc}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
