"""`PolicyDelta`: the compact update the trainer applies and sends to rollout engines.

Per target it carries the factor ``U`` (``[out, r]`` in ``factor_dtype``) of
``ΔW = -U A`` plus the seed information that rebuilds ``A``: ``out·r`` values instead of
``out·in`` weights. Projections fitted to the trainer's inputs (``distribution='inputs'``)
cannot be rebuilt; the first delta of each stream carries them (and, with refresh windows,
the first delta after each re-fit) and receivers keep them until the next ones arrive.
Trainer and receivers share the two steps that decide the bits:
`merge_update` (the one merge) and `logra.projection.build_projection` (the one way a
projection is drawn), so a receiver that applies the same deltas in order with
`apply_delta` holds bitwise the same weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from torch import nn

from .config import LoGRAConfig
from .errors import DeltaMismatchError
from .projection import build_projection, projection_key, stable_name

_STEP_ATTR = "_logra_policy_step"
_SCALE_KEY = "column_scale:"  # safetensors key prefix of a column-scale vector
_DENSE_KEY = "dense:"  # safetensors key prefix of a densely trained non-target tensor
_PROJECTION_KEY = "projection:"  # safetensors key prefix of a fitted projection
_FITTED_ATTR = "_logra_fitted_projections"


@dataclass
class PolicyDelta:
    """One applied update in compact form.

    Attributes:
        step: index of the update (number of updates applied before it).
        projection_index: which projection was in force (see `projection_index`).
        sync: the config's `SYNC_FIELDS` (rank, seed, distribution, refresh, ...).
        factors: per target stable name, ``U`` with ``ΔW = -U A``.
        decay: decoupled weight decay applied first, ``W *= 1 - decay`` (0 = none).
        checksum: optional digest of the sender's target weights after the update.
        metadata: free-form JSON-serialisable annotations.
        column_scales: per target, the column scales ``c`` (``[in]`` fp32) of its projection
            ``A·diag(c)`` (``LoGRAConfig.column_scale='input'``); absent targets use ``A``.
        dense: the new values of the non-target parameters a native AdamW trains
            (``non_target`` ``'adamw'``/``'sketch'``), by stable name, in their own dtype: the
            part of the update that has no low-rank form. Empty with ``'freeze'`` (paper).
        shapes: per target, the ``[out, in]`` shape of the weight it was made for; a
            receiver whose weight differs in any dimension is refused.
        base_checksum: on the first delta an optimizer makes (after construction or a
            resume), the digest of the target weights it started from: a receiver that
            holds other weights in the same dtype is refused at the first delta, not left
            to drift (a receiver in another dtype, e.g. a bf16 rollout copy, cannot hold
            the same bytes and is not checked).
        dtype: the dtype of the trainer's target weights (``'float32'``), with ``base_checksum``.
        fitted: the targets whose projection was fitted to the trainer's inputs
            (``distribution='inputs'``) rather than drawn from the seed.
        projections: those fitted projections (``[r, in]`` fp32) by input group
            (`logra.projection.projection_key` with ``shared=True``: the q/k/v and the gate/up
            layers of a decoder layer read one input and have one), on the first delta of each
            stream (the one with ``base_checksum``) and, with refresh windows, the first delta
            after each re-fit; other deltas name them in ``fitted`` and receivers use the ones
            they kept.
    """

    step: int
    projection_index: int
    sync: dict[str, Any]
    factors: dict[str, torch.Tensor]
    decay: float = 0.0
    checksum: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    column_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    base_checksum: str | None = None
    dtype: str | None = None
    fitted: list[str] = field(default_factory=list)
    projections: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the factors, column scales, dense tensors and carried projections (the
        payload; seeds and names are negligible)."""
        tensors = [*self.factors.values(), *self.column_scales.values(), *self.dense.values(),
                   *self.projections.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to_bytes(self) -> bytes:
        """Serialise (safetensors: factors as tensors, the rest as JSON metadata)."""
        header = {
            "step": self.step, "projection_index": self.projection_index, "sync": self.sync,
            "decay": self.decay, "checksum": self.checksum, "metadata": self.metadata,
            "shapes": self.shapes, "base_checksum": self.base_checksum, "dtype": self.dtype, "fitted": self.fitted,
        }
        tensors = {name: u.detach().contiguous().cpu() for name, u in self.factors.items()}
        tensors.update({_SCALE_KEY + name: c.detach().contiguous().cpu() for name, c in self.column_scales.items()})
        tensors.update({_DENSE_KEY + name: t.detach().contiguous().cpu() for name, t in self.dense.items()})
        tensors.update({_PROJECTION_KEY + name: a.detach().contiguous().cpu() for name, a in self.projections.items()})
        return _st_save(tensors, metadata={"logra": json.dumps(header)})

    @classmethod
    def from_bytes(cls, data: bytes) -> PolicyDelta:
        """Inverse of `to_bytes`.

        Raises:
            DeltaMismatchError: ``data`` is not a whole serialised `PolicyDelta` (garbage,
                truncated, or another safetensors file), in one line.
        """
        from safetensors import SafetensorError

        # Bytes come from a link or a file: anything malformed is one refusal, never a parser traceback.
        try:
            header_len = int.from_bytes(data[:8], "little")
            if len(data) < 8 or header_len > len(data) - 8:
                raise ValueError(f"{len(data)} bytes cannot hold the {header_len:,}-byte header they announce")
            meta = json.loads(data[8: 8 + header_len]).get("__metadata__") or {}
            if "logra" not in meta:
                raise ValueError("a safetensors file without the PolicyDelta header")
            header = json.loads(meta["logra"])
            tensors = _st_load(data)
            prefixes = (_SCALE_KEY, _DENSE_KEY, _PROJECTION_KEY)
            parts: dict[str, dict[str, torch.Tensor]] = {"": {}, **{p: {} for p in prefixes}}
            for key, value in tensors.items():
                prefix = next((p for p in prefixes if key.startswith(p)), "")
                parts[prefix][key[len(prefix):]] = value
            return cls(factors=parts[""], column_scales=parts[_SCALE_KEY], dense=parts[_DENSE_KEY],
                       projections=parts[_PROJECTION_KEY], **header)
        except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, SafetensorError) as e:
            detail = " ".join(str(e).split())[:200]
            raise DeltaMismatchError(f"these {len(data):,} bytes are not a serialised PolicyDelta: "
                                     f"{type(e).__name__}: {detail}") from None


def check_sync(delta: PolicyDelta, config: LoGRAConfig) -> None:
    """Raise `DeltaMismatchError` if ``delta`` was made with other sync fields than ``config``."""
    mismatch = config.sync_mismatch(delta.sync)
    if mismatch is not None:
        key, theirs, ours = mismatch
        raise DeltaMismatchError(f"delta was made with {key}={theirs!r} but this config has {key}={ours!r}")


def delta_projection(delta: PolicyDelta, config: LoGRAConfig, name: str, in_features: int,
                     device: torch.device | str | None = None,
                     kept: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The projection that was in force for target ``name`` when ``delta`` was made:
    `logra.projection.build_projection` (the trainer's own builder, times the delta's column
    scales if it carries them), or for a fitted target the projection the delta carries or,
    failing that, the one in ``kept`` (the receiver's, from the first delta of the stream or a
    full resync).

    Raises:
        DeltaMismatchError: a fitted projection is neither carried nor kept, or has the wrong shape.
    """
    if name not in delta.fitted:
        return build_projection(config, name, delta.projection_index, in_features, device,
                                delta.column_scales.get(name))
    group = projection_key(name, True)
    a = delta.projections.get(group)
    if a is None and kept is not None:
        a = kept.get(group)
    if a is None:
        raise DeltaMismatchError(
            f"update {delta.step}: the projection of {name} was fitted to the trainer's inputs and travels with the "
            "first delta of the stream (and of each refresh window), which this receiver has not applied (resync "
            "it with the trainer's LoGRAOptimizer.fitted_projections, as VLLMPolicy.load_from_model and rollout "
            "workers do, or resume the trainer, whose next delta carries them)")
    if tuple(a.shape) != (config.rank, in_features):
        raise DeltaMismatchError(f"update {delta.step}: the fitted projection of {name} is {tuple(a.shape)}, "
                                 f"expected {(config.rank, in_features)}")
    return a if device is None else a.to(device)


def kept_projections(model: nn.Module) -> dict[str, torch.Tensor]:
    """The fitted projections ``model`` received last, with a delta that carried them (a
    stream's first, or a refresh window's) or with a full resync (by input group)."""
    return getattr(model, _FITTED_ATTR, {})


def keep_projections(model: nn.Module, projections: Mapping[str, torch.Tensor]) -> None:
    """Keep fitted projections (by input group) on ``model`` for the deltas that follow, in
    place of any it held: what a full-weight resync does with the trainer's
    `LoGRAOptimizer.fitted_projections` (`apply_delta` keeps those a delta carries itself).
    An empty mapping leaves none kept, so a receiver resynced for another run never merges
    that run's deltas with the last run's projections; a delta that needs them and
    does not carry them is then refused."""
    setattr(model, _FITTED_ATTR, dict(projections))


def merge_update(weight: torch.Tensor, u: torch.Tensor, projection: torch.Tensor, decay: float) -> None:
    """In place: ``W ← (1 - decay)·W - U A`` (the single merge used by trainer and receivers).

    ``U A`` and the decay are computed in float32 (float64 for a float64 weight) and the
    result is rounded once into the weight's dtype. A bf16 weight is thus not updated by a
    bf16 GEMM, which CPUs without native bf16 matrix units (AVX2) run 10-20x slower than
    fp32 and which would round ``(1 - decay)·W`` separately. Every caller (trainer, HF
    copy, vLLM engine) goes through here with the weight's full shape, so the same
    deltas give the same bits on every receiver of the same device type.
    """
    compute = torch.promote_types(weight.dtype, torch.float32)
    u = u.to(device=weight.device, dtype=compute)
    a = projection.to(device=weight.device, dtype=compute)
    beta = 1.0 - decay
    # TF32 would round A (±1/sqrt(r) is not a TF32 number for most r) and depend on a
    # process-global flag that a trainer and an inference engine may set differently.
    tf32 = weight.is_cuda and torch.backends.cuda.matmul.allow_tf32
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        if weight.dtype == compute:
            weight.addmm_(u, a, beta=beta, alpha=-1.0)
            return
        # Row blocks bound the float32 temporary to 2^24 values (64 MiB) at any weight size;
        # the blocking is a function of the shape only, so every receiver blocks alike.
        rows = max(1, (1 << 24) // max(1, weight.shape[1]))
        for start in range(0, weight.shape[0], rows):
            block = weight[start: start + rows]
            block.copy_(torch.addmm(block.to(compute), u[start: start + rows], a, beta=beta, alpha=-1.0))
    finally:
        if tf32:
            torch.backends.cuda.matmul.allow_tf32 = True


def policy_step(model: nn.Module) -> int:
    """How many deltas have been applied to ``model`` through `apply_delta` (0 if none)."""
    return getattr(model, _STEP_ATTR, 0)


def set_policy_step(model: nn.Module, step: int) -> None:
    """Record that ``model`` now holds the policy after ``step`` updates (after a full sync)."""
    setattr(model, _STEP_ATTR, step)


def weights_checksum(model: nn.Module | Mapping[str, torch.Tensor], names: list[str] | None = None) -> str:
    """BLAKE2 digest of the named parameters' bytes (all parameters if ``names`` is None).

    Names are stable names (wrapper prefixes removed) and are digested in sorted order, so a
    mapping of name → tensor, such as a safetensors file's contents, digests like the model it
    was saved from when it holds the same tensors in the same dtype.
    """
    items = model.named_parameters() if isinstance(model, nn.Module) else model.items()
    params = {stable_name(n): p for n, p in items}
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(names if names is not None else params):
        t = params[name].detach()
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy())  # buffer protocol: no extra copy
    return h.hexdigest()


def apply_delta(model: nn.Module, delta: PolicyDelta, config: LoGRAConfig) -> None:
    """Apply ``delta`` to a copy of the policy, rebuilding every projection from seeds
    (fitted ones, ``distribution='inputs'``, arrive with the stream's first delta, and with
    refresh windows each window's, and are kept on ``model``).

    The model must have received every earlier delta (`policy_step`), so gaps and
    reorders are refused; so are deltas made with other sync fields, for weights of
    another shape, with non-finite values, or (the first delta of a stream, which carries
    ``base_checksum``) for other starting weights. After the same sequence of deltas every
    parameter the trainer changed (targets, and the ``dense`` part) is bitwise the trainer's.

    Raises:
        DeltaMismatchError: any of the above, naming the tensor. Nothing is changed then.
    """
    check_sync(delta, config)
    current = policy_step(model)
    if delta.step != current:
        raise DeltaMismatchError(
            f"out-of-order delta: model holds the policy after {current} updates, delta is update {delta.step}")
    params = {stable_name(n): p for n, p in model.named_parameters()}
    missing = sorted((set(delta.factors) | set(delta.dense)) - set(params))
    if missing:
        raise DeltaMismatchError(f"delta targets {missing[:3]}{'...' if len(missing) > 3 else ''} not in this model")
    for name, u in delta.factors.items():
        w = params[name]
        made_for = tuple(delta.shapes.get(name, w.shape))
        if w.dim() != 2 or u.shape != (w.shape[0], config.rank) or config.rank > w.shape[1] or made_for != w.shape:
            raise DeltaMismatchError(f"delta factor for {name} is {tuple(u.shape)} (made for a {made_for} weight), "
                                     f"model weight is {tuple(w.shape)}, rank {config.rank}")
    for name, t in delta.dense.items():
        if t.shape != params[name].shape:
            raise DeltaMismatchError(
                f"delta's dense {name} is {tuple(t.shape)}, model's is {tuple(params[name].shape)}")
    kept = kept_projections(model)
    projections = {n: delta_projection(delta, config, n, params[n].shape[1], kept=kept)
                   for n in delta.factors if n in delta.fitted}  # shapes and presence, before any change
    groups = (("factor", delta.factors), ("column scale", delta.column_scales), ("dense", delta.dense),
              ("projection", projections))
    for kind, group in groups:
        for name, t in group.items():
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise DeltaMismatchError(f"delta's {kind} for {name} holds NaN/Inf")
    same_dtype = all(str(params[n].dtype).removeprefix("torch.") == delta.dtype for n in delta.factors)
    if delta.base_checksum is not None and same_dtype:
        held = weights_checksum(model, sorted(delta.factors))
        if held != delta.base_checksum:
            raise DeltaMismatchError(f"delta stream starts from other weights: the trainer started from "
                                     f"{delta.base_checksum}, this model holds {held} (full resync needed)")
    with torch.no_grad():
        for name, u in delta.factors.items():
            w = params[name]
            a = projections[name].to(w.device) if name in projections else delta_projection(
                delta, config, name, w.shape[1], w.device)
            merge_update(w, u.to(w.device), a, delta.decay)
        for name, t in delta.dense.items():
            params[name].copy_(t)
    if delta.projections:  # a stream's or a refresh window's first delta; others use the kept ones
        keep_projections(model, delta.projections)
    set_policy_step(model, delta.step + 1)
