"""How well the one-pass Nyström sketch stands in for the exact input moment (``distribution='inputs'``).

Above `logra.projection.EXACT_MOMENT_MAX` input features the fit keeps ``Σ x xᵀ Ω`` (``2r``
Gaussian columns) instead of the ``in × in`` moment. This script fits a run's projections
both ways on the same prompts (the exact moment, and the sketch above ``--sketch-above``
features: 0, every width, by default) and prints, per kind of layer input, the share of the
exact moment's top-``r`` energy that the sketched subspace captures
(``tr(Qₙᵀ C Qₙ) / tr(Qₑᵀ C Qₑ)``, 1 = as good as exact), the overlap of the two subspaces
(``‖Qₑᵀ Qₙ‖_F² / r``) and the fit times.

    python scripts/bench_input_moment.py --recipe smollm2-135m --threads 1

``--shape`` fits a randomly initialised Qwen2 of ``logra bench memory``'s 330 M shape instead
(``--layers`` of them, on ``--tokens`` random tokens, rank ``--logra.rank``, 256 by default):
a random policy's inputs have a flatter spectrum than a trained one's, the hard case for the sketch.

    python scripts/bench_input_moment.py --shape --layers 2 --tokens 4096 --sketch-above 1024 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

import logra.projection
from logra import LoGRAConfig, LoGRAOptimizer
from logra.bench.common import FULL_SHAPE
from logra.bench.memory import build_model, build_parser, make_batch
from logra.projection import InputMoment, Projector
from logra.rl import RLTrainer
from logra.rl.cli import _parser, build_config

Batches = list[Mapping[str, torch.Tensor]]


def _fit(model: nn.Module, batches: Batches, rank: int, exact_max: int) -> tuple[dict[str, torch.Tensor], float]:
    """The fitted projections by input group, and the seconds the fit took."""
    logra.projection.EXACT_MOMENT_MAX = exact_max
    opt = LoGRAOptimizer(copy.deepcopy(model), LoGRAConfig(rank=rank, distribution="inputs", refresh=False))
    t0 = time.perf_counter()
    opt.fit_projections(batches)
    return dict(opt.projector.fitted), time.perf_counter() - t0


def _moments(model: nn.Module, batches: Batches, rank: int) -> dict[str, torch.Tensor]:
    """The exact ``Σ x xᵀ`` of every input group over the same batches (float64)."""
    logra.projection.EXACT_MOMENT_MAX = sys.maxsize
    probe = LoGRAOptimizer(copy.deepcopy(model), LoGRAConfig(rank=rank, distribution="inputs", refresh=False))
    readers = probe.projector._input_groups()
    moments = {g: InputMoment(t.in_features, 1, 0) for g, t in readers.items()}
    Projector._record(probe.model, batches, {g: [t.modules[0]] for g, t in readers.items()}, moments)
    return {g: m.moment for g, m in moments.items()}


def _random_model(layers: int, tokens: int) -> tuple[nn.Module, Batches]:
    """``logra bench memory``'s random 330 M-shape model cut to ``layers``, and its random token
    batch of ``tokens`` tokens (rows of up to 512)."""
    s = FULL_SHAPE
    args = build_parser().parse_args([
        "--hidden", str(s["hidden"]), "--layers", str(layers), "--heads", str(s["heads"]),
        "--kv-heads", str(s["kv_heads"]), "--intermediate", str(s["intermediate"]), "--vocab", str(s["vocab"]),
        "--batch", str(max(tokens // 512, 1)), "--seq", str(min(tokens, 512))])
    batch = make_batch(args)
    return build_model(args).eval(), [{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}]


def main(argv: list[str]) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--shape", action="store_true", help="a random model of the 330 M shape, not a recipe's policy")
    own.add_argument("--layers", type=int, default=2)
    own.add_argument("--tokens", type=int, default=4096)
    own.add_argument("--sketch-above", type=int, default=0, help="the compared fit sketches inputs wider than this")
    ours, rest = own.parse_known_args(argv)
    args, _ = _parser().parse_known_args(rest)
    trainer = None
    if ours.shape:
        torch.set_num_threads(int(getattr(args, "threads", 1)))
        rank = int(getattr(args, "logra.rank", 256))
        model, batches = _random_model(ours.layers, ours.tokens)
    else:
        values = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "quiet", "recipe")}
        config = build_config(values, args.recipe or "embedded")
        trainer = RLTrainer(config, progress=False)
        rank, model, batches = config.logra.rank, trainer.model, list(trainer._fit_batches())
    default = logra.projection.EXACT_MOMENT_MAX
    _fit(model, batches, rank, default)  # the first fit pays one-time costs (thread pools, LAPACK): not timed
    exact, t_exact = _fit(model, batches, rank, default)
    sketched, t_sketch = _fit(model, batches, rank, ours.sketch_above)
    moments = _moments(model, batches, rank)
    logra.projection.EXACT_MOMENT_MAX = default
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for group, c in moments.items():
        qe = torch.linalg.qr(exact[group].double().T)[0]
        qn = torch.linalg.qr(sketched[group].double().T)[0]
        energy = float(torch.trace(qn.T @ c @ qn) / torch.trace(qe.T @ c @ qe))
        overlap = float((qe.T @ qn).square().sum()) / rank
        rows[group.split(".")[-2]].append((energy, overlap))
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"rank {rank}, {len(moments)} layer inputs, {tokens} tokens; fit: exact up to {default} features "
          f"{t_exact:.1f} s, Nyström (2r = {2 * rank} columns) above {ours.sketch_above} {t_sketch:.1f} s\n")
    print("| layer input | in | energy captured, Nyström / exact (min, mean) | subspace overlap (min, mean) |")
    print("|---|---|---|---|")
    for kind, vals in rows.items():
        width = next(c.shape[0] for g, c in moments.items() if g.split(".")[-2] == kind)
        e, o = [v[0] for v in vals], [v[1] for v in vals]
        print(f"| {kind} | {width} | {min(e):.4f}, {statistics.mean(e):.4f} | {min(o):.3f}, {statistics.mean(o):.3f} |")
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
