"""Paired Pass@1 table and learning curves for finished `logra train` runs named by hand.

`logra bench learn --report-only` reports runs it started itself (same recorded arguments).
This script takes any finished run directories instead, grouped under a label, e.g. a run
of the bare `logra train` beside runs a queue started with other thread counts. Seeds are
read from each run's config.json and runs are paired by seed, as in `logra bench learn`.

    python scripts/runs_table.py --reference LoGRA --out docs/learning-2000.png \\
        --group "LoGRA=runs/d2000/logra-s*" --group "AdamW=runs/d2000/adamw-s*"
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from logra.bench.learn import format_paired_table, learning_lines, paired_rows, plot_curves, read_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", action="append", required=True, metavar="LABEL=GLOB[,GLOB...]",
                   help="finished run directories of one row (comma-separated globs)")
    p.add_argument("--reference", default=None, help="label the paired differences are taken against")
    p.add_argument("--out", type=Path, default=Path("runs/learning-runs.png"),
                   help="figure path (default under runs/, which git ignores)")
    p.add_argument("--title", default="held-out Pass@1 over the run")
    args = p.parse_args()
    groups = {}
    for spec in args.group:
        label, sep, patterns = spec.partition("=")
        dirs = sorted(d for pattern in patterns.split(",") for d in glob.glob(pattern)
                      if (Path(d) / "summary.json").is_file())
        if not sep or not dirs:
            raise SystemExit(f"--group {spec!r}: expected LABEL=GLOB matching finished runs")
        groups[label] = [read_run(d, label, json.loads((Path(d) / "config.json").read_text())["seed"])
                         for d in dirs]
    reference = args.reference or next(iter(groups))
    if reference not in groups:
        raise SystemExit(f"--reference {reference!r} is not a --group label ({', '.join(groups)})")
    for label, runs in groups.items():
        print(f"- {label}: " + ", ".join(f"seed {r.seed} {r.run_dir}" for r in runs))
    print()
    try:
        rows = paired_rows(groups, reference)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(format_paired_table(rows, reference))
    print()
    print("\n".join(learning_lines(groups)))
    extra = (("realized_kl", "realized KL per update", True, 10), ("alpha", "α (step scale)", True, 10))
    png = plot_curves(groups, args.out, args.title, metrics=("pass@1",), extra=extra)
    print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
