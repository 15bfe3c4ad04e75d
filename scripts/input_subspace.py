"""A research run: LoGRA with each layer's fixed projection spanning its inputs' principal subspace.

The default projection ``A`` of a weight (``[r, in]``) is random and fixed for the run, so the
accumulated update ``U·A`` lives in a random rank-``r`` input subspace, which holds ``r / in``
of dense AdamW's accumulated update (`scripts/subspace_probe.py`). The inputs a layer sees
occupy far fewer directions than ``in``, and the top-``r`` principal subspace of the first
update's inputs holds most of AdamW's update. This script trains with that subspace in place of
the random one: before the first update it runs the policy over the first update's prompts,
takes the top-``r`` eigenvectors ``Q`` (``[in, r]``) of ``Σ x xᵀ`` over each decoder linear
layer's input tokens, and installs ``A = √(in/r)·Qᵀ`` (the scale of ``distribution='orthogonal'``).
Everything else is ``logra train``'s (the embedding keeps its random projection).

It is an experiment, not an option: the projection is not rebuilt from a seed, so the policy
delta, rollout workers, vLLM, resume and ``logra bench spectrum --subspace`` do not know it. It
refuses those settings rather than run them wrong.

    python scripts/input_subspace.py --seed 0 --updates 700 --run_dir runs/input-subspace-s0
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection

import torch

from logra.rl import RLTrainer
from logra.rl.cli import _parser, build_config


def top_eigenvectors(gram: torch.Tensor, r: int) -> torch.Tensor:
    """Orthonormal ``[in, r]`` basis of the top-``r`` eigenvectors of a symmetric ``in × in`` (float64)."""
    return torch.linalg.eigh(gram.double())[1][:, -r:]


def input_bases(trainer: RLTrainer, rank: int, names: Collection[str]) -> dict[str, torch.Tensor]:
    """Per ``nn.Linear`` weight in ``names``, ``[in, r]`` orthonormal top-``r`` eigenvectors of the
    second moment of its inputs over the first update's prompt tokens (float64)."""
    model = trainer.model
    linears = {f"{n}.weight": m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and f"{n}.weight" in names}
    grams = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in linears.items()}
    mask: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: torch.nn.Module, args: tuple) -> None:
            x = args[0][mask["m"]].double()
            grams[name] += x.T @ x
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    prompts = [p.prompt for p in trainer._train_problems(0)]
    batch = trainer.tokenizer(prompts, return_tensors="pt", padding=True).to(trainer.device)
    mask["m"] = batch["attention_mask"].bool()
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return {n: top_eigenvectors(g, rank) for n, g in grams.items()}


def main(argv: list[str]) -> None:
    args, extra = _parser().parse_known_args(argv)
    if extra or args.resume or args.config:
        raise SystemExit("input_subspace.py: takes `logra train` flags only (no --resume, --config)")
    values = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "quiet", "recipe")}
    recipe = args.recipe or ("model" if values.get("model") else "embedded")  # as `logra train` picks it
    config = build_config(values, None if recipe == "none" else recipe)
    if config.optimizer != "logra" or config.logra.refresh or config.logra.share_projections \
            or config.logra.column_scale != "none" or config.rollout_workers or config.rollout_engine != "hf" \
            or config.dp > 1:
        raise SystemExit("input_subspace.py: needs --optimizer logra with one fixed projection per weight "
                         "(refresh, shared projections and column scales off), in-process rollouts, no --dp")
    trainer = RLTrainer(config, progress=not args.quiet)
    rank = config.logra.rank
    for name, q in input_bases(trainer, rank, trainer.optimizer.targets).items():
        target = trainer.optimizer.sketch_target(name)
        target.projection = (q.T * math.sqrt(target.in_features / rank)).float().to(target.weight.device)
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
