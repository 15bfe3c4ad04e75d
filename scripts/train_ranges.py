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
import json
from itertools import pairwise
from pathlib import Path


def range_means(records: list[dict], key: str, edges: list[int]) -> list[float | None]:
    """Mean of ``key`` over the records whose update lies in ``[edges[i], edges[i + 1])``."""
    means = []
    for lo, hi in pairwise(edges):
        values = [r[key] for r in records if lo <= r["update"] < hi and key in r]
        means.append(sum(values) / len(values) if values else None)
    return means


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.jsonl)")
    p.add_argument("--keys", nargs="+", default=["entropy"], help="keys of the train records")
    p.add_argument("--edges", nargs="+", type=int, default=[0, 250, 500, 1000, 2000],
                   help="range boundaries in updates (each range includes its start)")
    args = p.parse_args()
    if len(args.edges) < 2 or args.edges != sorted(args.edges):
        raise SystemExit("--edges: give at least two increasing update counts")
    ranges = [f"{lo}-{hi - 1}" for lo, hi in pairwise(args.edges)]
    print("| run | key | " + " | ".join(ranges) + " |")
    print("|---|---|" + "---|" * len(ranges))
    for run in args.runs:
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            raise SystemExit(f"{run}: no metrics.jsonl")
        records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
        for key in args.keys:
            cells = ["-" if m is None else f"{m:.3g}" for m in range_means(records, key, args.edges)]
            print(f"| {run.name} | {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
