"""What the diagnostics' parts share: the full protocol, progress lines, one RL run per
variant (`run_variant`) and the table of a group of runs."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from logra.bench.learn import RunResult, format_pm, read_run
from logra.rl import RLTrainer, recipe_config
from logra.rl.cli import build_config

PARTS: tuple[str, ...] = ("cosine", "rank", "kl")
KL_VARIANTS: tuple[str, ...] = ("cosine", "constant", "none")

_D = recipe_config("embedded")
#: The full protocol; anything smaller is labelled REDUCED.
FULL: dict[str, Any] = {
    "cosine_updates": 16, "cosine_ranks": "auto", "ranks": "auto", "updates": _D.updates,
    "kl_updates": 3 * _D.updates, "kl_variants": ",".join(KL_VARIANTS), "eval_problems": _D.eval_problems,
    "eval_every": 10, "seeds": 2,
}

def log(message: str) -> None:
    """A progress line on stderr (the tables on stdout stay clean)."""
    print(f"[bench diagnostics] {message}", file=sys.stderr, flush=True)


def int_list(text: str) -> list[int]:
    """Sorted distinct positive integers of a comma-separated list (else SystemExit)."""
    values = sorted({int(s) for s in text.split(",") if s.strip()})
    if not values or values[0] < 1:
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi``, and ``hi`` itself last."""
    out, r = [], 1
    while r <= hi:
        if r >= lo:
            out.append(r)
        r *= 2
    if out and out[-1] != hi and hi >= lo:
        out.append(hi)
    return out


def run_variant(values: dict[str, Any], run_dir: Path, label: str, seed: int, reuse: bool = False,
                model_factory: Any = None) -> RunResult:
    """Train one `RLConfig` (dotted ``values``) in-process into ``run_dir``; its metrics.

    With ``reuse``, a finished run whose config.json matches is read instead. The
    trainer's own prints go to stderr so the tables on stdout stay clean.
    ``model_factory`` (tests) returns ``(model, tokenizer, task)`` instead of the embedded policy.
    """
    config = build_config({**values, "run_dir": str(run_dir), "seed": seed}, "embedded")
    saved = run_dir / "config.json"
    if reuse and (run_dir / "summary.json").exists() and saved.exists() and \
            json.loads(saved.read_text()) == json.loads(json.dumps(config.to_dict())):
        log(f"reusing finished run {run_dir}")
        return read_run(run_dir, label, seed)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # metrics.jsonl is appended to; a stale one would mix runs
    model, tokenizer, task = model_factory() if model_factory is not None else (None, None, None)
    t0 = time.perf_counter()
    log(f"{label} seed {seed}: training into {run_dir}")
    with contextlib.redirect_stdout(sys.stderr):
        RLTrainer(config, model=model, tokenizer=tokenizer, task=task, progress=False).train()
    log(f"{label} seed {seed}: done in {time.perf_counter() - t0:.0f} s")
    return read_run(run_dir, label, seed)


def variant_table(groups: dict[str, list[RunResult]], first: str) -> str:
    """Markdown table of groups of runs: Pass@k, realised KL, α, predicted-KL error, time."""
    head = [first, "n", "Pass@1 start (%)", "peak Pass@1 (%)", "final Pass@1 (%)", "peak Pass@4 (%)",
            "mean realised KL", "max realised KL", "mean α", "predicted-KL rel. error (median)", "s/update"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in groups.items():
        kl = [x for r in runs for x in r.series("realized_kl", "train")[1]]
        alpha = [x for r in runs for x in r.series("alpha", "train")[1]]
        pairs = [(p, q) for r in runs
                 for p, q in zip(r.series("expected_kl", "train")[1], r.series("realized_kl", "train")[1],
                                 strict=False)
                 if not math.isnan(p) and q > 0]
        err = statistics.median(abs(p - q) / q for p, q in pairs) if pairs else float("nan")
        secs = [x for r in runs for x in r.series("time_update", "train")[1]]
        row = [label, str(len(runs)), format_pm([r.start_pass1 for r in runs], 100, 1),
               format_pm([r.peak_pass1 for r in runs], 100, 1), format_pm([r.final_pass1 for r in runs], 100, 1),
               format_pm([r.peak_pass4 for r in runs], 100, 1),
               f"{statistics.fmean(kl):.2e}" if kl else "-", f"{max(kl):.2e}" if kl else "-",
               f"{statistics.fmean(alpha):.2f}" if alpha else "-",
               "-" if math.isnan(err) else f"{err:.2f}", f"{statistics.fmean(secs):.2f}" if secs else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


