"""Build the warm start that ships with logra (src/logra/rl/shipped/) for the embedded default.

SFT on the default task's demonstrations with the default `TinyPolicyConfig`, exactly as a
cache miss of `logra train` trains it, then the weights (safetensors) and their record:
the config, the demonstrations' digest (what a run must match to load them), the weights'
checksum and where they were built. Which CPU and thread count build it decides the weights
(docs/learning.md, "one cache key, many warm starts"); the file shipped was built with one
thread on the machine its record names.

    python scripts/build_shipped_policy.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model

from logra.delta import weights_checksum
from logra.rl.build import load_policy, warm_start_demonstrations
from logra.rl.config import build_task, recipe_config
from logra.rl.tiny import _SHIPPED_DIR, demonstrations_digest


def _cpu() -> str:
    """The CPU's name, family and model (what `lscpu` shows), else what platform knows."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines())
    except (OSError, ValueError):
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    isa = "AVX-512" if "avx512f" in fields.get("flags", "").split() else "no AVX-512"
    return f"{fields.get('model name')} (family {fields.get('cpu family')}, model {fields.get('model')}, {isa})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the SFT (default 1)")
    parser.add_argument("--name", default="chain_sum-default", help="file stem under the output folder")
    parser.add_argument("--out", type=Path, default=_SHIPPED_DIR, help=f"output folder (default {_SHIPPED_DIR})")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as cache:
        # the embedded recipe is what a bare `logra train` runs
        config = recipe_config("embedded", **{"tiny.shipped": False, "cache_dir": cache})
        task = build_task(config)
        model, _, info = load_policy(config, task)
    record = {
        "config": {k: v for k, v in config.tiny.to_dict().items() if k != "shipped"},
        "demonstrations": demonstrations_digest(warm_start_demonstrations(config, task)),
        "checksum": weights_checksum(model),
        "data": info["data"],
        "warm_start": info["warm_start"],
        "built_with": {"cpu": _cpu(), "threads": args.threads, "torch": torch.__version__,
                       "transformers": transformers.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(args.out / f"{args.name}.safetensors"))
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / args.name}.safetensors and .json (weights {record['checksum']})")


if __name__ == "__main__":
    main()
