"""``logra estimate``: the command line of the memory planner (`main`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from .activations import METHODS
from .model import CATEGORIES, GIB, METHOD_LABELS, PHASES, Estimate, estimate
from .paper import PAPER_ASSUMPTIONS, PAPER_SETTING, paper_comparison, paper_markdown
from .shapes import ALIASES, BUILTIN_SHAPES, resolve_shape


def _fmt(x: float) -> str:
    return f"{x / GIB:.2f}"


def _method_table(est: Estimate) -> str:
    lines = [f"### {METHOD_LABELS[est.method]} — {est.model}", "",
             "| phase | " + " | ".join(CATEGORIES) + " | total GiB |", "|---|" + "---:|" * (len(CATEGORIES) + 1)]
    for phase in PHASES:
        cats = est.phases[phase]
        mark = " **(peak)**" if phase == est.peak_phase else ""
        lines.append(f"| {phase}{mark} | " + " | ".join(_fmt(cats[c]) for c in CATEGORIES)
                     + f" | {_fmt(sum(cats.values()))} |")
    verdict = "fits" if est.fits else "does NOT fit"
    lines += ["", f"Peak {est.total / GIB:.2f} GiB per GPU ({est.peak_phase}); {verdict} in "
              f"{est.gpu_bytes / GIB:.0f} GiB with {est.reserve_bytes / GIB:.1f} GiB reserve."]
    return "\n".join(lines)


def _summary_table(ests: Sequence[Estimate]) -> str:
    lines = ["| method | " + " | ".join(CATEGORIES) + " | peak GiB | peak phase | fits |",
             "|---|" + "---:|" * (len(CATEGORIES) + 1) + "---|---|"]
    for e in ests:
        cats = e.categories
        lines.append(f"| {METHOD_LABELS[e.method]} | " + " | ".join(_fmt(cats[c]) for c in CATEGORIES)
                     + f" | {_fmt(e.total)} | {e.peak_phase} | {'yes' if e.fits else 'NO'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logra estimate",
        description="Per-GPU memory of one training step for dense AdamW, LoRA and LoGRA (freeze and sketch "
                    "modes), by category, and whether it fits. The peak is the largest of four instants of a "
                    "step (forward at the loss, loss backward, last layer backward, optimizer step), as MemTracker "
                    "measures a single instant.",
    )
    p.add_argument("--model",
                   help="built-in shape name (see --list-models) or path to a HF config.json / its directory")
    p.add_argument("--list-models", action="store_true", help="print the built-in shapes and exit")
    p.add_argument("--paper", action="store_true",
                   help="compare with the paper's Table 1/2 in its setting (assumptions printed)")
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"methods to estimate (default: all of {' '.join(METHODS)})")
    p.add_argument("--gpus", type=int, default=1,
                   help="training GPUs (divides sharded state with --shard fsdp; default 1)")
    p.add_argument("--gpu-mem", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    p.add_argument("--reserve", type=float, default=1.0,
                   help="GiB kept free for CUDA context, NCCL and fragmentation (default 1)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch per GPU (default 1)")
    p.add_argument("--rank", type=int, default=256, help="LoGRA rank, also LoRA's unless --lora-rank (default 256)")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: --rank)")
    p.add_argument("--shard", choices=["none", "fsdp"], default="none",
                   help="none: every GPU holds everything; fsdp: full shard of params, grads and optimizer state")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per decoder layer")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weight dtype (default float32 master weights)")
    p.add_argument("--no-autocast", action="store_true", help="compute in the weight dtype instead of bf16 autocast")
    p.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa",
                   help="attention implementation (default sdpa)")
    p.add_argument("--padded", action="store_true", help="batches carry padding (explicit SDPA mask per layer)")
    p.add_argument("--adam-impl", choices=["foreach", "fused", "for-loop"], default="foreach",
                   help="AdamW implementation (scratch memory during the step; default foreach, the CUDA default)")
    p.add_argument("--logits-chunk", type=int, default=None,
                   help="model a chunked/fused lm_head+loss with this many tokens per chunk (default: full HF logits)")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``logra estimate``; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.list_models:
        rows = [dataclasses.asdict(s) | {"parameters": s.num_parameters} for s in BUILTIN_SHAPES.values()]
        if args.json:
            print(json.dumps({"models": rows, "aliases": ALIASES}, indent=2))
        else:
            print("| name | params (B) | vocab | hidden | layers | heads | kv heads | head dim | intermediate | tied |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
            for s in BUILTIN_SHAPES.values():
                print(f"| {s.name} | {s.num_parameters / 1e9:.2f} | {s.vocab_size} | {s.hidden_size} | "
                      f"{s.num_layers} | "
                      f"{s.num_heads} | {s.num_kv_heads} | {s.head_dim} | {s.intermediate_size} | {s.tie_embeddings} |")
            print("\naliases: " + ", ".join(f"{k} → {v}" for k, v in ALIASES.items()))
        return 0
    if args.paper:
        rows = paper_comparison()
        if args.json:
            print(json.dumps({"setting": PAPER_SETTING, "assumptions": PAPER_ASSUMPTIONS, "rows": rows}, indent=2))
        else:
            print(paper_markdown(rows))
        return 0
    if not args.model:
        print("logra estimate: give --model NAME|config.json, --paper or --list-models", file=sys.stderr)
        return 2
    try:
        shape = resolve_shape(args.model)
        ests = [
            estimate(shape, method, seq=args.seq, batch=args.batch, rank=args.rank, gpus=args.gpus,
                     gpu_memory_gib=args.gpu_mem, reserve_gib=args.reserve, shard=args.shard,
                     checkpointing=args.checkpointing, dtype=args.dtype, autocast=not args.no_autocast,
                     attention=args.attention, padded=args.padded, adam_impl=args.adam_impl,
                     lora_rank=args.lora_rank, logits_chunk=args.logits_chunk)
            for method in args.methods
        ]
    except (ValueError, FileNotFoundError) as e:
        print(f"logra estimate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(shape), "estimates": [e.to_dict() for e in ests]}, indent=2))
        return 0
    s = ests[0].settings
    print(f"## {shape.name}: {shape.num_parameters / 1e9:.2f}B parameters — {s['gpus']} GPU(s) × {args.gpu_mem:g} GiB, "
          f"shard={s['shard']}, seq={s['seq']}, batch={s['batch']}, rank={s['rank']}, weights {s['dtype']}, "
          f"activations {s['precision']}, checkpointing={'on' if s['checkpointing'] else 'off'}\n")
    print("GiB per GPU at each method's peak:\n")
    print(_summary_table(ests))
    for e in ests:
        print()
        print(_method_table(e))
    return 0
