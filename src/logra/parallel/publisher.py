"""Trainer side of policy sync: `PolicyPublisher` sends every update to the rollout workers.

See `logra.parallel` for the protocol; `logra.parallel.worker` is the other end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from ..config import LoGRAConfig
from ..delta import PolicyDelta, policy_step, weights_checksum
from ..errors import LinkError, NoWorkersLeftError
from ..optimizer import LoGRAOptimizer
from ..projection import stable_name
from .identity import PolicyIdentity
from .wire import Link, Message, Outgoing, encode_full_weights, encode_tensors

LOG = logging.getLogger(__name__)


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
class WorkerRollout:
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
            ``num_updates`` is the current step. Its fitted projections
            (``distribution='inputs'``) travel with every full-weight resync.
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
        ValueError: no ``optimizer`` for a config with ``distribution='inputs'``.
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
        if optimizer is None and config.distribution == "inputs":
            # a resync without the fitted projections would leave workers unable to merge later deltas
            raise ValueError("PolicyPublisher needs the trainer's optimizer with distribution='inputs': full "
                             "resyncs send its fitted projections")
        self.optimizer = optimizer
        self.step = optimizer.num_updates if optimizer is not None else policy_step(model)
        ids = {id(p) for p in optimizer.dense_parameters()} if optimizer is not None else set()
        self.dense_names = [stable_name(n) for n, p in model.named_parameters() if id(p) in ids]
        self.workers = {r: WorkerStatus(r) for r in worker_ranks}
        self._links = {r: Link(r, group, timeout) for r in worker_ranks}
        self._held: dict[int, list[Message]] = {}
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

    def _full_message(self) -> Message:
        header = {"step": self.step, "checksum": weights_checksum(self.model)}
        blobs = [encode_full_weights(self.model)]
        fitted = self.optimizer.fitted_projections() if self.optimizer is not None else {}
        if fitted:  # not rebuildable from a seed: without them the worker would refuse every later delta
            blobs.append(encode_tensors(fitted))
        return Message("full", header, blobs)

    # -------------------------------------------------------------- handshake
    def _handshake(self) -> None:
        mine = PolicyIdentity.of(self.model, self.config, step=self.step)
        full: Message | None = None
        for rank in list(self.workers):
            link = self._links[rank]
            try:
                hello = link.recv()
                if hello.kind != "hello":
                    raise LinkError(f"expected 'hello', got {hello.kind!r}")
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
            except LinkError as e:
                self._lose(rank, f"handshake failed: {e}")
        self._require_workers()

    def _check_ack(self, rank: int, reply: Message) -> str:
        if reply.kind == "error":
            raise LinkError(f"worker reported an error: {reply.header.get('error')}")
        if reply.kind != "ack":
            raise LinkError(f"expected 'ack', got {reply.kind!r}")
        self.workers[rank].step = reply.header["step"]
        return reply.header["status"]

    # -------------------------------------------------------------- publish
    def _encode_delta(self, delta: PolicyDelta) -> Message:
        verify = bool(self.checksum_every) and delta.step % self.checksum_every == 0
        if verify and delta.checksum is None:
            delta.checksum = weights_checksum(self.model, sorted(delta.factors))
        header: dict[str, Any] = {"step": delta.step, "checksum": delta.checksum, "dense": None}
        if delta.dense:  # the delta carries the densely trained tensors itself
            header["dense"] = weights_checksum(self.model, sorted(delta.dense)) if verify else ""
        return Message("delta", header, [delta.to_bytes()])

    @staticmethod
    def _corrupted(delta: PolicyDelta, message: Message) -> Message:
        name = sorted(delta.factors)[0]
        bad = dict(delta.factors)
        bad[name] = bad[name].clone()
        bad[name].view(-1)[0] += 1.0
        wrong = dataclasses.replace(delta, factors=bad)
        return Message(message.kind, message.header, [wrong.to_bytes()] + message.blobs[1:])

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
        posted: dict[int, list[Outgoing]] = {}
        t1 = time.perf_counter()
        for rank in self.live:
            queue: list[Message] | None = []
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
            except LinkError as e:
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
            except LinkError as e:
                self._lose(rank, str(e))
                outcome[rank] = f"lost: {e}"
        deliver_s = time.perf_counter() - t1
        self._require_workers()
        return PublishReport(delta.step, mode, payload, sent, encode_s, deliver_s, outcome)

    def full_sync(self, ranks: list[int] | None = None, step: int | None = None) -> PublishReport:
        """Send the trainer's full weights (and step) to ``ranks`` (default: all live workers).

        Args:
            ranks: the workers to resync (default: every live one).
            step: the policy step the trainer's weights are at, if it moved without `publish`
                (a checkpoint loaded into the trainer's model: its update count, also an
                earlier one); from then on it is the publisher's step.
        """
        if step is not None:
            self.step = step
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
            except LinkError as e:
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
            except LinkError as e:
                self._lose(rank, str(e))
        return out

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        top_p: float = 1.0,
    ) -> list[WorkerRollout]:
        """Sample one response per prompt on the live workers (round-robin split).

        Prompts of a worker lost meanwhile are regenerated on the remaining ones. Prompt
        ``i`` is sampled with seed ``seed + i`` whichever worker runs it. With ``top_p < 1``
        sampling is truncated to the nucleus; the log-probabilities are those of the full
        tempered distribution, as `logra.rl.generate_rollouts` records them.

        Raises:
            NoWorkersLeftError: every worker was lost.
        """
        results: dict[int, WorkerRollout] = {}
        todo = list(range(len(prompts)))
        while todo:
            self._require_workers()
            live = self.live
            assigned = {r: todo[i:: len(live)] for i, r in enumerate(live)}
            for rank, idx in list(assigned.items()):
                if not idx:
                    continue
                request = {"prompts": [prompts[i] for i in idx], "seeds": [seed + i for i in idx],
                           "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                           "eos_token_id": eos_token_id}
                try:
                    self._links[rank].send("generate", request)
                except LinkError as e:
                    self._lose(rank, str(e))
                    assigned.pop(rank)
            for rank, idx in assigned.items():
                if not idx or self.workers[rank].state != "live":
                    continue
                try:
                    reply = self._links[rank].recv()
                    if reply.kind != "samples":
                        raise LinkError(f"expected 'samples', got {reply.kind!r}: {reply.header}")
                except LinkError as e:
                    self._lose(rank, str(e))
                    continue
                for i, resp, lp in zip(idx, reply.header["responses"], reply.header["logprobs"], strict=False):
                    results[i] = WorkerRollout(list(prompts[i]), resp, lp, rank, reply.header["step"])
            todo = [i for i in todo if i not in results]
        return [results[i] for i in range(len(prompts))]

    def close(self) -> None:
        """Tell every live worker to stop serving (errors are ignored: it may be gone)."""
        for rank in self.live:
            try:
                self._links[rank].send("shutdown")
            except LinkError:
                pass
            self.workers[rank].state, self.workers[rank].reason = "closed", "shut down by the trainer"
