"""Checkpoints of an RL run: safetensors weights plus every piece of state that makes resume exact.

``run_dir/checkpoint/`` holds ``model.safetensors``, ``state.pt`` (optimizer, KL controller,
scheduler, update counter, baseline, RNG; loads with ``weights_only=True``),
``config.json`` (under data parallelism also ``rng-rank<r>.pt`` per rank) and, written
last, ``manifest.json``: the size and SHA-256 of every other file.

Atomic: a new checkpoint is written and flushed to disk in ``checkpoint.tmp``, the previous
one is renamed to ``checkpoint.old``, the new one to ``checkpoint``, then the old one is
deleted. A kill at any moment leaves a complete checkpoint: ``checkpoint`` or, between the
two renames, ``checkpoint.old`` (`checkpoint_dir` finds it; the next save tidies up).

Verified: loading checks every file against the manifest (present, same size, same
digest) before anything is read into the model, and refuses a damaged checkpoint with one
`CheckpointError` line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_model
from torch import nn

from ..errors import CheckpointError

CHECKPOINT = "checkpoint"
MANIFEST = "manifest.json"
#: what a checkpoint holds besides per-rank RNG files (all required)
FILES = ("model.safetensors", "state.pt", "config.json")
_TMP, _OLD = CHECKPOINT + ".tmp", CHECKPOINT + ".old"


def checkpoint_dir(run_dir: Path) -> Path | None:
    """The run's latest complete checkpoint folder: ``checkpoint``, or ``checkpoint.old`` if
    a save was killed between its two renames; None if the run has none."""
    for name in (CHECKPOINT, _OLD):
        if (run_dir / name).is_dir():
            return run_dir / name
    return None


def save_checkpoint(
    run_dir: Path, model: nn.Module, state: dict[str, Any], config: dict[str, Any], rank: int = 0, world: int = 1
) -> Path:
    """Write ``run_dir/checkpoint`` atomically (collective under data parallelism: every rank calls it)."""
    path, tmp, old = run_dir / CHECKPOINT, run_dir / _TMP, run_dir / _OLD
    if world > 1:
        torch.save({"rng": torch.random.get_rng_state(), "cuda_rng": _cuda_rng()}, run_dir / f"rng-rank{rank}.pt")
        dist.barrier()
        if rank != 0:
            dist.barrier()
            return path
    if tmp.exists():  # left by a save that was killed: never complete, never read
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save({**state, "rng": torch.random.get_rng_state(), "cuda_rng": _cuda_rng()}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for r in range(world if world > 1 else 0):
        os.replace(run_dir / f"rng-rank{r}.pt", tmp / f"rng-rank{r}.pt")
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {"format": 1, "update": state.get("update"),
                "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                          for name in files}}
    for name in files:
        _fsync(tmp / name)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    # The swap: at every instant `checkpoint` or `checkpoint.old` is a complete checkpoint.
    if path.is_dir():
        if old.exists():  # `checkpoint` is complete, so an older leftover can go
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(run_dir)
    if old.exists():
        shutil.rmtree(old)
    if world > 1:
        dist.barrier()
    return path


def verify_checkpoint(path: Path, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Check every file of the checkpoint folder ``path`` (or those in ``only``) against its
    manifest; return the manifest.

    A checkpoint written before manifests existed has none: it is accepted with a warning
    (its files are still refused one by one if they do not load).

    Raises:
        CheckpointError: the manifest or a file is missing, or a file's size or SHA-256
            differs from the manifest (truncated, damaged or edited since it was written).
    """
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        missing = [name for name in only or FILES if not (path / name).is_file()]
        if missing:
            raise CheckpointError(path / missing[0], "is missing")
        warnings.warn(f"checkpoint {path} has no {MANIFEST} (written by an older logra): its files are not "
                      "verified", stacklevel=2)
        return {"files": {}}
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["files"]
        sizes = {name: int(entry["bytes"]) for name, entry in entries.items()}
        digests = {name: str(entry["sha256"]) for name, entry in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(manifest_path, f"is unreadable ({type(e).__name__}: {e})") from None
    for name in only or (*FILES, *sorted(set(entries) - set(FILES))):
        file = path / name
        if name not in entries:
            raise CheckpointError(file, f"is not listed in {MANIFEST}")
        if not file.is_file():
            raise CheckpointError(file, "is missing")
        size = file.stat().st_size
        if size != sizes[name]:
            raise CheckpointError(file, f"has {size:,} bytes, {sizes[name]:,} were written (truncated or replaced)")
        if _sha256(file) != digests[name]:
            raise CheckpointError(file, "has changed since it was written (its SHA-256 differs from the manifest)")
    return manifest


def read_checkpoint_config(run_dir: Path) -> dict[str, Any]:
    """The verified ``config.json`` of the run's latest checkpoint (what ``--resume`` continues).

    Raises:
        CheckpointError: there is no checkpoint, or it fails `verify_checkpoint`.
    """
    path = checkpoint_dir(run_dir)
    if path is None:
        raise CheckpointError(run_dir / CHECKPOINT, "does not exist: the run has no checkpoint to resume")
    verify_checkpoint(path, only=("config.json",))  # the weights are verified when they are loaded
    try:
        return json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise CheckpointError(path / "config.json", f"is not valid JSON ({e})") from None


def load_checkpoint(run_dir: Path, model: nn.Module, rank: int = 0, world: int = 1,
                    start_checksum: str | None = None) -> dict[str, Any]:
    """Verify the run's latest checkpoint, load its weights into ``model``, restore this rank's
    RNG and return the saved state.

    Every file is verified and read before the model or the RNG is touched, so a refused
    checkpoint changes nothing.

    Args:
        start_checksum: if given, the run must have started from weights of this
            `weights_checksum` (checked when the state records its ``start_checksum``).

    Raises:
        CheckpointError: no checkpoint; a file missing, damaged or not loadable; weights
            that do not fit ``model``; or a run that started from other weights than
            ``start_checksum``.
    """
    path = checkpoint_dir(run_dir)
    if path is None:
        raise CheckpointError(run_dir / CHECKPOINT, "does not exist: the run has no checkpoint to resume")
    verify_checkpoint(path)
    state = _load(path / "state.pt")
    started = state.get("start_checksum")  # absent from checkpoints of older versions
    if start_checksum is not None and started is not None and started != start_checksum:
        raise CheckpointError(path / "state.pt", f"is of a run that started from weights {started[:12]}, not from "
                              f"the starting policy loaded now ({start_checksum[:12]}; was the warm-start cache "
                              "rebuilt, or is this another machine?)")
    rng = _load(path / f"rng-rank{rank}.pt") if world > 1 else state
    weights = path / "model.safetensors"
    try:
        tensors = load_file(weights)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types; all mean the same here
        raise CheckpointError(weights, f"does not load ({_first_line(e)})") from None
    own = model.state_dict()
    misfit = _misfit(tensors, own)
    if misfit:
        raise CheckpointError(weights, f"does not fit this model: {misfit}")
    model.load_state_dict(tensors, strict=False)  # tied duplicates were not saved
    torch.random.set_rng_state(rng["rng"])
    if rng.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda_rng"])
    return state


def _misfit(saved: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    """Why the saved tensors cannot replace the model's exactly ('' if they can).

    A tensor tied to a saved one (shared input/output embeddings) was saved once, under
    one of its names; every other tensor must be there with its shape."""
    for name, t in saved.items():
        if name not in own:
            return f"it holds {name!r}, which the model has not"
        if t.shape != own[name].shape:
            return f"{name} is {list(t.shape)} there, {list(own[name].shape)} in the model"
    stored = {own[n].untyped_storage().data_ptr() for n in saved}
    for name, t in own.items():
        if name not in saved and t.untyped_storage().data_ptr() not in stored:
            return f"it lacks {name!r}"
    return ""


def _load(file: Path) -> dict[str, Any]:
    try:
        return torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(file, "is missing") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle/zip raises whatever its first bad byte causes
        raise CheckpointError(file, f"does not load ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _sha256(file: Path) -> str:
    with file.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename never publishes unwritten data."""
    if os.name == "nt" and path.is_dir():  # Windows cannot open a folder; NTFS renames are journaled
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cuda_rng() -> torch.Tensor | None:
    """The current CUDA device's generator state (sampling on a GPU draws from it)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
