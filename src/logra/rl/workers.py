"""Rollout workers: processes with their own policy copy, kept current by verified low-rank deltas.

The trainer (rank 0 of a gloo group) publishes every update's `PolicyDelta`; each worker
checks its step index and checksum before applying it (or asks for a full resync), then
generates the next rollouts. See `logra.parallel` for the protocol.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..config import LoGRAConfig
from ..delta import PolicyDelta
from ..optimizer import LoGRAOptimizer
from ..parallel import PolicyPublisher, RolloutWorker


def _worker_main(rank: int, world: int, store: str, policy_dir: str, logra: dict[str, Any]) -> None:
    """A worker process: load the policy saved by the trainer, connect, serve until closed."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        worker = RolloutWorker(model, LoGRAConfig(**logra), trainer_rank=0)
        worker.connect()
        worker.serve()
    finally:
        dist.destroy_process_group()


class RolloutWorkers:
    """``n`` spawned rollout workers and the trainer's publisher.

    Attributes:
        publisher: the `PolicyPublisher` that sends deltas and generation requests.
    """

    def __init__(self, model: nn.Module, optimizer: LoGRAOptimizer, config: LoGRAConfig, n: int,
                 run_dir: Path) -> None:
        if dist.is_initialized():
            raise ValueError("rollout_workers cannot share a process group with data parallelism")
        policy_dir = run_dir / "rollout-policy"
        model.save_pretrained(policy_dir)
        store = run_dir / f"rollout-store-{time.time_ns()}"
        ctx = mp.get_context("spawn")
        self._procs = [
            ctx.Process(target=_worker_main, args=(rank, n + 1, str(store), str(policy_dir), config.to_dict()),
                        daemon=True)
            for rank in range(1, n + 1)
        ]
        for proc in self._procs:
            proc.start()
        dist.init_process_group("gloo", store=dist.FileStore(str(store), n + 1), rank=0, world_size=n + 1)
        self.publisher = PolicyPublisher(model, config, list(range(1, n + 1)), optimizer=optimizer)

    def publish(self, delta: PolicyDelta) -> dict[str, float]:
        """Send ``delta`` to every live worker; metrics of the send."""
        report = self.publisher.publish(delta)
        return {"rollout_workers_live": len(self.publisher.live), "sync_bytes": report.sent_bytes,
                "resyncs": sum(o.startswith("resynced") for o in report.outcome.values())}

    def resync(self, step: int) -> None:
        """Send every live worker the trainer's weights at update ``step``: after the trainer
        loaded a checkpoint, the workers still hold the weights they were started with."""
        self.publisher.full_sync(step=step)

    def close(self) -> None:
        """Stop the workers and leave their process group."""
        self.publisher.close()
        for proc in self._procs:
            proc.join(timeout=60)
        dist.destroy_process_group()
