"""vLLM's fused, tensor-parallel weight layout of a Llama / Qwen2 / Mistral decoder (no vLLM import).

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
HF tensor and where it lies in one rank's fused tensor); `fuse_state_dict` and
`copy_into_fused` move full weights into that layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import LayoutError
from ...projection import stable_name

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it.
DEFAULT_VOCAB_PADDING = 64

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


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
def slots_of(hf_state: Mapping[str, torch.Tensor], layout: FusedLayout) -> list[tuple[Slot, torch.Tensor]]:
    """The `Slot` of every tensor of ``hf_state`` on this rank (tensors with no slot here are left out)."""
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
    for s, t in slots_of(hf_state, layout):
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


def plan_copy(fused: Mapping[str, torch.Tensor], hf_tensors: Mapping[str, torch.Tensor], layout: FusedLayout,
               strict: bool) -> list[tuple[Slot, torch.Tensor]]:
    """Validate a copy of HF-named tensors into fused ones; raise LayoutError before any change."""
    placed = slots_of(hf_tensors, layout)
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
    placed = plan_copy(fused, hf_tensors, layout, strict)
    for s, t in placed:
        target = fused[s.fused_name]
        if strict and s.kind == "vocab":
            target[s.rows.stop:].zero_()
        s.fused_part(target).copy_(s.hf_part(t.detach()).to(target.device))


