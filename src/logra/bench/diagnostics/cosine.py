"""The ``cosine`` part (Figure 5b/c): accumulated gradient reconstruction per layer and rank,
measured for three projection variants and predicted for independent projections."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
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

from logra.bench.learn import protocol_lines, title_tag  # noqa: E402
from logra.projection import make_projection, projection_index, projection_seed  # noqa: E402
from logra.rl.cli import build_config  # noqa: E402

from .common import int_list, powers_of_two  # noqa: E402
from .gradients import coherence, record_gradients  # noqa: E402


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
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")



def layer_of(name: str) -> str:
    """The transformer layer a target belongs to ('0', '1', ...; the name itself if none)."""
    m = _LAYER.search(name)
    return m.group(1) if m else name


def group_by_layer(names: Sequence[str]) -> dict[str, list[str]]:
    """Layer label → its target names, layers in numeric order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(layer_of(name), []).append(name)
    return dict(sorted(groups.items(),
                       key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0, kv[0])))


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
    for k, (ax, (label, grid)) in enumerate(zip(axes[0], values.items(), strict=True)):
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


def run_cosine(args: argparse.Namespace, base: dict[str, Any], notes: list[str],
               model: nn.Module | None = None, tokenizer: Any = None, task: Any = None) -> dict[str, Any]:
    """The cosine part: record gradients, reconstruct, print the table, draw the heatmaps."""
    out_dir = args.out_dir / ("cosine" if args.cosine_loss == "rl" else f"cosine-{args.cosine_loss}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # Figure 5's rows are the transformer layers' projections: keep embeddings out of the sketches
    config = build_config({**base, "run_dir": str(out_dir / "run"), "eval_every": 0, "checkpoint_every": 0,
                           "logra.non_target": "freeze"}, "embedded")
    t0 = time.perf_counter()
    grads, errors, info = record_gradients(config, args.cosine_updates, model, tokenizer, task, args.cosine_loss)
    t_record = time.perf_counter() - t0
    min_in = min(g.shape[1] for g in grads[0].values())
    ranks = powers_of_two(1, min_in) if args.cosine_ranks == "auto" else int_list(args.cosine_ranks)
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
                  f"{config.responses_per_prompt} rollouts per update, mean train reward "
                  f"{statistics.fmean(rewards):.3f}) "
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

