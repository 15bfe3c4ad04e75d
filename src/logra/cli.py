"""The ``logra`` command: ``train``, ``bench <name>``, ``estimate``.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file only
dispatches, so ``logra train --help`` is the trainer's own argument parser.
"""

from __future__ import annotations

import importlib
import sys

from ._optional import require_extra
from .errors import MissingExtraError

_COMMANDS = {
    "train": ("logra.rl.cli", "RL post-training (the main job; no arguments = the embedded default)"),
    "estimate": ("logra.estimate", "memory planner: per-GPU memory of dense Adam, LoRA and LoGRA"),
}
#: the extra each command needs beyond the library (`logra._optional`).
_EXTRA = {"train": "rl", "estimate": None, "compare": "bench"}
_BENCHMARKS = {
    "memory": "AdamW vs LoGRA peak memory by category and step time",
    "kl": "predicted vs realised KL over consecutive RL updates",
    "sync": "bytes and time of full, sparse and low-rank policy sync",
    "compare": "memory and speed against the peers (LoRA, GaLore, APOLLO, 8-bit AdamW)",
    "learn": "LoGRA vs dense AdamW vs LoRA learning curves over seeds",
    "diagnostics": "the paper's gradient-reconstruction and rank/KL-control diagnostics",
    "spectrum": "spectra and cosines of the accumulated update W_T − W_0 of finished runs",
}


def _usage() -> str:
    lines = ["usage: logra <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in _COMMANDS.items()]
    lines += ["  bench      benchmarks that print tables:"]
    lines += [f"    {name:<12} {doc}" for name, doc in _BENCHMARKS.items()]
    lines += ["", "`logra <command> --help` documents each command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``logra`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if rest[:1] in (["-h"], ["--help"]):  # asked for: the list of benchmarks, success
            print(_usage())
            return 0
        if not rest or rest[0] not in _BENCHMARKS:
            problem = f"unknown benchmark {rest[0]!r}" if rest else "which benchmark?"
            print(f"logra bench: {problem}\n\n{_usage()}", file=sys.stderr)
            return 2
        module = f"logra.bench.{rest[0]}"
        rest = rest[1:]
    elif command in _COMMANDS:
        module = _COMMANDS[command][0]
    else:
        print(f"logra: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    name = argv[1] if command == "bench" else command
    try:
        extra = _EXTRA.get(name, "rl")
        if extra:
            require_extra(extra, f"logra {' '.join(argv[:2]) if command == 'bench' else command}")
        return int(importlib.import_module(module).main(rest) or 0)
    except MissingExtraError as e:
        print(f"logra: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
