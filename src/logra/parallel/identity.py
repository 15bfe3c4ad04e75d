"""What trainer and rollout worker must share: `PolicyIdentity`, exchanged at handshake."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import LoGRAConfig
from ..delta import policy_step, weights_checksum
from ..projection import stable_name


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

