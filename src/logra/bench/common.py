"""Helpers shared by the benchmarks that measure one method per process (`memory`, `compare`).

The model shapes of their presets, spawning a worker interpreter and reading back its
JSON result, and the unit their tables print in.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from logra.bench import relay
from logra.errors import WorkerError
from logra.memory import GIB

#: A Qwen2.5-0.5B-like shape (hidden 1024, 24 layers, GQA 16/2) with a 32k vocabulary and
#: an untied lm_head: ~330 M fp32 parameters, which fits with AdamW in 24 GiB of host RAM.
FULL_SHAPE: dict[str, int] = {
    "hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 2, "intermediate": 2816, "vocab": 32000,
}
#: Small enough for a unit test (``--quick``), with parameters (not logits) dominating memory.
QUICK_SHAPE: dict[str, int] = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 256}


def spawn_worker(method: str, argv: list[str], module: str) -> dict[str, Any]:
    """Run one method in a fresh interpreter (``python -m module``) and read back its JSON.

    The worker gets ``argv`` plus ``--worker METHOD --worker-out FILE`` and writes its
    result to ``FILE``; its output is relayed to our stderr (`logra.bench.relay`).

    Raises:
        WorkerError: the worker failed or wrote no result.
    """
    with tempfile.TemporaryDirectory(prefix="logra-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *argv, "--worker", method, "--worker-out", str(out)]
        code, last = relay(cmd)
        if code != 0 or not out.exists():
            raise WorkerError(method, code, last)
        return json.loads(out.read_text())


def size_unit(results: list[dict[str, Any]]) -> tuple[str, int]:
    """``('GiB', bytes)`` for real models; ``('MiB', bytes)`` keeps --quick's figures readable."""
    largest = max(max(r["tracked_peak"], r["rss_peak"]) for r in results)
    return ("GiB", GIB) if largest >= GIB else ("MiB", 1024**2)
