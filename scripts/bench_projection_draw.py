"""Time putting new projections in force, as the paper's refresh after every update does.

For the 330M-parameter Qwen2 shape of ``logra bench memory`` (rank 256: 168 targets), the
table gives, per host thread count (``torch.set_num_threads``), the seconds the optimizer's
projector takes (a) to install the next update's projections drawn in place, (b) to draw
them ahead on host threads (the wall time from the previous install until the draw is done:
what must fit under the next rollout, or a GPU's forward and backward, to be hidden), and
(c) to install them once drawn ahead. (c) is what stays on the update's critical path.

    python scripts/bench_projection_draw.py --threads 1 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra import LoGRAConfig, LoGRAOptimizer
from logra.bench.common import FULL_SHAPE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()],
                   help="host thread counts (torch.set_num_threads) to time")
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="installs timed per row (the median is printed)")
    args = p.parse_args()

    s = FULL_SHAPE
    with torch.device("meta"):  # only the shapes matter: no initialisation
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"]))
    model.to_empty(device="cpu")
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=args.rank))
    projector, beta2 = opt.projector, opt.param_groups[0]["beta2"]
    print(f"{len(opt.targets)} targets, rank {args.rank}, hidden {s['hidden']}, intermediate {s['intermediate']}")
    print("| host threads | (a) drawn in place, installed (s) | (b) drawn ahead: the draw's wall time (s) "
          "| (c) drawn ahead, installed (s) |")
    print("|---|---|---|---|")
    updates = 1
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows: list[list[float]] = [[], [], []]
        for _ in range(args.repeats):
            for job in getattr(projector._ahead, "jobs", []):  # none may run beside the in-place draw
                job.result()
            projector._ahead = None
            t0 = time.perf_counter()
            projector.install(updates, beta2)  # draws in place, then starts the next draw ahead
            t1 = time.perf_counter()
            for job in projector._ahead.jobs:
                job.result()
            t2 = time.perf_counter()
            projector.install(updates + 1, beta2)
            t3 = time.perf_counter()
            updates += 2
            for row, seconds in zip(rows, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                row.append(seconds)
        print(f"| {threads} | " + " | ".join(f"{statistics.median(r):.3f}" for r in rows) + " |")

if __name__ == "__main__":
    main()
