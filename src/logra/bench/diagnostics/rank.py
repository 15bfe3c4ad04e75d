"""The ``rank`` part (Figure 5a): held-out Pass@1 against the update for several LoGRA ranks."""

from __future__ import annotations

import argparse
from typing import Any

from logra.bench.learn import RunResult, plot_curves, protocol_lines, title_tag
from logra.rl import RLConfig
from logra.rl.cli import build_config

from .common import int_list, powers_of_two, run_variant, variant_table


def _embedded_min_input(config: RLConfig) -> int:
    """Smallest input size of a target layer of the configured policy ('auto' ranks)."""
    if config.model:
        raise SystemExit("--ranks auto needs the embedded policy; give --ranks explicitly for --model")
    return min(config.tiny.hidden_size, config.tiny.intermediate_size)


def run_rank(args: argparse.Namespace, base: dict[str, Any], notes: list[str],
             model_factory: Any = None) -> dict[str, Any]:
    """The rank part (Figure 5a): one run per (rank, seed)."""
    if args.ranks == "auto":
        ranks = powers_of_two(4, _embedded_min_input(build_config(base, "embedded")))
    else:
        ranks = int_list(args.ranks)
    common = {**base, "updates": args.updates, "eval_problems": args.eval_problems, "eval_every": args.eval_every,
              "checkpoint_every": 0}
    groups: dict[str, list[RunResult]] = {}
    for r in ranks:
        groups[f"rank {r}"] = [
            run_variant({**common, "logra.rank": r}, args.out_dir / "rank" / f"r{r}-s{s}", f"rank {r}", s,
                        args.reuse, model_factory)
            for s in range(args.seeds)]
    tag = title_tag(notes, args.passthrough)
    png = plot_curves(groups, args.out_dir / "rank" / "pass_vs_update.png",
                      f"LoGRA learning vs projection rank (Fig. 5a){tag}", metrics=("pass@1",),
                      extra=(("reward", "train reward", False, 5),))
    print("### Learning vs projection rank (Figure 5a)\n")
    header = protocol_lines(notes, args.passthrough)
    if header:
        print(header)
    print(f"LoGRA at each rank, otherwise the embedded recipe; {args.updates} updates, evaluation every "
          f"{args.eval_every} updates on {args.eval_problems} problems; mean ± sample std over {args.seeds} seed(s).\n")
    print(variant_table(groups, "rank"))
    print(f"\nplot: {png}\n")
    return {"groups": groups, "plot": png}

