"""``logra bench kl``: predicted vs realised KL over consecutive RL updates, and the probe's cost.

Runs the RL loop (the embedded default policy unless ``--model`` is given) for
``--updates`` updates with predicted-KL control on, and reads back, per update, the
predicted KL of the scaled step and the exact KL measured after applying it on the same
probe positions. Prints a per-update table, the median ``|predicted/realised - 1|``, the
probe's time as a fraction of the training step, and writes a scatter plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from ..rl import RLTrainer, recipe_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="logra bench kl", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--updates", type=int, default=50, help="consecutive RL updates to measure")
    p.add_argument("--model", default="", help="local causal LM path (empty: the embedded default policy)")
    p.add_argument("--optimizer", default="logra", choices=("logra", "adamw", "lora"), help="whose steps to predict")
    p.add_argument("--budget", type=float, default=None, help="constant KL budget (default: the recipe's schedule)")
    p.add_argument("--out-dir", default="runs/bench-kl", help="run directory (metrics, scatter plot)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling and prompts")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    args = _parser().parse_args(argv)
    # as `logra train`: the embedded recipe for the tiny policy, recipe 'model' for a model
    base = recipe_config("model", model=args.model) if args.model else recipe_config("embedded")
    kl = base.kl if args.budget is None else dataclasses.replace(base.kl, schedule="constant", budget=args.budget)
    config = dataclasses.replace(
        base, model=args.model, optimizer=args.optimizer, updates=args.updates, eval_every=0, checkpoint_every=0,
        run_dir=args.out_dir, threads=args.threads, seed=args.seed, kl=kl,
    )
    trainer = RLTrainer(config)
    rows = []
    for _ in range(args.updates):
        r = trainer.train_step()
        trainer.log.write(r)
        guard = r.get("time_guard", 0.0)
        step = r["time_update"] - r["time_kl"] - r["time_check"] - guard
        rows.append((r["update"], r["expected_kl"], r["realized_kl"], r["alpha"], r["effective_budget"], r["time_kl"],
                     step, guard, r.get("backtracks", 0)))
        print(f"update {r['update']:3d}: predicted {r['expected_kl']:.3e}  realised {r['realized_kl']:.3e}  "
              f"α {r['alpha']:.2f}", file=sys.stderr)
    print(format_table(rows, args))
    path = scatter(rows, Path(args.out_dir))
    print(f"\nscatter plot: {path}")
    return 0


def format_table(rows: list[tuple], args: argparse.Namespace) -> str:
    """Markdown: per-update predictions, then the median error and probe cost against the targets."""
    lines = ["| update | predicted KL | realised KL | ratio | α | backtracks | budget | probe s | guard s | step s |",
             "|" + "---|" * 10]
    errors, fractions, guards = [], [], []
    for u, pred, real, alpha, budget, t_kl, t_step, t_guard, backtracks in rows:
        ratio = pred / real if real > 0 else float("nan")
        if real > 0:
            errors.append(abs(ratio - 1))
        fractions.append(t_kl / t_step)
        guards.append(t_guard / t_step)
        lines.append(f"| {u} | {pred:.3e} | {real:.3e} | {ratio:.3f} | {alpha:.2f} | {backtracks} | {budget:.2e} | "
                     f"{t_kl:.3f} | {t_guard:.3f} | {t_step:.3f} |")
    median_err = statistics.median(errors) if errors else float("nan")
    cost = statistics.median(fractions)
    lines += [
        "",
        f"{args.optimizer} optimizer, {len(rows)} consecutive updates; 'step s' = rollout + loss/backward + "
        "proposal + apply (the probe, the overshoot guard and the realised-KL check excluded).",
        f"median |predicted/realised - 1| = {median_err:.4f} over {len(errors)} updates with realised KL > 0",
        f"median probe cost = {cost:.3f} × the training step; the guard's = {statistics.median(guards):.3f} × "
        f"(it shrank {sum(r[8] > 0 for r in rows)} of {len(rows)} steps)",
        f"{'PASS' if median_err <= 0.05 else 'FAIL'}: median error ≤ 5%",
        f"{'PASS' if cost <= 0.25 else 'FAIL'}: probe cost ≤ 25% of a training step",
    ]
    return "\n".join(lines)


def scatter(rows: list[tuple], out_dir: Path) -> Path:
    """Predicted vs realised KL, log-log, with the identity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = [r[1] for r in rows if r[2] > 0]
    real = [r[2] for r in rows if r[2] > 0]
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.loglog(real, pred, "o", ms=4, alpha=0.8)
    lo, hi = min(real + pred), max(real + pred)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = realised")
    ax.set_xlabel("realised KL (exact, after the step)")
    ax.set_ylabel("predicted KL (second order, before)")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "kl_scatter.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
