"""`PolicyDelta` into vLLM's fused, tensor-parallel weight layout (no vLLM import needed).

vLLM stores a Llama / Qwen2 / Mistral decoder differently from transformers:

- ``self_attn.qkv_proj`` stacks the rows of ``q_proj``, ``k_proj`` and ``v_proj``;
  ``mlp.gate_up_proj`` stacks ``gate_proj`` and ``up_proj``; ``o_proj`` and
  ``down_proj`` keep their names.
- With tensor parallelism (``tp`` ranks), column-parallel layers (qkv, gate_up) hold a
  slice of OUTPUT rows per rank: rank ``t`` holds its q heads, then its kv heads, then
  its v heads (kv heads are replicated when ``num_kv_heads < tp``); row-parallel layers
  (o_proj, down_proj) hold a slice of INPUT columns, their biases are replicated.
- ``embed_tokens`` / ``lm_head`` are vocab-parallel: the vocabulary is padded to a
  multiple of 64 and split into equal row blocks; padding rows are zero. Tied
  embeddings have no separate ``lm_head``.
- Norms are replicated.

`FusedLayout` maps every transformers parameter name to its `Slot` (a rectangle of the
HF tensor and where it lies in one rank's fused tensor). `apply_delta_fused` merges a
`PolicyDelta` into those fused tensors with one matmul per target, through the same
`merge_update` as `apply_delta`, so the fused slice holds the bits that the HF weight
would hold (for shards with tp > 1 the default ``strategy='full'`` runs that matmul at
the HF weight's shape, because a BLAS may round a smaller GEMM differently).
`FusedReceiver` adds the checks of `logra.sync`: the step must be the next one, the
fused state's checksum must match the trainer's per-rank expectation
(`expected_fused_checksum`), and `FusedReceiver.resync` rebuilds the fused tensors from
a full HF state dict (`fuse_state_dict` / `copy_into_fused`).

Bitwise equality needs the same dtype and device arithmetic on both sides: a bf16 vLLM
engine matches a bf16 HF copy that applied the same deltas, not a fp32 trainer's
weights cast to bf16.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config import LoGRAConfig
from .delta import PolicyDelta, merge_update
from .errors import DeltaMismatchError, LoGRAError
from .projection import make_projection, projection_seed, stable_name

__all__ = [
    "DEFAULT_VOCAB_PADDING", "STRATEGIES", "ChecksumMismatchError", "DeltaGapError", "FusedLayout", "FusedReceiver",
    "LayoutError", "NeedsResyncError", "Slot", "apply_delta_fused", "copy_into_fused", "expected_fused_checksum",
    "fuse_state_dict", "fused_checksum",
]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it.
DEFAULT_VOCAB_PADDING = 64

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class LayoutError(LoGRAError, ValueError):
    """A model, tensor-parallel setting or parameter name that the vLLM layout cannot express."""


class DeltaGapError(DeltaMismatchError):
    """A delta whose step is not the next one (a gap, a reorder or a duplicate).

    Attributes:
        have: updates the receiver holds.
        got: the delta's step.
    """

    def __init__(self, have: int, got: int) -> None:
        kind = "gap" if got > have else "stale (already applied)"
        super().__init__(f"out-of-order delta ({kind}): receiver holds the policy after {have} updates, "
                         f"delta is update {got}; only update {have} is accepted (a gap needs a full resync)")
        self.have, self.got = have, got


class ChecksumMismatchError(DeltaMismatchError):
    """The fused state's checksum differs from the trainer's expectation after an update."""


class NeedsResyncError(DeltaMismatchError):
    """The receiver's weights are known to be wrong; only `FusedReceiver.resync` is accepted."""


# ------------------------------------------------------------------ layout
@dataclass(frozen=True)
class Slot:
    """Where one HF parameter (or its shard) lies in one rank's fused tensor.

    The rectangle ``hf[hf_rows, hf_cols]`` of the HF tensor equals
    ``fused[fused_name][rows, cols]`` (1-D tensors use only the row slices).

    Attributes:
        hf_name: transformers parameter name (``model.layers.0.self_attn.q_proj.weight``).
        fused_name: vLLM parameter name (``model.layers.0.self_attn.qkv_proj.weight``).
        kind: ``'column'`` (output rows sharded), ``'row'`` (input columns sharded),
            ``'vocab'`` (padded vocabulary rows sharded) or ``'replicated'``.
        hf_shape: shape of the whole HF tensor.
        fused_shape: shape of this rank's fused tensor.
        hf_rows, hf_cols: the rectangle of the HF tensor held by this rank.
        rows, cols: the same rectangle in the fused tensor.
    """

    hf_name: str
    fused_name: str
    kind: str
    hf_shape: tuple[int, ...]
    fused_shape: tuple[int, ...]
    hf_rows: slice
    hf_cols: slice
    rows: slice
    cols: slice

    def hf_part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rectangle of the HF tensor ``t`` (a view)."""
        return t[self.hf_rows] if t.dim() == 1 else t[self.hf_rows, self.hf_cols]

    def fused_part(self, t: torch.Tensor) -> torch.Tensor:
        """The same rectangle of the fused tensor ``t`` (a view)."""
        return t[self.rows] if t.dim() == 1 else t[self.rows, self.cols]


_LAYER = re.compile(
    r"^model\.layers\.(\d+)\.(?:(self_attn)\.(q|k|v|o)|(mlp)\.(gate|up|down))_proj\.(weight|bias)$")


def _parts(m: re.Match) -> tuple[str, str, str, str]:
    """(layer, block, projection, 'weight'|'bias') of a `_LAYER` match."""
    layer, attn, attn_proj, mlp, mlp_proj, kind = m.groups()
    return layer, attn or mlp, attn_proj or mlp_proj, kind
_VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


@dataclass(frozen=True)
class FusedLayout:
    """vLLM's fused layout of a Llama-family decoder on one tensor-parallel rank.

    Build it with `from_hf_config`. Supported: ``num_heads % tp == 0`` and either
    ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0`` (kv heads replicated),
    ``intermediate_size % tp == 0``; anything else raises `LayoutError`.

    Attributes:
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
        vocab_size, tie_word_embeddings: from the HF config.
        tp_size, tp_rank: this rank of the tensor-parallel group.
        vocab_padding: vocabulary padding multiple (vLLM's default 64).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    vocab_padding: int = DEFAULT_VOCAB_PADDING

    def __post_init__(self) -> None:
        tp = self.tp_size
        if tp < 1 or not 0 <= self.tp_rank < tp:
            raise LayoutError(f"tensor-parallel rank {self.tp_rank} of size {tp} is not valid")
        if self.num_heads % tp:
            raise LayoutError(f"num_attention_heads={self.num_heads} is not divisible by tensor-parallel size {tp}; "
                              "vLLM cannot shard this model that way")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise LayoutError(f"num_key_value_heads={self.num_kv_heads} and tensor-parallel size {tp}: neither divides "
                              "the other, so kv heads can be neither split nor replicated evenly")
        if self.intermediate_size % tp:
            raise LayoutError(
                f"intermediate_size={self.intermediate_size} is not divisible by tensor-parallel size {tp}")
        if self.vocab_padding < 1 or self.padded_vocab % tp:
            raise LayoutError(f"padded vocabulary {self.padded_vocab} is not divisible by tensor-parallel size {tp}")

    @classmethod
    def from_hf_config(cls, config: Any, tp_size: int = 1, tp_rank: int = 0,
                       vocab_padding: int = DEFAULT_VOCAB_PADDING) -> FusedLayout:
        """The layout of a transformers ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` on one rank.

        Raises:
            LayoutError: another model type, or a tensor-parallel size vLLM cannot use.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=kv, head_dim=head_dim, intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            tp_size=tp_size, tp_rank=tp_rank, vocab_padding=vocab_padding,
        )

    def for_rank(self, tp_rank: int) -> FusedLayout:
        """The same model on another rank of the group."""
        return FusedLayout(**{**self.__dict__, "tp_rank": tp_rank})

    # ---------------------------------------------------------------- sizes
    @property
    def padded_vocab(self) -> int:
        """Vocabulary rows after padding (all ranks together)."""
        p = self.vocab_padding
        return (self.vocab_size + p - 1) // p * p

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each kv head (1 unless ``num_kv_heads < tp``)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def _local(self) -> tuple[int, int, int]:
        """Rows of q, of k (= of v) and of gate (= of up) on this rank."""
        q = self.num_heads // self.tp_size * self.head_dim
        kv = max(1, self.num_kv_heads // self.tp_size) * self.head_dim
        return q, kv, self.intermediate_size // self.tp_size

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """Shape of an HF projection / embedding parameter (LayoutError for other names)."""
        q, kv, ff = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        h = self.hidden_size
        if hf_name in _VOCAB:
            return (self.vocab_size, h)
        m = _LAYER.match(hf_name)
        if not m:
            raise LayoutError(f"{hf_name!r} is not a projection or embedding of a Llama-family model")
        out, inp = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
                    "gate": (ff, h), "up": (ff, h), "down": (h, ff)}[_parts(m)[2]]
        return (out, inp) if _parts(m)[3] == "weight" else (out,)

    # ---------------------------------------------------------------- mapping
    def slot(self, hf_name: str, hf_shape: tuple[int, ...] | None = None) -> Slot | None:
        """Where ``hf_name`` lies on this rank; None for a tied ``lm_head.weight``.

        ``hf_shape`` is needed only for replicated parameters (norms), whose shape the
        config does not give; it is checked against the config for the others.

        Raises:
            LayoutError: the name is not a parameter of a Llama-family model, its layer
                index is out of range, or ``hf_shape`` contradicts the config.
        """
        name = stable_name(hf_name)
        t, tp = self.tp_rank, self.tp_size
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        m = _LAYER.match(name)
        if m is None and name not in _VOCAB:
            if re.search(r"norm\.(weight|bias)$", name):
                if hf_shape is None:
                    raise LayoutError(f"the shape of replicated parameter {name!r} is needed")
                shape = tuple(hf_shape)
                full = slice(0, shape[0])
                cols = slice(0, shape[1]) if len(shape) > 1 else slice(None)
                return Slot(name, name, "replicated", shape, shape, full, cols, full, cols)
            raise LayoutError(f"{name!r} has no place in vLLM's layout of a Llama-family model "
                              "(expected projections, embeddings, lm_head or norms)")
        if m is not None and int(m.group(1)) >= self.num_layers:
            raise LayoutError(f"{name!r}: layer index out of range (model has {self.num_layers} layers)")
        shape = self.hf_shape(name)
        if hf_shape is not None and tuple(hf_shape) != shape:
            raise LayoutError(f"{name!r} has shape {tuple(hf_shape)}, the config implies {shape}")
        in_features = shape[1] if len(shape) > 1 else 0
        all_cols = slice(0, in_features) if len(shape) > 1 else slice(None)

        def make(fused: str, kind: str, fused_shape: tuple[int, ...], hf_rows: slice, rows: slice,
                 hf_cols: slice = all_cols, cols: slice = all_cols) -> Slot:
            return Slot(name, fused, kind, shape, fused_shape, hf_rows, hf_cols, rows, cols)

        if name in _VOCAB:
            per = self.padded_vocab // tp
            start = t * per
            valid = max(0, min(per, self.vocab_size - start))
            return make(name, "vocab", (per, in_features), _span(min(start, self.vocab_size), valid), _span(0, valid))
        layer, block, proj, kind = _parts(m)
        prefix = f"model.layers.{layer}.{block}."
        q_loc, kv_loc, ff_loc = self._local()
        tail = (in_features,) if kind == "weight" else ()
        if proj in ("q", "k", "v"):
            rows_total = q_loc + 2 * kv_loc
            if proj == "q":
                return make(prefix + f"qkv_proj.{kind}", "column", (rows_total, *tail), _span(t * q_loc, q_loc),
                            _span(0, q_loc))
            kv_index = t // self.kv_replicas  # which block of kv heads this rank holds
            offset = q_loc if proj == "k" else q_loc + kv_loc
            return make(prefix + f"qkv_proj.{kind}", "column", (rows_total, *tail), _span(kv_index * kv_loc, kv_loc),
                        _span(offset, kv_loc))
        if proj in ("gate", "up"):
            offset = 0 if proj == "gate" else ff_loc
            return make(prefix + f"gate_up_proj.{kind}", "column", (2 * ff_loc, *tail), _span(t * ff_loc, ff_loc),
                        _span(offset, ff_loc))
        # o_proj / down_proj: row-parallel, input columns sharded, bias replicated.
        out = shape[0]
        if kind == "bias":
            return make(name, "replicated", shape, slice(0, out), slice(0, out))
        local_in = in_features // tp
        return make(name, "row", (out, local_in), slice(0, out), slice(0, out),
                    _span(t * local_in, local_in), slice(0, local_in))

    def fused_name(self, hf_name: str) -> str | None:
        """The vLLM name holding ``hf_name`` on every rank (None for a tied ``lm_head.weight``)."""
        name = stable_name(hf_name)
        m = _LAYER.match(name)
        if m is not None:
            if int(m.group(1)) >= self.num_layers:
                raise LayoutError(f"{name!r}: layer index out of range (model has {self.num_layers} layers)")
            layer, block, proj, kind = _parts(m)
            fused = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj",
                     "up": "gate_up_proj"}.get(proj, f"{proj}_proj")
            return f"model.layers.{layer}.{block}.{fused}.{kind}"
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name in _VOCAB or re.search(r"norm\.(weight|bias)$", name):
            return name
        raise LayoutError(f"{name!r} has no place in vLLM's layout of a Llama-family model "
                          "(expected projections, embeddings, lm_head or norms)")

    def fused_names(self, hf_names: Iterable[str]) -> list[str]:
        """Sorted fused names holding any of ``hf_names`` (a tied ``lm_head`` maps to nothing)."""
        return sorted({f for f in map(self.fused_name, hf_names) if f is not None})


# ------------------------------------------------------------------ full weights
def _slots(hf_state: Mapping[str, torch.Tensor], layout: FusedLayout) -> list[tuple[Slot, torch.Tensor]]:
    out = []
    for name, t in hf_state.items():
        s = layout.slot(name, tuple(t.shape))
        if s is not None:
            out.append((s, t))
    return out


def _check_cover(fused_name: str, slots: list[Slot]) -> None:
    """Refuse a fused tensor whose members do not cover it (pad rows of the vocabulary excepted)."""
    s0 = slots[0]
    if s0.kind in ("vocab", "replicated", "row"):
        return
    covered = sum(s.rows.stop - s.rows.start for s in slots)
    if covered != s0.fused_shape[0]:
        members = sorted(s.hf_name.rsplit(".", 2)[-2] for s in slots)
        raise LayoutError(f"{fused_name} needs all of its members, got only {members}")


@torch.no_grad()
def fuse_state_dict(hf_state: Mapping[str, torch.Tensor], layout: FusedLayout) -> dict[str, torch.Tensor]:
    """New tensors in vLLM's layout for ``layout.tp_rank``, built from an HF state dict.

    ``hf_state`` maps transformers names (wrapper prefixes are ignored) to tensors, e.g.
    ``dict(model.named_parameters())``; dtype and device are kept. A tied
    ``lm_head.weight`` is skipped; vocabulary padding rows are zero, as vLLM loads them.

    Raises:
        LayoutError: a name has no place in the layout, a shape contradicts the config,
            or a fused tensor misses one of its members (e.g. ``k_proj`` without ``q_proj``).
    """
    groups: dict[str, list[tuple[Slot, torch.Tensor]]] = {}
    for s, t in _slots(hf_state, layout):
        groups.setdefault(s.fused_name, []).append((s, t))
    out = {}
    for fused_name, members in groups.items():
        _check_cover(fused_name, [s for s, _ in members])
        ref = members[0][1]
        fused = torch.zeros(members[0][0].fused_shape, dtype=ref.dtype, device=ref.device)
        for s, t in members:
            s.fused_part(fused).copy_(s.hf_part(t.detach()))
        out[fused_name] = fused
    return out


def _plan_copy(fused: Mapping[str, torch.Tensor], hf_tensors: Mapping[str, torch.Tensor], layout: FusedLayout,
               strict: bool) -> list[tuple[Slot, torch.Tensor]]:
    """Validate a copy of HF-named tensors into fused ones; raise LayoutError before any change."""
    placed = _slots(hf_tensors, layout)
    groups: dict[str, list[Slot]] = {}
    for s, t in placed:
        if s.fused_name not in fused:
            raise LayoutError(f"{s.hf_name} belongs to {s.fused_name}, which is not among the fused tensors")
        target = fused[s.fused_name]
        if tuple(target.shape) != s.fused_shape:
            raise LayoutError(f"{s.fused_name} is {tuple(target.shape)} here, the layout implies {s.fused_shape}")
        if t.dtype != target.dtype:
            raise LayoutError(f"{s.hf_name} is {t.dtype}, {s.fused_name} is {target.dtype} (no silent casts)")
        groups.setdefault(s.fused_name, []).append(s)
    if strict:
        missing = sorted(set(fused) - set(groups))
        if missing:
            raise LayoutError(f"full weights miss fused tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")
        for fused_name, slots in groups.items():
            _check_cover(fused_name, slots)
    return placed


@torch.no_grad()
def copy_into_fused(fused: Mapping[str, torch.Tensor], hf_tensors: Mapping[str, torch.Tensor], layout: FusedLayout,
                    strict: bool = False) -> None:
    """In place: copy HF-named tensors into their slices of existing fused tensors.

    Used for full-weight resyncs and for the dense (non-target) tensors that come with
    a delta. With ``strict``, every fused tensor must be fully covered by ``hf_tensors``
    (vocabulary padding rows are then zeroed, as vLLM's loader does).

    Raises:
        LayoutError: an unknown name, a missing fused tensor, a shape or dtype mismatch,
            or (``strict``) incomplete coverage. Nothing is copied in that case.
    """
    placed = _plan_copy(fused, hf_tensors, layout, strict)
    for s, t in placed:
        target = fused[s.fused_name]
        if strict and s.kind == "vocab":
            target[s.rows.stop:].zero_()
        s.fused_part(target).copy_(s.hf_part(t.detach()).to(target.device))


# ------------------------------------------------------------------ checksums
def _digest(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in items:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def fused_checksum(fused: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> str:
    """BLAKE2 digest of the named fused tensors' bytes, in sorted name order (all if None).

    The same recipe as `logra.weights_checksum`, applied to fused names and shards.
    """
    chosen = sorted(fused if names is None else names)
    missing = [n for n in chosen if n not in fused]
    if missing:
        raise LayoutError(f"no fused tensor {missing[0]!r}")
    return _digest((n, fused[n]) for n in chosen)


@torch.no_grad()
def expected_fused_checksum(hf_state: Mapping[str, torch.Tensor], layout: FusedLayout,
                            names: Iterable[str] | None = None) -> str:
    """What `fused_checksum` gives on ``layout.tp_rank`` if its weights equal ``hf_state``'s.

    The trainer computes this per rank (`FusedLayout.for_rank`) from the weights a
    receiver must hold (same dtype as the receiver's). Fused tensors are built one at a
    time on the CPU, so the extra memory is one fused shard.

    Args:
        hf_state: HF name → tensor; must hold every member of the fused tensors asked for.
        names: fused names to cover (default: every fused tensor ``hf_state`` touches).
    """
    by_fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf_state.items():
        s = layout.slot(name, tuple(t.shape))
        if s is not None:
            by_fused.setdefault(s.fused_name, {})[name] = t.detach().cpu()
    chosen = sorted(by_fused if names is None else names)
    missing = [n for n in chosen if n not in by_fused]
    if missing:
        raise LayoutError(f"hf_state holds no member of fused tensor {missing[0]!r}")

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for n in chosen:
            yield n, fuse_state_dict(by_fused[n], layout)[n]

    return _digest(tensors())


# ------------------------------------------------------------------ deltas
def _validate(fused: Mapping[str, torch.Tensor], delta: PolicyDelta, config: LoGRAConfig,
              layout: FusedLayout) -> list[tuple[str, torch.Tensor, Slot]]:
    for key, value in config.sync_fields().items():
        if delta.sync.get(key) != value:
            raise DeltaMismatchError(
                f"delta was made with {key}={delta.sync.get(key)!r} but this config has {key}={value!r}")
    plan = []
    for name, u in delta.factors.items():
        try:
            s = layout.slot(name)
        except LayoutError as e:
            raise DeltaMismatchError(f"delta target {name!r} does not fit the vLLM layout: {e}") from e
        if s is None:  # tied lm_head: vLLM shares embed_tokens, which the delta names instead
            raise DeltaMismatchError(f"delta targets {name!r} but this model ties it to the input embeddings")
        if len(s.hf_shape) != 2:
            raise DeltaMismatchError(f"delta target {name!r} is not a 2-D weight")
        if s.fused_name not in fused:
            raise DeltaMismatchError(f"delta target {name!r} belongs to {s.fused_name}, not among the fused tensors")
        w = fused[s.fused_name]
        if tuple(w.shape) != s.fused_shape:
            raise DeltaMismatchError(f"{s.fused_name} is {tuple(w.shape)}, the layout implies {s.fused_shape}")
        if tuple(u.shape) != (s.hf_shape[0], config.rank) or config.rank > s.hf_shape[1]:
            raise DeltaMismatchError(f"delta factor for {name} is {tuple(u.shape)}, the HF weight is {s.hf_shape}, "
                                     f"rank {config.rank}")
        plan.append((name, u, s))
    return plan


STRATEGIES = ("full", "slice")


@torch.no_grad()
def apply_delta_fused(fused: Mapping[str, torch.Tensor], delta: PolicyDelta, config: LoGRAConfig,
                      layout: FusedLayout, strategy: str = "full") -> None:
    """In place: merge ``delta`` into one rank's fused tensors, one matmul per target.

    For each target the projection ``A`` is rebuilt from the seeds exactly as
    `apply_delta` does, and `merge_update` (the trainer's arithmetic: ``U`` and ``A``
    cast to the weight's dtype, decay first, then ``addmm_``) runs in the fused
    tensor's dtype and device. Step order is not checked here: use `FusedReceiver`.

    Args:
        strategy: how a shard (a strict part of the HF weight, i.e. tp > 1) is updated.
            ``'full'`` (default): the matmul runs with the HF weight's full shape on a
            temporary holding this rank's rectangle, which is then copied back; the
            GEMM sees the same shape as `apply_delta`'s, so the bits are the same by
            construction, at the cost of one temporary of the HF weight's size and
            tp-times the (rank-r, cheap) FLOPs. ``'slice'``: the matmul runs on the
            rectangle itself with the matching rows of ``U`` (row-parallel: the
            matching columns of ``A``); least memory and FLOPs, but a BLAS may pick
            another kernel for the smaller shape: on this CPU a 32x8 output differed
            in the last bit while realistic shapes matched. Targets a rank holds whole
            (tp = 1) are always updated in place.

    Raises:
        DeltaMismatchError: sync fields, names or shapes do not fit. Nothing is changed.
        ValueError: unknown ``strategy``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    plan = _validate(fused, delta, config, layout)
    for name, u, s in plan:
        w = s.fused_part(fused[s.fused_name])
        if w.numel() == 0:  # a vocab shard made only of padding rows
            continue
        a = make_projection(config.rank, s.hf_shape[1], projection_seed(config.seed, delta.projection_index, name),
                            config.distribution)
        if tuple(w.shape) == s.hf_shape:
            merge_update(w, u.to(w.device), a.to(w.device), delta.decay)
        elif strategy == "full":
            tmp = torch.zeros(s.hf_shape, dtype=w.dtype, device=w.device)
            part = s.hf_part(tmp)
            part.copy_(w)
            merge_update(tmp, u.to(w.device), a.to(w.device), delta.decay)
            w.copy_(part)
            del tmp
        else:
            merge_update(w, u[s.hf_rows].to(w.device), a[:, s.hf_cols].contiguous().to(w.device), delta.decay)


# ------------------------------------------------------------------ receiver
class FusedReceiver:
    """One tensor-parallel rank of a rollout engine kept current by verified deltas.

    Args:
        params: fused name → the engine's tensors (updated in place, e.g. the
            ``named_parameters()`` of vLLM's model on this rank).
        layout: this rank's `FusedLayout`.
        config: the LoGRA config (sync fields must match the trainer's).
        step: the policy step ``params`` hold (updates applied so far).
        strategy: how shards are updated (see `apply_delta_fused`).

    Protocol (as `logra.sync`): `apply` accepts only update ``step``; after a failed
    checksum the receiver refuses every delta until `resync`.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], layout: FusedLayout, config: LoGRAConfig,
                 step: int = 0, strategy: str = "full") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        self.params = params
        self.layout = layout
        self.config = config
        self.step = step
        self.needs_resync = False
        self.resyncs = 0

    def apply(self, delta: PolicyDelta, checksum: str | None = None,
              dense: Mapping[str, torch.Tensor] | None = None) -> None:
        """Merge the next update, then copy ``dense`` (HF-named non-target tensors) and verify.

        Args:
            delta: must be update `step`.
            checksum: the trainer's `expected_fused_checksum` for this rank over
                `checked_names` (None: not verified).
            dense: HF-named tensors trained densely (``non_target='adamw'``/``'sketch'``).

        Raises:
            NeedsResyncError: an earlier checksum failed; call `resync`.
            DeltaGapError: ``delta.step`` is not `step` (nothing changed).
            DeltaMismatchError: the delta or dense tensors do not fit (nothing changed).
            ChecksumMismatchError: applied, but the result differs from the trainer's;
                the receiver now needs a resync.
        """
        if self.needs_resync:
            raise NeedsResyncError("this receiver's weights failed verification; it accepts only a full resync")
        if delta.step != self.step:
            raise DeltaGapError(self.step, delta.step)
        _validate(self.params, delta, self.config, self.layout)
        if dense:
            try:
                _plan_copy(self.params, dense, self.layout, strict=True)
            except LayoutError as e:
                raise DeltaMismatchError(f"dense tensors do not fit: {e}") from e
        apply_delta_fused(self.params, delta, self.config, self.layout, self.strategy)
        if dense:
            copy_into_fused(self.params, dense, self.layout)
        if checksum is not None:
            got = fused_checksum(self.params, self.checked_names(delta, dense))
            if got != checksum:
                self.needs_resync = True
                raise ChecksumMismatchError(f"checksum mismatch after update {delta.step} on tp rank "
                                            f"{self.layout.tp_rank}: {got} != {checksum}; a full resync is needed")
        self.step = delta.step + 1

    def checked_names(self, delta: PolicyDelta, dense: Mapping[str, torch.Tensor] | Iterable[str] | None = None
                      ) -> list[str]:
        """Fused names an update's checksum covers: those holding a target or a dense tensor."""
        return self.layout.fused_names(list(delta.factors) + list(dense or ()))

    def checksum(self, names: Iterable[str] | None = None) -> str:
        """`fused_checksum` of this rank's tensors (all if ``names`` is None)."""
        return fused_checksum(self.params, names)

    def resync(self, hf_state: Mapping[str, torch.Tensor], step: int, checksum: str | None = None) -> None:
        """Full-weight sync: overwrite every fused tensor from an HF state dict, then hold ``step``.

        Args:
            hf_state: every HF parameter (tied ``lm_head`` optional), in the receiver's dtype.
            step: the policy step these weights are.
            checksum: the trainer's `expected_fused_checksum` over all fused tensors of
                this rank (None: not verified).

        Raises:
            LayoutError: ``hf_state`` does not cover the fused tensors.
            ChecksumMismatchError: the loaded weights differ from the trainer's.
        """
        copy_into_fused(self.params, hf_state, self.layout, strict=True)
        if checksum is not None:
            got = self.checksum()
            if got != checksum:
                self.needs_resync = True
                raise ChecksumMismatchError(f"full weights for step {step} arrived with checksum {got}, "
                                            f"trainer sent {checksum}")
        self.step = step
        self.needs_resync = False
        self.resyncs += 1
