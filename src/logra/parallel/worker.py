"""Worker side of policy sync: `RolloutWorker` keeps its copy of the policy current and samples.

See `logra.parallel` for the protocol; `logra.parallel.publisher` is the other end.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import LoGRAConfig
from ..delta import PolicyDelta, apply_delta, keep_projections, policy_step, set_policy_step, weights_checksum
from ..errors import DeltaMismatchError, HandshakeError, LinkError, SyncError, TrainerLostError
from .identity import PolicyIdentity
from .wire import Link, Message, decode_full_weights, load_full_weights


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
        self._link = Link(trainer_rank, group, timeout)
        self.resyncs = 0
        self.events: list[str] = []

    @property
    def step(self) -> int:
        """The policy step this worker holds (updates applied so far)."""
        return policy_step(self.model)

    def _recv(self) -> Message:
        try:
            return self._link.recv()
        except LinkError as e:
            raise TrainerLostError(str(e)) from e

    def _send(self, kind: str, header: dict[str, Any] | None = None) -> None:
        try:
            self._link.send(kind, header)
        except LinkError as e:
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

    def _load_full(self, message: Message) -> None:
        # with distribution='inputs' the fitted projections come as a second blob
        fitted = decode_full_weights(message.blobs[1]) if len(message.blobs) > 1 else {}
        load_full_weights(self.model, decode_full_weights(message.blobs[0]))
        got = weights_checksum(self.model)
        if got != message.header["checksum"]:
            raise SyncError(f"full weights for step {message.header['step']} arrived with checksum {got}, "
                            f"trainer sent {message.header['checksum']}")
        keep_projections(self.model, fitted)
        set_policy_step(self.model, message.header["step"])
        self.resyncs += 1

    def _apply(self, message: Message) -> tuple[str, str]:
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
        dense = delta.dense if message.header["dense"] is not None else None
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
            top_p=float(request.get("top_p", 1.0)), max_new_tokens=int(request["max_new_tokens"]), eos_token_id=eos,
            pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
        )
        device = next(self.model.parameters()).device
        responses, logprobs = [], []
        was_training = self.model.training
        self.model.eval()
        try:
            for prompt, seed in zip(request["prompts"], request["seeds"], strict=True):
                torch.manual_seed(seed)
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                with torch.no_grad():
                    out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
                resp = out.sequences[0, ids.shape[1]:]
                # the full tempered distribution's log-probabilities (not the nucleus'), as the
                # trainer's own sampler records them: the loss's importance weights expect those
                logits = torch.stack(out.logits, dim=1)[0].float() / (temperature if temperature > 0 else 1.0)
                lp = logits.log_softmax(-1).gather(-1, resp[:, None])[:, 0]
                responses.append(resp.tolist())
                logprobs.append(lp.tolist())
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
