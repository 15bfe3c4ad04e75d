"""Pass@1 on questions the policy trained on beside held-out ones, for finished `logra train` runs.

Tasks split their questions between training and evaluation by a hash of the text, and a
run draws each update's prompts from a fixed pool of training problems (so resume is exact;
``--train_pool``: 2000 problems by default, 700 × 256 in the embedded recipe, which holds
every chain_sum question about 54 times): over hundreds of updates a policy sees each pool
question dozens of times and can raise its reward by remembering answers without getting
better on held-out questions. This script evaluates each run's starting policy and its final
checkpoint on ``--problems`` distinct training-split questions (the first ones of the pool's
stream: in both pools above all of them were trained on; a pool entry is drawn about
updates × prompts_per_update / train_pool times, so where a pool holds a question only once
it may never have been drawn) and on the run's own held-out pool (the same problems, samples
and random numbers as the run's evaluations), and prints both gains. LoGRA, dense AdamW and
LoRA runs (a LoRA checkpoint is read into the run's peft wrapper of its starting policy).

    python scripts/seen_vs_heldout.py runs/s15/w384-logra-b8e-3-u600-s0 runs/s15/w384-adamw3e-3-b8e-3-u600-s0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_model

from logra.rl.build import build_optimizer, load_policy
from logra.rl.checkpoint import checkpoint_dir
from logra.rl.cli import run_config
from logra.rl.config import build_task
from logra.rl.evaluation import distinct_problems, evaluate


def seen_and_heldout(run_dir: Path, problems: int) -> dict[str, float]:
    """Start and final Pass@1 of one run on training-split and held-out questions."""
    config = run_config(run_dir)
    task = build_task(config)
    model, tokenizer, _ = load_policy(config, task, progress=False)
    model.eval()
    pools = {"seen": distinct_problems(task, problems, config.seed, split="train"),
             "held-out": distinct_problems(task, problems, config.seed)}
    row = {}
    for when in ("start", "final"):
        if when == "final":
            if config.optimizer == "lora":  # its checkpoint is the wrapped model's: base weights and adapters
                model = build_optimizer(config, model)[0].eval()
            load_model(model, str(checkpoint_dir(run_dir) / "model.safetensors"))  # tied weights were saved once
        for name, pool in pools.items():
            row[f"{when} {name}"] = evaluate(model, tokenizer, task, pool, config.eval_samples, config, -1)["pass@1"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="finished `logra train` run directories")
    p.add_argument("--problems", type=int, default=500, help="distinct questions of each split")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--from_json", type=Path, default=None,
                   help="plot the rows an earlier --out wrote (evaluating nothing) instead of RUNS")
    p.add_argument("--plot", type=Path, default=None,
                   help="also plot each run's held-out gain against its gain on seen questions")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from_json only replots: give --plot PNG")
        _plot(json.loads(args.from_json.read_text()), args.plot)
        return
    if not args.runs:
        raise SystemExit("give finished run directories (or --from_json with --plot)")
    rows = {}
    print("| run | seen: start → final (gain) | held-out: start → final (gain) | held-out gain / seen gain |")
    print("|---|---|---|---|")
    for run in args.runs:
        r = rows[str(run)] = seen_and_heldout(run, args.problems)
        seen, held = r["final seen"] - r["start seen"], r["final held-out"] - r["start held-out"]
        ratio = f"{held / seen:.2f}" if seen > 0 else "—"
        print(f"| {run.name} | {100 * r['start seen']:.1f} → {100 * r['final seen']:.1f} ({100 * seen:+.1f}) "
              f"| {100 * r['start held-out']:.1f} → {100 * r['final held-out']:.1f} ({100 * held:+.1f}) | {ratio} |",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot)


def _plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    """Held-out gain against seen gain, one colour per (optimizer, width) read from each run's config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    groups: dict[str, list[tuple[float, float]]] = {}
    for run, r in rows.items():
        config = run_config(run)
        width = config.tiny.hidden_size if not config.model else config.model
        seen, held = 100 * (r["final seen"] - r["start seen"]), 100 * (r["final held-out"] - r["start held-out"])
        pool = f", pool {config.train_pool}" if config.train_pool else ""
        groups.setdefault(f"{config.optimizer}, width {width}{pool}", []).append((seen, held))
    top = max(max(x, y) for points in groups.values() for x, y in points)
    for label, points in sorted(groups.items()):
        ax.scatter(*zip(*points, strict=True), s=28, label=f"{label} ({len(points)} runs)",
                   marker="o" if label.startswith("logra") else "s")
    ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="held-out gain = seen gain")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("Pass@1 gain on trained-on questions (points)")
    ax.set_ylabel("Pass@1 gain on held-out questions (points)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
