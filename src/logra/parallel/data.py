"""Data-parallel LoGRA on ``torch.distributed``: all-reduce sketches, not dense gradients.

docs/method.md §7. Every rank draws the same projections from the seed, so the sum over ranks of
their sketches ``S_k = G_k Aᵀ`` is the sketch of the global batch, ``(Σ G_k) Aᵀ``. One
all-reduce of the ``[Σ out, r]`` fp32 sketch buffer per update replaces DDP's all-reduce
of ``Σ out·in`` dense gradients (`allreduce_bytes` gives both sizes).

The loss convention that makes data parallelism exact: **every rank divides its summed
token loss by the GLOBAL number of loss-bearing tokens of the update** (all ranks, all
micro-batches), obtained once per update with `global_token_count`. Summing the ranks'
sketches then gives exactly the single-process sketch of the global batch, and every
rank proposes and applies the identical step. With Hugging Face models, pass the count
as ``model(**batch, num_items_in_batch=n_global)`` (the causal-LM loss then divides its
sum by it); `count_loss_tokens` counts a rank's own tokens the way that loss does.

A typical update on every rank::

    info = init_from_env()                          # torchrun, or init_local(...) when spawned
    opt = LoGRAOptimizer(model, config)
    verify_projections(opt)                         # once, at start
    ...
    n = global_token_count(sum(count_loss_tokens(b["labels"]) for b in micro_batches))
    for b in micro_batches:
        model(**b, num_items_in_batch=n).loss.backward()
    allreduce_sketches(opt)                         # one collective (+1 for dense non-targets)
    delta = opt.step()

Row-sharded weights (FSDP2) use `logra.parallel.fsdp.RowShardedLoGRA` on top of this.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ProjectionMismatchError, RankMismatchError
from ..optimizer import LoGRAOptimizer

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank (0 when not distributed).
        world_size: number of processes (1 when not distributed).
        local_rank: rank on this machine; selects the CUDA device.
        device: the device this rank computes on (``cuda:<local_rank>`` with NCCL, else CPU).
        backend: ``'nccl'``, ``'gloo'`` or ``None`` when not distributed.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that logs, checkpoints and publishes deltas)."""
        return self.rank == 0


def default_backend() -> str:
    """``'nccl'`` when CUDA (and NCCL) is available, else ``'gloo'``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _finish_init(rank: int, world_size: int, local_rank: int, backend: str) -> DistInfo:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return DistInfo(rank, world_size, local_rank, device, backend)


def init_from_env(backend: str | None = None, timeout: datetime.timedelta = _DEFAULT_TIMEOUT) -> DistInfo:
    """Initialise the default process group from torchrun's environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``
    (``env://``). Without ``WORLD_SIZE`` (a plain ``python`` run) nothing is
    initialised and a single-process `DistInfo` is returned, so the same script runs
    both ways. An already initialised group is reused.

    Args:
        backend: ``'gloo'`` or ``'nccl'``; default `default_backend`.
        timeout: collective timeout of the process group.
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return _finish_init(dist.get_rank(), dist.get_world_size(), local, backend)
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 1, 0, torch.device("cuda" if torch.cuda.is_available() else "cpu"), None)
    backend = backend or default_backend()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return _finish_init(rank, world, local, backend)


def init_local(
    rank: int,
    world_size: int,
    store_path: str | os.PathLike[str],
    backend: str | None = None,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
) -> DistInfo:
    """Initialise the default process group of processes spawned on this machine.

    Rendezvous goes through a ``FileStore`` at ``store_path`` (a file that must not
    exist yet, on a filesystem all ranks see; no ports to choose). Use it from
    ``torch.multiprocessing.spawn`` targets; call ``dist.destroy_process_group()`` in a
    ``finally`` block.
    """
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(str(Path(store_path)), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    local = rank % torch.cuda.device_count() if backend == "nccl" else rank
    return _finish_init(rank, world_size, local, backend)


def spawn_local(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 600.0,
    start_method: str = "spawn",
    preload: Iterable[str] = (),
) -> list[int]:
    """Run ``fn(rank, nprocs, store_path, *args)`` in ``nprocs`` fresh local processes.

    ``store_path`` is a fresh file for `init_local`'s ``FileStore`` rendezvous. Waits
    for all processes; any still running after ``timeout`` seconds are killed, so a hung
    collective never outlives the caller. ``fn`` must be importable (a module-level
    function). With ``start_method='forkserver'``, ``preload`` names modules the fork
    server imports once, so each process starts in a fraction of a second instead of
    importing torch and transformers again.

    Returns:
        The processes' exit codes, by rank (0 = success, negative = killed by a signal).

    Raises:
        TimeoutError: some processes were still running at the deadline (now killed).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory(prefix="logra-dist-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=fn, args=(rank, nprocs, store, *args), name=f"logra-rank{rank}")
                 for rank in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(deadline - time.monotonic(), 0.0))
        finally:
            hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        if hung:
            raise TimeoutError(f"ranks {hung} were still running after {timeout:.0f} s and were killed")
        return [p.exitcode for p in procs]


def _collective_device(group: dist.ProcessGroup | None, fallback: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; gloo reduces CPU (and CUDA) tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def count_loss_tokens(labels: torch.Tensor, ignore_index: int = -100, shift: bool = True) -> int:
    """Loss-bearing tokens of a causal-LM batch, counted as Hugging Face's loss counts them.

    With ``shift`` (HF causal LMs) the first label of each row predicts nothing, so the
    count is over ``labels[..., 1:]``.
    """
    lab = labels[..., 1:] if shift else labels
    return int((lab != ignore_index).sum())


def global_token_count(local_count: int | torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum of ``local_count`` over the ranks of ``group`` (one small all-reduce).

    Call it once per update, before the backward passes, and divide every rank's summed
    loss by the result. Without an initialised process group it returns ``local_count``.
    """
    value = int(local_count)
    if not dist.is_available() or not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device(group, torch.device("cpu")))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def sum_over_ranks(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a list of scalars over the ranks of ``group`` in float64 (one small all-reduce).

    Without an initialised process group it returns ``values``. Used to pool the KL probe's
    sums, so every rank gets the same predicted KL and step scale.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group, torch.device("cpu")))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def allreduce_sketches(
    optimizer: LoGRAOptimizer, group: dist.ProcessGroup | None = None, *, average: bool = False
) -> None:
    """Sum the sketches (and dense non-target gradients) of ``optimizer`` over all ranks.

    The whole ``[Σ out, r]`` fp32 sketch buffer goes in ONE all-reduce, in place. If the
    optimizer trains non-target parameters densely (``non_target`` ``'adamw'`` or
    ``'sketch'``), their gradients are flattened into a second, single all-reduce,
    together with one flag per parameter so that a parameter without a gradient on every
    rank keeps ``grad=None`` (AdamW skips it) while one with a gradient on some ranks
    gets the sum. Call it after the last backward of the update, before ``propose``/``step``.

    With ``average`` the sums are divided by the world size: DDP's convention, for losses
    normalised per rank so that the MEAN over ranks is the global loss (Hugging Face /
    TRL trainers). The default (sum) suits this module's global-token-count convention.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    dist.all_reduce(optimizer.sketch_buffer, op=dist.ReduceOp.SUM, group=group)
    if average:
        optimizer.sketch_buffer.div_(world)
    params = optimizer.dense_parameters()
    if not params:
        return
    device = _collective_device(group, params[0].device)
    pieces = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, torch.float32) for p in params
    ]
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    flat = torch.cat(pieces + [flags])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flags_sum = flat[-len(params):].tolist()
    if average:
        flat.div_(world)
    offset = 0
    for p, has_grad in zip(params, flags_sum, strict=True):
        chunk = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
        if has_grad > 0:
            if p.grad is None:
                p.grad = chunk.to(p.device, p.dtype).clone()
            else:
                p.grad.copy_(chunk)
        else:
            p.grad = None


def allreduce_bytes(optimizer: LoGRAOptimizer) -> tuple[int, int]:
    """Payload bytes all-reduced per update: ``(LoGRA, dense DDP)``.

    LoGRA moves the fp32 sketch buffer (``Σ out·r·4`` bytes) plus the gradients of
    densely trained non-target parameters. DDP training the same parameters densely
    would move every target's full gradient (``Σ out·in``, in the weight's dtype) plus
    the same non-target gradients. These are payload sizes; a ring all-reduce sends
    about ``2(N-1)/N`` times the payload per rank for either.
    """
    sketch = optimizer.sketch_buffer
    dense_extra = sum(p.numel() * 4 for p in optimizer.dense_parameters())
    targets = [p for g in optimizer.param_groups[:1] for p in g["params"]]
    dense_targets = sum(p.numel() * p.element_size() for p in targets)
    return sketch.numel() * sketch.element_size() + dense_extra, dense_targets + dense_extra


def _digest(a: torch.Tensor) -> str:
    return hashlib.blake2b(a.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def _gather_against_first(mine: Any, group: dist.ProcessGroup | None) -> tuple[int, Any, list[tuple[int, Any]]]:
    """All-gather ``mine``: (first rank, its value, [(rank, value) of every other rank])."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    return ranks[0], gathered[0], list(zip(ranks[1:], gathered[1:], strict=True))


def verify_weights(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Check that every rank holds bit-identical parameters, whatever the optimizer.

    Call once at start: the ranks apply one summed step, so ranks that start apart stay apart
    and each generates from its own policy, with no error. (Two ways it happens: parameters
    drawn from torch's global generator, which torch 2.13 seeds afresh in every process, such
    as unseeded LoRA adapters; a model loaded from different files.) All ranks all-gather a
    digest of each parameter and compare with rank 0; every rank raises the same error. It
    reads every parameter once, on the CPU.

    Raises:
        RankMismatchError: naming the first rank and the first parameter that differ.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    first, ref, others = _gather_against_first(
        [(name, list(p.shape), _digest(p)) for name, p in model.named_parameters()], group)
    for rank, other in others:
        if [t[:2] for t in other] != [t[:2] for t in ref]:
            raise RankMismatchError(f"rank {rank} holds other parameters (names or shapes) than rank {first}")
        for (name, _, digest_ref), (_, _, digest) in zip(ref, other, strict=True):
            if digest != digest_ref:
                raise RankMismatchError(
                    f"rank {rank} starts from other weights than rank {first}: first differing parameter "
                    f"{name!r} (digest {digest} vs {digest_ref})")


def verify_projections(optimizer: LoGRAOptimizer, group: dist.ProcessGroup | None = None) -> None:
    """Check that every rank sketches the same targets with bit-identical projections.

    Call once at start (and after resuming, and after `LoGRAOptimizer.fit_projections`, before
    which fitted targets count as unfitted): all ranks all-gather their update count,
    sync fields, target names and a digest of each projection's bytes, then compare with
    rank 0. Every rank raises the same error, so no rank is left waiting in a collective.

    Raises:
        ProjectionMismatchError: naming the first rank and the first target that differ.
    """
    def entry(name: str) -> tuple[str, list[int], str]:
        a = optimizer.projection(name)
        return (name, [], "unfitted") if a is None else (name, list(a.shape), _digest(a))

    mine: dict[str, Any] = {
        "num_updates": optimizer.num_updates,
        "sync": optimizer.config.sync_fields(),
        "targets": [entry(n) for n in optimizer.targets],
    }
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    head, ref, others = _gather_against_first(mine, group)
    for rank, other in others:
        for key in ("num_updates", "sync"):
            if other[key] != ref[key]:
                raise ProjectionMismatchError(
                    f"rank {rank} has {key}={other[key]!r} but rank {head} has {ref[key]!r}: "
                    "its projections cannot match")
        names_ref, names_other = [t[0] for t in ref["targets"]], [t[0] for t in other["targets"]]
        if names_ref != names_other:
            first = next((a, b) for a, b in zip(names_ref + [None], names_other + [None], strict=False) if a != b)
            raise ProjectionMismatchError(
                f"rank {rank} sketches other targets than rank {head}: first difference "
                f"{first[1]!r} (rank {rank}) vs {first[0]!r} (rank {head})")
        for (name, shape_ref, digest_ref), (_, shape, digest) in zip(ref["targets"], other["targets"], strict=True):
            if shape != shape_ref or digest != digest_ref:
                raise ProjectionMismatchError(
                    f"rank {rank} drew a different projection for {name!r} than rank {head} "
                    f"(shape {shape} vs {shape_ref}, digest {digest} vs {digest_ref}); first differing layer")
