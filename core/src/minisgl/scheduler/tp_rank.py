"""Entry point of a tensor-parallel rank's process: ``python -m minisgl.scheduler.tp_rank``.

Rank 0 starts one per other rank of its node (see :mod:`minisgl.scheduler.tp`)
and writes the launch arguments as one JSON object on its stdin.
"""

from __future__ import annotations

import json
import sys

from .tp import follower_main


def main() -> None:
    launch = json.loads(sys.stdin.buffer.read())
    follower_main(launch["config"], launch["rank"], launch["local_rank"], launch["topology"])


if __name__ == "__main__":
    main()
