"""``logra bench diagnostics``: the command line (`build_parser`, `main`) that runs the parts."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from logra.bench.learn import reduced_notes
from logra.rl.cli import build_config

from .common import FULL, KL_VARIANTS, PARTS
from .cosine import run_cosine
from .kl import run_kl
from .rank import run_rank


def _passthrough(extra: Sequence[str]) -> dict[str, str]:
    """``--key value`` / ``--key=value`` pairs of `logra train` options."""
    out: dict[str, str] = {}
    items = list(extra)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise SystemExit(f"logra bench diagnostics: unexpected argument {item!r}")
        if "=" in item:
            key, value = item[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise SystemExit(f"logra bench diagnostics: {item} needs a value")
            key, value = item[2:], items[i + 1]
            i += 2
        out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``logra bench diagnostics --help``)."""
    p = argparse.ArgumentParser(
        prog="logra bench diagnostics",
        allow_abbrev=False,  # `--seed` etc. must reach `logra train`, not abbreviate our `--seeds`
        description="The paper's diagnostics on the embedded RL task: accumulated gradient-reconstruction cosine "
        "heatmaps (Fig. 5b/c), learning vs projection rank (Fig. 5a) and KL-control variants over a longer "
        "horizon (Fig. 6). Unknown flags are `logra train` options applied to every run. Settings below the "
        "full protocol are labelled REDUCED.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench-diagnostics"), help="run directories and plots")
    p.add_argument("--seeds", type=int, default=FULL["seeds"], help="seeds 0..N-1 per rank / KL variant")
    p.add_argument("--updates", type=int, default=FULL["updates"], help="RL updates per run of the rank part")
    p.add_argument("--kl-updates", type=int, default=FULL["kl_updates"], help="RL updates per run of the kl part")
    p.add_argument("--eval-problems", type=int, default=FULL["eval_problems"], help="held-out problems per evaluation")
    p.add_argument("--eval-every", type=int, default=FULL["eval_every"], help="evaluate every k updates")
    p.add_argument("--ranks", default=FULL["ranks"],
                   help="LoGRA ranks of the rank part ('auto': powers of two from 4 to the smallest target input size)")
    p.add_argument("--kl-variants", default=FULL["kl_variants"], help=f"subset of {','.join(KL_VARIANTS)}")
    p.add_argument("--cosine-updates", type=int, default=FULL["cosine_updates"],
                   help="RL updates whose dense gradients are recorded for the cosine part")
    p.add_argument("--cosine-loss", default="rl", choices=("rl", "sft"),
                   help="gradients of the cosine part: the RL loss of the trainer's own updates, or a supervised "
                   "next-token loss on task demonstrations (written to OUT_DIR/cosine-sft)")
    p.add_argument("--cosine-ranks", default=FULL["cosine_ranks"],
                   help="ranks of the heatmaps ('auto': 1, 2, 4, ... up to the smallest target input size)")
    p.add_argument("--vmax", type=float, default=None,
                   help="top of the shared heatmap colour scale (default: the paper's 0.4, raised to the next 0.1 "
                   "when a value exceeds it)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the CPUs are shared)")
    p.add_argument("--reuse", action="store_true",
                   help="read finished RL runs with identical configs instead of rerunning")
    return p


def main(argv: list[str] | None = None, model_factory: Any = None) -> int:
    """``logra bench diagnostics``: run the chosen parts and print their tables.

    ``model_factory`` (for tests) returns ``(model, tokenizer, task)`` to use instead of
    the embedded policy and the configured task.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")
    bad_kl = {v.strip() for v in args.kl_variants.split(",") if v.strip()} - set(KL_VARIANTS)
    if bad_kl:
        parser.error(f"--kl-variants: unknown {sorted(bad_kl)}; choose from {', '.join(KL_VARIANTS)}")
    for name in ("seeds", "updates", "kl_updates", "eval_problems", "cosine_updates", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    args.passthrough = list(extra)
    base = {**_passthrough(extra), "threads": args.threads}
    build_config(base, "embedded")  # unknown `logra train` options fail here, before any run
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print("## LoGRA diagnostics\n")
    if "cosine" in parts:
        notes = reduced_notes(vars(args), {k: FULL[k] for k in ("cosine_updates", "cosine_ranks")})
        factory = model_factory() if model_factory is not None else (None, None, None)
        run_cosine(args, base, notes, *factory)
    if "rank" in parts:
        keys = ("ranks", "updates", "eval_problems", "eval_every", "seeds")
        run_rank(args, base, reduced_notes(vars(args), {k: FULL[k] for k in keys}), model_factory)
    if "kl" in parts:
        keys = ("kl_updates", "kl_variants", "eval_problems", "eval_every", "seeds")
        run_kl(args, base, reduced_notes(vars(args), {k: FULL[k] for k in keys}), model_factory)
    print(f"(total wall time {(time.perf_counter() - t0) / 60:.1f} min)")
    return 0
