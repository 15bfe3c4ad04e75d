"""Data-parallel reductions of the RL loop's scalars (gradients: `logra.updater.Updater.reduce`)."""

from __future__ import annotations

import torch

from ..parallel import sum_over_ranks as _sum_over_group


def sum_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    """Sum scalars over the trainer's ranks in float64 (identity in one process).

    ``world`` decides, not the default group's size: rollout workers may share that group.
    """
    return values if world == 1 else _sum_over_group(values)
