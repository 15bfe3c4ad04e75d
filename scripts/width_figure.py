"""Held-out Pass@1 gain against policy width, one line per method, mean ± SE over seeds.

Gains come from finished `logra train` runs (``summary.json``: final − initial Pass@1) or,
for widths whose run directories are no longer at hand, from per-seed gains recorded in
docs/learning.md (drawn hollow and labelled as recorded). Also prints the table behind the
figure, with each method's gain as a ratio of dense AdamW's at the same width.

    python scripts/width_figure.py --out docs/learning-width.png \\
        --recorded LoGRA:128:11.5,12.25,12.75 --recorded AdamW:128:10.85,11.05,10.5 \\
        --group "LoGRA:256:runs/w256/wide-logra-s*" --group "AdamW:256:runs/w256/wide-adamw-s*" ...
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _gains(pattern: str) -> list[float]:
    """Gains in points of the finished runs matching ``pattern`` (sorted by directory name)."""
    out = []
    for run in sorted(glob.glob(pattern)):
        summary = Path(run) / "summary.json"
        if summary.is_file():
            out.append(100 * json.loads(summary.read_text())["pass@1_gain"])
    if not out:
        raise SystemExit(f"no finished run matches {pattern!r}")
    return out


def _parse(spec: str) -> tuple[str, int, str]:
    method, width, rest = spec.split(":", 2)
    return method, int(width), rest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", action="append", default=[], metavar="METHOD:WIDTH:GLOB",
                   help="finished run directories of one method at one width")
    p.add_argument("--recorded", action="append", default=[], metavar="METHOD:WIDTH:G1,G2,...",
                   help="per-seed gains (points) recorded from earlier runs")
    p.add_argument("--out", default="learning-width.png")
    args = p.parse_args()
    rows: dict[str, dict[int, tuple[list[float], bool]]] = {}
    for spec in args.group:
        method, width, pattern = _parse(spec)
        rows.setdefault(method, {})[width] = (_gains(pattern), False)
    for spec in args.recorded:
        method, width, values = _parse(spec)
        rows.setdefault(method, {})[width] = ([float(v) for v in values.split(",")], True)

    def stat(values: list[float]) -> tuple[float, float]:
        mean = statistics.fmean(values)
        return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)

    print("| method | width | seeds | gain (points, mean ± SE) | × AdamW's | source |")
    print("|---|---|---|---|---|---|")
    for method, widths in rows.items():
        for width in sorted(widths):
            values, recorded = widths[width]
            mean, se = stat(values)
            dense = rows.get("AdamW", {}).get(width)
            ratio = f"{mean / stat(dense[0])[0]:.2f}" if dense else "–"
            print(f"| {method} | {width} | {len(values)} | {mean:+.1f} ± {se:.1f} | {ratio} | "
                  f"{'recorded (earlier code)' if recorded else 'runs'} |")

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (method, widths) in enumerate(rows.items()):
        xs = sorted(widths)
        stats = [stat(widths[w][0]) for w in xs]
        offset = [w + 3 * (i - 1) for w in xs]  # side by side, so error bars do not overlap
        line = ax.errorbar(offset, [m for m, _ in stats], yerr=[0 if math.isnan(s) else s for _, s in stats],
                           marker="o", capsize=3, label=method)
        hollow = [j for j, w in enumerate(xs) if widths[w][1]]
        if hollow:
            ax.plot([offset[j] for j in hollow], [stats[j][0] for j in hollow], "o", mfc="white",
                    color=line[0].get_color(), zorder=5)
    ax.set(xlabel="hidden size", ylabel="held-out Pass@1 gain (points)",
           title="Gain vs width, mean ± SE over seeds\n(hollow: recorded from earlier code)")
    ax.set_xticks(sorted({w for widths in rows.values() for w in widths}))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
