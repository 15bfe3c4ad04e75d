"""Held-out Pass@1 by class of arithmetic problem over finished `logra train` runs.

Each evaluation a run logs records how many of its samples were right on every held-out
problem (``correct`` in metrics.jsonl, in the order of `logra.rl.evaluation.distinct_problems`).
This script rebuilds each run's held-out problems from its config, groups them by the
number of terms of the question and the sign of the answer (chain_sum-style questions such
as ``"3 - 7 + 2 ="``), and prints, per class and evaluation, Pass@1 and the share of
problems answered all-or-none (every sample right or every sample wrong: a policy that has
become deterministic there). With ``--greedy`` it also decodes the final checkpoint greedily
on one class and prints its most common answer and how often it gives it, to tell a policy
that learned a class from one that collapsed onto a single answer. No evaluation is re-run
except that greedy decode.

    python scripts/problem_classes.py runs/s31/d2k-logra-s0 runs/s31/d2k-adamw1e-3-s0 --greedy "3 terms, negative" \\
        --plot classes.png
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_model

from logra.rl.build import load_policy
from logra.rl.checkpoint import checkpoint_dir
from logra.rl.cli import run_config
from logra.rl.config import build_task
from logra.rl.evaluation import distinct_problems
from logra.tasks import Problem


def problem_class(problem: Problem) -> str:
    """``"<n> terms, negative|non-negative"`` from the question after its last ':'."""
    question = problem.prompt.rsplit(":", 1)[-1]
    terms = len(re.findall(r"\d+", question.split("=")[0]))
    return f"{terms} terms, {'negative' if problem.answer.strip().startswith('-') else 'non-negative'}"


def class_curves(run_dir: Path) -> tuple[list[int], dict[str, dict[str, list[float]]]]:
    """The run's evaluation updates and, per class, its size, Pass@1 and all-or-none share at each."""
    config = run_config(run_dir)
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval" and "correct" in r]
    if not evals:
        raise SystemExit(f"{run_dir}: no evaluation with per-problem counts in metrics.jsonl")
    problems = distinct_problems(build_task(config), evals[0]["problems"], config.seed)
    samples = evals[0]["samples"]
    classes = [problem_class(p) for p in problems]
    curves: dict[str, dict[str, list[float]]] = {}
    for name in sorted(set(classes)):
        members = [i for i, c in enumerate(classes) if c == name]
        curves[name] = {
            "size": [float(len(members))],
            "pass@1": [sum(r["correct"][i] for i in members) / (samples * len(members)) for r in evals],
            "all-or-none": [sum(r["correct"][i] in (0, samples) for i in members) / len(members) for r in evals],
        }
    return [r["update"] for r in evals], curves


def greedy_answers(run_dir: Path, name: str) -> tuple[int, Counter[str], int]:
    """Greedy answers of the final checkpoint on the held-out problems of class ``name``:
    (problems, answer counts, problems answered right)."""
    config = run_config(run_dir)
    if config.optimizer == "lora":
        raise SystemExit(f"{run_dir}: --greedy reads full-weight checkpoints (LoGRA, AdamW), not LoRA's")
    task = build_task(config)
    model, tokenizer, _ = load_policy(config, task, progress=False)
    load_model(model, str(checkpoint_dir(run_dir) / "model.safetensors"))
    model.eval()
    problems = [p for p in distinct_problems(task, config.eval_problems, config.seed) if problem_class(p) == name]
    if not problems:
        raise SystemExit(f"{run_dir}: no held-out problem of class {name!r}")
    batch = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=config.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    answers = [t.strip().split("\n")[0] for t in texts]
    right = sum(task.score(p, t) == 1.0 for p, t in zip(problems, texts, strict=True))
    return len(problems), Counter(answers), right


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished `logra train` run directories")
    p.add_argument("--greedy", default=None, metavar="CLASS",
                   help='also decode the final checkpoint greedily on this class, e.g. "3 terms, negative"')
    p.add_argument("--plot", type=Path, default=None, help="also plot Pass@1 per class over the updates")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    curves_of = {}
    for run in args.runs:
        updates, curves = curves_of[run] = class_curves(run)
        print(f"\n{run}  (evaluations at updates {updates[0]}…{updates[-1]}, every {updates[1] - updates[0]})"
              if len(updates) > 1 else f"\n{run}")
        for name, c in curves.items():
            print(f"  {name:26s} n={int(c['size'][0]):3d}  Pass@1 " + " ".join(f"{x:.2f}" for x in c["pass@1"])
                  + "  | all-or-none " + " ".join(f"{x:.2f}" for x in c["all-or-none"]))
        if args.greedy:
            n, answers, right = greedy_answers(run, args.greedy)
            top, count = answers.most_common(1)[0]
            print(f"  greedy on {args.greedy!r}: {right}/{n} right; most common answer {top!r} on {count}/{n}; "
                  f"{len(answers)} distinct answers")
    if args.plot:
        _plot(curves_of, args.plot)


def _plot(curves_of: dict[Path, tuple[list[int], dict[str, dict[str, list[float]]]]], path: Path) -> None:
    """One panel per class: each run's Pass@1 on it over the updates (LoGRA solid, others dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for _, curves in curves_of.values() for name in curves})
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for run, (updates, curves) in curves_of.items():
            if name in curves:
                ax.plot(updates, curves[name]["pass@1"], marker=".", label=run.name,
                        ls="-" if run_config(run).optimizer == "logra" else "--")
        sizes = {int(c[name]["size"][0]) for _, c in curves_of.values() if name in c}
        ax.set_title(f"{name} ({min(sizes)}–{max(sizes)} problems)" if len(sizes) > 1 else f"{name} ({sizes.pop()})",
                     fontsize=9)
        ax.set_xlabel("update")
    axes[0][0].set_ylabel("held-out Pass@1")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
