"""minisgl's per-user cache, shared by every environment of that user, and ``minisgl cache`` (list, size, clear).

The root is ``$MINISGL_CACHE_DIR``, else ``$XDG_CACHE_HOME/minisgl``, else ``~/.cache/minisgl``. It holds
``gguf/`` (GGUF files converted to Hugging Face directories, one per file *content*: see
:func:`content_digest`) and what plugins build there (``cpu-kernels/``). Every entry is written in a temporary
directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ENV_CACHE_DIR = "MINISGL_CACHE_DIR"
GGUF = "gguf"
SOURCE_FILE = "minisgl-source.json"  # in a converted GGUF entry: where it was made from
_DIGESTS = ".digests"  # gguf/.digests/<key of path, size, mtime>: the content digest computed for it
_CHUNK = 1 << 20


def cache_root() -> Path:
    """The cache's root directory, from the environment as it is now."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "minisgl"


def content_digest(path: Path, memo_dir: Path) -> str:
    """The SHA-256 of ``path``'s bytes. The whole file is hashed once per (real path, inode, size, mtime); the
    result is remembered as a small file in ``memo_dir``, so a later start from the same file reads it back
    instead, and a copy of the file elsewhere (another environment) hashes to the same digest."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    digest = sha.hexdigest()
    memo_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(memo, digest + "\n")
    return digest


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class CacheEntry:
    """One entry: a converted GGUF model (``gguf/NAME``) or another top-level folder (``cpu-kernels``)."""

    name: str  # what `minisgl cache clear NAME` takes
    path: Path
    size: int  # bytes
    source: str  # what it was made from, when known


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Every entry under the cache root, converted GGUF models first, each by name."""
    root = cache_root() if root is None else root
    found: list[CacheEntry] = []
    gguf = root / GGUF
    if gguf.is_dir():
        for d in sorted(p for p in gguf.iterdir() if p.is_dir() and not p.name.startswith(".")):
            try:
                source = json.loads((d / SOURCE_FILE).read_text()).get("source", "")
            except (OSError, ValueError, AttributeError):
                source = ""  # made by an earlier release (keyed by path)
            found.append(CacheEntry(f"{GGUF}/{d.name}", d, _size(d), source))
    if root.is_dir():
        for d in sorted(p for p in root.iterdir() if p.name != GGUF and not p.name.startswith(".")):
            found.append(CacheEntry(d.name, d, _size(d), ""))
    return found


def clear(name: str | None = None, root: Path | None = None) -> list[CacheEntry]:
    """Remove entry ``name`` (``gguf/NAME``, or just ``NAME`` of a GGUF entry), or everything; return what
    went. ``LookupError`` for a name that is not there."""
    root = cache_root() if root is None else root
    present = entries(root)
    if name is None:
        gone = present
    else:
        gone = [e for e in present if name in (e.name, e.name.removeprefix(f"{GGUF}/"))]
        if not gone:
            names = ", ".join(e.name for e in present) or "none"
            raise LookupError(f"no cache entry '{name}' in {root}; entries: {names}")
    for e in gone:
        # Renamed first, then removed: a process starting meanwhile sees the entry whole or not at all.
        doomed = e.path.with_name(f".removing-{e.path.name}-{os.getpid()}")
        os.replace(e.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True) if doomed.is_dir() else doomed.unlink(missing_ok=True)
    if name is None:
        shutil.rmtree(root / GGUF / _DIGESTS, ignore_errors=True)
    return gone


def human(size: int) -> str:
    """``517.2 MB``: a byte count as people read it (powers of 1000)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """``minisgl cache list|size|clear [NAME]``."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(
        prog="minisgl cache",
        description=f"Show or clear minisgl's cache (converted GGUF models, built kernels): {cache_root()} "
        f"(set {ENV_CACHE_DIR} to move it). Every environment of this user shares it.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="each entry: name, size, what it was made from")
    sub.add_parser("size", help="the total size")
    remove = sub.add_parser("clear", help="remove every entry, or the one named")
    remove.add_argument("name", nargs="?", help="an entry name from `minisgl cache list` (default: all)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    root = cache_root()
    if args.action == "list":
        found = entries(root)
        for e in found:
            print(f"{human(e.size):>10}  {e.name}" + (f"  (from {e.source})" if e.source else ""), file=out)
        print(f"{human(sum(e.size for e in found)):>10}  total in {root}", file=out)
    elif args.action == "size":
        print(f"{human(sum(e.size for e in entries(root)))}  {root}", file=out)
    else:
        try:
            gone = clear(args.name, root)
        except LookupError as exc:
            print(f"minisgl cache: error: {exc}", file=err)
            return 2
        noun = "entry" if len(gone) == 1 else "entries"
        print(f"removed {len(gone)} {noun}, {human(sum(e.size for e in gone))}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
