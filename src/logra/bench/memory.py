"""``logra bench memory``: peak training memory by category and step time, AdamW vs LoGRA.

Every method trains the same randomly initialised Qwen2-architecture model (fp32
weights, identical seed) on the same token batch. Each method runs in its own Python
process (``python -m logra.bench.memory --worker METHOD ...``) so that allocator
caches, peak RSS and CUDA peak statistics of one method never leak into another's.

A worker builds the model and optimizer, takes one warm-up step (AdamW creates its
moments lazily at its first step; afterwards every step is a steady-state step whose
peak includes that state), then

1. times ``--repeats`` full steps (forward, backward, optimizer step, ``zero_grad``)
   with ``time.perf_counter``, untracked: MemTracker is a ``TorchDispatchMode`` whose
   per-op bookkeeping costs differ between methods (LoGRA's step issues many more
   small ops than a dense AdamW step), so tracked steps would not time the method;
2. runs ``--memory-repeats`` (default: ``--repeats``) full steps for the peak by
   category. Each step is tracked as two `logra.memory.track_memory` regions,
   forward+backward and optimizer step+``zero_grad`` (every live parameter, gradient
   and optimizer tensor is registered again at the second region's start, so the step's
   peak is the larger of the two). The table's breakdown is that of the highest region
   peak; the JSON keeps every step's peak (``tracked_step_peaks``), the breakdown at the
   optimizer step's peak (``at_optimizer_step``: all gradients exist there, whereas a
   method whose peak falls in the backward pass may hold few of them at its peak) and
   the tracked steps' times (``tracked_step_times``);
3. (LoGRA only) runs one more step under ``torch.profiler`` and reports the share of its
   wall time spent in the named ranges of LoGRA's step (`STEP_PARTS`: ``X Aᵀ`` in the
   forward pass, the sketch in the backward pass, the proposal, the merge and the
   projection refresh).

The parent prints one markdown table and the issue's targets as PASS/FAIL lines;
``--tokens 512,2048,...`` repeats all of it per token count and ends with a summary table.

Methods:
    adamw: dense ``torch.optim.AdamW`` on every parameter (fp32 master weights).
    logra-freeze: `LoGRAOptimizer` with ``non_target='freeze'`` (the paper's default).
    logra-sketch: `LoGRAOptimizer` with ``non_target='sketch'`` (embeddings and lm_head
        sketched too; norms and biases trained by a small AdamW).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from logra import LoGRAConfig, LoGRAOptimizer
from logra.bench.common import FULL_SHAPE, QUICK_SHAPE, size_unit, spawn_worker
from logra.memory import CATEGORIES, MemoryReport, enable_activation_checkpointing, track_memory

#: Methods in table order; the first is the baseline the ratios refer to.
METHODS: tuple[str, ...] = ("adamw", "logra-freeze", "logra-sketch")
_BASELINE = "adamw"
# Targets (issue 12): peak vs AdamW with / without activation checkpointing, LoGRA's own
# tensors (sketch buffer + stored projections + step transients) vs the fp32 weights,
# and step time vs AdamW once an update has at least TIME_TARGET_TOKENS tokens.
PEAK_TARGET = {True: 0.33, False: 0.45}
OWN_TARGET = 0.10
TIME_TARGET = 0.75
TIME_TARGET_TOKENS = 8192

_QUICK_RUN = {"batch": 2, "seq": 16, "rank": 16, "repeats": 1}
_FULL_RUN = {"batch": 2, "seq": 256, "rank": 256, "repeats": 3}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``logra bench memory --help``)."""
    p = argparse.ArgumentParser(
        prog="logra bench memory",
        description="Peak training memory by category and step time: dense AdamW vs LoGRA "
        "(non_target='freeze' and 'sketch') on a random-init Qwen2-architecture model, one "
        "process per method. Prints a markdown table and the targets (LoGRA peak <= "
        f"{PEAK_TARGET[True]} x AdamW with --checkpointing, <= {PEAK_TARGET[False]} x without; LoGRA's own tensors "
        f"<= {OWN_TARGET:.0%} of the fp32 weights; step time <= {TIME_TARGET} x AdamW at >= {TIME_TARGET_TOKENS} "
        "tokens per step).",
    )
    shape = p.add_argument_group("model (defaults: ~330M-parameter Qwen2.5-0.5B-like shape; --quick: tiny)")
    shape.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {FULL_SHAPE['hidden']})")
    shape.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {FULL_SHAPE['layers']})")
    shape.add_argument("--heads", type=int, default=None, help=f"attention heads (default {FULL_SHAPE['heads']})")
    shape.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads (default {FULL_SHAPE['kv_heads']})")
    shape.add_argument("--intermediate", type=int, default=None,
                       help=f"MLP intermediate size (default {FULL_SHAPE['intermediate']})")
    shape.add_argument("--vocab", type=int, default=None, help=f"vocabulary size (default {FULL_SHAPE['vocab']})")
    shape.add_argument("--checkpointing", action="store_true",
                       help="activation checkpointing of every decoder layer (HF, non-reentrant) for all methods")
    shape.add_argument("--tie", action="store_true", help="tie input embeddings and lm_head (Qwen2.5-0.5B/1.5B style)")
    shape.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "eager"),
                       help="transformers attention implementation (default sdpa)")
    run = p.add_argument_group("run")
    run.add_argument("--batch", type=int, default=None, help=f"sequences per step (default {_FULL_RUN['batch']})")
    run.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {_FULL_RUN['seq']})")
    run.add_argument("--tokens", default=None, metavar="N,N,...",
                     help="token sweep: tokens per step (each a multiple of --batch; overrides --seq), one table "
                     "per point and a summary table, e.g. 512,2048,8192,16384")
    run.add_argument("--rank", type=int, default=None, help=f"LoGRA rank r (default {_FULL_RUN['rank']})")
    run.add_argument("--repeats", type=int, default=None,
                     help=f"timed (untracked) steps after the warm-up step (default {_FULL_RUN['repeats']})")
    run.add_argument("--memory-repeats", type=int, default=None,
                     help="steps measured under the memory tracker (default: --repeats)")
    run.add_argument("--logra-beta1", type=float, default=0.0,
                     help="LoGRA first-moment decay (LoGRAConfig.beta1; > 0 adds one sketch-sized momentum buffer, "
                     "counted as optimizer state; default 0 = the paper)")
    run.add_argument("--logra-optimizer", default="row_adam", choices=("row_adam", "adam", "sgd"),
                     help="LoGRAConfig.optimizer ('adam' adds a sketch-sized second moment; default row_adam = paper)")
    run.add_argument("--logits-chunk", type=int, default=0, metavar="N",
                     help="every method computes its loss with the output head N positions at a time under "
                     "checkpointing (logra train's log-probabilities), not from full [tokens, vocab] logits")
    run.add_argument("--logra-moment-dtype", default="float32", choices=("float32", "bfloat16"),
                     help="storage dtype of LoGRA's sketch-sized moments (LoGRAConfig.moment_dtype; default float32)")
    run.add_argument("--logra-fixed-projection", action="store_true",
                     help="LoGRA keeps one projection for the run (LoGRAConfig.refresh=False, the embedded recipe's) "
                     "instead of drawing new ones after every update (the paper)")
    run.add_argument("--logra-input-projection", action="store_true",
                     help="LoGRA's projections are fitted to the layers' inputs on the batch before the first step "
                     "(LoGRAConfig.distribution='inputs', implies --logra-fixed-projection): fp32 [r, in] per input "
                     "instead of sign bits")
    run.add_argument("--share-projections", action="store_true",
                     help="LoGRA shares one projection per input (q/k/v, gate/up: LoGRAConfig.share_projections), "
                     "saving X Aᵀ once per input")
    run.add_argument("--methods", default=",".join(METHODS),
                     help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    run.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    run.add_argument("--autocast", "--dtype", dest="autocast", default="fp32", choices=("fp32", "bf16"),
                     help="compute dtype; weights stay fp32. bf16 = torch.autocast, CUDA only (default fp32)")
    run.add_argument("--adamw-impl", default="default", choices=("default", "foreach", "fused"),
                     help="AdamW implementation of the baseline (default: torch's choice for the device: "
                     "a per-tensor loop on CPU, foreach on CUDA)")
    run.add_argument("--threads", type=int, default=1,
                     help="torch CPU threads per worker (default 1: the CPUs are shared)")
    run.add_argument("--seed", type=int, default=0, help="seed of the model weights and the token batch (default 0)")
    run.add_argument("--quick", action="store_true",
                     help="tiny model, batch 2 x 16 tokens, rank 16, 1 repeat (explicit options still win)")
    run.add_argument("--out", type=Path, default=None, help="write the raw numbers of every method as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset shape/run options from the full or the --quick defaults."""
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    run = _QUICK_RUN if args.quick else _FULL_RUN
    for key, value in {**shape, **run}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.memory_repeats is None:
        args.memory_repeats = args.repeats
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown or 'empty list'}; choose from {', '.join(METHODS)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    for name in ("layers", "intermediate", "vocab", "batch", "seq", "rank", "repeats", "memory_repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.logits_chunk < 0:
        parser.error("--logits-chunk must be >= 0 (0: the model's own loss)")
    if args.rank > min(args.hidden, args.intermediate):
        parser.error(f"--rank {args.rank} exceeds the smallest input size of a target layer")
    if args.autocast == "bf16" and torch.device(args.device).type != "cuda":
        parser.error("--autocast bf16 is only measured on CUDA (CPU bf16 autocast is not what GPUs run)")
    return methods


def build_model(args: argparse.Namespace) -> nn.Module:
    """The random-init Qwen2ForCausalLM of this run (fp32, seeded, on ``args.device``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=args.tie,
        attn_implementation=args.attn_implementation, use_cache=False,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(cfg).float().to(args.device)
    if args.checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    return model


def make_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """``batch × seq`` random token ids (fixed seed), full attention, labels = ids."""
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return {
        "input_ids": ids.to(args.device),
        "attention_mask": torch.ones_like(ids).to(args.device),
        "labels": ids.clone().to(args.device),
    }


def make_loss(model: nn.Module, batch: dict[str, torch.Tensor], logits_chunk: int = 0) -> Callable[[], torch.Tensor]:
    """The step's loss: the model's own next-token loss (full ``[tokens, vocab]`` logits), or
    with ``logits_chunk`` > 0 the same mean NLL through `logra.rl.rollout.token_logprobs`,
    whose output head runs that many positions at a time under checkpointing (as the RL
    loss of ``logra train`` does)."""
    if not logits_chunk:
        return lambda: model(**batch).loss
    from logra.rl.rollout import token_logprobs

    return lambda: -token_logprobs(model, batch["input_ids"], batch["attention_mask"], chunk=logits_chunk)[:, 1:].mean()


def build_optimizer(method: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The optimizer of ``method`` (LoGRA installs its sketches on ``model`` here)."""
    if method == "adamw":
        impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.adamw_impl]
        # The paper's dense control: betas (0.9, 0.95), no weight decay.
        return torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0, **impl)
    non_target = {"logra-freeze": "freeze", "logra-sketch": "sketch"}[method]
    inputs = getattr(args, "logra_input_projection", False)
    return LoGRAOptimizer(model, LoGRAConfig(rank=args.rank, non_target=non_target,
                                             beta1=getattr(args, "logra_beta1", 0.0),
                                             optimizer=getattr(args, "logra_optimizer", "row_adam"),
                                             moment_dtype=getattr(args, "logra_moment_dtype", "float32"),
                                             share_projections=getattr(args, "share_projections", False),
                                             distribution="inputs" if inputs else "rademacher",
                                             refresh=not (inputs or getattr(args, "logra_fixed_projection", False))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor],
                autocast: bool, device: torch.device,
                phase: Callable[[str], AbstractContextManager[Any]] | None = None) -> tuple[float, float, float]:
    """One full step; returns (loss, forward+backward seconds, optimizer step + zero_grad seconds).

    ``phase(name)``, if given, is entered around 'forward_backward' and 'optimizer'.
    """
    phase = phase or (lambda _: nullcontext())
    _sync(device)
    t0 = time.perf_counter()
    with phase("forward_backward"):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn()
        loss.backward()
        _sync(device)
    t1 = time.perf_counter()
    with phase("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
    t2 = time.perf_counter()
    return float(loss.detach()), t1 - t0, t2 - t1


def _tracked_phases(regions: dict[str, MemoryReport], *tracked: nn.Module | torch.optim.Optimizer,
                    device: torch.device) -> Callable[[str], AbstractContextManager[None]]:
    """A ``phase`` for `_train_step` that tracks each phase in its own region into ``regions``."""

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        with track_memory(*tracked, device=device) as regions[name]:
            yield

    return phase


#: Named ranges (`torch.profiler.record_function`) of LoGRA's step: ``X Aᵀ`` in the
#: forward pass, the sketch ``Hᵀ P`` in the backward pass, the proposal, the merge
#: ``W -= U A`` and the projection refresh.
STEP_PARTS: tuple[str, ...] = ("logra.project", "logra.sketch", "logra.propose", "logra.merge", "logra.refresh")
_PART_HEADS = [f"{p.removeprefix('logra.')} (%)" for p in STEP_PARTS]


def _profiled_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor],
                   autocast: bool, device: torch.device) -> dict[str, float | None]:
    """One full step under ``torch.profiler``: seconds in each of `STEP_PARTS` and in the
    whole step (``'step'``). On CUDA a part's time is the larger of the host time inside its
    range and the GPU time of the kernels launched there (None where both are zero): the
    projection refresh draws its signs on the host, which GPU time alone would hide."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _, fb, st = _train_step(model, opt, loss_fn, autocast, device)
    parts: dict[str, float | None] = {name: 0.0 for name in STEP_PARTS}
    for event in prof.key_averages():
        # a range's CPU row; on CUDA its device time sums the kernels launched inside it (the
        # GPU-annotation row of the same name would count them again)
        if event.key in parts and event.device_type == torch.autograd.DeviceType.CPU:
            us = max(event.device_time_total, event.cpu_time_total) if device.type == "cuda" else event.cpu_time_total
            parts[event.key] += us / 1e6
    if device.type == "cuda":
        parts = {k: (v or None) for k, v in parts.items()}
    return {**parts, "step": fb + st}


def _log(method: str, message: str) -> None:
    print(f"[bench memory] {method}: {message}", file=sys.stderr, flush=True)


#: Builds a method's optimizer on the model; returns the model to train (a wrapper such as
#: a peft model may replace it) and the optimizer.
Setup = Callable[[str, nn.Module, argparse.Namespace], tuple[nn.Module, torch.optim.Optimizer]]


def _default_setup(method: str, model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model, build_optimizer(method, model, args)


def run_worker(method: str, args: argparse.Namespace, log: Callable[[str, str], None] = _log,
               setup: Setup = _default_setup, profile_parts: bool = True) -> dict[str, Any]:
    """Measure one method in this process; returns the raw numbers (bytes, seconds).

    ``setup`` builds the optimizer (default: `build_optimizer`); other benchmarks pass
    their own to measure more methods with the same model, batch and step loop.
    ``profile_parts``: for LoGRA, one more step under the profiler (`STEP_PARTS`).
    """
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.device = str(device)
    autocast = args.autocast == "bf16"
    t0 = time.perf_counter()
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    log(method, f"built model, {n_params / 1e6:.1f}M parameters ({time.perf_counter() - t0:.1f} s)")
    batch = make_batch(args)
    model, opt = setup(method, model, args)
    fit = None
    if isinstance(opt, LoGRAOptimizer) and opt.needs_fit:
        # a peak of its own, before the first step: the input moments of every layer at once
        t0 = time.perf_counter()
        with track_memory(model, opt, device=device) as fit_report:
            tokens = opt.fit_projections([{"input_ids": batch["input_ids"],
                                           "attention_mask": batch["attention_mask"]}])
        fit = {"seconds": time.perf_counter() - t0, "tracked_peak": fit_report.peak_total,
               "cuda_max_allocated": fit_report.cuda_max_allocated}
        log(method, f"projections fitted to the inputs of {tokens:,} tokens ({fit['seconds']:.1f} s, tracked peak "
                    f"{fit_report.peak_total / 2**30:.3f} GiB)")
    loss_fn = make_loss(model, batch, getattr(args, "logits_chunk", 0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    loss, fb, st = _train_step(model, opt, loss_fn, autocast, device)
    warmup_time = fb + st
    log(method, f"warm-up step {fb + st:.2f} s (loss {loss:.3f})")
    gc.collect()

    times: list[float] = []
    phases: list[tuple[float, float]] = []
    losses: list[float] = []
    for i in range(args.repeats):
        loss, fb, st = _train_step(model, opt, loss_fn, autocast, device)
        losses.append(loss)
        times.append(fb + st)
        phases.append((fb, st))
        log(method, f"timed step {i + 1}/{args.repeats} {fb + st:.2f} s (forward+backward {fb:.2f} s, "
                    f"optimizer {st:.2f} s)")
    gc.collect()

    tracked_times: list[float] = []
    steps: list[dict[str, MemoryReport]] = []
    for i in range(args.memory_repeats):
        regions: dict[str, MemoryReport] = {}
        loss, fb, st = _train_step(model, opt, loss_fn, autocast, device,
                                   phase=_tracked_phases(regions, model, opt, device=device))
        steps.append(regions)
        losses.append(loss)
        tracked_times.append(fb + st)
        log(method, f"tracked step {i + 1}/{args.memory_repeats} {fb + st:.2f} s")
    step_parts = None
    if profile_parts and isinstance(opt, LoGRAOptimizer):
        step_parts = _profiled_step(model, opt, loss_fn, autocast, device)
        log(method, f"profiled step {step_parts['step']:.2f} s")
    report = max((r for regions in steps for r in regions.values()), key=lambda r: r.peak_total)
    at_opt = max((regions["optimizer"] for regions in steps), key=lambda r: r.peak_total)
    cuda = device.type == "cuda"
    cuda_steps = [max(r.cuda_max_allocated for r in regions.values()) for regions in steps] if cuda else None

    result: dict[str, Any] = {
        "method": method,
        "params": n_params,
        "trainable_params": trainable,
        "peak_by_category": dict(report.peak_by_category),
        "tracked_peak": report.peak_total,
        "tracked_step_peaks": [max(r.peak_total for r in regions.values()) for regions in steps],
        "at_optimizer_step": dict(at_opt.peak_by_category),
        "rss_peak": steps[-1]["optimizer"].peak_rss,
        "cuda_max_allocated": max(cuda_steps) if cuda_steps else None,
        "cuda_step_max_allocated": cuda_steps,
        "warmup_step_time": warmup_time,
        "step_times": times,
        "step_time_median": statistics.median(times),
        "forward_backward_median": statistics.median(p[0] for p in phases),
        "optimizer_step_median": statistics.median(p[1] for p in phases),
        "tracked_step_times": tracked_times,
        "losses": losses,
        "step_parts": step_parts,
        "fit": fit,
    }
    if isinstance(opt, LoGRAOptimizer):
        result["sketch_buffer_bytes"] = opt.sketch_buffer.numel() * opt.sketch_buffer.element_size()
        result["sketch_rows"] = opt.sketch_buffer.shape[0]
        stored = {id(a): a for a in (opt.sketch_target(n).stored_projection for n in opt.targets)}  # shared: once
        result["projection_bytes"] = sum(a.numel() * a.element_size() for a in stored.values())
        result["dense_params"] = sum(p.numel() for p in opt.dense_parameters())
        result["logra_state_bytes"] = {
            cat: sum(t.numel() * t.element_size() for t in ts) for cat, ts in opt.memory_tensors().items()
        }
        result["targets"] = len(opt.targets)
        # what the step allocates beyond the persistent state, at the optimizer step's peak
        result["step_transient_bytes"] = max(0, at_opt.peak_by_category["optimizer"]
                                             - result["logra_state_bytes"]["optimizer"])
    return result


def _worker_main(args: argparse.Namespace) -> int:
    result = run_worker(args.worker, args)
    if args.worker_out is None:
        print(json.dumps(result))
    else:
        args.worker_out.write_text(json.dumps(result))
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    """The markdown table of measured results (ratios against the AdamW row, if present)."""
    base = next((r for r in results if r["method"] == _BASELINE), None)
    cuda = any(r.get("cuda_max_allocated") is not None for r in results)
    unit, div = size_unit(results)

    def fmt(nbytes: float) -> str:
        return f"{nbytes / div:.3f}"

    cats = [c for c in CATEGORIES if c not in ("buffers", "other")]
    head = ["method", "params (M)", "trainable (M)"] + [f"{c} ({unit})" for c in cats]
    head += [f"buffers+other ({unit})", f"tracked peak ({unit})", f"RSS peak ({unit})"]
    if cuda:
        head.append(f"CUDA max alloc ({unit})")
    head += ["step time (s, median [min–max])", "fwd+bwd / opt (s)", "peak / AdamW", "time / AdamW"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        pc = r["peak_by_category"]
        row = [r["method"], f"{r['params'] / 1e6:.2f}", f"{r['trainable_params'] / 1e6:.2f}"]
        row += [fmt(pc[c]) for c in cats]
        row += [fmt(pc["buffers"] + pc["other"]), fmt(r["tracked_peak"]), fmt(r["rss_peak"])]
        if cuda:
            row.append(fmt(r["cuda_max_allocated"]) if r.get("cuda_max_allocated") is not None else "-")
        row += timing_cells(r, base)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def timing_cells(r: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """Step time (median [min–max]), its forward+backward / optimizer split, and the ratios
    of tracked peak and step time to ``base`` (the AdamW row) — the tail of a table row."""
    cells = [f"{r['step_time_median']:.2f} [{min(r['step_times']):.2f}–{max(r['step_times']):.2f}]",
             f"{r['forward_backward_median']:.2f} / {r['optimizer_step_median']:.2f}"]
    if base is None:
        return cells + ["-", "-"]
    return cells + [f"{r['tracked_peak'] / base['tracked_peak']:.3f}",
                    f"{r['step_time_median'] / base['step_time_median']:.3f}"]


def fit_table(results: list[dict[str, Any]]) -> str:
    """Markdown: the fit of ``--logra-input-projection`` (before the first step), its time and
    tracked peak beside the step's ("" without it)."""
    rows = [r for r in results if r.get("fit")]
    if not rows:
        return ""
    lines = ["| method | fit (s) | fit's tracked peak (GiB) | step's tracked peak (GiB) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['fit']['seconds']:.1f} | {r['fit']['tracked_peak'] / 2**30:.3f} | "
                     f"{r['tracked_peak'] / 2**30:.3f} |")
    return "\n".join(lines)


def parts_table(results: list[dict[str, Any]]) -> str:
    """Markdown: the share of one profiled LoGRA step spent in each of `STEP_PARTS` (the rest
    is the model's own forward and backward and, with 'sketch', the small AdamW)."""
    rows = [r for r in results if r.get("step_parts")]
    if not rows:
        return ""
    head = ["method", "profiled step (s)", *_PART_HEADS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parts = r["step_parts"]
        lines.append("| " + " | ".join([r["method"], f"{parts['step']:.2f}", *_shares(parts)]) + " |")
    return "\n".join(lines)


def _shares(parts: dict[str, float | None] | None) -> list[str]:
    """Per `STEP_PARTS` entry, its percentage of the profiled step ('-' where not measured)."""
    parts = parts or {}
    return ["-" if parts.get(p) is None else f"{100 * parts[p] / parts['step']:.1f}" for p in STEP_PARTS]


def target_lines(results: list[dict[str, Any]], checkpointing: bool, tokens: int) -> list[str]:
    """PASS/FAIL lines of the targets for every LoGRA row: peak vs AdamW (needs the AdamW
    row), LoGRA's own tensors vs the weights, and step time at ``tokens`` per step."""
    base = next((r for r in results if r["method"] == _BASELINE), None)
    peak = PEAK_TARGET[checkpointing]
    ckpt = "with" if checkpointing else "without"
    lines = []
    for r in results:
        if r["method"] == _BASELINE:
            continue
        checks = []
        if base is not None:
            checks.append((f"LoGRA peak memory ≤ {peak:.2f} × AdamW's {ckpt} checkpointing (tracked peak)",
                           r["tracked_peak"] / base["tracked_peak"], peak))
            if r.get("cuda_max_allocated") is not None and base.get("cuda_max_allocated"):
                checks.append((f"LoGRA peak memory ≤ {peak:.2f} × AdamW's {ckpt} checkpointing (CUDA max allocated)",
                               r["cuda_max_allocated"] / base["cuda_max_allocated"], peak))
        own = r["sketch_buffer_bytes"] + r["projection_bytes"] + r["step_transient_bytes"]
        checks.append((f"LoGRA's own tensors (sketch buffer + projections + step transients) ≤ {OWN_TARGET:.2f} × "
                       "the fp32 weights", own / r["peak_by_category"]["parameters"], OWN_TARGET))
        for text, ratio, limit in checks:
            lines.append(f"{'PASS' if ratio <= limit else 'FAIL'} [{r['method']}] {text}: measured {ratio:.3f}×")
        text = f"LoGRA step time ≤ {TIME_TARGET:.2f} × AdamW's at ≥ {TIME_TARGET_TOKENS} tokens per step"
        if base is None:
            lines.append(f"n/a  [{r['method']}] {text}: no adamw row")
            continue
        ratio = r["step_time_median"] / base["step_time_median"]
        if tokens < TIME_TARGET_TOKENS:
            lines.append(f"n/a  [{r['method']}] {text}: this run has {tokens} tokens per step ({ratio:.3f}×)")
        else:
            lines.append(f"{'PASS' if ratio <= TIME_TARGET else 'FAIL'} [{r['method']}] {text}: measured {ratio:.3f}×")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``logra bench memory``: spawn one worker per method, print the table and targets
    (per point of ``--tokens``, then the sweep's summary)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = _resolve(parser.parse_args(argv))
    methods = _validate(parser, args)
    if args.worker is not None:
        return _worker_main(args)
    points = _token_points(parser, args)
    sweep = []
    for seq in points:
        args.seq = seq
        if len(points) > 1:
            print(f"# {args.batch * seq} tokens per step\n")
        results = _run_point(args, methods)
        sweep.append({"tokens": args.batch * seq, "seq": seq, "results": results})
    if len(points) > 1:
        print("## Token sweep\n")
        print(sweep_table(sweep))
    if args.out is not None:
        setup = {k: v for k, v in vars(args).items() if k not in ("out", "worker", "worker_out")}
        payload = {"setup": setup, "results": sweep[0]["results"]} if len(points) == 1 else {
            "setup": setup, "sweep": sweep}
        args.out.write_text(json.dumps(payload, indent=2, default=str))
    return 0


def _token_points(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """Sequence lengths of the run: ``--tokens`` split over ``--batch`` sequences, else ``--seq``."""
    if not args.tokens:
        return [args.seq]
    points = []
    for item in args.tokens.split(","):
        try:
            tokens = int(item)
        except ValueError:
            parser.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
        if tokens < args.batch or tokens % args.batch:
            parser.error(f"--tokens {tokens} is not a positive multiple of --batch {args.batch}")
        points.append(tokens // args.batch)
    return points


def _run_point(args: argparse.Namespace, methods: list[str]) -> list[dict[str, Any]]:
    """One table: every method at ``args.seq`` tokens per sequence; prints it and the targets."""
    # Workers get the fully resolved options, so they cannot disagree with this table.
    worker_argv = [
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab),
        "--attn-implementation", args.attn_implementation, "--batch", str(args.batch), "--seq", str(args.seq),
        "--rank", str(args.rank), "--repeats", str(args.repeats), "--memory-repeats", str(args.memory_repeats),
        "--device", args.device,
        "--autocast", args.autocast, "--adamw-impl", args.adamw_impl, "--threads", str(args.threads),
        "--seed", str(args.seed), "--logra-beta1", str(args.logra_beta1), "--logra-optimizer", args.logra_optimizer,
        "--logra-moment-dtype", args.logra_moment_dtype, "--logits-chunk", str(args.logits_chunk),
    ]
    for flag in ("share_projections", "logra_fixed_projection", "logra_input_projection", "tie", "checkpointing"):
        if getattr(args, flag):
            worker_argv.append("--" + flag.replace("_", "-"))
    results = []
    for method in methods:
        _log(method, f"starting worker process ({args.batch} × {args.seq} tokens)")
        results.append(spawn_worker(method, worker_argv, "logra.bench.memory"))

    setup = (f"Qwen2 random init, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
             f"intermediate {args.intermediate}, vocab {args.vocab}{' (tied)' if args.tie else ''}, fp32 weights; "
             f"batch {args.batch} × {args.seq} tokens; rank {args.rank}"
             f"{f', LoGRA beta1 {args.logra_beta1:g}' if args.logra_beta1 else ''}"
             f"{', shared q/k/v and gate/up projections' if args.share_projections else ''}"
             f"{', one fixed projection per layer' if args.logra_fixed_projection else ''}"
             f"{', projections fitted to the inputs' if args.logra_input_projection else ''}"
             f"{f', LoGRA optimizer {args.logra_optimizer}' if args.logra_optimizer != 'row_adam' else ''}"
             f"{f', LoGRA moments {args.logra_moment_dtype}' if args.logra_moment_dtype != 'float32' else ''}; "
             f"compute {args.autocast}; "
             f"{f'logits {args.logits_chunk} positions at a time; ' if args.logits_chunk else ''}"
             f"activation checkpointing {'on' if args.checkpointing else 'off'}; "
             f"device {args.device}; {args.threads} thread(s); 1 warm-up + {args.repeats} timed + "
             f"{args.memory_repeats} memory-tracked step(s) per method (+ 1 profiled step for LoGRA), one process "
             "per method. Step time: "
             "median of the untracked steps; 'fwd+bwd / opt' splits it into forward+backward and "
             "optimizer step+zero_grad (medians).")
    print(f"## LoGRA vs AdamW: peak memory by category and step time\n\n{setup}\n")
    print(format_table(results))
    fits = fit_table(results)
    if fits:
        print("\n### Fitting the projections to the inputs (once, before the first step)\n")
        print(fits)
    parts = parts_table(results)
    if parts:
        print("\n### LoGRA's step by part (one profiled step; % of its wall time)\n")
        print(parts)
    print()
    print("\n".join(target_lines(results, args.checkpointing, args.batch * args.seq)))
    print(flush=True)
    return results


def sweep_table(sweep: list[dict[str, Any]]) -> str:
    """Markdown: per token count and LoGRA method, peak and step time against AdamW's and
    the shares of LoGRA's step (from each point's profiled step)."""
    head = ["tokens per step", "method", "tracked peak / AdamW", "step time / AdamW", *_PART_HEADS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in sweep:
        base = next((r for r in point["results"] if r["method"] == _BASELINE), None)
        for r in point["results"]:
            if r["method"] == _BASELINE:
                continue
            ratios = timing_cells(r, base)[2:]  # peak / AdamW, time / AdamW
            lines.append("| " + " | ".join([str(point["tokens"]), r["method"], *ratios, *_shares(r.get("step_parts"))])
                         + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
