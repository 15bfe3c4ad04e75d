"""``logra bench sync --engine vllm``: per update into a RUNNING vLLM engine, full reload vs LoGRA delta.

For each shape (the embedded tiny policy; a Qwen2.5-0.5B-shaped model with random weights,
494M parameters with its 151,936-token vocabulary) and each engine dtype (fp32, bf16):

1. a random ``Qwen2ForCausalLM`` of that shape is saved to a temporary folder and a vLLM
   engine is started on it in this process (`logra.parallel.vllm.make_engine`);
2. a LoGRA optimizer on the HF model (fp32, the trainer) makes real updates: the sketch
   buffer is filled with Gaussian noise (a sync benchmark needs no forward pass), RowAdam
   proposes and ``apply`` merges at the paper's update ratio 6e-5;
3. every update reaches the engine twice, timed separately:
   - **delta**: `VLLMPolicy.publish` (serialise the `PolicyDelta`, the engine verifies it,
     rebuilds the projections from seeds, merges, and, where vLLM prepacks its weights,
     pushes the touched modules through ``reload_weights``);
   - **full**: the trainer's whole state dict as safetensors bytes in memory (cast to the
     engine's dtype), loaded by the engine through ``reload_weights`` (`VLLMPolicy.resync`);
     no disk, the cheapest full reload there is.
   With an fp32 engine every other delta carries the trainer's checksum (computed on the
   trainer, then checked in the engine against a dry-run merge before anything changes:
   the "checksum-verified" column), and after both paths the engine's checksum is compared
   with the trainer's. The full reload is never verified (its column has no such cost).

Seconds are wall time in the driver, per update (median over ``--repeats``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import save as st_save

from logra import LoGRAConfig, LoGRAOptimizer
from logra.projection import stable_name

#: name → Qwen2 shape (hidden, intermediate, heads, kv heads, layers, vocab, tied embeddings)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 128, "intermediate": 384, "heads": 4, "kv_heads": 2, "layers": 4, "vocab": 258, "tie": True},
    "0.5b": {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "layers": 24, "vocab": 151936,
             "tie": True},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--engine vllm`` (added to ``logra bench sync``'s parser)."""
    p.add_argument("--vllm-shapes", default="tiny,0.5b", help="--engine vllm: shapes to run (tiny, 0.5b)")
    p.add_argument("--vllm-dtypes", default="float32,bfloat16", help="--engine vllm: engine dtypes")
    p.add_argument("--rank", type=int, default=64, help="--engine vllm: LoGRA rank")


def _model(shape: dict[str, Any], seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=512,
                      tie_word_embeddings=shape["tie"])
    return Qwen2ForCausalLM(cfg).float().eval()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_one(shape_name: str, dtype: str, rank: int, repeats: int, update_ratio: float, seed: int) -> dict[str, Any]:
    """One engine, ``repeats`` updates each sent as a delta and as a full reload; the measurements."""
    from logra.parallel.vllm import VLLMPolicy, make_engine

    shape = SHAPES[shape_name]
    model = _model(shape, seed)
    n_params = sum(p.numel() for p in model.parameters())
    config = LoGRAConfig(rank=rank, update_ratio=update_ratio)
    with tempfile.TemporaryDirectory(prefix="logra-bench-vllm-") as folder:
        model.save_pretrained(folder)
        t0 = time.perf_counter()
        llm = make_engine(folder, dtype=dtype, seed=seed)
        start_s = time.perf_counter() - t0
        opt = LoGRAOptimizer(model, config)
        engine = VLLMPolicy(llm, config, model=model, optimizer=opt)
        if engine.comparable:
            engine.verify()
        gen = torch.Generator().manual_seed(seed)
        rec: dict[str, Any] = {"shape": shape_name, "dtype": dtype, "params": n_params, "rank": rank,
                               "mode": engine.info["mode"], "shadow_bytes": engine.info["shadow_bytes"],
                               "engine_start_s": start_s, "delta_s": [], "verified_s": [], "delta_bytes": [],
                               "full_s": [], "full_bytes": [], "equal": []}
        engine_dtype = engine.dtype
        for i in range(2 * repeats if engine.comparable else repeats):
            opt.sketch_buffer.copy_(torch.randn(opt.sketch_buffer.shape, generator=gen))
            delta = opt.apply(opt.propose())
            # fp32 engine, every other update: the trainer's checksum travels with the delta and the
            # engine checks its merge against it before committing (a dry run)
            verified = engine.comparable and i % 2 == 1
            engine.verify_every = 1 if verified else 0
            t = time.perf_counter()
            engine.publish(delta)
            rec["verified_s" if verified else "delta_s"].append(time.perf_counter() - t)
            rec["delta_bytes"].append(len(delta.to_bytes()))
            after_delta = engine.checksum()
            t = time.perf_counter()
            state = {stable_name(n): p.detach().to(engine_dtype) for n, p in model.named_parameters()}
            data = st_save(state)
            del state
            engine.resync(data, opt.num_updates)
            rec["full_s"].append(time.perf_counter() - t)
            rec["full_bytes"].append(len(data))
            del data
            if engine.comparable:
                rec["equal"].append(after_delta == engine.checksum() == engine.trainer_checksum())
        engine.close()
        del llm, engine, opt, model
        gc.collect()
    return rec


def main(args: argparse.Namespace) -> int:
    """Run every (shape, dtype), print the table; 0 when every target holds, 1 otherwise."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    shapes = [s.strip() for s in args.vllm_shapes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    bad = [s for s in shapes if s not in SHAPES] + [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        print(f"unknown shape or dtype {bad}; shapes {sorted(SHAPES)}, dtypes float32, bfloat16", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = [run_one(s, d, args.rank, args.repeats, args.update_ratio, args.seed) for s in shapes for d in dtypes]
    print(f"## logra bench sync --engine vllm (in-process vLLM engine, {args.repeats} updates, median; "
          f"rank {args.rank}, update ratio {args.update_ratio})\n")
    print("| shape | params | engine dtype | engine mode | shadow | full reload: bytes | s | LoGRA delta: bytes | s "
          "| s, checksum-verified | bytes ratio | r/in (min) | time ratio | checksums equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    checks = []
    for r in results:
        full_b, delta_b = _median(r["full_bytes"]), _median(r["delta_bytes"])
        full_s, delta_s = _median(r["full_s"]), _median(r["delta_s"])
        r_over_in = args.rank / SHAPES[r["shape"]]["hidden"]  # the smallest input size is the hidden size
        equal = "n/a (bf16 engine)" if not r["equal"] else f"{sum(r['equal'])}/{len(r['equal'])}"
        verified = f"{_median(r['verified_s']):.3f}" if r["verified_s"] else "n/a"
        print(f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['mode']} | "
              f"{r['shadow_bytes'] / 2**20:.1f} MiB | {full_b / 2**20:.1f} MiB | {full_s:.3f} | "
              f"{delta_b / 2**20:.2f} MiB | {delta_s:.3f} | {verified} | "
              f"{delta_b / full_b:.2%} | {r_over_in:.2%} | "
              f"{delta_s / full_s:.2f} | {equal} |")
        checks.append((f"{r['shape']} {r['dtype']}: delta bytes ≤ r/in of a full reload",
                       delta_b <= r_over_in * full_b))
        checks.append((f"{r['shape']} {r['dtype']}: delta time ≤ full reload time", delta_s <= full_s))
        if r["equal"]:
            checks.append((f"{r['shape']} {r['dtype']}: engine checksum equals the trainer's after every update",
                           all(r["equal"])))
    print()
    for r in results:
        print(f"- {r['shape']} {r['dtype']}: engine start {r['engine_start_s']:.1f} s")
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")
    return 0 if all(ok for _, ok in checks) else 1
