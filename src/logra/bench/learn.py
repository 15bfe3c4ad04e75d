"""``logra bench learn``: LoGRA vs dense AdamW vs LoRA on the embedded RL recipe, over seeds.

The shape of the paper's Table 1 / Table 2 on our task: every (method, seed) runs
``python -m logra.cli train --optimizer METHOD --seed SEED ...`` in its own process (so
peak-RSS / CUDA-peak figures of one run never mix with another's), then this command
reads each run's ``metrics.jsonl`` and prints

* a markdown table per method: peak Pass@1 and Pass@4 over all evaluations
  (update 0 included, as in the paper), memory (peak RSS on CPU, CUDA max allocated on
  GPU, the maximum over updates of the per-update figure the trainer logs) and
  updates/hour (``3600 × updates / Σ time_update``), each as mean ± sample standard
  deviation over seeds;
* the verdict for the target "LoGRA's peak Pass@1 is within noise of (or above) dense
  AdamW's". *Within noise* is defined as: ``mean_LoGRA − mean_AdamW > −2·SE`` with
  ``SE = sqrt(s_L²/n_L + s_A²/n_A)`` the standard error of the difference of the two
  seed means (``s`` = sample std of the per-seed peaks). With a single seed per method
  the per-run evaluation standard error of the peak evaluation (``pass@1_stderr``,
  over problems) stands in for ``s/√n``;
* ``learning.png``: Pass@1 and Pass@4 against the update, mean ± one sample std band
  over seeds, thin lines for the individual seeds.

The dense and LoRA learning rate is ``--lr`` (default: ``RLConfig.lr``). ``--lr-sweep``
first runs dense AdamW on the first seed at each listed value and uses the one with the
best peak Pass@1 (ties: the better final Pass@1) for AdamW and LoRA (``--lora-lr``
overrides LoRA's). Every flag this command does not know is passed to every
``logra train`` run unchanged (e.g. ``--kl.budget 1e-3`` or ``--tiny.sft_steps 200``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from logra.bench import relay  # noqa: E402
from logra.rl import recipe_config  # noqa: E402
from logra.rl.config import BASELINE_SETTINGS  # noqa: E402
from logra.rl.evaluation import start_checksum  # noqa: E402

#: Methods in table order; the first is LoGRA, compared against the second.
METHODS: tuple[str, ...] = ("logra", "adamw", "lora")
_LABELS = {"logra": "LoGRA", "adamw": "Dense AdamW", "lora": "LoRA"}
#: The noise threshold of the verdict, in standard errors of the difference of means.
NOISE_SE = 2.0
_EMBEDDED = recipe_config("embedded")
_FULL = {"seeds": 3, "updates": _EMBEDDED.updates, "eval_problems": _EMBEDDED.eval_problems,
         "eval_every": _EMBEDDED.eval_every}


# ----------------------------------------------------------------------- run summaries
@dataclass
class RunResult:
    """What one finished run's ``metrics.jsonl`` says.

    Attributes:
        label: method or variant name the run belongs to.
        seed: its seed.
        run_dir: its run directory.
        evals: evaluation rows (``update``, ``pass@1``, ``pass@1_stderr``, ``pass@4``, ...).
        train: per-update rows (``reward``, ``realized_kl``, ``alpha``, ``time_update``, ...).
        start_checksum: `weights_checksum` of the policy the run started from, as its
            ``summary.json`` records it (None for runs of older versions or unfinished ones).
    """

    label: str
    seed: int
    run_dir: Path
    evals: list[dict[str, Any]] = field(default_factory=list)
    train: list[dict[str, Any]] = field(default_factory=list)
    start_checksum: str | None = None

    @property
    def peak_eval(self) -> dict[str, Any]:
        """The evaluation with the highest Pass@1 (the earliest one on ties)."""
        return max(self.evals, key=lambda e: (e["pass@1"], -e["update"]))

    @property
    def peak_pass1(self) -> float:
        """Highest Pass@1 over all evaluations (update 0 included)."""
        return self.peak_eval["pass@1"]

    @property
    def peak_pass4(self) -> float:
        """Highest Pass@4 over all evaluations (update 0 included)."""
        return max(e["pass@4"] for e in self.evals)

    @property
    def start_pass1(self) -> float:
        """Pass@1 of the first evaluation (before any update)."""
        return self.evals[0]["pass@1"]

    @property
    def final_pass1(self) -> float:
        """Pass@1 of the last evaluation."""
        return self.evals[-1]["pass@1"]

    @property
    def memory_key(self) -> str:
        """``peak_mem_gib`` (CUDA max allocated) if the run was on a GPU, else ``peak_rss_gib``."""
        return "peak_mem_gib" if self.train and "peak_mem_gib" in self.train[0] else "peak_rss_gib"

    @property
    def memory_gib(self) -> float:
        """Largest per-update memory figure of the run (GiB)."""
        return max(r[self.memory_key] for r in self.train) if self.train else float("nan")

    @property
    def updates_per_hour(self) -> float:
        """``3600 × updates / Σ time_update`` (rollout, backward, KL control and apply)."""
        total = sum(r["time_update"] for r in self.train)
        return 3600.0 * len(self.train) / total if total > 0 else float("nan")

    def series(self, key: str, kind: str = "eval") -> tuple[list[int], list[float]]:
        """``(updates, values)`` of ``key`` over the eval or train rows."""
        rows = self.evals if kind == "eval" else self.train
        rows = [r for r in rows if key in r and r[key] is not None]
        return [r["update"] for r in rows], [float(r[key]) for r in rows]


def read_run(run_dir: str | Path, label: str, seed: int) -> RunResult:
    """Load ``run_dir/metrics.jsonl`` into a `RunResult`.

    Raises:
        FileNotFoundError: the run wrote no metrics.
        ValueError: the run has no evaluation rows.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    result = RunResult(label, seed, run_dir, [r for r in rows if r.get("kind") == "eval"],
                       [r for r in rows if r.get("kind") == "train"])
    if not result.evals:
        raise ValueError(f"{path} has no evaluation rows")
    result.start_checksum = start_checksum(run_dir)
    return result


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def format_pm(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± std`` (sample std over the values), or just the value for one."""
    mean, std = mean_std([v * scale for v in values])
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def seed_mean_se(runs: Sequence[RunResult], metric: str = "peak_pass1") -> tuple[float, float]:
    """Mean over seeds of a per-run figure and its standard error.

    Two or more seeds: sample std / √n. One seed: the evaluation standard error of its
    peak evaluation (problems are the only noise one run shows).
    """
    values = [getattr(r, metric) for r in runs]
    mean, std = mean_std(values)
    if std is not None:
        return mean, std / math.sqrt(len(values))
    return mean, float(runs[0].peak_eval.get("pass@1_stderr", float("nan")))


def verdict(candidate: Sequence[RunResult], baseline: Sequence[RunResult], candidate_name: str = "LoGRA",
            baseline_name: str = "dense AdamW") -> tuple[bool, str]:
    """The target "candidate's peak Pass@1 within noise of (or above) the baseline's".

    Within noise: ``mean_c − mean_b > −NOISE_SE · sqrt(SE_c² + SE_b²)`` (see `seed_mean_se`).
    Returns ``(passed, line)``.
    """
    mc, sc = seed_mean_se(candidate)
    mb, sb = seed_mean_se(baseline)
    diff, se = mc - mb, math.hypot(sc, sb)
    passed = diff >= 0 or diff > -NOISE_SE * se
    how = "above" if diff >= 0 else ("within noise" if passed else "below, outside noise")
    line = (f"{'PASS' if passed else 'FAIL'}: {candidate_name}'s peak Pass@1 within noise of (or above) "
            f"{baseline_name}'s — {candidate_name} {mc:.3f} (n={len(candidate)}) vs {baseline_name} {mb:.3f} "
            f"(n={len(baseline)}): difference {diff:+.3f}, {NOISE_SE:g}×SE of the difference = "
            f"{NOISE_SE * se:.3f} → {how}")
    return passed, line


def learning_lines(groups: dict[str, Sequence[RunResult]]) -> list[str]:
    """Did each method learn? ``final − start`` Pass@1 per seed (same problems and sampling seed, so
    paired) with its standard error, and a warning when no method gained beyond ``NOISE_SE`` SE.

    One seed: the two evaluations' standard errors combined stand in for the SE over seeds.
    """
    lines, learned = [], False
    for label, runs in groups.items():
        gains = [r.final_pass1 - r.start_pass1 for r in runs]
        peak_gains = [r.peak_pass1 - r.start_pass1 for r in runs]
        mean, std = mean_std(gains)
        if std is not None:
            se = std / math.sqrt(len(gains))
        else:
            se = math.hypot(runs[0].evals[0].get("pass@1_stderr", 0.0), runs[0].evals[-1].get("pass@1_stderr", 0.0))
        learned |= mean > NOISE_SE * se
        lines.append(f"- {label}: final − start Pass@1 {100 * mean:+.1f} ± {100 * se:.1f} points (SE), "
                     f"peak − start {100 * statistics.fmean(peak_gains):+.1f} points")
    if not learned:
        lines.append(f"- No method's final Pass@1 exceeds its update-0 evaluation by more than {NOISE_SE:g} SE: at "
                     "this horizon no method learned measurably, so the peak-Pass@1 verdict above compares policies "
                     "that barely moved from update 0 (peaks are mostly the update-0 policy plus evaluation noise) "
                     "and says little about learning.")
    return lines


def paired_eval_se(a: dict[str, Any], b: dict[str, Any]) -> float:
    """SE over problems of ``pass@1(a) − pass@1(b)`` for two evaluations of the same problems.

    Uses the per-problem correct counts (``correct``, out of ``samples``) when both rows
    have them for the same number of problems; otherwise the two SEs combined (an upper
    bound when the problems are shared).
    """
    ca, cb = a.get("correct"), b.get("correct")
    if ca and cb and len(ca) == len(cb) > 1:
        d = [x / a["samples"] - y / b["samples"] for x, y in zip(ca, cb, strict=True)]
        return statistics.stdev(d) / math.sqrt(len(d))
    return math.hypot(a.get("pass@1_stderr", float("nan")), b.get("pass@1_stderr", float("nan")))


def _gain_se(runs: Sequence[RunResult], values: Sequence[float]) -> float:
    """SE over seeds of per-seed values; one seed: paired over problems (`paired_eval_se`)."""
    if len(values) > 1:
        return statistics.stdev(values) / math.sqrt(len(values))
    return paired_eval_se(runs[0].evals[-1], runs[0].evals[0])


def paired_rows(groups: dict[str, Sequence[RunResult]], reference: str | None) -> list[dict[str, Any]]:
    """Per group: paired Pass@1 gain (final − start, same seed = same warm start, problems and
    sampling) mean ± SE over seeds, and the paired difference of final Pass@1 vs ``reference``
    over the seeds both ran (mean ± SE of the per-seed differences), plus mean α and KL.

    Raises:
        ValueError: two runs of one seed started from different weights (their recorded
            ``start_checksum`` differ), so their difference would count the starting
            policies' difference as the methods'. The embedded warm start of one cache key
            differs between machines and thread counts; runs are paired within one cache.
    """
    ref = {r.seed: r for r in groups.get(reference, [])} if reference else {}
    for runs in groups.values():
        for r in runs:
            other = ref.get(r.seed)
            if other is None or r.start_checksum is None or other.start_checksum is None:
                continue  # unpaired, or a run of an older version (nothing recorded)
            if r.start_checksum != other.start_checksum:
                raise ValueError(f"{r.run_dir} and {other.run_dir} (seed {r.seed}) started from different weights "
                                 f"({r.start_checksum[:12]} and {other.start_checksum[:12]}): a paired difference "
                                 "would count their starting policies' difference as the methods'; run both "
                                 "from one warm-start cache")
    rows = []
    for label, runs in groups.items():
        gains = [r.final_pass1 - r.start_pass1 for r in runs]
        row: dict[str, Any] = {"label": label, "n": len(runs), "seeds": [r.seed for r in runs],
                               "start": statistics.fmean(r.start_pass1 for r in runs),
                               "final": statistics.fmean(r.final_pass1 for r in runs),
                               "gain": statistics.fmean(gains), "gain_se": _gain_se(runs, gains)}
        pairs = [(r, ref[r.seed]) for r in runs if r.seed in ref]
        if pairs and label != reference:
            diffs = [a.final_pass1 - b.final_pass1 for a, b in pairs]
            if len(diffs) > 1:
                se = statistics.stdev(diffs) / math.sqrt(len(diffs))
            else:  # one seed: paired over the shared problems
                se = paired_eval_se(pairs[0][0].evals[-1], pairs[0][1].evals[-1])
            row.update(diff=statistics.fmean(diffs), diff_se=se, diff_n=len(diffs))
        alphas = [a for r in runs for a in r.series("alpha", "train")[1]]
        kls = [k for r in runs for k in r.series("realized_kl", "train")[1]]
        row["alpha"] = statistics.fmean(alphas) if alphas else float("nan")
        row["kl"] = statistics.fmean(kls) if kls else float("nan")
        row["memory_gib"] = statistics.fmean(r.memory_gib for r in runs)
        rows.append(row)
    return rows


def format_paired_table(rows: Sequence[dict[str, Any]], reference: str | None) -> str:
    """Markdown table of `paired_rows` (Pass@1 in points)."""
    head = ["row", "seeds", "Pass@1 start (%)", "Pass@1 final (%)", "gain (points, ± SE)",
            f"vs {reference or '-'} (points, ± paired SE)", "mean α", "mean realized KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        diff = (f"{100 * r['diff']:+.1f} ± {100 * r['diff_se']:.1f}"
                + (f" (n={r['diff_n']})" if r["diff_n"] != r["n"] else "")
                if "diff" in r else "—")
        lines.append("| " + " | ".join([
            r["label"], ",".join(map(str, r["seeds"])), f"{100 * r['start']:.1f}", f"{100 * r['final']:.1f}",
            f"{100 * r['gain']:+.1f} ± {100 * r['gain_se']:.1f}", diff, f"{r['alpha']:.3g}", f"{r['kl']:.2e}"]) + " |")
    return "\n".join(lines)


def _aligned(runs: Sequence[RunResult], key: str, kind: str = "eval") -> tuple[list[int], list[list[float]]]:
    """Updates present in every run and the per-run values there."""
    common = None
    per_run = []
    for r in runs:
        x, y = r.series(key, kind)
        per_run.append(dict(zip(x, y, strict=True)))
        common = set(x) if common is None else common & set(x)
    updates = sorted(common or [])
    return updates, [[d[u] for u in updates] for d in per_run]


def plot_curves(groups: dict[str, Sequence[RunResult]], path: Path, title: str,
                metrics: Sequence[str] = ("pass@1", "pass@4"),
                extra: Sequence[tuple[str, str, bool, int]] = ()) -> Path:
    """Eval metrics (and optional train metrics) against the update, one colour per group.

    Thick line = mean over seeds, band = ± one sample std (two or more seeds) or ± the
    evaluation standard error (one seed, Pass@1 only), thin lines = individual seeds.
    ``extra`` adds panels ``(train key, y label, log scale, moving-mean window)`` from the
    per-update rows (mean over seeds, then a trailing moving mean over ``window`` updates).
    """
    panels = len(metrics) + len(extra)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8), squeeze=False)
    axes = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(groups.items()):
        color = colors[i % len(colors)]
        for ax, key in zip(axes, metrics, strict=False):  # extra panels follow
            x, ys = _aligned(runs, key)
            if not x:
                continue
            mean = [statistics.fmean(col) for col in zip(*ys, strict=False)]
            if len(ys) > 1:
                std = [statistics.stdev(col) for col in zip(*ys, strict=False)]
                for y in ys:
                    ax.plot(x, y, color=color, lw=0.6, alpha=0.45)
            elif key == "pass@1":
                std = runs[0].series("pass@1_stderr")[1]
            else:
                std = [0.0] * len(x)
            ax.plot(x, mean, color=color, lw=2, marker="o", ms=3, label=f"{label} (n={len(ys)})")
            band = list(zip(mean, std, strict=True))
            ax.fill_between(x, [m - s for m, s in band], [m + s for m, s in band],
                            color=color, alpha=0.18, lw=0)
        for ax, (key, ylabel, log, window) in zip(axes[len(metrics):], extra, strict=True):
            x, ys = _aligned(runs, key, "train")
            if not x:
                continue
            mean = [statistics.fmean(col) for col in zip(*ys, strict=False)]
            mean = [statistics.fmean(mean[max(0, i - window + 1): i + 1]) for i in range(len(mean))]
            if window > 1:
                ylabel = f"{ylabel}\n({window}-update moving mean)"
            if log:
                mean = [max(m, 1e-12) for m in mean]
            ax.plot(x, mean, color=color, lw=1.5, label=label)
            ax.set_ylabel(ylabel)
            if log:
                ax.set_yscale("log")
    for ax, key in zip(axes, metrics, strict=False):  # extra panels follow
        ax.set_ylabel(f"held-out {key.replace('pass', 'Pass')}")
    for ax in axes:
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(groups: dict[str, Sequence[RunResult]], lrs: dict[str, str] | None = None) -> str:
    """The Table-1-shaped markdown table (mean ± sample std over seeds)."""
    lrs = lrs or {}
    any_cuda = any(r.memory_key == "peak_mem_gib" for runs in groups.values() for r in runs)
    mem = "CUDA max allocated (GiB)" if any_cuda else "peak RSS (GiB)"
    head = ["method", "n", "lr", mem, "updates/h", "Pass@1 start (%)", "peak Pass@1 (%)", "peak Pass@4 (%)",
            "final Pass@1 (%)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in groups.items():
        row = [label, str(len(runs)), lrs.get(label, "-"),
               format_pm([r.memory_gib for r in runs], digits=3),
               format_pm([r.updates_per_hour for r in runs], digits=0),
               format_pm([r.start_pass1 for r in runs], 100, 1),
               format_pm([r.peak_pass1 for r in runs], 100, 1),
               format_pm([r.peak_pass4 for r in runs], 100, 1),
               format_pm([r.final_pass1 for r in runs], 100, 1)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------- running
def _log(message: str) -> None:
    print(f"[bench learn] {message}", file=sys.stderr, flush=True)


def _finished_with(run_dir: Path, wanted: dict[str, Any]) -> bool:
    """Whether ``run_dir`` holds a finished run started with exactly ``wanted``."""
    recorded = run_dir / "bench_args.json"
    return ((run_dir / "summary.json").exists() and recorded.exists()
            and json.loads(recorded.read_text()).get("args") == wanted["args"])


def run_train(run_dir: Path, args: Sequence[str], reuse: bool = False) -> Path:
    """Run ``python -m logra.cli train ARGS --run_dir RUN_DIR --quiet`` in a fresh process.

    The run directory is emptied first (metrics.jsonl is appended to, so a stale one
    would mix runs). With ``reuse``, a finished run with identical arguments is kept.
    Everything the run prints is relayed to our stderr.

    Raises:
        RuntimeError: the run failed.
    """
    run_dir = Path(run_dir)
    wanted = {"args": list(args)}
    if reuse and _finished_with(run_dir, wanted):
        _log(f"reusing finished run {run_dir}")
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "logra.cli", "train", *args, "--run_dir", str(run_dir), "--quiet"]
    _log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    code, last = relay(cmd)
    if code != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {code}: {last}")
    seconds = time.perf_counter() - t0
    (run_dir / "bench_args.json").write_text(json.dumps({**wanted, "seconds": seconds}))
    _log(f"finished {run_dir} in {seconds:.0f} s")
    return run_dir


def reduced_notes(values: dict[str, Any], full: dict[str, Any]) -> list[str]:
    """Where a run's settings fall short of the full protocol (empty = not reduced).

    Counts (seeds, updates, problems) below the full value, evaluations rarer than the
    full protocol's (``eval_every`` larger, or 0) and any other differing setting
    (rank or variant lists) are reductions.
    """
    notes = []
    for key, want in full.items():
        have = values.get(key)
        if key.endswith("eval_every"):
            short = have == 0 or have > want
        elif isinstance(want, int) and isinstance(have, int):
            short = have < want
        else:
            short = have != want
        if short:
            notes.append(f"{key.replace('_', '-')} {have} (full: {want})")
    return notes


def protocol_lines(notes: Sequence[str], passthrough: Sequence[str]) -> str:
    """The REDUCED / extra-flags label printed above a table ('' for the full protocol)."""
    lines = []
    if notes:
        lines.append("**REDUCED RUN** (short of the full protocol: " + "; ".join(notes) + ")")
    if passthrough:
        lines.append("Extra `logra train` flags for every run: `" + " ".join(passthrough) + "`")
    return "\n\n".join(lines) + ("\n" if lines else "")


def title_tag(notes: Sequence[str], passthrough: Sequence[str] = ()) -> str:
    """Suffix of plot titles: ' — REDUCED RUN', ' — extra flags' or ''."""
    return " — REDUCED RUN" if notes else (" — extra train flags" if passthrough else "")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``logra bench learn --help``)."""
    d = _EMBEDDED
    p = argparse.ArgumentParser(
        prog="logra bench learn",
        allow_abbrev=False,  # `--seed` etc. must reach `logra train`, not abbreviate our `--seeds`
        description="LoGRA vs dense AdamW vs LoRA on the embedded RL recipe (RLConfig defaults), one "
        "`logra train` process per (method, seed). Prints a Table-1-shaped markdown table (peak Pass@1 / "
        "Pass@4, memory, updates/h; mean ± sample std over seeds), the verdict 'LoGRA's peak Pass@1 within "
        f"noise of (or above) dense AdamW's' (difference > -{NOISE_SE:g} × the standard error of the "
        "difference of seed means) and writes learning.png. Unknown flags are passed to every `logra train` "
        "run.",
    )
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} ('' = none: only --variant rows)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra row: `logra train FLAGS` (shell-quoted, e.g. "
                   "--variant \"momentum=--logra.beta1 0.9 --logra.refresh_every 10\"), run for every seed in "
                   "OUT_DIR/NAME-sSEED; FLAGS may name another --optimizer (its --lr then defaults to RLConfig's). "
                   "Repeatable.")
    p.add_argument("--reference", default=None,
                   help="row label the paired differences are taken against (default: LoGRA if run, else the "
                   "first row)")
    p.add_argument("--seeds", type=int, default=_FULL["seeds"], help="seeds per method: 0 .. N-1")
    p.add_argument("--updates", type=int, default=_FULL["updates"], help="RL updates per run")
    p.add_argument("--eval-problems", type=int, default=_FULL["eval_problems"],
                   help="held-out problems per evaluation (RLConfig.eval_samples samples each)")
    p.add_argument("--eval-every", type=int, default=_FULL["eval_every"], help="evaluate every k updates")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate of dense AdamW and LoRA (cosine schedule)")
    p.add_argument("--lora-lr", type=float, default=None, help="LoRA's learning rate (default: --lr, or the sweep's)")
    p.add_argument("--lr-sweep", default="",
                   help="comma-separated learning rates: run dense AdamW on the first seed at each and use the best "
                   "peak Pass@1 for AdamW and LoRA (default: no sweep, use --lr)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (the CPUs are shared)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench-learn"), help="where the run directories go")
    p.add_argument("--reuse", action="store_true", help="keep finished runs with identical arguments")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: tabulate the finished runs found under --out-dir (any seeds missing are left "
                   "out of their row and the row shows its seeds)")
    p.add_argument("--out", type=Path, default=None, help="also write the per-run figures as JSON")
    return p


def _lr_text(lr: float) -> str:
    return f"{lr:g}"


def _run_minutes(out_dir: Path) -> float:
    """Summed wall time of the runs under ``out_dir`` (as recorded when each finished)."""
    total = 0.0
    for recorded in Path(out_dir).rglob("bench_args.json"):
        total += json.loads(recorded.read_text()).get("seconds", 0.0)
    return total / 60


def _train_args(method: str, seed: int, lr: str, common: Sequence[str]) -> list[str]:
    """`logra train` arguments of one (method, seed) run (LoGRA's step size is its update ratio;
    flags of the baselines passed through, such as ``--adam_beta1``, go to the runs that read them)."""
    extra = [] if method == "logra" else ["--lr", lr]
    # passed-through flags this method does not read (`RLConfig` refuses them for it)
    ignored = {f"--{name}" for name, users in BASELINE_SETTINGS.items() if method not in users}
    kept, skip = [], False
    for i, arg in enumerate(common):
        if skip:
            skip = False
        elif arg.split("=")[0] in ignored:
            skip = "=" not in arg and i + 1 < len(common)
        else:
            kept.append(arg)
    return ["--optimizer", method, "--seed", str(seed), *extra, *kept]


def _finished(run_dir: Path, args: Sequence[str]) -> bool:
    """A finished run started with exactly ``args`` (what `run_train` with ``reuse`` keeps)."""
    return _finished_with(Path(run_dir), {"args": list(args)})


def main(argv: list[str] | None = None) -> int:
    """``logra bench learn``: run every (method, seed), print the table and the verdict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, passthrough = parser.parse_known_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    variants: dict[str, list[str]] = {}
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip() or "/" in name:
            parser.error(f"--variant {spec!r}: expected NAME=FLAGS")
        variants[name.strip()] = shlex.split(flags)
    if (not methods and not variants) or set(methods) - set(METHODS):
        parser.error(f"--methods: choose from {', '.join(METHODS)}")
    for name in ("seeds", "updates", "eval_problems"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    sweep = [float(s) for s in args.lr_sweep.split(",") if s.strip()]
    common = ["--updates", str(args.updates), "--eval_problems", str(args.eval_problems),
              "--eval_every", str(args.eval_every), "--checkpoint_every", "0", "--threads", str(args.threads),
              *passthrough]
    t_start = time.perf_counter()

    sweep_rows: list[tuple[float, RunResult]] = []
    lr = args.lr
    if sweep and args.report_only:
        parser.error("--report-only does not take --lr-sweep")
    if sweep:
        for value in sweep:
            run_dir = args.out_dir / "lr-sweep" / f"adamw-lr{_lr_text(value)}-s0"
            run_train(run_dir, _train_args("adamw", 0, _lr_text(value), common), args.reuse)
            sweep_rows.append((value, read_run(run_dir, "adamw", 0)))
        lr = max(sweep_rows, key=lambda vr: (vr[1].peak_pass1, vr[1].final_pass1))[0]
    lrs = {"logra": "update_ratio", "adamw": _lr_text(lr), "lora": _lr_text(args.lora_lr or lr)}

    def seed_runs(name: str, train_args: Any) -> list[RunResult]:
        """The finished (or, unless --report-only, freshly run) runs of one row, seed by seed."""
        runs = []
        for seed in range(args.seeds):
            if name == "adamw" and seed == 0 and sweep_rows:
                # the sweep's run at the chosen rate is exactly this run: same arguments
                runs.append(next(r for value, r in sweep_rows if value == lr))
                continue
            run_dir, seed_args = args.out_dir / f"{name}-s{seed}", train_args(seed)
            if args.report_only and not _finished(run_dir, seed_args):
                continue
            if not args.report_only:
                run_train(run_dir, seed_args, args.reuse)
            runs.append(read_run(run_dir, name, seed))
        return runs

    rows = {_LABELS[m]: seed_runs(m, lambda seed, m=m: _train_args(m, seed, lrs[m], common)) for m in methods}
    rows.update({name: seed_runs(name, lambda seed, f=flags: ["--seed", str(seed), *f, *common])
                 for name, flags in variants.items()})
    groups: dict[str, list[RunResult]] = {label: runs for label, runs in rows.items() if runs}
    if not groups:
        parser.error("no finished runs to report")
    reference = args.reference or ("LoGRA" if "LoGRA" in groups else next(iter(groups)))

    values = {"seeds": args.seeds, "updates": args.updates, "eval_problems": args.eval_problems,
              "eval_every": args.eval_every}
    notes = reduced_notes(values, _FULL)
    first = next(iter(groups.values()))[0]
    config = json.loads((first.run_dir / "config.json").read_text())
    print("## LoGRA vs dense AdamW vs LoRA on the embedded RL task\n")
    header = protocol_lines(notes, passthrough)
    if header:
        print(header)
    print(f"Task {config['task']}, {config['algorithm']}, {config['prompts_per_update']} prompts × "
          f"{config['responses_per_prompt']} responses per update, {args.updates} updates, evaluation every "
          f"{args.eval_every} updates on {args.eval_problems} held-out problems × {config['eval_samples']} samples; "
          f"LoGRA rank {config['logra']['rank']}, update ratio {config['logra']['update_ratio']}; same predicted-KL "
          f"control for every method (budget {config['kl']['budget']} → {config['kl']['budget_final']}, "
          f"{config['kl']['schedule']}). One process per (method, seed), {args.threads} thread(s). Peaks include the "
          "update-0 evaluation. Memory: maximum over updates of the trainer's per-update figure (whole-process RSS on "
          "CPU, so it includes the Python/PyTorch runtime). Wall time of the runs (process start to exit, "
          f"summed): {_run_minutes(args.out_dir):.1f} min; of this invocation: "
          f"{(time.perf_counter() - t_start) / 60:.1f} min{' (finished runs reused)' if args.reuse else ''}.\n")
    if sweep_rows:
        print("Learning-rate sweep (dense AdamW, seed 0; the best peak Pass@1 is used for AdamW"
              f"{' and LoRA' if args.lora_lr is None else ''}):\n")
        print("| lr | peak Pass@1 (%) | final Pass@1 (%) | peak Pass@4 (%) | mean α |")
        print("|---|---|---|---|---|")
        for value, r in sweep_rows:
            alpha = statistics.fmean(a for a in r.series("alpha", "train")[1]) if r.train else float("nan")
            mark = " (chosen)" if value == lr else ""
            print(f"| {_lr_text(value)}{mark} | {100 * r.peak_pass1:.1f} | {100 * r.final_pass1:.1f} | "
                  f"{100 * r.peak_pass4:.1f} | {alpha:.2f} |")
        print()
    print(format_table(groups, {_LABELS[m]: lrs[m] for m in methods}))
    print()
    if variants:
        print("Rows:\n")
        for name, flags in variants.items():
            print(f"- {name}: `logra train {' '.join(map(shlex.quote, flags))}`")
        print()
    try:
        paired = paired_rows(groups, reference)
    except ValueError as e:
        parser.error(str(e))
    print(f"Paired Pass@1 (final − start; same seed = same warm start, problems and samples), mean ± SE over seeds; "
          f"difference vs {reference} ± SE of the per-seed differences:\n")
    print(format_paired_table(paired, reference))
    print()
    if _LABELS["logra"] in groups and _LABELS["adamw"] in groups:
        print(verdict(groups[_LABELS["logra"]], groups[_LABELS["adamw"]])[1])
    else:
        print("(verdict not evaluated: needs both logra and adamw)")
    print("\nLearning over the run (paired: the same held-out problems and samples at every evaluation):\n")
    print("\n".join(learning_lines(groups)))
    title = "LoGRA vs dense AdamW vs LoRA" + title_tag(notes, passthrough)
    png = plot_curves(groups, args.out_dir / "learning.png", title, metrics=("pass@1",),
                      extra=(("reward", "train reward", False, 20), ("realized_kl", "realized KL per update", True, 10),
                             ("alpha", "α (step scale)", True, 10)))
    print(f"\nplot: {png}")
    if args.out is not None:
        payload = {label: [{"seed": r.seed, "run_dir": str(r.run_dir), "peak_pass@1": r.peak_pass1,
                            "peak_pass@4": r.peak_pass4, "memory_gib": r.memory_gib,
                            "updates_per_hour": r.updates_per_hour} for r in runs]
                   for label, runs in groups.items()}
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "lrs": lrs,
                                        "passthrough": passthrough, "runs": payload, "paired": paired,
                                        "variants": variants}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
