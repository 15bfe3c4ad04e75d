"""LoGRA over FSDP2 row-sharded target weights (``fully_shard``, ``Shard(0)``), docs/method.md §7.

Row-sharded weights use `RowShardedLoGRA` instead of ``opt.propose``/``opt.apply``:
every rank holds the full sketch and updates only its own rows ``W_local -= U[rows] A``;
the weight norm of the update-ratio step size is reduced across ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..delta import PolicyDelta
from ..optimizer import LoGRAOptimizer, Proposal
from ..sketch import SketchTarget


class RowShardedLoGRA:
    """LoGRA over FSDP2 row-sharded target weights (``fully_shard``, ``Shard(0)``), docs/method.md §7.

    Build the optimizer AFTER ``fully_shard`` (its targets must be the sharded DTensor
    parameters), then use this object's `propose`/`apply`/`step` in place of the
    optimizer's. What it does:

    - forward: FSDP2 all-gathers each layer's weights before its forward. The sketch
      forward reads the weight from the optimizer's target record, so a forward pre-hook
      points that record at the gathered weight for the duration of the call (and a
      post-hook back at the shard). The full ``H`` reaches the backward, so every rank
      holds the full ``[Σ out, r]`` sketch of its data; `allreduce_sketches` sums them.
    - propose: identical on every rank (same summed sketch, same projections). With the
      update-ratio step size (every trust ratio), each target's weight norm comes from
      the ranks' local shards (all-gathered and summed in rank order, so every rank gets
      the same bits) and is handed to `LoGRAOptimizer.propose`; the core's own norms
      would see only this rank's shard.
    - apply: each rank merges ``W_local -= U[rows] A`` into its own rows; the returned
      `PolicyDelta` holds the full factors ``U`` (identical on every rank), ready to
      publish to rollout workers.

    Only ``non_target='freeze'`` (the paper default) is supported: dense non-target
    training under FSDP2 needs a reduce-scatter of sharded gradients, which this path
    does not implement. Single 1-D device mesh only.
    """

    def __init__(self, optimizer: LoGRAOptimizer, group: dist.ProcessGroup | None = None) -> None:
        from torch.distributed.tensor import DTensor, Shard

        if optimizer.config.non_target != "freeze":
            raise ValueError("RowShardedLoGRA supports non_target='freeze' only (dense non-target "
                             f"training under FSDP2 is not implemented), got {optimizer.config.non_target!r}")
        self.optimizer = optimizer
        self.group = group
        self._targets = {name: optimizer.sketch_target(name) for name in optimizer.targets}
        self._sharded: dict[str, Any] = {}
        self._rows: dict[str, slice] = {}
        for name, target in self._targets.items():
            w = target.weight
            if not isinstance(w, DTensor) or tuple(w.placements) != (Shard(0),):
                raise ValueError(
                    f"target {name} is not a Shard(0) DTensor ({type(w).__name__}); apply fully_shard "
                    "before creating the LoGRAOptimizer")
            if any(m.weight is not w for m in target.modules):
                raise ValueError(f"target {name}: the module's weight is not the sharded parameter")
            mesh = w.device_mesh
            if mesh.ndim != 1:
                raise ValueError(f"target {name}: only a 1-D device mesh is supported, got {mesh.ndim}-D")
            out, local = w.shape[0], w.to_local().shape[0]
            chunk = math.ceil(out / mesh.size())
            start = min(mesh.get_local_rank() * chunk, out)
            if local != min(chunk, out - start):
                raise ValueError(f"target {name}: unexpected local shard of {local} rows (out={out}, chunk={chunk})")
            self._sharded[name] = w
            self._rows[name] = slice(start, start + local)
        self._handles = []
        for target in self._targets.values():
            for module in target.modules:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._gathered_weight, target)))
                self._handles.append(module.register_forward_hook(functools.partial(self._sharded_weight, target)))

    def _gathered_weight(self, target: SketchTarget, module: nn.Module, args: Any) -> None:
        target.weight = module.weight

    def _sharded_weight(self, target: SketchTarget, module: nn.Module, args: Any, output: Any) -> None:
        target.weight = self._sharded[target.name]

    def rows(self, name: str) -> slice:
        """The rows of target ``name`` that this rank holds."""
        return self._rows[name]

    def _weight_norms(self) -> torch.Tensor:
        """``‖W_l‖_F`` of every full target weight, from the ranks' local shards."""
        local = torch.stack([self._sharded[n].to_local().float().square().sum() for n in self._targets])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, local, group=self.group)
        per_target = gathered[0].clone()
        for g in gathered[1:]:  # rank order: every rank adds the same numbers in the same order
            per_target += g
        # Equal to the core's single-process norms up to float rounding (the squares of one
        # target are summed shard by shard here); the tests check it to rtol 1e-5.
        return per_target.sqrt()

    @torch.no_grad()
    def propose(self) -> Proposal:
        """The optimizer's proposal, its step size from the full weights' norms (any trust ratio)."""
        opt = self.optimizer
        return opt.propose(self._weight_norms() if opt.param_groups[0]["update_ratio"] is not None else None)

    @torch.no_grad()
    def apply(self, proposal: Proposal, alpha: float = 1.0) -> PolicyDelta:
        """Merge this rank's rows of ``α·proposal``; return the full `PolicyDelta`.

        Unlike `LoGRAOptimizer.apply` it leaves ``proposal.directions`` in place, and the full
        factors are made before the merge: directions and factors coexist here."""
        local = dataclasses.replace(
            proposal, directions={n: d[self._rows[n]] for n, d in proposal.directions.items()})
        dtype = self.optimizer.config.torch_factor_dtype
        # The same rounding as the core's apply, on the full directions.
        factors = {n: (d * alpha).to(dtype) for n, d in proposal.directions.items()}
        try:
            for name, target in self._targets.items():
                target.weight = self._sharded[name].to_local()
            delta = self.optimizer.apply(local, alpha)
        finally:
            for name, target in self._targets.items():
                target.weight = self._sharded[name]
        delta.factors = factors
        delta.shapes = {n: list(w.shape) for n, w in self._sharded.items()}
        return delta

    def step(self) -> PolicyDelta:
        """``apply(propose())``."""
        return self.apply(self.propose())

    def remove(self) -> None:
        """Remove the forward hooks (the optimizer's sketches stay installed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
