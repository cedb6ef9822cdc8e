"""``--model owner/name[@revision]``: Hugging Face Hub ids resolved from a prepared cache, without network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.utils.model_path import ModelPathError, hub_cache_dir, parse_hub_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline: any attempt to reach the network fails the resolution."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def prepare(home: Path, repo: str, files: dict[str, str], *, ref: str | None = "main") -> Path:
    """A cache entry laid out as huggingface_hub lays it out (blobs + snapshot links + refs)."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for i, (name, text) in enumerate(files.items()):
        blob = root / "blobs" / f"blob{i}"
        blob.write_text(text)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (root / "refs").mkdir()
        (root / "refs" / ref).write_text(COMMIT)
    return snapshot


MODEL_FILES = {"config.json": json.dumps({"model_type": "llama"}), "model.safetensors": "x", "tokenizer.json": "{}"}


def test_hub_ids_are_recognised() -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("Qwen/Qwen3-0.6B@main") == ("Qwen/Qwen3-0.6B", "main")
    assert parse_hub_id(f"a-b/c.d_e@{COMMIT}") == ("a-b/c.d_e", COMMIT)
    assert parse_hub_id("org/model@refs/pr/1") == ("org/model", "refs/pr/1")
    for not_hub in ("model", "./a/b", "/a/b", "~/a/b", "a/b/c", "a/b.gguf", "dist:x", "a/../b", "a--b/c", "a/"):
        assert parse_hub_id(not_hub) is None, not_hub


def test_cached_snapshot_resolves_offline(hf_home: Path) -> None:
    snapshot = prepare(hf_home, "owner/name", MODEL_FILES)
    assert hub_cache_dir() == hf_home / "hub"
    assert resolve_model_path("owner/name") == snapshot
    assert resolve_model_path("owner/name@main") == snapshot
    assert resolve_model_path(f"owner/name@{COMMIT}") == snapshot


def test_cached_sharded_snapshot_needs_every_shard(hf_home: Path) -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    files = {
        "config.json": "{}",
        "model.safetensors.index.json": json.dumps(index),
        "model-00001-of-00002.safetensors": "x",
    }
    prepare(hf_home, "owner/sharded", files)
    with pytest.raises(ModelPathError, match="in the cache without weight shards model-00002-of-00002"):
        resolve_model_path("owner/sharded")


def test_hub_cache_env_wins_over_hf_home(hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "elsewhere"
    snapshot = prepare(other.parent / "x", "owner/name", MODEL_FILES)  # .../x/hub/models--owner--name
    monkeypatch.setenv("HF_HUB_CACHE", str(other.parent / "x" / "hub"))
    assert resolve_model_path("owner/name") == snapshot


def test_not_cached_and_offline_says_what_to_do(hf_home: Path) -> None:
    with pytest.raises(ModelPathError) as info:
        resolve_model_path("owner/missing")
    message = str(info.value)
    assert "'owner/missing' is not a local path" in message
    assert "not in the cache" in message and str(hf_home / "hub") in message
    assert "HF_HUB_OFFLINE" in message and "HF_HOME" in message
    assert "hf download owner/missing" in message and "local model directory" in message


def test_no_network_and_not_cached_says_what_to_do(tmp_path: Path) -> None:
    """Online mode, but the Hub cannot be reached (a closed local port stands in for no network)."""
    code = (
        "import minisgl.utils.model_path as m\n"
        "try:\n    m.resolve_model_path('owner/missing')\nexcept m.ModelPathError as e:\n    print(e)\n"
    )
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True)
    assert "is not cached and cannot be downloaded" in out.stdout, out.stdout + out.stderr
    assert "hf download owner/missing" in out.stdout and "HF_HOME" in out.stdout


def test_existing_path_wins_over_hub_id(hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "owner" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("owner/name") == Path("owner/name")


def test_not_a_path_nor_a_hub_id() -> None:
    with pytest.raises(ModelPathError, match="Hub id like Qwen/Qwen3-0.6B"):
        resolve_model_path("/no/such/model/dir")


def test_model_path_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, minisgl.utils.model_path as m\n"
        "try:\n    m.resolve_model_path('owner/missing')\nexcept m.ModelPathError:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
