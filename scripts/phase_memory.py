"""Peak tensor memory of one RL update, phase by phase, from PyTorch's memory profiler.

On a CPU, `logra train` reports the process's peak RSS: the allocator's high-water mark,
which also counts the runtime and memory kept after tensors are freed, and so blurs the
differences between optimizers. This script runs ``--warmup`` updates of a `logra train`
configuration, then profiles one more with ``torch.profiler`` and prints the peak of live
tensor memory in each phase of that update (rollout, loss and backward, step), split into
the profiler's categories (parameters, optimizer state, gradients, activations, ...).
`logra.memory.track_memory` gives one peak over a whole region; the phases of a single
update need the profiler's timeline. The profiler does not know LoGRA's own buffers
(sketches, moments, projections): they count as "unknown".

    python scripts/phase_memory.py --recipe smollm2-135m --set optimizer=adamw lr=1e-5
    python scripts/phase_memory.py --set prompts_per_update=64 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from logra.memory import GIB
from logra.rl import RLTrainer
from logra.rl.cli import build_config

# the order of the categories in `export_memory_timeline`'s rows (after an uncategorised first entry)
CATEGORIES = ("parameter", "optimizer state", "input", "temporary", "activation", "gradient", "autograd detail",
              "unknown")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="embedded", help="the recipe whose settings --set changes")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="`logra train` settings as dotted keys, e.g. optimizer=adamw kl.probe_responses=16")
    p.add_argument("--warmup", type=int, default=1, help="updates before the profiled one (optimizer state exists)")
    args = p.parse_args()
    if bad := [item for item in args.set if "=" not in item]:
        p.error(f"--set takes KEY=VALUE pairs, not {' '.join(bad)}")
    values = dict(item.split("=", 1) for item in args.set)
    values = {"eval_every": "0", "checkpoint_every": "0", "run_dir": "runs/phase-memory", **values}
    trainer = RLTrainer(build_config(values, args.recipe), progress=False)
    for _ in range(args.warmup):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        record = trainer.train_step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA snapshots; the CPU has no other
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        times, sizes = json.loads(path.read_text())
    start = times[0]
    seconds = [(t - start) / 1e6 for t in times]
    rollout, train = record["time_rollout"], record["time_rollout"] + record["time_train"]
    phases = {"rollout": (0.0, rollout), "loss + backward": (rollout, train), "step": (train, float("inf"))}
    print(f"one update after {args.warmup} warm-up update(s); profiled times are slower than unprofiled ones")
    print("| phase | seconds | peak tensor memory (GiB) | " + " | ".join(CATEGORIES) + " |")
    print("|---|---|---|" + "---|" * len(CATEGORIES))
    for name, (lo, hi) in phases.items():
        inside = [i for i, s in enumerate(seconds) if lo <= s < hi]
        if not inside:
            continue
        peak = max(inside, key=lambda i: sum(sizes[i]))
        parts = " | ".join(f"{b / GIB:.3f}" for b in sizes[peak][1:])
        print(f"| {name} | {min(hi, seconds[-1]) - lo:.1f} | {sum(sizes[peak]) / GIB:.3f} | {parts} |")
    print(f"\npeak RSS of the process after this update: {record.get('peak_rss_gib', float('nan')):.3f} GiB")


if __name__ == "__main__":
    main()
