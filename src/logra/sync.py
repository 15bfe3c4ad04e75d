"""Policy sync: the trainer publishes each update to rollout workers in separate processes.

Spec §4: after an update the trainer sends the `PolicyDelta` (per target the factor
``U`` in bf16 plus seed information, ``out·r`` values instead of ``out·in``); a rollout
worker rebuilds the projections from the seeds and merges it with `apply_delta`, the
same code path as the trainer, so both hold bitwise the same weights.

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
  ``publish(delta, mode='full')``); the worker loads it, verifies the checksum of all
  parameters and calls `set_policy_step`.
- ``generate``: prompts in, sampled token ids and their log-probabilities out.

A worker whose link fails or times out is marked lost and reported (log and
`PublishReport`); the trainer continues with the others. With none left, `publish`
raises `NoWorkersLeftError` after the trainer's own state is complete (the publisher
never touches the model or optimizer), so the run can checkpoint and stop cleanly.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from torch import nn

from .config import LoGRAConfig
from .delta import PolicyDelta, apply_delta, policy_step, set_policy_step, weights_checksum
from .errors import DeltaMismatchError, LoGRAError
from .optimizer import LoGRAOptimizer
from .projection import stable_name

__all__ = [
    "HandshakeError", "NoWorkersLeftError", "PolicyIdentity", "PolicyPublisher", "PublishReport", "Rollout",
    "RolloutWorker", "SyncError", "SyncTestHooks", "TrainerLostError", "WorkerStatus", "decode_full_weights",
    "encode_full_weights", "load_full_weights",
]

LOG = logging.getLogger("logra.sync")


class SyncError(LoGRAError):
    """A policy-sync link failed or a peer broke the protocol."""


class HandshakeError(SyncError):
    """A worker was refused at handshake: its model or LoGRA config differs from the trainer's.

    Attributes:
        field: what differs (``'config.rank'``, ``'parameter names'``, ``'shape of <name>'``, ...).
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class NoWorkersLeftError(SyncError):
    """Every rollout worker is lost or refused; the trainer's own state is intact."""


class TrainerLostError(SyncError):
    """A worker lost its link to the trainer (the trainer died or timed out)."""


class _LinkError(SyncError):
    """A send or receive on one point-to-point link failed or timed out."""


# ------------------------------------------------------------------ identity / handshake
@dataclass
class PolicyIdentity:
    """What trainer and worker must share, exchanged at handshake.

    Attributes:
        params: per stable parameter name, ``(shape, dtype)`` in model order.
        sync: the LoGRA config's `LoGRAConfig.sync_fields`.
        step: the policy step the process holds (`policy_step` on a worker).
        checksum: `weights_checksum` of all parameters.
    """

    params: dict[str, tuple[list[int], str]]
    sync: dict[str, Any]
    step: int
    checksum: str

    @classmethod
    def of(cls, model: nn.Module, config: LoGRAConfig, step: int | None = None) -> PolicyIdentity:
        """The identity of ``model`` under ``config`` (step defaults to `policy_step`)."""
        params = {stable_name(n): (list(p.shape), str(p.dtype).removeprefix("torch."))
                  for n, p in model.named_parameters()}
        return cls(params, config.sync_fields(), policy_step(model) if step is None else step, weights_checksum(model))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"params": self.params, "sync": self.sync, "step": self.step, "checksum": self.checksum}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyIdentity:
        """Inverse of `to_dict`."""
        return cls({k: (list(v[0]), v[1]) for k, v in d["params"].items()}, d["sync"], d["step"], d["checksum"])

    def mismatch(self, worker: PolicyIdentity) -> tuple[str, str] | None:
        """``(field, message)`` for the first model/config difference from ``worker``, else None.

        ``self`` is the trainer's identity. Step and checksum differences are not
        mismatches: they are repaired by a full-weight sync.
        """
        for key in sorted(set(self.sync) | set(worker.sync)):
            a, b = self.sync.get(key), worker.sync.get(key)
            if a != b:
                return f"config.{key}", f"LoGRA config field {key!r} differs: trainer has {a!r}, worker has {b!r}"
        missing = [n for n in self.params if n not in worker.params]
        extra = [n for n in worker.params if n not in self.params]
        if missing or extra:
            detail = (f"{missing[0]!r} is in the trainer's model but not the worker's" if missing
                      else f"{extra[0]!r} is in the worker's model but not the trainer's")
            return "parameter names", (f"parameter names differ ({len(missing)} missing, {len(extra)} extra "
                                       f"on the worker): {detail}")
        for name, (shape, dtype) in self.params.items():
            w_shape, w_dtype = worker.params[name]
            if list(shape) != list(w_shape):
                return f"shape of {name}", f"shape of parameter {name!r} differs: trainer {shape}, worker {w_shape}"
            if dtype != w_dtype:
                return f"dtype of {name}", (f"dtype of parameter {name!r} differs: trainer {dtype}, worker {w_dtype} "
                                            "(bitwise-identical merges need the same dtype)")
        return None


# ------------------------------------------------------------------ full weights
def encode_full_weights(model: nn.Module) -> bytes:
    """Safetensors bytes of every parameter of ``model``, keyed by stable name (tied weights once)."""
    return _st_save({stable_name(n): p.detach().contiguous().cpu() for n, p in model.named_parameters()})


def decode_full_weights(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `encode_full_weights` (CPU tensors)."""
    return dict(_st_load(data))


@torch.no_grad()
def load_full_weights(model: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy ``tensors`` (stable name → tensor) into ``model``'s parameters in place.

    Raises:
        DeltaMismatchError: a name is unknown or (with ``strict``) a parameter is missing,
            or a shape differs. Nothing is copied in that case.
    """
    params = {stable_name(n): p for n, p in model.named_parameters()}
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(set(params) - set(tensors)) if strict else []
    if unknown or missing:
        raise DeltaMismatchError(f"full weights do not fit the model: unknown {unknown[:3]}, missing {missing[:3]}")
    for name, t in tensors.items():
        if t.shape != params[name].shape:
            raise DeltaMismatchError(f"full weight {name} is {tuple(t.shape)}, model has {tuple(params[name].shape)}")
    for name, t in tensors.items():
        params[name].copy_(t)


# ------------------------------------------------------------------ wire
@dataclass
class _Message:
    kind: str
    header: dict[str, Any]
    blobs: list[bytes]


def _as_tensor(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        # Sending only reads the buffer; copying a gigabyte of weights to silence
        # "non-writable buffer" would be waste.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


@dataclass
class _Outgoing:
    works: list[Any]
    tensors: list[torch.Tensor]  # kept alive until the sends complete
    nbytes: int


class _Link:
    """One point-to-point link to ``peer``: length-prefixed JSON header plus binary blobs."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None, timeout: float | None) -> None:
        self.peer = peer
        self.group = group
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _wait(self, work: dist.Work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def post(self, kind: str, header: dict[str, Any] | None = None, blobs: list[bytes] = ()) -> _Outgoing:
        """Start sending one message without waiting for the peer to receive it.

        gloo completes a send only once the peer has posted the matching receive, so a
        sender that must also read the peer's replies (which the peer sends before
        reading our next message) posts first and waits with `complete` afterwards.
        """
        meta = json.dumps({"kind": kind, "header": header or {}, "blobs": [len(b) for b in blobs]}).encode()
        tensors = [torch.tensor([len(meta)], dtype=torch.int64), _as_tensor(meta)]
        tensors += [_as_tensor(b) for b in blobs if len(b)]
        tensors = [t.to(self.device) for t in tensors]
        try:
            works = [dist.isend(t, self.peer, group=self.group) for t in tensors]
        except (RuntimeError, dist.DistError) as e:
            raise _LinkError(f"send to rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e
        return _Outgoing(works, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def complete(self, outgoing: _Outgoing) -> None:
        """Wait until the peer has received a posted message."""
        try:
            for w in outgoing.works:
                self._wait(w)
        except (RuntimeError, dist.DistError) as e:
            raise _LinkError(f"send to rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e

    def send(self, kind: str, header: dict[str, Any] | None = None, blobs: list[bytes] = ()) -> int:
        """Send one message and wait until the peer has received it; returns the bytes sent."""
        outgoing = self.post(kind, header, blobs)
        self.complete(outgoing)
        return outgoing.nbytes

    def _recv_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._wait(dist.irecv(t, self.peer, group=self.group))
        return t.cpu()

    def recv(self) -> _Message:
        """Receive one message (blocking, up to the link's timeout)."""
        try:
            size = int(self._recv_tensor(1, torch.int64).item())
            meta = json.loads(self._recv_tensor(size, torch.uint8).numpy().tobytes())
            blobs = [self._recv_tensor(n, torch.uint8).numpy().tobytes() if n else b"" for n in meta["blobs"]]
        except (RuntimeError, dist.DistError) as e:
            raise _LinkError(f"receive from rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e
        return _Message(meta["kind"], meta["header"], blobs)


# ------------------------------------------------------------------ trainer side
@dataclass
class SyncTestHooks:
    """Fault injection for tests: per worker rank, the update steps to tamper with.

    Attributes:
        drop: steps whose delta is never sent to that worker (it must detect the gap).
        corrupt: steps whose factors are altered in transit (checksum mismatch).
        delay: steps whose delta is held back and sent after the next step's (reorder).
    """

    drop: dict[int, set[int]] = field(default_factory=dict)
    corrupt: dict[int, set[int]] = field(default_factory=dict)
    delay: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class WorkerStatus:
    """The trainer's view of one rollout worker.

    Attributes:
        rank: the worker's rank in the process group.
        state: ``'live'``, ``'refused'`` (at handshake), ``'lost'`` (link failed or timed
            out) or ``'closed'`` (after `PolicyPublisher.close`).
        reason: why it was refused or lost.
        step: the policy step it last acknowledged.
        resyncs: how many full-weight resyncs it has received.
        events: notable events (``'update 7: resync (gap: ...)'``), oldest first.
    """

    rank: int
    state: str = "live"
    reason: str = ""
    step: int = -1
    resyncs: int = 0
    events: list[str] = field(default_factory=list)


@dataclass
class PublishReport:
    """What one `PolicyPublisher.publish` did.

    Attributes:
        step: index of the published update.
        mode: ``'delta'`` or ``'full'``.
        payload_bytes: bytes of one copy of the message (delta + dense tensors, or full weights).
        sent_bytes: bytes put on the wire to all workers, resyncs included.
        encode_s: seconds to build the message (checksums and serialisation).
        deliver_s: seconds from the first send until every worker answered.
        outcome: per worker rank: ``'applied'``, ``'stale'``, ``'resynced: <reason>'``,
            ``'dropped (test hook)'`` or ``'lost: <reason>'``.
    """

    step: int
    mode: str
    payload_bytes: int
    sent_bytes: int
    encode_s: float
    deliver_s: float
    outcome: dict[int, str]


@dataclass
class Rollout:
    """One sampled response from a rollout worker.

    Attributes:
        prompt_ids: the prompt's token ids.
        response_ids: sampled token ids (ending with EOS if one was sampled).
        logprobs: log-probability of each response token under the sampling
            distribution (temperature applied) of the worker's policy.
        worker: rank of the worker that generated it.
        policy_step: the policy step the worker held.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    worker: int
    policy_step: int


class PolicyPublisher:
    """Trainer side of policy sync: handshake, publish every update, resync, generate.

    Construct it on the trainer rank after the process group is initialised and after
    the optimizer (its targets and dense parameters are read from it); the constructor
    performs the handshake with every worker rank, which must call
    `RolloutWorker.connect` at the same time. Then call `publish` with the delta of
    every update (in order), `generate` to sample from the workers, and `close` at the end.

    Args:
        model: the trainer's policy (weights are only read).
        config: the LoGRA config (its sync fields must match every worker's).
        worker_ranks: global ranks of the rollout workers.
        optimizer: the trainer's `LoGRAOptimizer`; its ``dense_parameters()`` (non-target
            parameters trained by AdamW) are sent densely with each delta, and its
            ``num_updates`` is the current step.
        group: process group holding trainer and workers (default: the world).
        timeout: seconds to wait on any one link before declaring the worker lost.
        checksum_every: put the target-weight checksum into every k-th delta (workers
            verify it; 0 = never). It is a BLAKE2 digest of the weights' bytes on the CPU:
            cheap for small models, but ``logra bench sync`` measures ~100 s per update
            for the fp32 target weights of a 7B model on one CPU thread, so large runs
            should verify every N updates (a corrupted delta is then caught, and repaired
            by a full resync, at the next verified update).
        test_hooks: fault injection for tests.

    Raises:
        NoWorkersLeftError: no worker passed the handshake.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoGRAConfig,
        worker_ranks: list[int],
        *,
        optimizer: LoGRAOptimizer | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = 300.0,
        checksum_every: int = 1,
        test_hooks: SyncTestHooks | None = None,
    ) -> None:
        self.model = model
        self.config = config
        if checksum_every < 0:
            raise ValueError(f"checksum_every must be >= 0, got {checksum_every}")
        self.checksum_every = checksum_every
        self.hooks = test_hooks or SyncTestHooks()
        self.step = optimizer.num_updates if optimizer is not None else policy_step(model)
        ids = {id(p) for p in optimizer.dense_parameters()} if optimizer is not None else set()
        self.dense_names = [stable_name(n) for n, p in model.named_parameters() if id(p) in ids]
        self.workers = {r: WorkerStatus(r) for r in worker_ranks}
        self._links = {r: _Link(r, group, timeout) for r in worker_ranks}
        self._held: dict[int, list[_Message]] = {}
        self._handshake()

    # -------------------------------------------------------------- bookkeeping
    @property
    def live(self) -> list[int]:
        """Ranks of the workers still in service."""
        return [r for r, w in self.workers.items() if w.state == "live"]

    @property
    def refused(self) -> dict[int, str]:
        """Workers refused at handshake, with the reason."""
        return {r: w.reason for r, w in self.workers.items() if w.state == "refused"}

    @property
    def lost(self) -> dict[int, str]:
        """Workers lost since (dead or timed out), with the reason."""
        return {r: w.reason for r, w in self.workers.items() if w.state == "lost"}

    def _lose(self, rank: int, reason: str) -> None:
        w = self.workers[rank]
        if w.state == "live":
            w.state, w.reason = "lost", reason
            w.events.append(f"update {self.step - 1}: lost ({reason})")
            LOG.warning("rollout worker rank %d lost at update %d: %s; continuing with %d worker(s)",
                        rank, self.step - 1, reason, len(self.live))

    def _require_workers(self) -> None:
        if not self.live:
            detail = "; ".join(f"rank {r}: {w.state} ({w.reason})" for r, w in self.workers.items())
            raise NoWorkersLeftError(f"no rollout worker left after update {self.step - 1}: {detail}")

    def _full_message(self) -> _Message:
        header = {"step": self.step, "checksum": weights_checksum(self.model)}
        return _Message("full", header, [encode_full_weights(self.model)])

    # -------------------------------------------------------------- handshake
    def _handshake(self) -> None:
        mine = PolicyIdentity.of(self.model, self.config, step=self.step)
        full: _Message | None = None
        for rank in list(self.workers):
            link = self._links[rank]
            try:
                hello = link.recv()
                if hello.kind != "hello":
                    raise _LinkError(f"expected 'hello', got {hello.kind!r}")
                theirs = PolicyIdentity.from_dict(hello.header)
                problem = mine.mismatch(theirs)
                if problem is not None:
                    what, message = problem
                    link.send("refuse", {"field": what, "reason": message})
                    w = self.workers[rank]
                    w.state, w.reason = "refused", message
                    LOG.warning("rollout worker rank %d refused at handshake: %s", rank, message)
                    continue
                if theirs.step == self.step and theirs.checksum == mine.checksum:
                    link.send("welcome", {"step": self.step, "full": False})
                else:
                    full = full or self._full_message()
                    link.send("welcome", {"step": self.step, "full": True})
                    link.send("full", full.header, full.blobs)
                    self.workers[rank].resyncs += 1
                reply = link.recv()
                self._check_ack(rank, reply)
            except _LinkError as e:
                self._lose(rank, f"handshake failed: {e}")
        self._require_workers()

    def _check_ack(self, rank: int, reply: _Message) -> str:
        if reply.kind == "error":
            raise _LinkError(f"worker reported an error: {reply.header.get('error')}")
        if reply.kind != "ack":
            raise _LinkError(f"expected 'ack', got {reply.kind!r}")
        self.workers[rank].step = reply.header["step"]
        return reply.header["status"]

    # -------------------------------------------------------------- publish
    def _encode_delta(self, delta: PolicyDelta) -> _Message:
        verify = bool(self.checksum_every) and delta.step % self.checksum_every == 0
        if verify and delta.checksum is None:
            delta.checksum = weights_checksum(self.model, sorted(delta.factors))
        header: dict[str, Any] = {"step": delta.step, "checksum": delta.checksum, "dense": None}
        blobs = [delta.to_bytes()]
        if self.dense_names:
            params = {stable_name(n): p for n, p in self.model.named_parameters()}
            blobs.append(_st_save({n: params[n].detach().contiguous().cpu() for n in self.dense_names}))
            header["dense"] = weights_checksum(self.model, self.dense_names) if verify else ""
        return _Message("delta", header, blobs)

    @staticmethod
    def _corrupted(delta: PolicyDelta, message: _Message) -> _Message:
        name = sorted(delta.factors)[0]
        bad = dict(delta.factors)
        bad[name] = bad[name].clone()
        bad[name].view(-1)[0] += 1.0
        wrong = PolicyDelta(delta.step, delta.projection_index, delta.sync, bad, delta.decay, delta.checksum,
                            delta.metadata)
        return _Message(message.kind, message.header, [wrong.to_bytes()] + message.blobs[1:])

    def publish(self, delta: PolicyDelta, mode: str = "delta") -> PublishReport:
        """Send the update ``delta`` (just applied by the trainer) to every live worker.

        Sets ``delta.checksum`` (target weights after the update) on every
        ``checksum_every``-th update. Waits until every worker has applied it (or been
        resynced, or lost).

        Args:
            delta: the `PolicyDelta` returned by the optimizer's ``apply``/``step``.
            mode: ``'delta'`` (the low-rank delta) or ``'full'`` (all weights as
                safetensors bytes, for comparison).

        Raises:
            NoWorkersLeftError: no worker is left after this update.
            ValueError: ``delta`` is older than the last published update, or bad mode.
        """
        if mode not in ("delta", "full"):
            raise ValueError(f"mode must be 'delta' or 'full', got {mode!r}")
        if delta.step < self.step:
            raise ValueError(f"update {delta.step} was already published (publisher is at step {self.step})")
        self._require_workers()
        self.step = delta.step + 1
        t0 = time.perf_counter()
        message = self._encode_delta(delta) if mode == "delta" else self._full_message()
        full = message if mode == "full" else None
        encode_s = time.perf_counter() - t0
        payload = sum(len(b) for b in message.blobs)
        outcome: dict[int, str] = {}
        posted: dict[int, list[_Outgoing]] = {}
        t1 = time.perf_counter()
        for rank in self.live:
            queue: list[_Message] | None = []
            if mode == "delta" and delta.step in self.hooks.drop.get(rank, ()):
                outcome[rank] = "dropped (test hook)"
            elif mode == "delta" and delta.step in self.hooks.delay.get(rank, ()):
                self._held.setdefault(rank, []).append(message)
                outcome[rank] = "delayed (test hook)"
                queue = None
            elif mode == "delta" and delta.step in self.hooks.corrupt.get(rank, ()):
                queue.append(self._corrupted(delta, message))
            else:
                queue.append(message)
            if queue is not None:
                queue += self._held.pop(rank, [])
            try:
                for m in queue or ():
                    posted.setdefault(rank, []).append(self._links[rank].post(m.kind, m.header, m.blobs))
            except _LinkError as e:
                self._lose(rank, str(e))
                outcome[rank] = f"lost: {e}"
        sent = 0
        for rank, outgoing in posted.items():
            if self.workers[rank].state != "live":
                continue
            link, count, statuses = self._links[rank], len(outgoing), []
            try:
                while count:
                    reply = link.recv()
                    count -= 1
                    if reply.kind == "resync":
                        reason = reply.header.get("reason", "")
                        self.workers[rank].events.append(f"update {delta.step}: resync ({reason})")
                        LOG.info("rollout worker rank %d asked for a full resync at update %d: %s",
                                 rank, delta.step, reason)
                        full = full or self._full_message()
                        outgoing.append(link.post(full.kind, full.header, full.blobs))
                        self.workers[rank].resyncs += 1
                        statuses.append(f"resynced: {reason}")
                        count += 1
                    else:
                        status = self._check_ack(rank, reply)
                        if status != "resynced" or not statuses:
                            statuses.append(status)
                for o in outgoing:
                    link.complete(o)
                    sent += o.nbytes
                outcome[rank] = "; ".join(statuses)
            except _LinkError as e:
                self._lose(rank, str(e))
                outcome[rank] = f"lost: {e}"
        deliver_s = time.perf_counter() - t1
        self._require_workers()
        return PublishReport(delta.step, mode, payload, sent, encode_s, deliver_s, outcome)

    def full_sync(self, ranks: list[int] | None = None) -> PublishReport:
        """Send the trainer's full weights (and step) to ``ranks`` (default: all live workers)."""
        self._require_workers()
        t0 = time.perf_counter()
        message = self._full_message()
        encode_s = time.perf_counter() - t0
        outcome, sent = {}, 0
        t1 = time.perf_counter()
        for rank in (ranks if ranks is not None else self.live):
            try:
                sent += self._links[rank].send(message.kind, message.header, message.blobs)
                outcome[rank] = self._check_ack(rank, self._links[rank].recv())
                self.workers[rank].resyncs += 1
            except _LinkError as e:
                self._lose(rank, str(e))
                outcome[rank] = f"lost: {e}"
        self._require_workers()
        return PublishReport(self.step - 1, "full", len(message.blobs[0]), sent, encode_s,
                             time.perf_counter() - t1, outcome)

    def checksums(self) -> dict[int, str]:
        """Each live worker's `weights_checksum` of all its parameters (lost ones are dropped)."""
        out = {}
        for rank in self.live:
            try:
                self._links[rank].send("checksum")
                reply = self._links[rank].recv()
                out[rank] = reply.header["checksum"]
            except _LinkError as e:
                self._lose(rank, str(e))
        return out

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> list[Rollout]:
        """Sample one response per prompt on the live workers (round-robin split).

        Prompts of a worker lost meanwhile are regenerated on the remaining ones. Prompt
        ``i`` is sampled with seed ``seed + i`` whichever worker runs it.

        Raises:
            NoWorkersLeftError: every worker was lost.
        """
        results: dict[int, Rollout] = {}
        todo = list(range(len(prompts)))
        while todo:
            self._require_workers()
            live = self.live
            assigned = {r: todo[i:: len(live)] for i, r in enumerate(live)}
            for rank, idx in list(assigned.items()):
                if not idx:
                    continue
                request = {"prompts": [prompts[i] for i in idx], "seeds": [seed + i for i in idx],
                           "max_new_tokens": max_new_tokens, "temperature": temperature,
                           "eos_token_id": eos_token_id}
                try:
                    self._links[rank].send("generate", request)
                except _LinkError as e:
                    self._lose(rank, str(e))
                    assigned.pop(rank)
            for rank, idx in assigned.items():
                if not idx or self.workers[rank].state != "live":
                    continue
                try:
                    reply = self._links[rank].recv()
                    if reply.kind != "samples":
                        raise _LinkError(f"expected 'samples', got {reply.kind!r}: {reply.header}")
                except _LinkError as e:
                    self._lose(rank, str(e))
                    continue
                for i, resp, lp in zip(idx, reply.header["responses"], reply.header["logprobs"]):
                    results[i] = Rollout(list(prompts[i]), resp, lp, rank, reply.header["step"])
            todo = [i for i in todo if i not in results]
        return [results[i] for i in range(len(prompts))]

    def close(self) -> None:
        """Tell every live worker to stop serving (errors are ignored: it may be gone)."""
        for rank in self.live:
            try:
                self._links[rank].send("shutdown")
            except _LinkError:
                pass
            self.workers[rank].state, self.workers[rank].reason = "closed", "shut down by the trainer"


# ------------------------------------------------------------------ worker side
class RolloutWorker:
    """Worker side of policy sync: holds its own copy of the policy and keeps it current.

    Args:
        model: the worker's copy of the policy (same architecture and dtype as the
            trainer's; no optimizer installed).
        config: the LoGRA config (sync fields must match the trainer's).
        trainer_rank: global rank of the `PolicyPublisher`.
        group: process group holding trainer and workers (default: the world).
        timeout: seconds to wait for the trainer's next message; ``None`` uses the
            process group's timeout. A trainer that training keeps busy for long between
            updates needs a generous value.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoGRAConfig,
        trainer_rank: int = 0,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self._link = _Link(trainer_rank, group, timeout)
        self.resyncs = 0
        self.events: list[str] = []

    @property
    def step(self) -> int:
        """The policy step this worker holds (updates applied so far)."""
        return policy_step(self.model)

    def _recv(self) -> _Message:
        try:
            return self._link.recv()
        except _LinkError as e:
            raise TrainerLostError(str(e)) from e

    def _send(self, kind: str, header: dict[str, Any] | None = None) -> None:
        try:
            self._link.send(kind, header)
        except _LinkError as e:
            raise TrainerLostError(str(e)) from e

    def connect(self) -> None:
        """Handshake with the trainer (and take its full weights if ours differ).

        Raises:
            HandshakeError: the trainer refused this worker; the message names the
                differing field.
        """
        self._send("hello", PolicyIdentity.of(self.model, self.config).to_dict())
        reply = self._recv()
        if reply.kind == "refuse":
            raise HandshakeError(f"trainer refused this worker: {reply.header['reason']}", reply.header["field"])
        if reply.kind != "welcome":
            raise SyncError(f"expected 'welcome', got {reply.kind!r}")
        if reply.header["full"]:
            try:
                self._load_full(self._recv())
            except (SyncError, DeltaMismatchError) as e:
                if not isinstance(e, TrainerLostError):
                    self._send("error", {"error": f"{type(e).__name__}: {e}"})
                raise
        self._send("ack", {"step": self.step, "status": "resynced" if reply.header["full"] else "in sync"})

    def _load_full(self, message: _Message) -> None:
        load_full_weights(self.model, decode_full_weights(message.blobs[0]))
        got = weights_checksum(self.model)
        if got != message.header["checksum"]:
            raise SyncError(f"full weights for step {message.header['step']} arrived with checksum {got}, "
                            f"trainer sent {message.header['checksum']}")
        set_policy_step(self.model, message.header["step"])
        self.resyncs += 1

    def _apply(self, message: _Message) -> tuple[str, str]:
        """Apply a delta message; returns ``(reply kind, status or resync reason)``."""
        step, current = message.header["step"], self.step
        if step < current:
            return "ack", "stale"
        if step > current:
            return "resync", f"gap: holds the policy after {current} updates, got update {step}"
        delta = PolicyDelta.from_bytes(message.blobs[0])
        try:
            apply_delta(self.model, delta, self.config)
        except DeltaMismatchError as e:
            return "resync", f"delta refused: {e}"
        dense = None
        if message.header["dense"] is not None:
            dense = dict(_st_load(message.blobs[1]))
            load_full_weights(self.model, dense, strict=False)
        if message.header["checksum"]:
            got = weights_checksum(self.model, sorted(delta.factors))
            if got != message.header["checksum"]:
                return "resync", f"checksum mismatch after update {step}: {got} != {message.header['checksum']}"
        if dense is not None and message.header["dense"]:
            if weights_checksum(self.model, sorted(dense)) != message.header["dense"]:
                return "resync", f"dense-parameter checksum mismatch after update {step}"
        return "ack", "applied"

    def _generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from transformers import GenerationConfig

        temperature = float(request["temperature"])
        eos = request["eos_token_id"]
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        pad = getattr(self.model.config, "pad_token_id", None)
        pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
        gen = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=0,
            top_p=1.0, max_new_tokens=int(request["max_new_tokens"]), eos_token_id=eos, pad_token_id=pad,
            output_scores=True, return_dict_in_generate=True,
        )
        device = next(self.model.parameters()).device
        responses, logprobs = [], []
        was_training = self.model.training
        self.model.eval()
        try:
            for prompt, seed in zip(request["prompts"], request["seeds"]):
                torch.manual_seed(seed)
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                with torch.no_grad():
                    out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
                    scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
                resp = out.sequences[0, ids.shape[1]:]
                responses.append(resp.tolist())
                logprobs.append(scores[0, : resp.shape[0]].float().tolist())
        finally:
            self.model.train(was_training)
        return {"responses": responses, "logprobs": logprobs, "step": self.step}

    def receive(self) -> str:
        """Wait for and handle one message from the trainer; returns its kind.

        ``'delta'`` / ``'full'``: policy updated (or a resync requested and received);
        ``'generate'``: responses sampled and sent; ``'checksum'``: answered;
        ``'shutdown'``: the trainer is done (stop calling).

        Raises:
            TrainerLostError: the link to the trainer failed or timed out.
        """
        message = self._recv()
        kind = message.kind
        try:
            if kind == "delta":
                reply, detail = self._apply(message)
                if reply == "resync":
                    self.events.append(f"update {message.header['step']}: resync ({detail})")
                    self._send("resync", {"reason": detail, "have": self.step})
                else:
                    self._send("ack", {"step": self.step, "status": detail})
            elif kind == "full":
                self._load_full(message)
                self._send("ack", {"step": self.step, "status": "resynced"})
            elif kind == "generate":
                self._send("samples", self._generate(message.header))
            elif kind == "checksum":
                self._send("checksum", {"checksum": weights_checksum(self.model), "step": self.step})
            elif kind != "shutdown":
                raise SyncError(f"unknown message kind {kind!r}")
        except TrainerLostError:
            raise
        except Exception as e:
            # Tell the trainer why (it drops this worker) instead of leaving it waiting.
            self._send("error", {"error": f"{type(e).__name__}: {e}"})
            raise
        return kind

    def serve(self) -> None:
        """Handle messages until the trainer sends ``shutdown``."""
        while self.receive() != "shutdown":
            pass
