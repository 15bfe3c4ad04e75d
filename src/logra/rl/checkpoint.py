"""Checkpoints of an RL run: safetensors weights plus every piece of state that makes resume exact.

``run_dir/checkpoint/`` holds ``model.safetensors``, ``state.pt`` (optimizer, KL controller,
scheduler, update counter, baseline, RNG; loads with ``weights_only=True``) and
``config.json``. It is written to a temporary sibling and renamed, so an interrupted
save never leaves a half-written checkpoint. Under data parallelism rank 0 writes it and
every rank adds its own RNG state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model
from torch import nn

CHECKPOINT = "checkpoint"


def save_checkpoint(
    run_dir: Path, model: nn.Module, state: dict[str, Any], config: dict[str, Any], rank: int = 0, world: int = 1
) -> Path:
    """Write ``run_dir/checkpoint`` (collective under data parallelism: every rank calls it)."""
    path = run_dir / CHECKPOINT
    if world > 1:
        torch.save({"rng": torch.random.get_rng_state(), "cuda_rng": _cuda_rng()}, run_dir / f"rng-rank{rank}.pt")
        dist.barrier()
        if rank != 0:
            dist.barrier()
            return path
    tmp = run_dir / (CHECKPOINT + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save({**state, "rng": torch.random.get_rng_state(), "cuda_rng": _cuda_rng()}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    if world > 1:
        for r in range(world):
            (run_dir / f"rng-rank{r}.pt").rename(path / f"rng-rank{r}.pt")
        dist.barrier()
    return path


def load_checkpoint(run_dir: Path, model: nn.Module, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Load the weights into ``model``, restore this rank's RNG and return the saved state."""
    path = run_dir / CHECKPOINT
    load_model(model, str(path / "model.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True)
    rng = torch.load(path / f"rng-rank{rank}.pt", weights_only=True) if world > 1 else state
    torch.random.set_rng_state(rng["rng"])
    if rng.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda_rng"])
    return state


def _cuda_rng() -> torch.Tensor | None:
    """The current CUDA device's generator state (sampling on a GPU draws from it)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
