"""``logra bench compare``: LoGRA against the optimizers users would otherwise pick.

Every method trains the same randomly initialised Qwen2-architecture model (fp32
weights, identical seed) of each ``--sizes`` preset on the same token batch, each in its
own Python process (``python -m logra.bench.compare --worker METHOD ...``), with the
step loop, memory tracking and worker spawning of `logra.bench.memory`: one warm-up
step, ``--repeats`` untracked steps for the step time (median), then ``--memory-repeats``
steps under `logra.memory.track_memory` (forward+backward and optimizer step in separate
regions; the step's peak is the larger).

Methods (the peers are the real packages, imported in the worker; one that fails to
import or run is listed in the table with its error):
    adamw: dense ``torch.optim.AdamW`` on every parameter (fp32 master weights).
    adamw8bit: ``bitsandbytes.optim.AdamW8bit`` on every parameter (8-bit moments).
    logra-freeze / logra-sketch: `LoGRAOptimizer` with ``non_target='freeze'`` /
        ``'sketch'``, at every rank of ``--ranks``.
    lora: peft LoRA (``r = lora_alpha = rank``, no dropout) on the same 7 projections
        LoGRA sketches, AdamW on the adapters, at every rank of ``--peer-ranks``.
    galore: ``galore_torch.GaLoreAdamW``, rank on the 7 projection weights (README
        settings: ``update_proj_gap=200, scale=0.25, proj_type='std'``), plain Adam on the
        other parameters, at every rank of ``--peer-ranks``.
    apollo: ``apollo_torch.APOLLOAdamW`` with channel-wise scaling (``proj='random',
        scale_type='channel', scale=1, update_proj_gap=200, proj_type='std'``), same
        parameter split as GaLore, at every rank of ``--peer-ranks``.

Memory: the average over the measured steps of each step's peak (as the paper's
"average memory" averages per-update peaks) and the highest step peak, by MemTracker
category; process peak RSS; on CUDA also ``torch.cuda.max_memory_allocated`` per step.
Writes ``compare.md``, ``compare.json``, ``memory_bars.png`` (the paper's Figure 1
layout: dark bar = average, pale extension = peak) and ``memory_vs_size.png`` to
``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from logra import LoGRAConfig
from logra.bench import memory
from logra.bench.common import FULL_SHAPE, QUICK_SHAPE, size_unit, spawn_worker
from logra.errors import WorkerError
from logra.memory import CATEGORIES, GIB
from logra.sketch import find_targets, target_module_names

#: Methods in table order; the first is the baseline the ratios refer to.
METHODS: tuple[str, ...] = ("adamw", "adamw8bit", "logra-freeze", "logra-sketch", "lora", "galore", "apollo")
_BASELINE = "adamw"
_LOGRA = ("logra-freeze", "logra-sketch")
_PEERS_RANKED = ("lora", "galore", "apollo")

#: Model presets (Qwen2 architecture, untied embeddings, 32k vocabulary except ``tiny``).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(QUICK_SHAPE),
    "25m": {"hidden": 256, "layers": 12, "heads": 4, "kv_heads": 2, "intermediate": 704, "vocab": 32000},
    "100m": {"hidden": 640, "layers": 14, "heads": 10, "kv_heads": 2, "intermediate": 1728, "vocab": 32000},
    "330m": dict(FULL_SHAPE),
}
_FULL = {"sizes": "25m,100m,330m", "ranks": "64,256", "batch": 2, "seq": 256, "repeats": 2}
_QUICK = {"sizes": "tiny", "ranks": "16", "batch": 2, "seq": 16, "repeats": 1}
# The peers' published defaults for projection refresh and update scale.
_PROJ_GAP = 200
_GALORE_GROUP = {"update_proj_gap": _PROJ_GAP, "scale": 0.25, "proj_type": "std"}
_APOLLO_GROUP = {
    "proj": "random", "scale_type": "channel", "scale": 1.0, "update_proj_gap": _PROJ_GAP, "proj_type": "std",
}
# Same hyper-parameters as the dense control of `logra.bench.memory`; they do not change
# memory or time, and a small lr keeps the random model's loss finite.
_ADAM_KW = {"lr": 1e-6, "betas": (0.9, 0.95), "weight_decay": 0.0}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``logra bench compare --help``)."""
    p = argparse.ArgumentParser(
        prog="logra bench compare",
        description="Peak/average training memory by category and step time of dense AdamW, 8-bit AdamW "
        "(bitsandbytes), LoGRA (freeze/sketch, rank sweep), LoRA (peft), GaLore (galore-torch) and APOLLO "
        "(apollo-torch) on random-init Qwen2-architecture models of several sizes, one process per method "
        "and size. Prints markdown tables; writes them, the raw JSON and two PNG charts to --out-dir.",
    )
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated model presets from {','.join(SIZES)} (default {_FULL['sizes']}; "
                   f"--quick: {_QUICK['sizes']})")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--ranks", default=None,
                   help=f"LoGRA ranks, comma-separated (default {_FULL['ranks']}; --quick: {_QUICK['ranks']})")
    p.add_argument("--peer-ranks", default=None,
                   help="ranks of LoRA, GaLore and APOLLO, comma-separated (default: the largest of --ranks)")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per step (default {_FULL['batch']})")
    p.add_argument("--seq", type=int, default=None,
                   help=f"tokens per sequence (default {_FULL['seq']}; --quick: {_QUICK['seq']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed (untracked) steps after the warm-up step (default {_FULL['repeats']}; --quick: 1)")
    p.add_argument("--memory-repeats", type=int, default=None,
                   help="steps measured under the memory tracker (default: --repeats); each step's peak "
                   "enters the average, the largest is the peak")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--autocast", default="fp32", choices=("fp32", "bf16"),
                   help="compute dtype; weights stay fp32. bf16 = torch.autocast, CUDA only (default fp32)")
    p.add_argument("--adamw-impl", default="default", choices=("default", "foreach", "fused"),
                   help="implementation of the dense AdamW baseline (default: torch's choice for the device)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer (HF, non-reentrant) for all methods")
    p.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "eager"),
                   help="transformers attention implementation (default sdpa)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per worker (default 1: the CPUs are shared)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the token batch (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, batch 2 x 16 tokens, rank 16, 1 repeat (explicit options still win)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench-compare"),
                   help="where compare.md, compare.json and the PNGs go (default runs/bench-compare)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="measure nothing: re-render the tables and PNGs of a previous run's compare.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _ints(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{option}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{option}: expected positive integers, got {text!r}")
    return values


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the full or --quick defaults and check them."""
    defaults = _QUICK if args.quick else _FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.memory_repeats is None:
        args.memory_repeats = args.repeats
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.size_list if s not in SIZES]
    if unknown or not args.size_list:
        parser.error(f"--sizes: unknown {unknown or 'empty list'}; choose from {', '.join(SIZES)}")
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown or not args.method_list:
        parser.error(f"--methods: unknown {unknown or 'empty list'}; choose from {', '.join(METHODS)}")
    args.rank_list = _ints(parser, "--ranks", args.ranks)
    args.peer_rank_list = (_ints(parser, "--peer-ranks", args.peer_ranks) if args.peer_ranks
                           else [max(args.rank_list)])
    for name in ("batch", "seq", "repeats", "memory_repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(m in _LOGRA for m in args.method_list):
        for size in args.size_list:
            shape = SIZES[size]
            if max(args.rank_list) > min(shape["hidden"], shape["intermediate"]):
                parser.error(f"--ranks {max(args.rank_list)} exceeds the smallest input size of a target "
                             f"layer of the {size} preset ({min(shape['hidden'], shape['intermediate'])})")
    if args.autocast == "bf16" and torch.device(args.device).type != "cuda":
        parser.error("--autocast bf16 is only measured on CUDA (CPU bf16 autocast is not what GPUs run)")
    return args


def _label(method: str, rank: int | None) -> str:
    return method if rank is None else f"{method} r{rank}"


def _runs(args: argparse.Namespace) -> list[tuple[str, str, int | None]]:
    """(size, method, rank) of every worker, in table order."""
    runs = []
    for size in args.size_list:
        for method in args.method_list:
            ranks = args.rank_list if method in _LOGRA else args.peer_rank_list if method in _PEERS_RANKED else [None]
            runs += [(size, method, r) for r in ranks]
    return runs


# ----------------------------------------------------------------------------- worker

class _ProjectorState:
    """Exposes the projection matrices GaLore/APOLLO keep on projector objects.

    They live in ``state[p]['projector'].ortho_matrix``, not as tensor values of
    ``optimizer.state``, so MemTracker would not count them; `logra.memory.track_memory`
    counts what an optimizer's ``memory_tensors()`` lists.
    """

    state: dict[Any, dict[str, Any]]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """``{'optimizer': [projection matrices]}``."""
        mats: list[torch.Tensor] = []
        for st in self.state.values():
            m = getattr(st.get("projector"), "ortho_matrix", None)
            if isinstance(m, torch.Tensor):
                mats.append(m)
            elif isinstance(m, (list, tuple)):  # proj_type 'full' keeps two factors
                mats += [t for t in m if isinstance(t, torch.Tensor)]
        return {"optimizer": mats}


def _split_targets(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(weights of LoGRA's default targets, every other parameter)."""
    low = [modules[0][1].weight for modules in find_targets(model, LoGRAConfig().target_modules).values()]
    ids = {id(p) for p in low}
    return low, [p for p in model.parameters() if id(p) not in ids]


def _setup(method: str, model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model and optimizer of ``method`` (peers are imported here, so a broken one fails its own worker)."""
    if method in ("adamw",) + _LOGRA:
        return model, memory.build_optimizer(method, model, args)
    if method == "adamw8bit":
        import bitsandbytes as bnb

        return model, bnb.optim.AdamW8bit(model.parameters(), **_ADAM_KW)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0,
                         target_modules=target_module_names(model, LoGRAConfig().target_modules))
        model = get_peft_model(model, cfg)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **_ADAM_KW)
    low, rest = _split_targets(model)
    if method == "galore":
        from galore_torch import GaLoreAdamW

        cls = type("GaLoreAdamW", (_ProjectorState, GaLoreAdamW), {})
        groups = [{"params": rest}, {"params": low, "rank": args.rank, **_GALORE_GROUP}]
        return model, cls(groups, no_deprecation_warning=True, **_ADAM_KW)
    if method == "apollo":
        from apollo_torch import APOLLOAdamW

        cls = type("APOLLOAdamW", (_ProjectorState, APOLLOAdamW), {})
        groups = [{"params": rest}, {"params": low, "rank": args.rank, **_APOLLO_GROUP}]
        return model, cls(groups, **_ADAM_KW)
    raise ValueError(f"unknown method {method!r}")


def _log(method: str, message: str) -> None:
    print(f"[bench compare] {method}: {message}", file=sys.stderr, flush=True)


def _worker_main(args: argparse.Namespace) -> int:
    wargs = argparse.Namespace(
        **SIZES[args.worker_size], tie=False, checkpointing=args.checkpointing,
        attn_implementation=args.attn_implementation, batch=args.batch, seq=args.seq,
        rank=args.worker_rank, repeats=args.repeats, memory_repeats=args.memory_repeats, device=args.device,
        autocast=args.autocast, adamw_impl=args.adamw_impl, threads=args.threads, seed=args.seed,
    )
    ranked = args.worker in _LOGRA + _PEERS_RANKED
    label = f"{args.worker_size} {_label(args.worker, args.worker_rank if ranked else None)}"
    result = memory.run_worker(args.worker, wargs, log=lambda _, msg: _log(label, msg), setup=_setup,
                               profile_parts=False)
    result["size"] = args.worker_size
    result["rank"] = args.worker_rank
    assert args.worker_out is not None
    args.worker_out.write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- report

def _fail_result(size: str, method: str, rank: int | None, err: WorkerError) -> dict[str, Any]:
    code = f"exit code {err.returncode}" if err.returncode >= 0 else f"killed by signal {-err.returncode}"
    return {"size": size, "method": method, "rank": rank, "error": f"{err.last_line or '(no output)'} ({code})"}


def _avg_peak(r: dict[str, Any]) -> tuple[float, float, str]:
    """(average, peak) bytes of the memory the charts show, and its name."""
    if r.get("cuda_step_max_allocated"):
        steps = r["cuda_step_max_allocated"]
        return statistics.fmean(steps), max(steps), "CUDA max allocated"
    return statistics.fmean(r["tracked_step_peaks"]), r["tracked_peak"], "tracked (MemTracker)"


def _unit(results: list[dict[str, Any]]) -> tuple[str, int]:
    ok = [r for r in results if "error" not in r]
    return size_unit(ok) if ok else ("GiB", GIB)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_size_table(results: list[dict[str, Any]], unit: tuple[str, int]) -> str:
    """Markdown table of one model size (ratios against its AdamW row, if present)."""
    name, div = unit
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["method"] == _BASELINE), None)
    cuda = any(r.get("cuda_max_allocated") is not None for r in ok)
    cats = [c for c in CATEGORIES if c not in ("buffers", "other")]
    head = ["method", "trainable (M)"] + [f"{c} ({name})" for c in cats]
    head += [f"buffers+other ({name})", f"grads / opt. state at opt. step ({name})",
             f"tracked avg / peak ({name})", f"RSS peak ({name})"]
    if cuda:
        head.append(f"CUDA max alloc avg / peak ({name})")
    head += ["step time (s, median [min–max])", "fwd+bwd / opt (s)", "peak / AdamW", "time / AdamW"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        label = _label(r["method"], r["rank"])
        if "error" in r:
            lines.append("| " + " | ".join([label, _cell(f"FAILED: {r['error']}")] + [""] * (len(head) - 2)) + " |")
            continue
        pc = r["peak_by_category"]
        row = [label, f"{r['trainable_params'] / 1e6:.2f}"] + [f"{pc[c] / div:.3f}" for c in cats]
        avg = statistics.fmean(r["tracked_step_peaks"])
        at_opt = r["at_optimizer_step"]
        row += [f"{(pc['buffers'] + pc['other']) / div:.3f}",
                f"{at_opt['gradients'] / div:.3f} / {at_opt['optimizer'] / div:.3f}",
                f"{avg / div:.3f} / {r['tracked_peak'] / div:.3f}",
                f"{r['rss_peak'] / div:.3f}"]
        if cuda:
            steps = r.get("cuda_step_max_allocated")
            row.append(f"{statistics.fmean(steps) / div:.3f} / {max(steps) / div:.3f}" if steps else "-")
        row += memory.timing_cells(r, base)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_summary(results: list[dict[str, Any]], sizes: list[str], unit: tuple[str, int]) -> str:
    """Methods × sizes: tracked average / peak memory and median step time."""
    name, div = unit
    labels = list(dict.fromkeys(_label(r["method"], r["rank"]) for r in results))
    by_key = {(r["size"], _label(r["method"], r["rank"])): r for r in results}
    head = ["method"] + [f"{s}: avg / peak ({name}), step (s)" for s in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        row = [label]
        for s in sizes:
            r = by_key.get((s, label))
            if r is None:
                row.append("-")
            elif "error" in r:
                row.append("failed")
            else:
                avg, peak, _ = _avg_peak(r)
                row.append(f"{avg / div:.3f} / {peak / div:.3f}, {r['step_time_median']:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

_COLORS = {"adamw": "#444444", "adamw8bit": "#8c564b", "logra-freeze": "#1f77b4", "logra-sketch": "#17becf",
           "lora": "#ff7f0e", "galore": "#2ca02c", "apollo": "#9467bd"}
_SIZE_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def plot_bars(results: list[dict[str, Any]], sizes: list[str], path: Path) -> Path:
    """Figure-1-style chart: per size one panel, per method a dark bar (average) and a pale
    extension (peak), labelled "avg / peak"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(r["method"], r["rank"]) for r in results))
    by_key = {(r["size"], _label(r["method"], r["rank"])): r for r in results}
    ok = [r for r in results if "error" not in r]
    what = _avg_peak(ok[0])[2] if ok else "tracked (MemTracker)"
    unit, div = _unit(results)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 0.42 * len(labels) + 1.6),
                             sharey=True, squeeze=False)
    for i, (size, ax) in enumerate(zip(sizes, axes[0], strict=True)):
        color = _SIZE_COLORS[i % len(_SIZE_COLORS)]
        rows = [by_key.get((size, label)) for label in labels]
        peaks = [_avg_peak(r)[1] / div for r in rows if r is not None and "error" not in r]
        xmax = max(peaks, default=1.0)
        params = next((r["params"] for r in rows if r is not None and "error" not in r), None)
        for y, r in enumerate(rows):
            if r is None:
                continue
            if "error" in r:
                ax.text(0.01 * xmax, y, "failed: " + r["error"][:60], va="center", fontsize=7, color="#b00000")
                continue
            avg, peak, _ = _avg_peak(r)
            avg, peak = avg / div, peak / div
            hatch = "//" if r["method"].startswith("logra") else None
            ax.barh(y, peak, color=color, alpha=0.3, edgecolor=color, height=0.7)
            ax.barh(y, avg, color=color, alpha=0.95, hatch=hatch, edgecolor="white", height=0.7)
            ax.text(peak + 0.01 * xmax, y, f"{avg:.2f} / {peak:.2f}", va="center", fontsize=7.5)
        base = by_key.get((size, _BASELINE))
        if base is not None and "error" not in base:
            ax.axvline(_avg_peak(base)[1] / div, color="#444444", ls=":", lw=1)
        ax.set_xlim(0, xmax * 1.32)
        title = size if params is None else f"{size} ({params / 1e6:.3g}M parameters)"
        ax.set_title(title, color=color, fontsize=10)
        ax.set_xlabel(f"memory ({unit}): avg / peak")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"Training memory per step, {what}\ndark: average over the measured steps, pale: peak; "
                 "dotted line: dense AdamW peak; hatched: LoGRA", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scaling(results: list[dict[str, Any]], path: Path) -> Path:
    """Memory against model size, one curve per method: peak total and gradients + optimizer state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    unit, div = _unit(results)
    labels = list(dict.fromkeys(_label(r["method"], r["rank"]) for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    what = _avg_peak(ok[0])[2] if ok else "tracked (MemTracker)"
    for label in labels:
        rows = sorted((r for r in ok if _label(r["method"], r["rank"]) == label), key=lambda r: r["params"])
        if not rows:
            continue
        method, rank = rows[0]["method"], rows[0]["rank"]
        x = [r["params"] / 1e6 for r in rows]
        style = {"color": _COLORS.get(method, None), "marker": "o", "label": label,
                 "ls": "--" if rank is not None and method in _LOGRA and rank != max(r["rank"] for r in ok
                                                                                     if r["method"] == method) else "-"}
        axes[0].plot(x, [_avg_peak(r)[1] / div for r in rows], **style)
        axes[1].plot(x, [(r["at_optimizer_step"]["gradients"] + r["at_optimizer_step"]["optimizer"]) / div
                         for r in rows], **style)
    axes[0].set_title(f"peak training memory, {what}", fontsize=10)
    axes[1].set_title("gradients + optimizer state during the optimizer step (MemTracker)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("model parameters (M)")
        ax.set_ylabel(f"{unit}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    """``logra bench compare``: one worker per (size, method, rank); tables, JSON and PNGs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = _resolve(parser, parser.parse_args(argv))
    if args.worker is not None:
        return _worker_main(args)
    if args.from_json is not None:
        payload = json.loads(args.from_json.read_text())
        for key, value in payload["setup"].items():
            setattr(args, key, value)
        results = payload["results"]
    else:
        results = _measure(args)
    _report(args, results)
    return 0


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn one worker per (size, method, rank); failures become rows with their error."""
    common = [
        "--batch", str(args.batch), "--seq", str(args.seq), "--repeats", str(args.repeats),
        "--memory-repeats", str(args.memory_repeats), "--device", args.device, "--autocast", args.autocast,
        "--adamw-impl", args.adamw_impl, "--threads", str(args.threads), "--seed", str(args.seed),
        "--attn-implementation", args.attn_implementation, "--sizes", ",".join(args.size_list),
        "--ranks", ",".join(map(str, args.rank_list)),
    ] + (["--checkpointing"] if args.checkpointing else [])
    results: list[dict[str, Any]] = []
    for size, method, rank in _runs(args):
        label = f"{size} {_label(method, rank)}"
        _log(label, "starting worker process")
        worker_argv = common + ["--worker-size", size, "--worker-rank", str(rank or max(args.rank_list))]
        try:
            r = spawn_worker(method, worker_argv, "logra.bench.compare")
            r["rank"] = rank
        except WorkerError as err:
            r = _fail_result(size, method, rank, err)
            _log(label, f"FAILED: {r['error']}")
        results.append(r)
    return results


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Print the tables; write them, the JSON and the PNGs to ``args.out_dir``."""
    unit = _unit(results)
    parts = [
        "## LoGRA vs AdamW, 8-bit AdamW, LoRA, GaLore, APOLLO: training memory and step time\n",
        f"Qwen2 random init, fp32 weights; batch {args.batch} × {args.seq} tokens (same ids for every method); "
        f"LoGRA ranks {','.join(map(str, args.rank_list))}, LoRA/GaLore/APOLLO ranks "
        f"{','.join(map(str, args.peer_rank_list))}; compute {args.autocast}; activation checkpointing "
        f"{'on' if args.checkpointing else 'off'}; device {args.device}; {args.threads} thread(s); 1 warm-up + "
        f"{args.repeats} timed + {args.memory_repeats} memory-tracked step(s) per method, one process per "
        "method and size. Memory categories are MemTracker's at the highest step peak (a peak in the backward pass "
        "may precede most gradients); 'grads / opt. state at opt. step' = the same categories at the optimizer "
        "step's peak; 'avg / peak' = mean / max over the tracked steps of each step's peak. Step time: median of the "
        "untracked steps. AdamW, 8-bit "
        "AdamW, GaLore and APOLLO train every parameter; LoRA trains adapters only; logra-freeze freezes "
        "embeddings, lm_head, norms and biases. GaLore/APOLLO refresh their projections every "
        f"{_PROJ_GAP} steps: the refresh falls in the untimed warm-up step (see warmup_step_time in compare.json).\n",
    ]
    for size in args.size_list:
        rows = [r for r in results if r["size"] == size]
        params = next((r["params"] for r in rows if "error" not in r), None)
        shape = SIZES[size]
        parts.append(f"### {size}: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']}/"
                     f"{shape['kv_heads']} heads, intermediate {shape['intermediate']}, vocab {shape['vocab']}"
                     + (f" ({params / 1e6:.1f}M parameters)" if params else "") + "\n")
        parts.append(format_size_table(rows, unit) + "\n")
    if len(args.size_list) > 1:
        parts.append(f"### Across sizes\n\n{format_summary(results, args.size_list, unit)}\n")
    failed = [r for r in results if "error" in r]
    failed_labels = ", ".join(sorted({_label(r["method"], r["rank"]) for r in failed}))
    parts.append(f"{len(results) - len(failed)} of {len(results)} runs measured"
                 + (f"; failed: {failed_labels}" if failed else "") + ".")
    text = "\n".join(parts)
    print(text)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "compare.md").write_text(text + "\n")
    setup = {k: v for k, v in vars(args).items() if not k.startswith("worker") and k not in ("out_dir", "from_json")}
    (args.out_dir / "compare.json").write_text(json.dumps({"setup": setup, "results": results}, indent=2, default=str))
    pngs = [plot_bars(results, args.size_list, args.out_dir / "memory_bars.png"),
            plot_scaling(results, args.out_dir / "memory_vs_size.png")]
    print("\nwrote " + ", ".join(str(p) for p in [args.out_dir / "compare.md", args.out_dir / "compare.json", *pngs]))


if __name__ == "__main__":
    sys.exit(main())
