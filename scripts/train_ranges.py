"""Mean of logged training quantities over ranges of updates, one row per run.

Reads the `"train"` records of each run's metrics.jsonl (docs/architecture.md lists their
keys) and prints, for every key asked for, its mean over each range of updates, e.g. the
policy's entropy over a 2000-update run:

    python scripts/train_ranges.py runs/s34/d2k-budget2e-3-s* --keys entropy realized_kl \\
        --edges 0 250 500 1000 2000

A run that has not reached a range yet shows its mean over the updates it has; a range with
no record shows "-".
"""

from __future__ import annotations

import argparse
from itertools import pairwise
from pathlib import Path

from logra.bench.learn import read_run


def range_means(updates: list[int], values: list[float], edges: list[int]) -> list[float | None]:
    """Mean of the values whose update lies in ``[edges[i], edges[i + 1])``, per range."""
    means = []
    for lo, hi in pairwise(edges):
        inside = [v for u, v in zip(updates, values, strict=True) if lo <= u < hi]
        means.append(sum(inside) / len(inside) if inside else None)
    return means


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.jsonl)")
    p.add_argument("--keys", nargs="+", default=["entropy"], help="keys of the train records")
    p.add_argument("--edges", nargs="+", type=int, default=[0, 250, 500, 1000, 2000],
                   help="range boundaries in updates (each range includes its start)")
    args = p.parse_args()
    if len(args.edges) < 2 or any(hi <= lo for lo, hi in pairwise(args.edges)):
        raise SystemExit("--edges: give at least two strictly increasing update counts")
    ranges = [f"{lo}-{hi - 1}" for lo, hi in pairwise(args.edges)]
    print("| run | key | " + " | ".join(ranges) + " |")
    print("|---|---|" + "---|" * len(ranges))
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            raise SystemExit(f"{run}: no metrics.jsonl")
        result = read_run(run, run.name, seed=0)  # the seed plays no part here
        for key in args.keys:
            means = range_means(*result.series(key, kind="train"), args.edges)
            cells = ["-" if m is None else f"{m:.3g}" for m in means]
            print(f"| {run.name} | {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
