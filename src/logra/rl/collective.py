"""Data-parallel reductions of the RL loop: scalars summed over ranks, one gradient all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..optimizer import LoGRAOptimizer
from ..parallel import allreduce_sketches
from ..parallel import sum_over_ranks as _sum_over_group


def sum_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    """Sum scalars over the trainer's ranks in float64 (identity in one process).

    ``world`` decides, not the default group's size: rollout workers may share that group.
    """
    return values if world == 1 else _sum_over_group(values)


def allreduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """One collective per update: LoGRA's sketch buffer, or a dense optimizer's flattened gradients."""
    if isinstance(optimizer, LoGRAOptimizer):
        allreduce_sketches(optimizer)
        return
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
