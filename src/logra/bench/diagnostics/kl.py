"""The ``kl`` part (Figure 6): cosine budget schedule, constant budget and no KL control
over a longer horizon."""

from __future__ import annotations

import argparse
from typing import Any

from logra.bench.learn import RunResult, plot_curves, protocol_lines, title_tag
from logra.rl.cli import build_config

from .common import KL_VARIANTS, run_variant, variant_table


def kl_values(variant: str, horizon: int) -> dict[str, Any]:
    """The ``kl.*`` options of a KL-control variant over a ``horizon``-update run."""
    if variant == "cosine":
        return {"kl.enabled": True, "kl.schedule": "cosine", "kl.schedule_steps": horizon}
    if variant == "constant":
        return {"kl.enabled": True, "kl.schedule": "constant", "kl.schedule_steps": horizon}
    if variant == "none":
        return {"kl.enabled": False}
    raise ValueError(f"unknown KL variant {variant!r}; choose from {', '.join(KL_VARIANTS)}")


def run_kl(args: argparse.Namespace, base: dict[str, Any], notes: list[str],
           model_factory: Any = None) -> dict[str, Any]:
    """The KL-control part (Figure 6): one run per (variant, seed) over ``--kl-updates``."""
    variants = [v.strip() for v in args.kl_variants.split(",") if v.strip()]
    common = {**base, "updates": args.kl_updates, "eval_problems": args.eval_problems,
              "eval_every": args.eval_every, "checkpoint_every": 0}
    names = {"cosine": "cosine budget", "constant": "constant budget", "none": "no KL control"}
    groups: dict[str, list[RunResult]] = {}
    for v in variants:
        groups[names[v]] = [
            run_variant({**common, **kl_values(v, args.kl_updates)}, args.out_dir / "kl" / f"{v}-s{s}", names[v], s,
                        args.reuse, model_factory)
            for s in range(args.seeds)]
    tag = title_tag(notes, args.passthrough)
    png = plot_curves(groups, args.out_dir / "kl" / "pass_vs_update.png",
                      f"KL control over a longer horizon (Fig. 6){tag}", metrics=("pass@1",),
                      extra=(("realized_kl", "realised KL per update", True, 1), ("reward", "train reward", False, 10),
                             ("response_len", "response length (tokens)", False, 10)))
    cfg = build_config(common, "embedded")
    print("### KL-control variants over a longer horizon (Figure 6)\n")
    header = protocol_lines(notes, args.passthrough)
    if header:
        print(header)
    print(f"LoGRA, the embedded recipe, {args.kl_updates} updates, evaluation every {args.eval_every} updates on "
          f"{args.eval_problems} problems; mean ± sample std over {args.seeds} seed(s). Cosine: budget "
          f"{cfg.kl.budget:g} → {cfg.kl.budget_final:g} over the {args.kl_updates} updates; constant: "
          f"{cfg.kl.budget:g} "
          "throughout; none: kl.enabled=False (α = 1, the optimizer's update_ratio step).\n")
    print(variant_table(groups, "KL control"))
    print(f"\nplot: {png}\n")
    return {"groups": groups, "plot": png}

