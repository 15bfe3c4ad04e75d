"""Parallel LoGRA: data parallelism, FSDP2 row sharding, and policy sync to rollout workers.

Data parallelism (`data`): every rank sketches its share of the batch, one all-reduce of
the ``[Σ out, r]`` sketch buffer per update replaces DDP's all-reduce of dense gradients,
and every rank applies the identical step (docs/method.md §7). `fsdp` does the same over
FSDP2 row-sharded weights.

Policy sync (`publisher`, `worker`, over `wire`): the trainer publishes each update to
rollout workers in separate processes.

docs/method.md §4: after an update the trainer sends the `PolicyDelta` (per target the factor
``U`` in bf16 plus seed information, ``out·r`` values instead of ``out·in``); a rollout
worker rebuilds the projections from the seeds and merges it with `apply_delta`, which
draws each projection with the trainer's own builder (`logra.projection.build_projection`)
and merges with the trainer's own `merge_update`, so both hold bitwise the same weights.

Transport is ``torch.distributed`` point-to-point (``isend``/``irecv``; gloo on CPU over
the process group's own TCP pairs, NCCL on GPU). The trainer and every worker are ranks
of one process group. Point-to-point only, no collectives: a worker that dies breaks
only its own pair, and the trainer carries on with the rest.

Protocol (every trainer message gets exactly one reply):

- handshake: the worker sends its `PolicyIdentity` (parameter names, shapes, dtypes;
  LoGRA sync fields; policy step; weights checksum). The trainer refuses a worker whose
  model or config differs, naming the field; it sends full weights to one whose weights
  or step differ.
- ``delta``: step index, the delta's ``checksum`` (target weights after the update), and,
  when non-target parameters are trained (``non_target`` ``'adamw'``/``'sketch'``), the
  dense tensors that changed, with their checksum. The worker applies it only if its step
  is the next one and acks; a gap or reorder (step ahead of the worker's), a failed apply
  or a checksum mismatch makes it ask for a full resync instead, which the trainer
  answers at once; a step behind the worker's (a late duplicate) is acked as stale.
- ``full``: safetensors bytes of every parameter (also the comparison mode
  ``publish(delta, mode='full')``) and, with ``distribution='inputs'``, of the fitted
  projections; the worker loads it, verifies the checksum of all parameters, keeps the
  projections and calls `set_policy_step`.
- ``generate``: prompts in, sampled token ids and their log-probabilities out.

A worker whose link fails or times out is marked lost and reported (log and
`PublishReport`); the trainer continues with the others. With none left, `publish`
raises `NoWorkersLeftError` after the trainer's own state is complete (the publisher
never touches the model or optimizer), so the run can checkpoint and stop cleanly.
"""

from __future__ import annotations

from ..errors import (
    HandshakeError,
    LinkError,
    NoWorkersLeftError,
    ProjectionMismatchError,
    RankMismatchError,
    SyncError,
    TrainerLostError,
)
from .data import (
    DistInfo,
    allreduce_bytes,
    allreduce_sketches,
    count_loss_tokens,
    default_backend,
    global_token_count,
    init_from_env,
    init_local,
    spawn_local,
    sum_over_ranks,
    verify_projections,
    verify_weights,
)
from .fsdp import RowShardedLoGRA
from .identity import PolicyIdentity
from .publisher import PolicyPublisher, PublishReport, SyncTestHooks, WorkerRollout, WorkerStatus
from .wire import decode_full_weights, encode_full_weights, load_full_weights
from .worker import RolloutWorker

__all__ = [
    "DistInfo", "HandshakeError", "LinkError", "NoWorkersLeftError", "PolicyIdentity", "PolicyPublisher",
    "ProjectionMismatchError", "PublishReport", "RankMismatchError", "RolloutWorker", "RowShardedLoGRA", "SyncError",
    "SyncTestHooks",
    "TrainerLostError", "WorkerRollout", "WorkerStatus", "allreduce_bytes", "allreduce_sketches",
    "count_loss_tokens", "decode_full_weights", "default_backend", "encode_full_weights", "global_token_count",
    "init_from_env", "init_local", "load_full_weights", "spawn_local", "sum_over_ranks", "verify_projections",
    "verify_weights",
]
