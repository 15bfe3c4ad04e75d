"""Time putting new projections in force, as the paper's refresh after every update does.

For the 330M-parameter Qwen2 shape of ``logra bench memory`` (rank 256: 168 targets), the
table gives the seconds `LoGRAOptimizer`'s projector spends installing the projections of
the next update (a) drawn in place, at each host thread count, and (b) after they were drawn
ahead on host threads while the rest of the update ran (here: a wait until that draw is
done, which is what a rollout or a GPU's forward and backward give it). (b) is what stays on
the update's critical path; (a) is the draw itself.

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
    print("| host threads | drawn in place (s) | drawn ahead, then installed (s) |")
    print("|---|---|---|")
    updates = 1
    for threads in args.threads:
        torch.set_num_threads(threads)
        inline, ahead = [], []
        for _ in range(args.repeats):
            projector._ahead = None  # nothing drawn ahead: the install draws
            t0 = time.perf_counter()
            projector.install(updates, beta2)
            inline.append(time.perf_counter() - t0)
            updates += 1
            pending = getattr(projector, "_ahead", None)  # started by the install above
            if pending is None:
                continue
            for job in pending[1]:
                job.result()
            t0 = time.perf_counter()
            projector.install(updates, beta2)
            ahead.append(time.perf_counter() - t0)
            updates += 1
        shown = f"{statistics.median(ahead):.3f}" if ahead else "not drawn ahead"
        print(f"| {threads} | {statistics.median(inline):.3f} | {shown} |")


if __name__ == "__main__":
    main()
