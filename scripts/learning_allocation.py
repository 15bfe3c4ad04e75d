"""How one update is shared between layers: per-layer ‖ΔW‖ for LoGRA (global / per-layer
trust ratio) and dense AdamW on the embedded recipe (docs/learning.md).

Runs N updates of `logra train` in-process per method, records each applied update's
per-parameter displacement (α included) and prints, per layer group, the mean share of
Σ‖ΔW‖² and the median relative step ‖ΔW_l‖/‖W_l‖.

    PYTHONPATH=src python scripts/learning_allocation.py --updates 30 --cache_dir runs/cache-study
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from logra.kl import DenseProposal
from logra.optimizer import LoGRAOptimizer
from logra.rl import RLConfig, RLTrainer

GROUPS = ("embed_tokens", "lm_head", "self_attn", "mlp", "other")


def _group(name: str) -> str:
    return next((g for g in GROUPS[:-1] if g in name), "other")


def measure(config: RLConfig) -> dict[str, dict[str, float]]:
    records: list[dict[str, tuple[float, float]]] = []  # per update: name -> (‖ΔW‖, ‖W‖)
    real_apply, real_dense = LoGRAOptimizer.apply, DenseProposal.apply

    def logra_apply(self, proposal, alpha=1.0):
        targets = self._sketches.targets
        rec = {n: (float(torch.linalg.vector_norm((d * alpha) @ targets[n].projection)),
                   float(torch.linalg.vector_norm(targets[n].weight))) for n, d in proposal.directions.items()}
        before = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        out = real_apply(self, proposal, alpha)
        for n, p in self.model.named_parameters():
            if n in before:
                rec[n] = (float(torch.linalg.vector_norm(p.detach() - before[n])), float(torch.linalg.vector_norm(p)))
        records.append(rec)
        return out

    def dense_apply(self, alpha=1.0):
        names = {id(p): n for n, p in self.model.named_parameters()}
        records.append({names[id(p)]: (alpha * float(torch.linalg.vector_norm(d)), float(torch.linalg.vector_norm(p)))
                        for p, d in self.displacements.items()})
        return real_dense(self, alpha)

    LoGRAOptimizer.apply, DenseProposal.apply = logra_apply, dense_apply
    try:
        RLTrainer(config, progress=False).train()
    finally:
        LoGRAOptimizer.apply, DenseProposal.apply = real_apply, real_dense
    share, rel = defaultdict(list), defaultdict(list)
    for rec in records:
        total = sum(d * d for d, _ in rec.values()) or 1.0
        sums = defaultdict(float)
        for name, (d, w) in rec.items():
            sums[_group(name)] += d * d / total
            if w > 0:
                rel[_group(name)].append(d / w)
        for g in GROUPS:
            share[g].append(sums[g])
    return {g: {"share": statistics.fmean(share[g]), "rel": statistics.median(rel[g]) if rel[g] else 0.0}
            for g in GROUPS}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--cache_dir", default="~/.cache/logra")
    p.add_argument("--run_dir", default="runs/allocation")
    args = p.parse_args()
    rows = {}
    for label, opt, logra_kw in (("LoGRA (global ratio)", "logra", {}),
                                 ("LoGRA trust_ratio=layer", "logra", {"trust_ratio": "layer"}),
                                 ("LoGRA β1=0.9 k=10 + layer", "logra", {"trust_ratio": "layer", "beta1": 0.9,
                                                                         "refresh_every": 10}),
                                 ("dense AdamW", "adamw", {})):
        config = RLConfig(optimizer=opt, updates=args.updates, eval_every=0, eval_problems=8, eval_samples=4,
                          checkpoint_every=0, threads=1, cache_dir=args.cache_dir,
                          run_dir=f"{args.run_dir}/{label.split()[0]}-{len(rows)}")
        for k, v in logra_kw.items():
            setattr(config.logra, k, v)
        rows[label] = measure(config)
    print(f"Per-layer-group allocation of the update over the first {args.updates} updates "
          "(share of Σ‖ΔW‖², mean over updates; median ‖ΔW_l‖/‖W_l‖ over layers and updates):\n")
    print("| method | " + " | ".join(f"{g} share / rel. step" for g in GROUPS) + " |")
    print("|---|" + "---|" * len(GROUPS))
    for label, r in rows.items():
        print(f"| {label} | " + " | ".join(f"{100 * r[g]['share']:.1f}% / {r[g]['rel']:.1e}" for g in GROUPS) + " |")


if __name__ == "__main__":
    main()
