"""The run's metrics: ``metrics.jsonl`` (and optionally TensorBoard), and per-update memory figures."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..memory import GIB, peak_rss_bytes


class MetricsLog:
    """Append-only ``run_dir/metrics.jsonl``: one JSON object per update or evaluation."""

    def __init__(self, run_dir: Path, tensorboard: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (and its numbers to TensorBoard, under ``train/`` or ``eval/``)."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("update", 0)
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "update":
                    self.writer.add_scalar(prefix + k, v, step)

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far (a last line cut short by a killed process is not one)."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.split("\n")
        torn = lines.pop()  # '' when the file ends with a newline, as every complete write does
        records = [json.loads(line) for line in lines if line.strip()]
        if torn.strip():
            try:
                records.append(json.loads(torn))
            except ValueError:
                pass
        return records

    def truncate(self, update: int, evaluated: bool = True) -> None:
        """Keep only the records of the run up to ``update``'s checkpoint, for exact resume: its
        evaluation stays if ``evaluated`` (the checkpoint was written after it). Replaced
        atomically, so a kill while truncating leaves the old log."""
        kept = [r for r in self.read()
                if r["update"] < update or (evaluated and r["kind"] == "eval" and r["update"] == update)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory of this update: CUDA max allocated on a GPU, process peak RSS on the CPU."""
    if device.type == "cuda":
        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / GIB}
    return {"peak_rss_gib": peak_rss_bytes() / GIB}
