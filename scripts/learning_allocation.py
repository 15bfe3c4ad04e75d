"""How one update is shared between layer groups, in step size and in predicted KL.

Runs N updates of the embedded recipe (`logra train` with no arguments, docs/learning.md)
in-process per method: LoGRA as the recipe has it (β1 0.9, element-wise second moment,
one projection for the run, per-layer trust ratio), the first study's LoGRA (β1 0.9,
RowAdam, 10-update projection windows, per-layer trust ratio), the paper's LoGRA update
(β1 0, refresh every update, global trust ratio), dense AdamW and LoRA at the learning
rates the bench's sweep chose. For every update it records

- each parameter's applied displacement (α included), giving per layer group the share of
  Σ‖ΔW‖² (mean over updates) and the median relative step ‖ΔW_l‖/‖W_l‖ (over layers and
  updates);
- the predicted KL of the full-size proposal and of the proposal restricted to each group
  (every target or parameter outside the group displaced by zero), giving each group's
  share KL_g / Σ_g KL_g (mean over updates). Cross terms between groups are left out of
  the shares; Σ_g KL_g / KL_full says how much they matter.

The extra probes are forward-mode AD passes under ``no_grad`` that leave the weights and the
RNG alone, so the run follows the same trajectory as without them: ``run(config,
group_kl=False)`` gave bitwise the same final weights and metrics for 3 updates of every
method. About 3 min on one CPU thread:

    PYTHONPATH=src python scripts/learning_allocation.py --updates 20 --cache_dir runs/cache
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import logra.kl
from logra.kl import DenseProposal, Displacement
from logra.optimizer import LoGRAOptimizer, Proposal
from logra.rl import RLConfig, RLTrainer
from logra.rl.config import recipe_config

GROUPS = ("embed_tokens/lm_head", "self_attn", "mlp", "other")
#: method label → the embedded recipe's dotted-key changes
METHODS: dict[str, dict[str, Any]] = {
    "LoGRA, embedded default (β1 0.9, element-wise v, fixed projection, layer trust ratio)": {},
    "LoGRA, first study's (β1 0.9, RowAdam, refresh 10, layer trust ratio)": {
        "logra.optimizer": "row_adam", "logra.refresh": True, "logra.refresh_every": 10},
    "LoGRA, paper update (β1 0, RowAdam, refresh 1, global trust ratio)": {
        "logra.optimizer": "row_adam", "logra.beta1": 0.0, "logra.refresh": True, "logra.refresh_every": 1,
        "logra.trust_ratio": "global"},
    "dense AdamW (lr 1e-3)": {"optimizer": "adamw", "lr": 1e-3},
    "LoRA (lr 1e-3)": {"optimizer": "lora", "lr": 1e-3},
}


def _group(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return GROUPS[0]
    return next((g for g in GROUPS[1:-1] if g in name), GROUPS[-1])


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach()))


def _restricted(proposal: Displacement, group: str) -> Displacement | None:
    """``proposal`` with every target / parameter outside ``group`` displaced by zero (None: nothing left)."""
    if isinstance(proposal, Proposal):
        if not any(_group(n) == group for n in proposal.directions):
            return None
        directions = {n: d if _group(n) == group else torch.zeros_like(d) for n, d in proposal.directions.items()}
        return dataclasses.replace(proposal, directions=directions)
    if isinstance(proposal, DenseProposal):
        names = {id(p): n for n, p in proposal.model.named_parameters()}
        kept = {p: d for p, d in proposal.displacements.items() if _group(names[id(p)]) == group}
        return DenseProposal(proposal.model, kept) if kept else None
    raise TypeError(f"unknown proposal type {type(proposal).__name__}")


@dataclasses.dataclass
class Records:
    """Per update: name → (‖ΔW‖, ‖W‖) and (KL_full, group → KL_g) of the probed groups; the final weights."""

    steps: list[dict[str, tuple[float, float]]] = dataclasses.field(default_factory=list)
    kls: list[tuple[float, dict[str, float]]] = dataclasses.field(default_factory=list)
    final_weights: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def run(config: RLConfig, group_kl: bool = True) -> Records:
    """Train ``config`` while recording every update's displacement and (if ``group_kl``) per-group KL."""
    rec = Records()
    real_apply, real_dense, real_kl = LoGRAOptimizer.apply, DenseProposal.apply, logra.kl.predicted_kl

    def logra_apply(self: LoGRAOptimizer, proposal: Proposal, alpha: float = 1.0) -> Any:
        targets = self._sketches.targets
        step = {n: (_norm((d * alpha) @ targets[n].projection), _norm(targets[n].weight))
                for n, d in proposal.directions.items()}
        before = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        out = real_apply(self, proposal, alpha)
        for n, p in self.model.named_parameters():
            if n in before:
                step[n] = (_norm(p - before[n]), _norm(p))
        rec.steps.append(step)
        return out

    def dense_apply(self: DenseProposal, alpha: float = 1.0) -> None:
        names = {id(p): n for n, p in self.model.named_parameters()}
        rec.steps.append({names[id(p)]: (alpha * _norm(d), _norm(p)) for p, d in self.displacements.items()})
        return real_dense(self, alpha)

    def kl_by_group(model: nn.Module, proposal: Displacement, *probe: Any, **kw: Any) -> float:
        full = real_kl(model, proposal, *probe, **kw)
        per = {}
        for g in GROUPS:
            part = _restricted(proposal, g)
            if part is not None:
                per[g] = real_kl(model, part, *probe, **kw)
        rec.kls.append((full, per))
        return full

    # controlled_update looks predicted_kl up in logra.kl's namespace at each call
    patched: Callable[..., float] = kl_by_group if group_kl else real_kl
    LoGRAOptimizer.apply, DenseProposal.apply, logra.kl.predicted_kl = logra_apply, dense_apply, patched
    try:
        trainer = RLTrainer(config, progress=False)
        trainer.train()
    finally:
        LoGRAOptimizer.apply, DenseProposal.apply, logra.kl.predicted_kl = real_apply, real_dense, real_kl
    rec.final_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return rec


def summarize(rec: Records) -> dict[str, Any]:
    """Per group: ``share`` of Σ‖ΔW‖², median ``rel`` step, ``kl`` share (None: not in the prediction)."""
    share, rel, kl_share = defaultdict(list), defaultdict(list), defaultdict(list)
    for step in rec.steps:
        total = sum(d * d for d, _ in step.values()) or 1.0
        sums: dict[str, float] = defaultdict(float)
        for name, (d, w) in step.items():
            sums[_group(name)] += d * d / total
            if w > 0:
                rel[_group(name)].append(d / w)
        for g in GROUPS:
            share[g].append(sums[g])
    probed = {g for _, per in rec.kls for g in per}
    sanity = []
    for full, per in rec.kls:
        total = sum(per.values())
        for g in probed:
            kl_share[g].append(per.get(g, 0.0) / total if total > 0 else math.nan)
        sanity.append(total / full if full > 0 else math.nan)
    groups = {g: {"share": statistics.fmean(share[g]), "rel": statistics.median(rel[g]) if rel[g] else math.nan,
                  "kl": statistics.fmean(kl_share[g]) if g in probed else None} for g in GROUPS}
    return {"groups": groups, "sanity": sanity, "kl_full": [full for full, _ in rec.kls]}


def table(summary: dict[str, Any]) -> str:
    """The markdown table of one method."""
    lines = ["| group | share of Σ‖ΔW‖² | median ‖ΔW_l‖/‖W_l‖ | share of predicted KL | KL share / ‖ΔW‖² share |",
             "|---|---|---|---|---|"]
    for g, r in summary["groups"].items():
        rel = "—" if math.isnan(r["rel"]) else f"{r['rel']:.2e}"
        if r["kl"] is None:
            kl = ratio = "not in the prediction" if r["share"] > 0 else "—"
        else:
            kl = f"{100 * r['kl']:.1f}%"
            ratio = f"{r['kl'] / r['share']:.2f}" if r["share"] > 0 else "—"
        lines.append(f"| {g} | {100 * r['share']:.1f}% | {rel} | {kl} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--cache_dir", default="~/.cache/logra")
    p.add_argument("--run_dir", default="runs/allocation")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    print(f"Per-layer-group allocation of the update over the first {args.updates} updates of the embedded "
          "recipe. Shares are means over updates; the relative step is the median over layers and updates. "
          "KL shares are KL_g / Σ_g KL_g with KL_g the predicted KL of the full-size proposal restricted to "
          "group g: cross terms between groups are ignored (Σ_g KL_g / KL_full below shows by how much).\n")
    for i, (label, changes) in enumerate(METHODS.items()):
        config = recipe_config(
            "embedded", updates=args.updates, eval_every=0, eval_problems=8, eval_samples=4, checkpoint_every=0,
            threads=args.threads, cache_dir=args.cache_dir, run_dir=f"{args.run_dir}/{i}", **changes)
        t0 = time.perf_counter()
        summary = summarize(run(config))
        sanity = [s for s in summary["sanity"] if not math.isnan(s)]
        print(f"### {label}\n\n{table(summary)}\n")
        print(f"Σ_g KL_g / KL_full: mean {statistics.fmean(sanity):.3f}, range {min(sanity):.3f}–{max(sanity):.3f}; "
              f"median KL_full {statistics.median(summary['kl_full']):.2e}; {time.perf_counter() - t0:.0f} s\n")
    print("LoGRA's predicted KL covers the sketched targets only: the parameters its AdamW group trains "
          "(non_target_lr; the norms, in 'other') are stepped but not in the prediction. LoRA's ‖ΔW‖ and "
          "relative step are those of the adapter weights (lora_A, lora_B), not of the merged W.")


if __name__ == "__main__":
    main()
