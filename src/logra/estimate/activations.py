"""Bytes autograd saves for backward in one forward pass, predicted per method (`logra.estimate`).

The coefficients encode what `logra.estimate.calibrate.measure_saved_activations` measured
on Hugging Face Qwen2/Llama decoders; the package docstring lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .shapes import ModelShape

#: Methods `estimate` understands. ``'logra'`` is accepted as ``'logra-freeze'``.
METHODS: tuple[str, ...] = ("adamw", "lora", "logra-freeze", "logra-sketch")
#: How activations are stored (see `activation_precision`).
Precision = Literal["fp32", "autocast", "bf16"]


def canonical_method(method: str) -> str:
    """One of `METHODS` for ``method`` (``'logra'`` → ``'logra-freeze'``, ``'dense'``/``'adam'`` → ``'adamw'``).

    Raises:
        ValueError: an unknown method.
    """
    m = method.lower()
    if m == "logra":
        m = "logra-freeze"
    if m in ("dense", "adam"):
        m = "adamw"
    if m not in METHODS:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")
    return m


def activation_precision(dtype: str, autocast: bool, shard: str = "none") -> Precision:
    """How activations are stored: ``'fp32'``, ``'autocast'`` (fp32 weights, bf16 compute) or ``'bf16'``.

    FSDP with autocast is taken to mean FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``:
    the unsharded weights and the residual stream are bf16, as with bf16 weights.
    """
    if dtype in ("bfloat16", "bf16"):
        return "bf16"
    if dtype not in ("float32", "fp32"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if not autocast:
        return "fp32"
    return "bf16" if shard == "fsdp" else "autocast"


@dataclass
class SavedActivations:
    """Bytes autograd keeps for backward after a forward pass, by where they were saved.

    Attributes:
        embed: saved by the input embedding (its token ids).
        layers: one entry per decoder layer (layer 0 also holds the rotary cos/sin that
            every layer shares).
        head: final norm, lm_head and loss (the fp32 log-softmax ``[N, vocab]``).
    """

    embed: int = 0
    layers: list[int] = field(default_factory=list)
    head: int = 0

    @property
    def total(self) -> int:
        """All saved bytes."""
        return self.embed + sum(self.layers) + self.head


def predict_saved_activations(
    shape: ModelShape,
    method: str,
    *,
    seq: int,
    batch: int = 1,
    rank: int = 256,
    precision: Precision = "fp32",
    attention: Literal["sdpa", "eager"] = "sdpa",
    padded: bool = False,
    lora_rank: int | None = None,
) -> SavedActivations:
    """Bytes saved for backward by one forward pass of a HF Qwen2/Llama causal LM.

    The coefficients are what `measure_saved_activations` shows (see the
    `logra.estimate` docstring); ``padded`` means a batch with padding, so SDPA gets an explicit mask
    (kept per layer, ``[B, 1, S, S]``) and HF expands k/v to all heads. Without padding
    HF passes ``is_causal`` and native GQA. Attention with ``sdpa`` is modelled as a
    flash/efficient kernel (saves q, k, v, output and a fp32 logsumexp).
    """
    m = canonical_method(method)
    r_lora = lora_rank or rank
    n = batch * seq
    h, qd, kvd, nh = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.num_heads
    inter, v = shape.intermediate_size, shape.vocab_size
    rs = 2 if precision == "bf16" else 4          # residual stream bytes
    c = 4 if precision == "fp32" else 2           # compute (matmul output) bytes
    ac = precision == "autocast"
    dense, lora = m == "adamw", m == "lora"
    logra = m.startswith("logra")
    norm_trainable = m in ("adamw", "logra-sketch")
    embed_trainable = m in ("adamw", "logra-sketch")

    def norm(grad_in: bool) -> int:
        out = (4 * h + 4) if grad_in else 0          # fp32 input (pow/mul) and rsqrt
        if norm_trainable:
            out += rs * h                            # normalised x, for the weight's grad
        return out

    def consumers_input(width: int, count: int, *, norm_output: bool) -> int:
        """Copies of a layer input kept for weight (or lora_A) gradients."""
        if dense:
            if ac:
                return 2 * width * count             # each autocast F.linear saves its own bf16 cast
            return rs * width if norm_output else 0  # the output itself, shared by all consumers
        if lora:
            if precision == "bf16":
                return 4 * width * count             # PEFT casts to the fp32 adapter dtype, per layer
            if ac:
                return 2 * width * count
            return 4 * width if norm_output else 0
        return 0

    def linear_input(width: int) -> int:
        """A consumer whose input is an existing compute-dtype tensor (o_proj, down_proj)."""
        if dense:
            return c * width
        if lora:
            return (4 if precision == "bf16" else c) * width
        return 0

    def layer(index: int) -> int:
        t = norm(grad_in=index > 0 or embed_trainable) + consumers_input(h, 3, norm_output=True)
        if attention == "sdpa":
            kv_saved = qd if padded else kvd
            t += c * (2 * qd + 2 * kv_saved) + 4 * nh + (c * seq if padded else 0)
            if lora and precision == "bf16":
                t += 4 * qd                          # o_proj's lora_A input, cast to fp32
            elif lora and ac:
                t += 2 * qd                          # PEFT's fp32 cast, re-cast to bf16 by autocast
        else:
            t += c * 3 * qd + 4 * nh * seq + (2 * nh * seq if c == 2 else 0) + linear_input(qd)
        t += norm(grad_in=True) + consumers_input(h, 2, norm_output=True)
        t += 3 * c * inter + linear_input(inter)     # gate, silu(gate), up; down's input
        if logra:
            t += 7 * rank * c                        # P = X Aᵀ per target
        if lora:
            t += 7 * r_lora * (2 if ac else 4)       # lora_B's input X A
        per_token = t * n
        const = 0
        if ac and (dense or lora):
            const += 2 * sum(o * i for _, o, i in shape.targets())  # bf16 weight copies
        if ac and lora:
            const += 2 * r_lora * sum(o + i for _, o, i in shape.targets())
            if index == 0 and not embed_trainable:
                # nothing upstream of layer 0's q/k/v needs a gradient: their frozen
                # weights and lora_A weights are not kept for an input gradient
                const -= 2 * sum(o * i + r_lora * i for _, o, i in shape.targets()[:3])
        if index == 0:
            const += 2 * seq * shape.head_dim * rs   # rotary cos/sin, shared by all layers
        return per_token + const

    head_tok = norm(grad_in=True) + 4 * v + 8        # final norm, log-softmax, targets
    head_const = 4                                   # the loss's total_weight scalar
    if dense:
        head_tok += 2 * h if ac else rs * h
        head_const += 2 * v * h if ac else 0
    elif m == "logra-sketch":
        head_tok += rank * c
    elif ac:
        head_const += 2 * v * h                      # bf16 copy of the frozen lm_head
    embed = 8 * n if embed_trainable else 0
    return SavedActivations(
        embed=embed, layers=[layer(i) for i in range(shape.num_layers)], head=head_tok * n + head_const,
    )

