"""The protocol's offline workloads, shared by ``bench offline`` and ``bench roofline``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

GPU_EXPECTED_OUTPUT_TOKENS = 133_966
CPU_EXPECTED_OUTPUT_TOKENS = 2_251
CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and the number of tokens to generate for each."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def gpu_workload() -> Workload:
    """The protocol's 256 requests: all prompts drawn first, then all output lengths."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    lens = [rng.randint(100, 1024) for _ in range(256)]
    return Workload(prompts, lens)


def cpu_workload() -> Workload:
    """The protocol's CPU variant: 32 prompts of 16-256 tokens, 16-128 output tokens each."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    lens = [rng.randint(16, 128) for _ in range(32)]
    return Workload(prompts, lens)


def warmup_workload(work: Workload) -> Workload:
    """Eight requests shaped like the workload's first eight, with other token ids.

    The prompts share nothing with the timed ones, so a prefix cache cannot serve
    the timed run from the warm-up (which would shorten the prefill the baseline pays for).
    """
    rng = random.Random(1)
    prompts = [[rng.randint(0, 10000) for _ in p] for p in work.prompts[:8]]
    return Workload(prompts, [min(16, n) for n in work.output_lens[:8]])
