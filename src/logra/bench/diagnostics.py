"""``logra bench diagnostics``: the paper's gradient-compression and KL-control diagnostics.

Three parts, chosen with ``--parts`` (default all):

``cosine`` (Figure 5b/c)
    How well the sketches ``S_t = G_t A_tᵀ`` of real gradients reconstruct the dense
    gradient when they are ACCUMULATED over updates: the cosine between ``Σ_t G_t`` and
    ``Σ_t S_t A_t`` after ``t`` updates, per transformer layer (the layer's seven target
    matrices taken together as one vector) and rank. Projections are drawn exactly as
    the optimizer draws them (`logra.projection.make_projection` with
    `projection_seed` (LoGRA seed, `projection_index`, layer name)) for three variants:
    fixed Rademacher (``update_index`` stays 0), refreshed Rademacher (paper default) and
    refreshed Gaussian. With refreshed projections ``E[A_tᵀA_t] = I`` and independent
    draws average the reconstruction errors out, so the accumulated cosine rises towards
    1; with a fixed projection ``Σ_t G_t AᵀA`` keeps the error of a single draw.

    The gradients ``G_t`` are the real dense weight gradients of the RL policy-gradient
    loss (the trainer's own loss of its own rollouts: GRPO on the embedded task by
    default) while `RLTrainer` trains the embedded policy with LoGRA (``RLConfig``
    defaults). They are recorded during the trainer's own backward pass: a forward hook on
    every target ``nn.Linear`` keeps its input ``X`` and a tensor hook on its output adds
    ``Hᵀ X`` (what dense autograd computes for the weight) into an fp32 buffer. Before
    each update applies, the optimizer's real sketches are compared with ``G_t A_tᵀ`` of
    the recorded gradients (reported as "sketch check").

    Besides the measurement the table shows the prediction for independent projections
    (ratio of expectations, exact moments): ``E⟨ΣG, ΣSA⟩ = ‖ΣG‖²`` and, per target of
    input size ``n``, ``E‖G AᵀA‖² = ‖G‖²(n + r ∓ 1)/r`` (− Rademacher, + Gaussian), so
    refreshed: ``cos ≈ ‖ΣG‖ / sqrt(‖ΣG‖² + Σ_t Σ_m ‖G_tm‖²(n_m ∓ 1)/r)`` and fixed:
    ``cos ≈ ‖ΣG‖ / sqrt(Σ_m ‖ΣG_m‖²(n_m + r ∓ 1)/r)``.

``rank`` (Figure 5a)
    Held-out Pass@1 against the update for several LoGRA ranks (everything else
    ``RLConfig`` defaults).

``kl`` (Figure 6)
    A longer horizon with three step controls: the cosine budget schedule (paper), a
    constant budget (``kl.budget`` throughout) and none (``kl.enabled=False``: every step
    is the optimizer's own ``update_ratio`` step). The cosine schedule is stretched to the
    horizon (``kl.schedule_steps = --kl-updates``).

Every RL run is an in-process `RLTrainer` with its run directory under ``--out-dir``
(``rank/r{R}-s{S}``, ``kl/{variant}-s{S}``). Every flag this command does not know is a
``logra train`` option applied to every run (e.g. ``--task chain_sum``). Whatever is
smaller than the full protocol is labelled REDUCED in the output and in the plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from torch import nn

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from logra.bench.learn import (  # noqa: E402
    RunResult, format_pm, plot_curves, protocol_lines, read_run, reduced_notes, title_tag,
)
from logra.optimizer import LoGRAOptimizer  # noqa: E402
from logra.projection import make_projection, projection_index, projection_seed  # noqa: E402
from logra.rl import RLConfig, RLTrainer  # noqa: E402
from logra.sketch import find_targets  # noqa: E402
from logra.train import build_config  # noqa: E402

PARTS: tuple[str, ...] = ("cosine", "rank", "kl")
KL_VARIANTS: tuple[str, ...] = ("cosine", "constant", "none")


@dataclass(frozen=True)
class ProjectionVariant:
    """One way of drawing the projections of successive updates.

    Attributes:
        label: name in tables and plots.
        distribution: 'rademacher' or 'gaussian'.
        refresh: a new projection every update (else the update-0 projection throughout).
    """

    label: str
    distribution: str
    refresh: bool


#: The variants of Figure 5b (first two) and 5c (last two).
VARIANTS: tuple[ProjectionVariant, ...] = (
    ProjectionVariant("fixed Rademacher", "rademacher", False),
    ProjectionVariant("refreshed Rademacher", "rademacher", True),
    ProjectionVariant("refreshed Gaussian", "gaussian", True),
)

_D = RLConfig()
#: The full protocol; anything smaller is labelled REDUCED.
FULL: dict[str, Any] = {
    "cosine_updates": 16, "cosine_ranks": "auto", "ranks": "auto", "updates": _D.updates,
    "kl_updates": 3 * _D.updates, "kl_variants": ",".join(KL_VARIANTS), "eval_problems": _D.eval_problems,
    "eval_every": 10, "seeds": 2,
}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _log(message: str) -> None:
    print(f"[bench diagnostics] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------- dense gradients
class DenseGradientRecorder:
    """Dense weight gradients ``G = Σ Hᵀ X`` of target layers, taken during an ordinary backward.

    A forward hook on every target ``nn.Linear`` (grad mode only) keeps the layer's input
    ``X`` and registers a hook on its output that adds ``Hᵀ X`` in fp32 when ``H = dL/dY``
    arrives, which is exactly the weight gradient dense autograd would produce. It works
    whether or not LoGRA's sketches are installed (they keep ``X`` out of autograd, the
    hook keeps it here for the diagnostic only).

    Attributes:
        targets: stable weight name → the module(s) computing with it.
        grads: stable weight name → accumulated fp32 gradient ``[out, in]``.
    """

    def __init__(self, model: nn.Module, patterns: Sequence[str]) -> None:
        groups = find_targets(model, tuple(patterns))
        self.targets = {name: [m for _, m in modules] for name, modules in groups.items()}
        self.grads: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, modules in self.targets.items():
            w = modules[0].weight
            self.grads[name] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for module in modules:
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = inputs[0].detach()
            grad = self.grads[name]

            def add(h: torch.Tensor) -> None:
                grad.addmm_(h.reshape(-1, h.shape[-1]).T.float(), x.reshape(-1, x.shape[-1]).float())

            output.register_hook(add)

        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last `pop` (copies); the buffers are zeroed."""
        out = {name: g.clone() for name, g in self.grads.items()}
        for g in self.grads.values():
            g.zero_()
        return out

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _sketch_error(optimizer: torch.optim.Optimizer, grads: Mapping[str, torch.Tensor]) -> float | None:
    """Largest ``‖S − G Aᵀ‖ / ‖G Aᵀ‖`` over LoGRA's targets (None for other optimizers)."""
    if not isinstance(optimizer, LoGRAOptimizer):
        return None
    worst = 0.0
    for name, sketch in optimizer.sketches().items():
        expected = grads[name] @ optimizer.projection(name).T
        scale = float(torch.linalg.vector_norm(expected))
        if scale > 0:
            worst = max(worst, float(torch.linalg.vector_norm(sketch - expected)) / scale)
    return worst


class _RecordingTrainer(RLTrainer):
    """`RLTrainer` that keeps the dense gradient of every update and checks the sketches against it.

    `_apply_update` is the trainer's step between the backward passes and the update;
    the sketches (if LoGRA) still hold this update's ``G Aᵀ`` there.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = DenseGradientRecorder(self.model, self.config.logra.target_modules)
        self.recorded: list[dict[str, torch.Tensor]] = []
        self.sketch_errors: list[float] = []

    def keep(self) -> None:
        """Store the gradient recorded since the last call and check the sketches against it."""
        grads = self.recorder.pop()
        self.recorded.append({n: g.cpu() for n, g in grads.items()})
        err = _sketch_error(self.optimizer, grads)
        if err is not None:
            self.sketch_errors.append(err)

    def _apply_update(self, rollout: Any) -> dict[str, Any]:
        self.keep()
        return super()._apply_update(rollout)


def _sft_batch(tokenizer: Any, pairs: Sequence[tuple[str, str]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer + eos; labels only on answer and eos (as the warm start)."""
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a for _, a in pairs], add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (q, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(q)] = torch.tensor(q)
        mask[i, : len(q)] = 1
        labels[i, len(p): len(q)] = ids[i, len(p): len(q)]
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def record_gradients(
    config: RLConfig, updates: int, model: nn.Module | None = None, tokenizer: Any = None, task: Any = None,
    loss: str = "rl", sft_batch: int = 64,
) -> tuple[list[dict[str, torch.Tensor]], list[float], dict[str, Any]]:
    """Train ``updates`` updates with the optimizer of ``config`` and return the dense gradient of each.

    ``loss='rl'``: the trainer's own RL updates (rollouts, policy-gradient loss, KL-controlled
    step). ``loss='sft'``: supervised next-token loss on ``sft_batch`` fresh task
    demonstrations (prompt + reference response) per update, plain ``optimizer.step()``.
    Returns ``(grads, sketch_errors, info)``: per update, stable weight name → fp32 ``G``
    (CPU) of the loss the update was computed from; per update, the largest relative
    difference between the optimizer's sketch and ``G Aᵀ`` (LoGRA only); per-update records.
    """
    trainer = _RecordingTrainer(config, model=model, tokenizer=tokenizer, task=task, progress=False)
    records: list[dict[str, Any]] = []
    try:
        if loss == "rl":
            for i in range(updates):
                records.append(trainer.train_step())
                r = records[-1]
                _log(f"cosine: update {i + 1}/{updates}: reward {r['reward']:.3f}, alpha {r['alpha']:.2f}, "
                     f"{r['time_update']:.1f} s")
        elif loss == "sft":
            problems = trainer.task.problems("train", updates * sft_batch, seed=config.seed + 1_000)
            trainer.model.train()
            for i in range(updates):
                chunk = problems[i * sft_batch: (i + 1) * sft_batch]
                batch = _sft_batch(trainer.tokenizer, [(p.prompt, trainer.task.reference_response(p)) for p in chunk],
                                   trainer.device)
                value = trainer.model(**batch).loss
                value.backward()
                trainer.keep()
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                records.append({"loss": float(value.detach())})
                _log(f"cosine: SFT update {i + 1}/{updates}: loss {records[-1]['loss']:.3f}")
        else:
            raise ValueError(f"loss must be 'rl' or 'sft', got {loss!r}")
    finally:
        trainer.recorder.remove()
    return trainer.recorded, trainer.sketch_errors, {"records": records, "task": getattr(trainer.task, "name", "?")}


def coherence(grads: Sequence[Mapping[str, torch.Tensor]], layers: Mapping[str, Sequence[str]]) -> np.ndarray:
    """Per layer, ``‖Σ_t G_t‖² / Σ_t ‖G_t‖²``: 1 for uncorrelated updates, T for identical ones.

    Refreshed projections can only beat a single draw when this exceeds 1: their
    independent errors add up like ``Σ_t ‖G_t‖²`` while the signal grows like ``‖Σ_t G_t‖²``.
    """
    out = []
    for members in layers.values():
        total = sum(float(sum(step[n].double() for step in grads).square().sum()) for n in members)
        own = sum(float(step[n].double().square().sum()) for step in grads for n in members)
        out.append(total / own if own > 0 else float("nan"))
    return np.array(out)


# ----------------------------------------------------------------------- reconstruction
def layer_of(name: str) -> str:
    """The transformer layer a target belongs to ('0', '1', ...; the name itself if none)."""
    m = _LAYER.search(name)
    return m.group(1) if m else name


def group_by_layer(names: Sequence[str]) -> dict[str, list[str]]:
    """Layer label → its target names, layers in numeric order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(layer_of(name), []).append(name)
    return dict(sorted(groups.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0, kv[0])))


def reconstruction_stats(
    grads: Sequence[Mapping[str, torch.Tensor]],
    ranks: Sequence[int],
    variant: ProjectionVariant,
    seed: int,
    layers: Mapping[str, Sequence[str]] | None = None,
) -> np.ndarray:
    """Inner products of the accumulated dense gradient and its accumulated reconstruction.

    For update ``t`` the projection of target ``name`` at rank ``r`` is
    ``make_projection(r, in, projection_seed(seed, projection_index(t, refresh, 1), name),
    distribution)`` — what `LoGRAOptimizer` draws — and its reconstruction is
    ``(G_t Aᵀ) A``. Returns float64 ``[T, L, R, 3]``: after ``t + 1`` updates, per layer
    (its targets' matrices concatenated) and rank, ``(⟨ΣG, ΣSA⟩, ‖ΣG‖², ‖ΣSA‖²)``.
    """
    layers = layers or group_by_layer(list(grads[0]))
    names = [n for members in layers.values() for n in members]
    total = {n: torch.zeros_like(grads[0][n], dtype=torch.float64) for n in names}
    recon = {(n, r): torch.zeros_like(total[n]) for n in names for r in ranks}
    out = np.zeros((len(grads), len(layers), len(ranks), 3))
    for t, step in enumerate(grads):
        index = projection_index(t, variant.refresh, 1)
        for n in names:
            g = step[n].double()
            total[n] += g
            seed_n = projection_seed(seed, index, n)
            for r in ranks:
                a = make_projection(r, g.shape[1], seed_n, variant.distribution).double()
                recon[(n, r)] += (g @ a.T) @ a
        for li, members in enumerate(layers.values()):
            for ri, r in enumerate(ranks):
                out[t, li, ri, 0] = sum(float((total[n] * recon[(n, r)]).sum()) for n in members)
                out[t, li, ri, 1] = sum(float(total[n].square().sum()) for n in members)
                out[t, li, ri, 2] = sum(float(recon[(n, r)].square().sum()) for n in members)
    return out


def cosines(stats: np.ndarray) -> np.ndarray:
    """Cosine ``⟨a, b⟩ / (‖a‖‖b‖)`` from `reconstruction_stats` (NaN where a norm is 0)."""
    denom = np.sqrt(stats[..., 1] * stats[..., 2])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, stats[..., 0] / np.where(denom > 0, denom, 1.0), np.nan)


def predicted_cosines(
    grads: Sequence[Mapping[str, torch.Tensor]],
    ranks: Sequence[int],
    variant: ProjectionVariant,
    layers: Mapping[str, Sequence[str]] | None = None,
) -> np.ndarray:
    """Ratio-of-expectations prediction of `cosines` for independent projections, ``[T, L, R]``.

    Exact moments: ``E[AᵀA] = I`` and ``E[(AᵀA)²] = (n + r + c)/r · I`` with ``c = −1``
    (Rademacher, ``aᵀa = n`` exactly) or ``+1`` (Gaussian). Refreshed:
    ``E‖Σ_t G_t A_tᵀA_t‖² = ‖ΣG‖² + Σ_t ‖G_t‖²(n + c)/r``; fixed:
    ``E‖(ΣG) AᵀA‖² = ‖ΣG‖²(n + r + c)/r``; both with ``E⟨ΣG, ·⟩ = ‖ΣG‖²``.
    """
    layers = layers or group_by_layer(list(grads[0]))
    c = -1.0 if variant.distribution == "rademacher" else 1.0
    out = np.zeros((len(grads), len(layers), len(ranks)))
    total = {n: torch.zeros_like(grads[0][n], dtype=torch.float64) for ms in layers.values() for n in ms}
    own_sq = {n: 0.0 for n in total}  # Σ_t ‖G_t‖² (n + c)
    for t, step in enumerate(grads):
        for n in total:
            g = step[n].double()
            total[n] += g
            own_sq[n] += float(g.square().sum()) * (g.shape[1] + c)
        for li, members in enumerate(layers.values()):
            sq = sum(float(total[n].square().sum()) for n in members)
            for ri, r in enumerate(ranks):
                if variant.refresh:
                    expected = sq + sum(own_sq[n] for n in members) / r
                else:
                    expected = sum(float(total[n].square().sum()) * (total[n].shape[1] + r + c) / r for n in members)
                out[t, li, ri] = math.sqrt(sq / expected) if expected > 0 else float("nan")
    return out


def _heatmaps(values: dict[str, np.ndarray], layers: Sequence[str], ranks: Sequence[int], vmax: float,
              path: Path, title: str) -> Path:
    """Side-by-side heatmaps (rows = layers, columns = ranks) on one shared colour scale."""
    width = 1.6 + 0.62 * len(ranks) * len(values) + 1.0
    fig, axes = plt.subplots(1, len(values), figsize=(width, 0.42 * len(layers) + 1.8), squeeze=False, sharey=True,
                             constrained_layout=True)
    im = None
    for k, (ax, (label, grid)) in enumerate(zip(axes[0], values.items())):
        im = ax.imshow(grid, vmin=0.0, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
        if k == 0:
            ax.set_yticks(range(len(layers)), [f"layer {name}" if name.isdigit() else name for name in layers])
        ax.set_xlabel("rank r")
        ax.set_title(label, fontsize=10)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                v = grid[i, j]
                ax.text(j, i, "–" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if (np.isnan(v) or v < 0.6 * vmax) else "black")
    fig.colorbar(im, ax=list(axes[0]), shrink=0.9, label="cosine(ΣG, ΣSA)")
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _cosine_vs_updates(values: dict[str, np.ndarray], ranks: Sequence[int], path: Path, title: str) -> Path:
    """Layer-mean accumulated cosine against the number of updates, per variant and rank."""
    show = sorted({ranks[0], ranks[len(ranks) // 2], ranks[-1]})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = {"fixed Rademacher": ":", "refreshed Rademacher": "-", "refreshed Gaussian": "--"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for label, cos in values.items():
        for k, r in enumerate(show):
            y = np.nanmean(cos[:, :, list(ranks).index(r)], axis=1)
            ax.plot(range(1, len(y) + 1), y, styles.get(label, "-"), color=colors[k % len(colors)],
                    label=f"{label}, r={r}")
    ax.set_xlabel("updates accumulated")
    ax.set_ylabel("cosine(ΣG, ΣSA), mean over layers")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, r = [], 1
    while r <= hi:
        if r >= lo:
            out.append(r)
        r *= 2
    if out and out[-1] != hi and hi >= lo:
        out.append(hi)
    return out


def run_cosine(args: argparse.Namespace, base: dict[str, Any], notes: list[str],
               model: nn.Module | None = None, tokenizer: Any = None, task: Any = None) -> dict[str, Any]:
    """The cosine part: record gradients, reconstruct, print the table, draw the heatmaps."""
    out_dir = args.out_dir / ("cosine" if args.cosine_loss == "rl" else f"cosine-{args.cosine_loss}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # Figure 5's rows are the transformer layers' projections: keep embeddings out of the sketches
    config = build_config({**base, "run_dir": str(out_dir / "run"), "eval_every": 0, "checkpoint_every": 0,
                           "logra.non_target": "freeze"})
    t0 = time.perf_counter()
    grads, errors, info = record_gradients(config, args.cosine_updates, model, tokenizer, task, args.cosine_loss)
    t_record = time.perf_counter() - t0
    min_in = min(g.shape[1] for g in grads[0].values())
    ranks = _powers_of_two(1, min_in) if args.cosine_ranks == "auto" else _int_list(args.cosine_ranks)
    if max(ranks) > min_in:
        raise SystemExit(f"--cosine-ranks: {max(ranks)} exceeds the smallest target input size {min_in}")
    layers = group_by_layer(list(grads[0]))
    seed = config.logra.seed
    measured, predicted = {}, {}
    for variant in VARIANTS:
        measured[variant.label] = cosines(reconstruction_stats(grads, ranks, variant, seed, layers))
        predicted[variant.label] = predicted_cosines(grads, ranks, variant, layers)
    final = {label: cos[-1] for label, cos in measured.items()}
    top = max(float(np.nanmax(v)) for v in final.values())
    vmax = args.vmax if args.vmax is not None else (0.4 if top <= 0.4 else math.ceil(top * 10) / 10)
    tag = title_tag(notes, args.passthrough)
    T = len(grads)
    scale_note = "" if vmax == 0.4 else f" (colour scale [0, {vmax:g}]: values exceed the paper's 0.4)"
    fig_b = _heatmaps({k: final[k] for k in ("fixed Rademacher", "refreshed Rademacher")}, list(layers), ranks, vmax,
                      out_dir / "heatmap_fixed_vs_refreshed.png",
                      f"Reconstruction of {args.cosine_loss.upper()} gradients accumulated over {T} updates (Fig. 5b)"
                      f"{tag}{scale_note}")
    fig_c = _heatmaps({k: final[k] for k in ("refreshed Rademacher", "refreshed Gaussian")}, list(layers), ranks, vmax,
                      out_dir / "heatmap_rademacher_vs_gaussian.png",
                      f"Reconstruction of {args.cosine_loss.upper()} gradients accumulated over {T} updates (Fig. 5c)"
                      f"{tag}{scale_note}")
    fig_t = _cosine_vs_updates(measured, ranks, out_dir / "cosine_vs_updates.png",
                               f"Accumulated reconstruction of {args.cosine_loss.upper()} gradients vs updates{tag}")

    sizes = sorted({(g.shape[0], g.shape[1]) for g in grads[0].values()})
    rho = coherence(grads, layers)
    if args.cosine_loss == "rl":
        rewards = [r["reward"] for r in info["records"]]
        source = (f"the RL policy-gradient loss ({config.algorithm}, task {info['task']}, {config.prompts_per_update}×"
                  f"{config.responses_per_prompt} rollouts per update, mean train reward {statistics.fmean(rewards):.3f}) "
                  f"of {T} consecutive RL updates (KL-controlled)")
    else:
        losses = [r["loss"] for r in info["records"]]
        source = (f"a supervised next-token loss on 64 fresh demonstrations of task {info['task']} per update (loss "
                  f"{losses[0]:.3f} → {losses[-1]:.3f}) over {T} consecutive plain LoGRA steps")
    print(f"### Gradient-reconstruction cosine (Figure 5b/c), {args.cosine_loss.upper()} gradients\n")
    header = protocol_lines(notes, args.passthrough)
    if header:
        print(header)
    print(f"Dense gradients of {source}, while LoGRA (rank {config.logra.rank}, refreshed {config.logra.distribution}) "
          f"trains the {'embedded' if not config.model and model is None else 'given'} policy; {len(grads[0])} target "
          f"matrices in {len(layers)} layers, (out, in) sizes {sizes}. Cell = cosine of Σ_t G_t with Σ_t S_t A_t after "
          f"{T} updates, per layer (its target matrices as one vector); table = mean over layers; 'pred.' = "
          "ratio-of-expectations prediction for independent projections (see `--help`). Gradient coherence "
          f"‖Σ_t G_t‖² / Σ_t ‖G_t‖² per layer: {', '.join(f'{x:.2f}' for x in rho)} (1 = uncorrelated updates, "
          f"{T} = one persistent direction; refreshed projections beat a fixed one only above 1). Recording took "
          f"{t_record:.0f} s.")
    if errors:
        print(f"Sketch check: the optimizer's sketches equal G_t A_tᵀ of the recorded dense gradients to a relative "
              f"error of at most {max(errors):.1e} over all targets and updates.")
    print()
    head = ["rank"] + [f"{v.label} (pred.)" for v in VARIANTS] + [f"{VARIANTS[1].label}, 1 update"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for ri, r in enumerate(ranks):
        row = [str(r)]
        for v in VARIANTS:
            m, p = np.nanmean(measured[v.label][-1, :, ri]), np.nanmean(predicted[v.label][-1, :, ri])
            row.append(f"{m:.3f} ({p:.3f})")
        row.append(f"{np.nanmean(measured[VARIANTS[1].label][0, :, ri]):.3f}")
        print("| " + " | ".join(row) + " |")
    print(f"\nplots: {fig_b}, {fig_c}, {fig_t}\n")
    payload = {"ranks": ranks, "layers": list(layers), "updates": T, "loss": args.cosine_loss, "sketch_errors": errors,
               "coherence": rho.tolist(),
               "measured": {k: v.tolist() for k, v in measured.items()},
               "predicted": {k: v.tolist() for k, v in predicted.items()}, "reduced": notes}
    (out_dir / "cosine.json").write_text(json.dumps(payload))
    return {"ranks": ranks, "measured": measured, "predicted": predicted, "sketch_errors": errors,
            "plots": [fig_b, fig_c, fig_t]}


# ----------------------------------------------------------------------- RL variants
def run_variant(values: dict[str, Any], run_dir: Path, label: str, seed: int, reuse: bool = False,
                model_factory: Any = None) -> RunResult:
    """Train one `RLConfig` (dotted ``values``) in-process into ``run_dir``; its metrics.

    With ``reuse``, a finished run whose config.json matches is read instead. The
    trainer's own prints go to stderr so the tables on stdout stay clean.
    ``model_factory`` (tests) returns ``(model, tokenizer, task)`` instead of the embedded policy.
    """
    config = build_config({**values, "run_dir": str(run_dir), "seed": seed})
    saved = run_dir / "config.json"
    if reuse and (run_dir / "summary.json").exists() and saved.exists() and \
            json.loads(saved.read_text()) == json.loads(json.dumps(config.to_dict())):
        _log(f"reusing finished run {run_dir}")
        return read_run(run_dir, label, seed)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # metrics.jsonl is appended to; a stale one would mix runs
    model, tokenizer, task = model_factory() if model_factory is not None else (None, None, None)
    t0 = time.perf_counter()
    _log(f"{label} seed {seed}: training into {run_dir}")
    with contextlib.redirect_stdout(sys.stderr):
        RLTrainer(config, model=model, tokenizer=tokenizer, task=task, progress=False).train()
    _log(f"{label} seed {seed}: done in {time.perf_counter() - t0:.0f} s")
    return read_run(run_dir, label, seed)


def _variant_table(groups: dict[str, list[RunResult]], first: str) -> str:
    head = [first, "n", "Pass@1 start (%)", "peak Pass@1 (%)", "final Pass@1 (%)", "peak Pass@4 (%)",
            "mean realised KL", "max realised KL", "mean α", "predicted-KL rel. error (median)", "s/update"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in groups.items():
        kl = [x for r in runs for x in r.series("realized_kl", "train")[1]]
        alpha = [x for r in runs for x in r.series("alpha", "train")[1]]
        pairs = [(p, q) for r in runs for p, q in zip(r.series("predicted_kl", "train")[1], r.series("realized_kl", "train")[1])
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


def _embedded_min_input(config: RLConfig) -> int:
    """Smallest input size of a target layer of the configured policy ('auto' ranks)."""
    if config.model:
        raise SystemExit("--ranks auto needs the embedded policy; give --ranks explicitly for --model")
    return min(config.tiny.hidden_size, config.tiny.intermediate_size)


def run_rank(args: argparse.Namespace, base: dict[str, Any], notes: list[str], model_factory: Any = None) -> dict[str, Any]:
    """The rank part (Figure 5a): one run per (rank, seed)."""
    if args.ranks == "auto":
        ranks = _powers_of_two(4, _embedded_min_input(build_config(base)))
    else:
        ranks = _int_list(args.ranks)
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
    print(f"LoGRA at each rank, otherwise RLConfig defaults; {args.updates} updates, evaluation every "
          f"{args.eval_every} updates on {args.eval_problems} problems; mean ± sample std over {args.seeds} seed(s).\n")
    print(_variant_table(groups, "rank"))
    print(f"\nplot: {png}\n")
    return {"groups": groups, "plot": png}


def kl_values(variant: str, horizon: int) -> dict[str, Any]:
    """The ``kl.*`` options of a KL-control variant over a ``horizon``-update run."""
    if variant == "cosine":
        return {"kl.enabled": True, "kl.schedule": "cosine", "kl.schedule_steps": horizon}
    if variant == "constant":
        return {"kl.enabled": True, "kl.schedule": "constant", "kl.schedule_steps": horizon}
    if variant == "none":
        return {"kl.enabled": False}
    raise ValueError(f"unknown KL variant {variant!r}; choose from {', '.join(KL_VARIANTS)}")


def run_kl(args: argparse.Namespace, base: dict[str, Any], notes: list[str], model_factory: Any = None) -> dict[str, Any]:
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
    cfg = build_config(common)
    print("### KL-control variants over a longer horizon (Figure 6)\n")
    header = protocol_lines(notes, args.passthrough)
    if header:
        print(header)
    print(f"LoGRA, RLConfig defaults, {args.kl_updates} updates, evaluation every {args.eval_every} updates on "
          f"{args.eval_problems} problems; mean ± sample std over {args.seeds} seed(s). Cosine: budget "
          f"{cfg.kl.budget:g} → {cfg.kl.budget_final:g} over the {args.kl_updates} updates; constant: {cfg.kl.budget:g} "
          "throughout; none: kl.enabled=False (α = 1, the optimizer's update_ratio step).\n")
    print(_variant_table(groups, "KL control"))
    print(f"\nplot: {png}\n")
    return {"groups": groups, "plot": png}


# ----------------------------------------------------------------------- command line
def _int_list(text: str) -> list[int]:
    values = sorted({int(s) for s in text.split(",") if s.strip()})
    if not values or values[0] < 1:
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


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
    p.add_argument("--reuse", action="store_true", help="read finished RL runs with identical configs instead of rerunning")
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
    build_config(base)  # unknown `logra train` options fail here, before any run
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


if __name__ == "__main__":
    sys.exit(main())
