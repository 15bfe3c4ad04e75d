"""The wire format of policy sync: full weights as safetensors bytes, and `Link`, one
point-to-point link carrying length-prefixed JSON headers plus binary blobs."""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from torch import nn

from ..errors import DeltaMismatchError, LinkError
from ..projection import stable_name


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of CPU copies of ``tensors``."""
    return _st_save({name: t.detach().contiguous().cpu() for name, t in tensors.items()})


def encode_full_weights(model: nn.Module) -> bytes:
    """Safetensors bytes of every parameter of ``model``, keyed by stable name (tied weights once)."""
    return encode_tensors({stable_name(n): p for n, p in model.named_parameters()})


def decode_full_weights(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `encode_full_weights` and `encode_tensors` (CPU tensors)."""
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



@dataclass
class Message:
    """One protocol message: its kind, a JSON header and binary blobs."""

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
class Outgoing:
    """A message posted with `Link.post` whose sends may still be in flight."""

    works: list[Any]
    tensors: list[torch.Tensor]  # kept alive until the sends complete
    nbytes: int


class Link:
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

    def post(self, kind: str, header: dict[str, Any] | None = None, blobs: list[bytes] = ()) -> Outgoing:
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
            raise LinkError(f"send to rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e
        return Outgoing(works, tensors, sum(t.numel() * t.element_size() for t in tensors))

    def complete(self, outgoing: Outgoing) -> None:
        """Wait until the peer has received a posted message."""
        try:
            for w in outgoing.works:
                self._wait(w)
        except (RuntimeError, dist.DistError) as e:
            raise LinkError(f"send to rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e

    def send(self, kind: str, header: dict[str, Any] | None = None, blobs: list[bytes] = ()) -> int:
        """Send one message and wait until the peer has received it; returns the bytes sent."""
        outgoing = self.post(kind, header, blobs)
        self.complete(outgoing)
        return outgoing.nbytes

    def _recv_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._wait(dist.irecv(t, self.peer, group=self.group))
        return t.cpu()

    def recv(self) -> Message:
        """Receive one message (blocking, up to the link's timeout)."""
        try:
            size = int(self._recv_tensor(1, torch.int64).item())
            meta = json.loads(self._recv_tensor(size, torch.uint8).numpy().tobytes())
            blobs = [self._recv_tensor(n, torch.uint8).numpy().tobytes() if n else b"" for n in meta["blobs"]]
        except (RuntimeError, dist.DistError) as e:
            raise LinkError(f"receive from rank {self.peer} failed: {str(e).splitlines()[0][:300]}") from e
        return Message(meta["kind"], meta["header"], blobs)

