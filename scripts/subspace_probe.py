"""How much of a finished run's accumulated update lies in input subspaces chosen early.

LoGRA's update of a weight ``W`` (``out × in``) is ``U·A`` with a random rank-``r`` projection
``A``, so its accumulated update lives in one rank-``r`` input subspace; a random one holds
``r / in`` of another run's update in expectation. This script asks how much better a subspace
chosen from data could do. For each reference run (dense AdamW, say) it prints the share of its
``‖ΔW‖_F²`` inside these rank-``r`` input subspaces, per kind of weight (mean over layers):

* ``gradient, first K updates``: the top-``r`` eigenvectors of ``Σ_k G_kᵀ G_k`` over the dense
  gradients of the first ``K`` updates of the same run (a dense trainer rebuilt from the run's
  config and seed, so these are the run's own first gradients);
* ``activations, first update``: the top-``r`` eigenvectors of ``Σ x xᵀ`` over the weight's
  inputs at the response and prompt tokens of the first update's loss passes;
* ``prompts of the first update``: the same over the prompt tokens of the first update, one
  forward pass before any training (the projection ``--logra.distribution inputs`` fits);
* ``W_0``: the top-``r`` right singular vectors of the starting weight;
* ``LoRA``: the row space of a LoRA run's final ``A`` (``--lora``);
* ``LoGRA``: the fixed projection of a LoGRA run (``--logra``);
* ``oracle``: the top-``r`` right singular vectors of ``ΔW`` itself (no rank-``r`` subspace holds more).

    python scripts/subspace_probe.py runs/s26/u700-adamw1e-3-const-s{0,1,2} \\
        --lora runs/s26/u700-lora3e-3-s{0,1,2} --logra runs/s26/u700-logra-s{0,1,2} --updates 1 10 50
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch

from logra import LoGRAConfig, LoGRAOptimizer
from logra.bench.spectrum import _LORA_A, _kind, _load, _run_weights, subspace_bases
from logra.projection import stable_name
from logra.rl import RLTrainer
from logra.rl.cli import _flatten, build_config


def top_eigenvectors(gram: torch.Tensor, r: int) -> torch.Tensor:
    """Orthonormal ``[in, r]`` basis of the top-``r`` eigenvectors of a symmetric ``in × in`` (float64)."""
    return torch.linalg.eigh(gram.double())[1][:, -r:]


def prompt_bases(trainer: RLTrainer, rank: int) -> dict[str, torch.Tensor]:
    """Per decoder linear weight, the row space (``[in, r]``) of the projection that
    ``distribution='inputs'`` fits on the trainer's first update (fitted on a copy of its model)."""
    fitted = LoGRAOptimizer(copy.deepcopy(trainer.model),
                            LoGRAConfig(rank=rank, distribution="inputs", refresh=False))
    fitted.fit_projections(trainer._fit_batches())
    return {n: torch.linalg.qr(fitted.projection(n).double().T)[0] for n in fitted.targets}


def _inside(delta: torch.Tensor, basis: torch.Tensor) -> float:
    return float((delta @ basis).square().sum() / delta.square().sum())


def early_subspaces(run_dir: Path, rank: int, updates: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """Gradient subspaces of the run's first ``K`` updates (each ``K`` in ``updates``) and the
    activation subspace of its first update, from a dense trainer rebuilt from its config."""
    values = _flatten(json.loads((run_dir / "config.json").read_text()))
    values.update(optimizer="adamw", eval_every=0, checkpoint_every=0, tensorboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        config = dataclasses.replace(build_config(values), run_dir=tmp)
        trainer = RLTrainer(config, progress=False)
        linears = {f"{name}.weight": m for name, m in trainer.model.named_modules()
                   if isinstance(m, torch.nn.Linear) and ".layers." in name}
        prompts = prompt_bases(trainer, rank)
        grams = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}
        acts = {name: torch.zeros_like(g) for name, g in grams.items()}
        # the first update's loss passes only: not its rollout (no grad) nor its KL probe (after the gradients)
        state: dict[str, torch.Tensor | bool] = {"capturing": True}
        out: dict[str, dict[str, torch.Tensor]] = {}

        def remember_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if state["capturing"] and torch.is_grad_enabled():
                state["mask"] = kwargs["attention_mask"].bool()

        def activation(name: str):
            def hook(module: torch.nn.Module, args: tuple) -> None:
                if state["capturing"] and torch.is_grad_enabled():
                    x = args[0].detach()[state["mask"]].double()
                    acts[name] += x.T @ x
            return hook

        handles = [trainer.model.get_decoder().register_forward_pre_hook(remember_mask, with_kwargs=True)]
        handles += [m.register_forward_pre_hook(activation(n)) for n, m in linears.items()]

        def gradients(t: RLTrainer) -> None:
            state["capturing"] = False
            for name, m in linears.items():
                g = m.weight.grad.double()
                grams[name] += g.T @ g
            k = t.num_updates + 1
            if k in updates:
                out[f"gradient, first {k} update{'s' * (k > 1)}"] = {
                    stable_name(n): top_eigenvectors(g, rank) for n, g in grams.items()}

        trainer.add_gradient_hook(gradients)
        for _ in range(max(updates)):
            trainer.train_step()
        for h in handles:
            h.remove()
        trainer.close()
    out["activations, first update"] = {stable_name(n): top_eigenvectors(a, rank) for n, a in acts.items()}
    out["prompts of the first update"] = prompts
    return out


def lora_bases(run_dir: Path) -> dict[str, torch.Tensor]:
    """Row space of each final LoRA ``A`` (``[in, r]``, orthonormal), by the base weight's name."""
    final = _load(run_dir / "checkpoint" / "model.safetensors")
    return {f"{_LORA_A.match(k)['module']}.weight": torch.linalg.qr(v.double().T)[0]
            for k, v in final.items() if _LORA_A.match(k)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="reference runs (one per seed) whose ΔW is explained")
    p.add_argument("--lora", nargs="*", type=Path, default=[], help="LoRA runs, one per reference run")
    p.add_argument("--logra", nargs="*", type=Path, default=[], help="fixed-projection LoGRA runs, one per reference")
    p.add_argument("--updates", nargs="+", type=int, default=[1, 10, 50], help="K of the gradient subspaces")
    p.add_argument("--rank", type=int, default=0, help="subspace rank (default: the run's logra.rank)")
    p.add_argument("--json", type=Path, help="also write every share")
    args = p.parse_args()
    for extra in (args.lora, args.logra):
        if extra and len(extra) != len(args.runs):
            p.error("--lora and --logra take one run per reference run")
    shares: dict[str, dict[str, list[list[float]]]] = {}  # source → kind → per-run list of per-layer shares
    for i, run in enumerate(args.runs):
        config = json.loads((run / "config.json").read_text())
        rank = args.rank or int(config["logra"]["rank"])
        deltas, w0, _ = _run_weights(run)
        sources = early_subspaces(run, rank, sorted(set(args.updates)))
        sources["W_0"] = {n: torch.linalg.svd(w0[n].double(), full_matrices=False)[2][:rank].T for n in deltas}
        if args.lora:
            sources["LoRA (final A)"] = lora_bases(args.lora[i])
        if args.logra:
            sources["LoGRA (fixed projection)"] = subspace_bases(args.logra[i])
        sources["oracle (top r of ΔW)"] = {
            n: torch.linalg.svd(d, full_matrices=False)[2][:rank].T for n, d in deltas.items()}
        sources["random: r / in"] = {}
        for source, bases in sources.items():
            per_kind: dict[str, list[float]] = {}
            for name, delta in deltas.items():
                share = rank / delta.shape[1] if not bases else _inside(delta, bases[name])
                per_kind.setdefault(_kind(name), []).append(share)
            for kind, values in per_kind.items():
                shares.setdefault(source, {}).setdefault(kind, []).append(values)
        print(f"[subspace probe] {run}: done", flush=True)
    kinds = list(next(iter(shares.values())))
    print(f"\nShare of the reference runs' ‖ΔW‖² inside each rank-r input subspace "
          f"(mean over layers; mean ± SE over {len(args.runs)} run(s))\n")
    print("| subspace | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for source, by_kind in shares.items():
        cells = []
        for kind in kinds:
            means = [statistics.fmean(v) for v in by_kind[kind]]
            se = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else math.nan
            cells.append(f"{statistics.fmean(means):.2f}" + ("" if math.isnan(se) else f" ± {se:.2f}"))
        print(f"| {source} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(shares, indent=1))


if __name__ == "__main__":
    main()
