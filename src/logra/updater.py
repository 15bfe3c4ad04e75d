"""One interface for every optimizer an RL job steps, and the one KL-controlled step.

An `Updater` hides what kind of optimizer sits behind it (LoGRA, or any dense
``torch.optim`` optimizer: AdamW, LoRA adapters, `logra.optimizer.DenseRowAdam`) behind
what an RL update does with it: sum its gradients over data-parallel ranks
(`Updater.reduce`), propose a step, apply it scaled by ``α`` (returning the
`PolicyDelta` for LoGRA), and clear the gradients. `controlled_step` is
propose → predicted KL → ``α`` → apply → realised KL for any updater; the RL trainer,
`logra.integrations.KLControlledLoGRA` and the TRL trainer all take their steps through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .delta import PolicyDelta
from .kl import DenseProposal, Displacement, KLController, Probe, controlled_update
from .optimizer import LoGRAOptimizer, Proposal


class Updater(Protocol):
    """What an RL update needs from its optimizer."""

    def check_ranks(self) -> None:
        """Under data parallelism, before the first update: refuse ranks that would not
        take identical steps."""

    def reduce(self) -> None:
        """Sum this update's gradients (or sketches) over the data-parallel ranks."""

    def propose(self) -> Displacement:
        """The step that would be taken now, not yet applied."""

    def apply(self, proposal: Any, alpha: float) -> PolicyDelta | None:
        """Take ``α`` times ``proposal``; the compact delta if there is one."""

    def statistics(self, proposal: Any) -> dict[str, float]:
        """Norms of the proposal worth logging."""

    def delta_bytes(self, proposal: Any, delta: PolicyDelta | None) -> int:
        """Bytes a rollout engine receives to follow this update."""

    def zero_grad(self) -> None:
        """Clear this update's gradients (or sketches)."""


class LoGRAUpdater:
    """`Updater` of a `LoGRAOptimizer`: one all-reduce of the sketch buffer, and the delta."""

    def __init__(self, optimizer: LoGRAOptimizer) -> None:
        self.optimizer = optimizer

    def check_ranks(self) -> None:
        """Every rank must draw the same projections (`logra.parallel.verify_projections`)."""
        from .parallel import verify_projections

        verify_projections(self.optimizer)

    def reduce(self) -> None:
        """All-reduce the sketch buffer (one collective)."""
        from .parallel import allreduce_sketches

        allreduce_sketches(self.optimizer)

    def propose(self) -> Proposal:
        """`LoGRAOptimizer.propose`."""
        return self.optimizer.propose()

    def apply(self, proposal: Proposal, alpha: float) -> PolicyDelta:
        """`LoGRAOptimizer.apply`."""
        return self.optimizer.apply(proposal, alpha)

    def statistics(self, proposal: Proposal) -> dict[str, float]:
        """The sketched gradient's and the proposed update's global norms."""
        return {"sketch_norm": proposal.sketch_norm, "update_norm": proposal.update_norm}

    def delta_bytes(self, proposal: Proposal, delta: PolicyDelta | None) -> int:
        """The delta's payload."""
        return delta.nbytes if delta is not None else 0

    def zero_grad(self) -> None:
        """Zero the sketches (and dense non-target gradients)."""
        self.optimizer.zero_grad(set_to_none=True)


class DenseUpdater:
    """`Updater` of any dense ``torch.optim`` optimizer: its step's displacement, scaled."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def check_ranks(self) -> None:
        """Nothing to check beyond the starting weights (`logra.parallel.verify_weights`, which
        the trainer runs for every optimizer): a dense step has no randomness of its own."""

    def reduce(self) -> None:
        """All-reduce the gradients, flattened into one buffer (one collective)."""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def propose(self) -> DenseProposal:
        """`DenseProposal.from_optimizer`: one real step, recorded and undone."""
        return DenseProposal.from_optimizer(self.model, self.optimizer)

    def apply(self, proposal: DenseProposal, alpha: float) -> None:
        """``θ ← θ + α·Δθ``."""
        proposal.apply(alpha)

    def statistics(self, proposal: DenseProposal) -> dict[str, float]:
        """The displacement's global norm."""
        return {"update_norm": proposal.norm()}

    def delta_bytes(self, proposal: DenseProposal, delta: PolicyDelta | None) -> int:
        """Every parameter the step moved, in its own dtype (a dense sync)."""
        return sum(p.numel() * p.element_size() for p in proposal.displacements)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``."""
        self.optimizer.zero_grad(set_to_none=True)


def make_updater(model: nn.Module, optimizer: torch.optim.Optimizer) -> Updater:
    """The `Updater` for ``optimizer`` (LoGRA's own, or the dense one for anything else)."""
    if isinstance(optimizer, LoGRAOptimizer):
        return LoGRAUpdater(optimizer)
    return DenseUpdater(model, optimizer)


def controlled_step(
    updater: Updater,
    model: nn.Module,
    controller: KLController | None,
    step: int,
    probe: Probe | None,
    *,
    temperature: float = 1.0,
    max_tokens: int = 4096,
    chunk: int = 64,
    measure_realized: bool = True,
    reduce: Callable[[list[float]], list[float]] | None = None,
    proposal: Any = None,
) -> tuple[PolicyDelta | None, dict[str, float]]:
    """One KL-controlled update: propose → predicted KL → ``α`` → apply → realised KL.

    The arguments after ``step`` are `logra.kl.controlled_update`'s. Returns the delta
    (None for a dense optimizer) and the update's record: the updater's `statistics`,
    ``delta_bytes`` and the controller's statistics. ``proposal``: one the caller already
    made with ``updater.propose()`` (default: made here). Gradients are left for the
    caller to clear (`Updater.zero_grad`).
    """
    proposal = updater.propose() if proposal is None else proposal
    record: dict[str, Any] = updater.statistics(proposal)
    delta, control = controlled_update(
        model, proposal, lambda alpha: updater.apply(proposal, alpha), controller, step, probe,
        temperature=temperature, max_tokens=max_tokens, chunk=chunk, measure_realized=measure_realized,
        reduce=reduce)
    record["delta_bytes"] = updater.delta_bytes(proposal, delta)
    record.update(control)
    return delta, record
