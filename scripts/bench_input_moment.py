"""How well the one-pass Nyström sketch stands in for the exact input moment (``distribution='inputs'``).

Above `logra.projection.EXACT_MOMENT_MAX` input features the fit keeps ``Σ x xᵀ Ω`` (``2r``
Gaussian columns) instead of the ``in × in`` moment. This script fits a run's projections
both ways on the same prompts (the exact moment, and the sketch forced at every width) and
prints, per kind of layer input, the share of the exact moment's top-``r`` energy that the
sketched subspace captures (``tr(Qₙᵀ C Qₙ) / tr(Qₑᵀ C Qₑ)``, 1 = as good as exact), the
overlap of the two subspaces (``‖Qₑᵀ Qₙ‖_F² / r``) and the fit times.

    python scripts/bench_input_moment.py --recipe smollm2-135m --threads 1
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections import defaultdict

import torch

import logra.projection
from logra import LoGRAConfig, LoGRAOptimizer
from logra.projection import InputMoment, Projector
from logra.rl import RLTrainer
from logra.rl.cli import _parser, build_config


def _fit(trainer: RLTrainer, rank: int, exact_max: int) -> tuple[dict[str, torch.Tensor], float]:
    """The fitted projections by input group, and the seconds the fit took."""
    logra.projection.EXACT_MOMENT_MAX = exact_max
    opt = LoGRAOptimizer(copy.deepcopy(trainer.model), LoGRAConfig(rank=rank, distribution="inputs", refresh=False))
    t0 = time.perf_counter()
    opt.fit_projections(trainer._fit_batches())
    return dict(opt.projector.fitted), time.perf_counter() - t0


def _moments(trainer: RLTrainer, rank: int) -> dict[str, torch.Tensor]:
    """The exact ``Σ x xᵀ`` of every input group over the same prompts (float64)."""
    probe = LoGRAOptimizer(copy.deepcopy(trainer.model), LoGRAConfig(rank=rank, distribution="inputs", refresh=False))
    readers = probe.projector._input_groups()
    moments = {g: InputMoment(t.in_features, 1, 0) for g, t in readers.items()}  # exact below 4096 features
    Projector._record(probe.model, list(trainer._fit_batches()), {g: [t.modules[0]] for g, t in readers.items()},
                      moments)
    return {g: m.moment for g, m in moments.items()}


def main(argv: list[str]) -> None:
    args, _ = _parser().parse_known_args(argv)
    values = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "quiet", "recipe")}
    config = build_config(values, args.recipe or "embedded")
    trainer = RLTrainer(config, progress=False)
    rank = config.logra.rank
    default = logra.projection.EXACT_MOMENT_MAX
    _fit(trainer, rank, default)  # the first fit pays one-time costs (thread pools, LAPACK): not timed
    exact, t_exact = _fit(trainer, rank, default)
    sketched, t_sketch = _fit(trainer, rank, 0)
    logra.projection.EXACT_MOMENT_MAX = default
    moments = _moments(trainer, rank)
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for group, c in moments.items():
        qe = torch.linalg.qr(exact[group].double().T)[0]
        qn = torch.linalg.qr(sketched[group].double().T)[0]
        energy = float(torch.trace(qn.T @ c @ qn) / torch.trace(qe.T @ c @ qe))
        overlap = float((qe.T @ qn).square().sum()) / rank
        rows[group.split(".")[-2]].append((energy, overlap))
    print(f"rank {rank}, {len(moments)} layer inputs; fit: exact {t_exact:.1f} s, Nyström (2r = {2 * rank} columns) "
          f"{t_sketch:.1f} s\n")
    print("| layer input | in | energy captured, Nyström / exact (min, mean) | subspace overlap (min, mean) |")
    print("|---|---|---|---|")
    for kind, vals in rows.items():
        width = next(c.shape[0] for g, c in moments.items() if g.split(".")[-2] == kind)
        e, o = [v[0] for v in vals], [v[1] for v in vals]
        print(f"| {kind} | {width} | {min(e):.4f}, {statistics.mean(e):.4f} | {min(o):.3f}, {statistics.mean(o):.3f} |")
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
