"""The GGUF conversion cache: keyed by the file's content (a copy elsewhere, as in another environment, reuses
the entry), written atomically (concurrent first uses convert once), and ``minisgl cache`` list / size / clear.

The GGUF files are tiny ones written by the ``gguf`` package; the converter is a stand-in that records its
calls (the real conversion, through transformers, is covered by the SmolLM2 tests)."""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from minisgl.models.loader import gguf_to_hf_dir
from minisgl.utils import cache

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


def write_gguf(path: Path, values: list[float]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.array(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class Converter:
    """Writes a config.json naming the source, counting calls; ``delay`` widens the window for a race."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[Path] = []
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, src: Path, out: Path) -> None:
        with self.lock:
            self.calls.append(src)
        time.sleep(self.delay)
        (out / "model.safetensors").write_bytes(b"x" * 1000)
        (out / "config.json").write_text(json.dumps({"from": src.name}))


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_copy_of_the_same_file_in_another_environment_reuses_the_entry(tmp_path: Path, root: Path) -> None:
    convert = Converter()
    (tmp_path / "venv-a").mkdir()
    (tmp_path / "venv-b").mkdir()
    first = write_gguf(tmp_path / "venv-a" / "model.gguf", [1, 2])
    second = tmp_path / "venv-b" / "model.gguf"
    shutil.copy(first, second)  # another path, another mtime, the same bytes
    os.utime(second, (1_000_000, 1_000_000))
    a = gguf_to_hf_dir(first, convert)
    b = gguf_to_hf_dir(second, convert)
    assert a == b and convert.calls == [first]
    assert a.parent == root / "gguf" and json.loads((a / "config.json").read_text()) == {"from": "model.gguf"}
    source = json.loads((a / cache.SOURCE_FILE).read_text())
    assert source["source"] == str(first.resolve()) and source["size"] == first.stat().st_size
    # Different content, same path and name: a new entry.
    write_gguf(second, [3, 4])
    c = gguf_to_hf_dir(second, convert)
    assert c != a and convert.calls == [first, second]
    assert not list((root / "gguf").glob(".convert-*"))  # no temporary directory left behind


def test_the_digest_is_remembered_per_file_and_recomputed_when_it_changes(tmp_path: Path, root: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", [1, 2, 3])
    memo = root / "gguf" / ".digests"
    digest = cache.content_digest(path, memo)
    assert [f.read_text().strip() for f in memo.iterdir()] == [digest]
    write_gguf(path, [1, 2, 4])  # rewritten in place: new mtime and content
    assert cache.content_digest(path, memo) != digest
    assert len(list(memo.iterdir())) == 2


def test_concurrent_first_uses_convert_once(tmp_path: Path, root: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", [5, 6])
    convert = Converter(delay=0.3)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(gguf_to_hf_dir(path, convert))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(convert.calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "config.json").exists()


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, root: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", [7])

    def broken(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        gguf_to_hf_dir(path, broken)
    assert [e.name for e in cache.entries(root)] == []
    assert gguf_to_hf_dir(path, Converter()).is_dir()  # the next try converts


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cache.main(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cache_command_lists_sizes_and_clears(tmp_path: Path, root: Path) -> None:
    one = gguf_to_hf_dir(write_gguf(tmp_path / "one.gguf", [1]), Converter())
    two = gguf_to_hf_dir(write_gguf(tmp_path / "two.gguf", [2]), Converter())
    (root / "cpu-kernels").mkdir()
    (root / "cpu-kernels" / "k.so").write_bytes(b"y" * 500)
    size = sum(f.stat().st_size for f in one.rglob("*") if f.is_file())
    code, out, _ = run("list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [f"{size / 1000:.1f}", "kB", f"gguf/{one.name}", "(from", f"{tmp_path / 'one.gguf'})"]
    assert lines[1].split()[2] == f"gguf/{two.name}" and lines[2].split() == ["500", "B", "cpu-kernels"]
    total = 2 * size + 500
    assert lines[3] == f"{cache.human(total):>10}  total in {root}"
    assert run("size")[1] == f"{cache.human(total)}  {root}\n"
    assert run("clear", one.name)[:2] == (0, f"removed 1 entry, {cache.human(size)}\n")
    assert not one.exists() and two.exists()
    code, _, err = run("clear", "nope")
    assert code == 2 and err.startswith(f"minisgl cache: error: no cache entry 'nope' in {root}; entries: gguf/")
    assert run("clear")[1] == f"removed 2 entries, {cache.human(size + 500)}\n"
    assert cache.entries(root) == [] and not (root / "gguf" / ".digests").exists()


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MINISGL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "minisgl"
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
