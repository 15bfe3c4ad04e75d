"""``logra bench sync``: bytes and time per update of three ways to sync a policy.

Two processes on this machine (rank 0 = trainer, rank 1 = rollout receiver) joined by a
gloo process group over loopback. Both build the same randomly initialised stack of
Qwen2 decoder layers (transformers' ``Qwen2DecoderLayer``) at Qwen2.5-0.5B or -7B shapes.
The trainer keeps fp32 master weights and the bf16 copy it last served; the receiver
holds bf16 weights, as a rollout engine does.

Each measured update is a real LoGRA step: the sketch buffer is filled with Gaussian
noise (a sync benchmark needs no forward pass), then RowAdam proposes and ``apply``
merges it at the paper's update ratio 6e-5. The SAME update is then sent three ways:

1. **full**: the trainer casts its fp32 weights to bf16 and sends every parameter of the
   layers as safetensors bytes; the receiver decodes and copies them into its weights.
2. **sparse bf16**: indices (int32) and bf16 values of the elements whose bf16 value
   changed in this update (what some RL frameworks send); the receiver scatters them.
   The receiver's result is checked to equal the full sync bit for bit.
3. **LoGRA rank r**: ``PolicyDelta.to_bytes()`` (bf16 factors ``U`` plus seeds); the
   receiver rebuilds every projection from the seeds and merges with `apply_delta`.

Times: *encode* = trainer-side work after the optimizer step (cast, diff, serialise);
*transfer* = from the trainer's first send to the receiver holding the bytes (one
monotonic clock: both processes are on this machine); *apply* = receiver-side decode
plus merge/copy/scatter. The decoder layers of the shape are measured on a subset
(``--layers-*``) and per-update figures are scaled linearly to the model's layer count
(every layer has the same shapes); embeddings and ``lm_head`` are frozen under the
paper's default (``non_target='freeze'``) and left out of every row: a full sync of the
whole model would move them too.

A second table gives, for data-parallel training, the payload all-reduced per update:
LoGRA's fp32 sketch buffer vs the dense gradients DDP would all-reduce
(`logra.parallel.allreduce_bytes`). The informative end-to-end lines compare the
sum of encode, transfer and apply per update.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from logra import LoGRAConfig, LoGRAOptimizer, PolicyDelta, apply_delta, set_policy_step, weights_checksum
from logra.parallel import allreduce_bytes, decode_full_weights, init_local, load_full_weights, spawn_local
from logra.projection import stable_name

#: Qwen2.5 shapes: hidden, intermediate, attention heads, KV heads, decoder layers.
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "layers": 24},
    "7b": {"hidden": 3584, "intermediate": 18944, "heads": 28, "kv_heads": 4, "layers": 28},
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logra bench sync",
        description="Bytes and wall time per update of full-weight, sparse-bf16 and LoGRA low-rank policy sync "
                    "between two processes (gloo over loopback). Prints a markdown table and PASS/FAIL targets.",
    )
    p.add_argument("--shapes", default="0.5b,7b", help="comma-separated model shapes to run (0.5b, 7b)")
    p.add_argument("--layers-0.5b", dest="layers_05b", type=int, default=24,
                   help="decoder layers of the 0.5B shape actually built and measured (of 24; scaled to 24)")
    p.add_argument("--layers-7b", dest="layers_7b", type=int, default=1,
                   help="decoder layers of the 7B shape actually built and measured (of 28; scaled to 28)")
    p.add_argument("--ranks", default="64,256", help="comma-separated LoGRA ranks")
    p.add_argument("--repeats", type=int, default=2, help="updates measured per shape and rank (median reported)")
    p.add_argument("--update-ratio", type=float, default=6e-5, help="LoGRA update ratio ‖ΔW‖/‖W‖ of each update")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (2 processes run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and sketches")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the two processes are killed")
    p.add_argument("--json", type=Path, default=None, help="also write the raw measurements to this JSON file")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="receiver: 'hf' (a second process holding HF weights, gloo; the tables above) or 'vllm' "
                        "(a running vLLM engine in this process: full reload vs LoGRA delta, fp32 and bf16; "
                        "see logra.bench.sync_vllm)")
    from .sync_vllm import add_arguments

    add_arguments(p)
    return p


class _Stack(nn.Module):
    """``model.layers.{i}`` Qwen2 decoder layers, named as in a Qwen2 checkpoint."""

    def __init__(self, shape: dict[str, int], layers: int) -> None:
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        super().__init__()
        cfg = Qwen2Config(
            hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
            num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], num_hidden_layers=layers,
            vocab_size=128,
        )
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i) for i in range(layers))


def _payload(data: bytes) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: sending only reads it
        return torch.frombuffer(data, dtype=torch.uint8)


def _send(data: bytes) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), 1)
    dist.send(_payload(data), 1)


def _recv() -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, 0)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(buf, 0)
    return buf.numpy().tobytes()


def _sparse_encode(new16: dict[str, torch.Tensor], old16: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    tensors, changed = {}, 0
    for name, new in new16.items():
        flat_new, flat_old = new.view(-1), old16[name].view(-1)
        idx = (flat_new != flat_old).nonzero().view(-1)
        changed += idx.numel()
        tensors[f"{name}:idx"] = idx.to(torch.int32)
        tensors[f"{name}:val"] = flat_new[idx]
    return st_save(tensors), changed


def _sparse_apply(weights: dict[str, torch.Tensor], data: bytes) -> None:
    tensors = st_load(data)
    for name, w in weights.items():
        w.view(-1)[tensors[f"{name}:idx"].long()] = tensors[f"{name}:val"]


def _rank_main(rank: int, world: int, store: str, args: dict[str, Any], out: str) -> None:
    torch.set_num_threads(args["threads"])
    init_local(rank, world, store, backend="gloo", timeout=datetime.timedelta(seconds=args["timeout"]))
    try:
        results = []
        for shape_name in args["shapes"]:
            results.append(_run_shape(rank, shape_name, args))
        peaks: list[Any] = [None, None]
        dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        for rec in results:
            rec["peak_rss"] = peaks
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _run_shape(rank: int, shape_name: str, args: dict[str, Any]) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    layers = args["layers"][shape_name]
    torch.manual_seed(args["seed"])
    model = _Stack(shape, layers)  # fp32; the same bits in both processes
    rec: dict[str, Any] = {"shape": shape_name, "layers": layers, "total_layers": shape["layers"],
                           "hidden": shape["hidden"], "rows": []}
    if rank == 1:
        model.to(torch.bfloat16)
        targets = {stable_name(n): p for n, p in model.named_parameters() if n.endswith("proj.weight")}
        sparse_copy = {n: p.detach().clone() for n, p in targets.items()}
    else:
        served = {stable_name(n): p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    for r in args["ranks"]:
        config = LoGRAConfig(rank=r, update_ratio=args["update_ratio"], seed=args["seed"])
        opt = LoGRAOptimizer(model, config) if rank == 0 else None
        gen = torch.Generator().manual_seed(args["seed"] + r)
        for rep in range(args["repeats"]):
            row: dict[str, Any] = {"rank": r, "repeat": rep}
            if rank == 0:
                opt.sketch_buffer.copy_(torch.randn(opt.sketch_buffer.shape, generator=gen))
                t = time.perf_counter()
                delta = opt.apply(opt.propose())
                row["optimizer_step_s"] = time.perf_counter() - t
            for method in ("lowrank", "full", "sparse"):
                dist.barrier()
                if rank == 0:
                    t0 = time.perf_counter()
                    if method == "lowrank":
                        data = delta.to_bytes()
                    else:
                        new16 = {stable_name(n): p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
                        if method == "full":
                            data = st_save(new16)
                        else:
                            data, changed = _sparse_encode({n: new16[n] for n in delta.factors}, served)
                            row["sparse_changed"] = changed
                            row["target_numel"] = sum(new16[n].numel() for n in delta.factors)
                            served = new16
                    t1 = time.perf_counter()
                    _send(data)
                    row[method] = {"bytes": len(data), "encode_s": t1 - t0, "send_start": t1}
                else:
                    data = _recv()
                    t1 = time.perf_counter()
                    if method == "lowrank":
                        d = PolicyDelta.from_bytes(data)
                        set_policy_step(model, d.step)
                        apply_delta(model, d, LoGRAConfig(rank=r, update_ratio=args["update_ratio"],
                                                          seed=args["seed"]))
                    elif method == "full":
                        load_full_weights(model, decode_full_weights(data))
                    else:
                        _sparse_apply(sparse_copy, data)
                    row[method] = {"recv_done": t1, "apply_s": time.perf_counter() - t1}
                    if method == "sparse":
                        row["sparse_exact"] = all(torch.equal(sparse_copy[n], p) for n, p in targets.items())
            rec["rows"].append(row)
        if rank == 0:
            rec.setdefault("allreduce", {})[r] = allreduce_bytes(opt)
            t = time.perf_counter()
            weights_checksum(model, opt.targets)
            rec.setdefault("checksum_s", {})[r] = time.perf_counter() - t
            opt.remove()
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, rec)
    return _merge(*gathered)


def _merge(sender: dict[str, Any], receiver: dict[str, Any]) -> dict[str, Any]:
    for s_row, r_row in zip(sender["rows"], receiver["rows"], strict=True):
        for method in ("lowrank", "full", "sparse"):
            s, r = s_row[method], r_row[method]
            s["transfer_s"] = r["recv_done"] - s["send_start"]
            s["apply_s"] = r["apply_s"]
        s_row["sparse_exact"] = r_row["sparse_exact"]
    return sender


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _table(results: list[dict[str, Any]]) -> tuple[list[str], list[tuple[str, bool]]]:
    lines = [
        "| shape | method | bytes / update | vs full | encode s | transfer s | apply s | total s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks: list[tuple[str, bool]] = []
    for rec in results:
        scale = rec["total_layers"] / rec["layers"]
        rows = rec["rows"]

        def med(method: str, key: str, rank: int | None = None, rows: list[Any] = rows, scale: float = scale) -> float:
            vals = [row[method][key] for row in rows if rank is None or row["rank"] == rank]
            return statistics.median(vals) * scale

        full_bytes = med("full", "bytes")

        def line(label: str, method: str, rank: int | None = None, note: str = "", shape: str = rec["shape"],
                 full_bytes: float = full_bytes) -> None:
            b = med(method, "bytes", rank)
            enc, tr, ap = med(method, "encode_s", rank), med(method, "transfer_s", rank), med(method, "apply_s", rank)
            lines.append(f"| {shape} | {label}{note} | {_fmt_bytes(b)} | {b / full_bytes:.2%} | {enc:.3f} | "
                         f"{tr:.3f} | {ap:.3f} | {enc + tr + ap:.3f} |")

        line("full bf16", "full")
        ranks = sorted({row["rank"] for row in rows})
        for r in ranks:
            frac = statistics.median(row["sparse_changed"] / row["target_numel"] for row in rows if row["rank"] == r)
            line(f"sparse bf16 (rank-{r} update, {frac:.1%} changed)", "sparse", r)
        for r in ranks:
            line(f"LoGRA rank {r}", "lowrank", r)
        full_load = med("full", "apply_s")
        for r in ranks:
            ratio = med("lowrank", "bytes", r) / full_bytes
            bound = r / rec["hidden"]
            checks.append((f"{rec['shape']} rank {r}: low-rank bytes {ratio:.2%} of full <= r/in = {r}/{rec['hidden']} "
                           f"= {bound:.2%}", ratio <= bound))
            apply = med("lowrank", "apply_s", r)
            checks.append((f"{rec['shape']} rank {r}: receiver apply {apply:.3f} s <= full-weight load "
                           f"{full_load:.3f} s", apply <= full_load))
        exact = all(row["sparse_exact"] for row in rows)
        checks.append((f"{rec['shape']}: sparse bf16 sync reproduces the full sync bit for bit", exact))
    return lines, checks


def _end_to_end(results: list[dict[str, Any]]) -> list[str]:
    """Informative (not a target): encode + transfer + apply of LoGRA vs full sync."""
    out = []
    for rec in results:
        scale = rec["total_layers"] / rec["layers"]

        def total(method: str, rank: int | None = None, rec: dict[str, Any] = rec, scale: float = scale) -> float:
            rows = [row[method] for row in rec["rows"] if rank is None or row["rank"] == rank]
            # Sum of the per-phase medians, as in the table's "total s" column.
            return sum(statistics.median(r[k] for r in rows) for k in ("encode_s", "transfer_s", "apply_s")) * scale

        full = total("full")
        for r in sorted({row["rank"] for row in rec["rows"]}):
            out.append(f"- info: {rec['shape']} rank {r}: end-to-end LoGRA {total('lowrank', r):.3f} s vs full "
                       f"{full:.3f} s per update ({full / total('lowrank', r):.1f}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns 0 when every target passes, 1 otherwise."""
    args = _parser().parse_args(argv)
    if args.engine == "vllm":
        from .sync_vllm import main as vllm_main

        return vllm_main(args)
    shapes = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}", file=sys.stderr)
        return 2
    layers = {"0.5b": args.layers_05b, "7b": args.layers_7b}
    for s in shapes:
        if not 1 <= layers[s] <= SHAPES[s]["layers"]:
            print(f"--layers-{s} must be in [1, {SHAPES[s]['layers']}]", file=sys.stderr)
            return 2
    config = {
        "shapes": shapes, "layers": layers, "ranks": [int(r) for r in args.ranks.split(",")],
        "repeats": args.repeats, "update_ratio": args.update_ratio, "threads": args.threads, "seed": args.seed,
        "timeout": args.timeout,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="logra-bench-sync-") as tmp:
        out = os.path.join(tmp, "results.json")
        codes = spawn_local(_rank_main, 2, (config, out), timeout=args.timeout)
        if codes != [0, 0]:
            print(f"benchmark processes failed with exit codes {codes}", file=sys.stderr)
            return 1
        results = json.loads(Path(out).read_text())
    if args.json is not None:
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=1))
    lines, checks = _table(results)
    print(f"## logra bench sync ({args.repeats} updates per shape and rank, median; "
          f"{args.threads} thread(s) per process, gloo over loopback, CPU)\n")
    for rec in results:
        print(f"- {rec['shape']}: measured {rec['layers']} of {rec['total_layers']} decoder layers, per-update figures "
              f"scaled x{rec['total_layers'] / rec['layers']:.2f}; embeddings and lm_head excluded (frozen). "
              f"Checksum of the fp32 target weights (BLAKE2, per update, both sides): "
              + ", ".join(f"{v * rec['total_layers'] / rec['layers']:.2f} s at rank {k}"
                          for k, v in rec["checksum_s"].items()))
    if results:
        sender, receiver = results[0]["peak_rss"]
        print(f"- peak RSS over the whole run: trainer process {sender / 2**30:.2f} GiB, "
              f"receiver process {receiver / 2**30:.2f} GiB")
    print()
    print("\n".join(lines))
    print()
    print("Data-parallel training, payload all-reduced per update (`logra.parallel.allreduce_bytes`, fp32):\n")
    print("| shape | rank | LoGRA sketch | DDP dense gradients | ratio |")
    print("|---|---|---|---|---|")
    for rec in results:
        scale = rec["total_layers"] / rec["layers"]
        for r, (sketch, dense) in rec["allreduce"].items():
            print(f"| {rec['shape']} | {r} | {_fmt_bytes(sketch * scale)} | {_fmt_bytes(dense * scale)} | "
                  f"{sketch / dense:.2%} |")
    print()
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    print()
    for line in _end_to_end(results):
        print(line)
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
