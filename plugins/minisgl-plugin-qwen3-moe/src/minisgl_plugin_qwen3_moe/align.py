"""Token-to-expert alignment in plain PyTorch (no Triton: runs and is tested on CPU).

The fused kernels work on blocks of ``block_m`` rows that all belong to one
expert. Alignment sorts the ``tokens * top_k`` (token, expert) assignments by
expert, stably, and pads each expert's run to a multiple of ``block_m``.

* ``sorted_ids[slot]`` is the flat assignment index ``token * top_k + j``, or
  ``tokens * top_k`` (one past the last) on a padding slot;
* ``block_expert[b]`` is the expert of slots ``[b * block_m, (b + 1) * block_m)``,
  or -1 for a block past the last expert's run (kernels skip those).

Both have a length fixed by the shapes alone (an upper bound), so nothing here
waits for the GPU and the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of ``block_m`` blocks after padding: each non-empty expert pads < block_m rows."""
    return (num_assignments + min(num_assignments, num_experts) * (block_m - 1)) // block_m


def align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert)`` (int32) for ``topk_ids`` ``[tokens, top_k]``, as the module docstring says."""
    flat = topk_ids.reshape(-1).long()
    m = flat.numel()
    dev = flat.device
    nb = max_blocks(m, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    run_starts = counts.cumsum(0) - counts  # where each expert's run starts before padding
    sorted_experts, order = torch.sort(flat, stable=True)
    # Slot = padded start of the expert + rank of the assignment within its expert's run.
    slots = (
        padded_ends[sorted_experts] - padded[sorted_experts] + torch.arange(m, device=dev) - run_starts[sorted_experts]
    )
    sorted_ids = torch.full((nb * block_m,), m, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, slots, order.to(torch.int32))
    first_slot = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(padded_ends, first_slot, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert
