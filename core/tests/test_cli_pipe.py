"""A CLI whose reader goes away (``minisgl plugins --json | head``) exits quietly."""

from __future__ import annotations

import os
import subprocess
import sys


def test_closed_stdout_is_not_a_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "minisgl", "plugins", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr.decode()
    assert proc.returncode == 141
