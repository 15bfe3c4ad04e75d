"""The per-phase memory accounting of one training step: `estimate` and its `Estimate`.

How each category is counted, which instants make the peak and how FSDP is modelled is
described in the `logra.estimate` package docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .activations import activation_precision, canonical_method, predict_saved_activations
from .shapes import ModelShape, resolve_shape

GIB = 1024**3

#: Memory categories of an `Estimate` (the first five of `logra.memory.CATEGORIES`).
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "temporaries")
#: The instants of a training step whose maximum is the peak.
PHASES: tuple[str, ...] = ("forward (loss)", "loss backward", "last layer backward", "optimizer step")

#: Table labels of the methods.
METHOD_LABELS: dict[str, str] = {
    "adamw": "Dense AdamW", "lora": "LoRA", "logra-freeze": "LoGRA (freeze)", "logra-sketch": "LoGRA (sketch)",
}


@dataclass
class Estimate:
    """Predicted per-GPU memory of one steady-state training step.

    Attributes:
        method: one of `METHODS`.
        model: the shape's name.
        settings: the arguments the estimate was made with.
        phases: bytes by category (`CATEGORIES`) at each instant of `PHASES`.
        peak_phase: the phase with the largest total (the peak).
        gpu_bytes: memory of one GPU.
        reserve_bytes: headroom kept for what is not modelled (CUDA context, NCCL,
            fragmentation) when deciding `fits`.
        num_parameters: parameters of the model.
        trainable_parameters: parameters an optimizer updates densely (LoGRA: the
            non-target ones; its targets are counted in `sketch_values`).
        sketch_values: entries of LoGRA's sketch buffer (0 for other methods).
    """

    method: str
    model: str
    settings: dict[str, Any]
    phases: dict[str, dict[str, int]]
    peak_phase: str
    gpu_bytes: int
    reserve_bytes: int
    num_parameters: int
    trainable_parameters: int
    sketch_values: int = 0

    @property
    def categories(self) -> dict[str, int]:
        """Bytes by category at the peak."""
        return dict(self.phases[self.peak_phase])

    @property
    def total(self) -> int:
        """Peak bytes per GPU."""
        return sum(self.phases[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        """Whether the peak plus the reserve fits in one GPU."""
        return self.total + self.reserve_bytes <= self.gpu_bytes

    def gib(self) -> dict[str, float]:
        """Peak categories and total in GiB."""
        out = {k: v / GIB for k, v in self.categories.items()}
        out["total"] = self.total / GIB
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes, plus GiB for convenience)."""
        return {
            "method": self.method, "model": self.model, "settings": self.settings,
            "peak_phase": self.peak_phase, "peak_bytes": self.total, "peak_gib": round(self.total / GIB, 3),
            "categories_bytes": self.categories, "phases_bytes": self.phases, "fits": self.fits,
            "gpu_bytes": self.gpu_bytes, "reserve_bytes": self.reserve_bytes,
            "num_parameters": self.num_parameters, "trainable_parameters": self.trainable_parameters,
            "sketch_values": self.sketch_values,
        }


def estimate(
    shape: ModelShape | str,
    method: str,
    *,
    seq: int = 4096,
    batch: int = 1,
    rank: int = 256,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    reserve_gib: float = 1.0,
    shard: Literal["none", "fsdp"] = "none",
    checkpointing: bool = False,
    dtype: Literal["float32", "bfloat16"] = "float32",
    autocast: bool = True,
    attention: Literal["sdpa", "eager"] = "sdpa",
    padded: bool = False,
    adam_impl: Literal["foreach", "fused", "for-loop"] = "foreach",
    lora_rank: int | None = None,
    logits_chunk: int | None = None,
) -> Estimate:
    """Predict the per-GPU peak memory of one training step of ``method`` on ``shape``.

    Args:
        shape: a `ModelShape`, a built-in name or a path to a ``config.json``.
        method: ``'adamw'`` (dense), ``'lora'`` (rank ``lora_rank`` on the 7 projections,
            frozen base), ``'logra-freeze'`` (paper default: every non-target frozen) or
            ``'logra-sketch'`` (lm_head/embeddings sketched too, norms and biases AdamW).
        seq: tokens per sequence; ``batch``: sequences per micro-batch (per GPU).
        rank: LoGRA rank (and LoRA rank unless ``lora_rank`` is given).
        gpus: training GPUs; only matters with ``shard='fsdp'`` (data parallel otherwise
            replicates everything; DDP's gradient buckets are not modelled).
        gpu_memory_gib: memory of one GPU; ``reserve_gib`` is kept free for what is not
            modelled when deciding whether it fits.
        shard: ``'none'`` or ``'fsdp'`` (full shard of parameters, gradients and optimizer
            state across ``gpus``; see the `logra.estimate` docstring).
        checkpointing: HF activation checkpointing per decoder layer (non-reentrant):
            only each layer's input is kept; one layer is recomputed at a time.
        dtype: weight dtype (``'float32'`` master weights or ``'bfloat16'``).
        autocast: bf16 compute (``torch.autocast``; with FSDP, its mixed-precision policy).
        attention: ``'sdpa'`` (flash / memory-efficient kernel) or ``'eager'`` (keeps the
            ``[B, heads, S, S]`` probabilities).
        padded: batches carry padding, so SDPA gets an explicit mask.
        adam_impl: ``torch.optim.AdamW`` implementation: ``'foreach'`` (CUDA default; one
            scratch tensor the size of the trainable parameters during the step),
            ``'fused'`` (no scratch) or ``'for-loop'`` (scratch of the largest tensor).
        logits_chunk: None (HF default: the fp32 log-softmax ``[N, vocab]`` is kept and
            backward holds two more) or a chunk of tokens for a chunked / fused
            lm_head + loss that never materialises ``[N, vocab]`` (modelled as three
            fp32 ``[chunk, vocab]`` buffers plus a fp32 ``[N, hidden]`` input gradient;
            not measured here, since HF models do not do it by default).

    Returns:
        An `Estimate`; its peak is the largest of `PHASES`, as `logra.memory.track_memory`
        reports one instant (for AdamW usually the optimizer step, when activations are
        already freed; for LoGRA the start of backward).
    """
    if isinstance(shape, (str, Path)):
        shape = resolve_shape(str(shape))
    m = canonical_method(method)
    if shard not in ("none", "fsdp"):
        raise ValueError(f"shard must be 'none' or 'fsdp', got {shard!r}")
    if adam_impl not in ("foreach", "fused", "for-loop"):
        raise ValueError(f"adam_impl must be 'foreach', 'fused' or 'for-loop', got {adam_impl!r}")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    for name, value in (("seq", seq), ("batch", batch), ("rank", rank), ("gpus", gpus)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if m.startswith("logra"):  # the optimizer refuses it (SketchSet): an estimate for it would describe nothing
        name, _, narrowest = min(shape.targets(), key=lambda t: t[2])
        if rank > narrowest:
            raise ValueError(f"rank {rank} exceeds the input size {narrowest} of {name} in {shape.name}: LoGRA's rank "
                             f"is at most the narrowest target input ({narrowest})")
    precision = activation_precision(dtype, autocast, shard)
    r_lora = lora_rank or rank
    n_tok = batch * seq
    h, v, inter, L = shape.hidden_size, shape.vocab_size, shape.intermediate_size, shape.num_layers
    pb = 2 if dtype in ("bfloat16", "bf16") else 4
    cb = 4 if precision == "fp32" else 2
    rs = 2 if precision == "bf16" else 4
    world = gpus if shard == "fsdp" else 1
    fsdp = shard == "fsdp"
    targets = shape.targets()

    # ---- parameters
    n_params = shape.num_parameters
    adapters = L * r_lora * sum(o + i for _, o, i in targets) if m == "lora" else 0
    params_resident = (n_params * pb + adapters * 4) / world
    working = (shape.root_parameters + 2 * shape.layer_parameters) * cb if fsdp else 0

    # ---- what a dense optimizer trains
    if m == "adamw":
        dense_numel, dense_bytes = n_params, pb
        tensors = [v * h] + [o * i for _, o, i in targets]
    elif m == "lora":
        dense_numel, dense_bytes = adapters, 4
        tensors = [r_lora * max(o, i) for _, o, i in targets]
    elif m == "logra-sketch":
        dense_numel = L * 2 * h + h + (L * (shape.q_dim + 2 * shape.kv_dim) if shape.qkv_bias else 0)
        dense_bytes = pb
        tensors = [max(h, shape.q_dim)]
    else:
        dense_numel, dense_bytes, tensors = 0, pb, [0]
    grads_full = dense_numel * dense_bytes / world
    states = 2 * dense_numel * dense_bytes / world
    if adam_impl == "foreach":
        step_scratch = dense_numel * dense_bytes / world
    elif adam_impl == "for-loop":
        step_scratch = max(tensors) * dense_bytes / world if dense_numel else 0
    else:
        step_scratch = 0

    # ---- LoGRA's own tensors (not sharded: every rank holds the full sketch)
    sketch = moments = projections = 0
    rows = 0
    if m.startswith("logra"):
        # Rademacher projections are stored as sign bits: ⌈in/8⌉ bytes per row of A
        rows = L * sum(o for _, o, _ in targets)
        in_bytes = L * sum(-(-i // 8) for _, _, i in targets)
        if m == "logra-sketch":
            rows += v * (1 if shape.tie_embeddings else 2)
            in_bytes += -(-h // 8) * (1 if shape.tie_embeddings else 2)
        sketch, moments, projections = rows * rank * 4, rows * 4, in_bytes * rank
        # propose() peaks as it forms the last directions D: all of D, the new row moments,
        # one r×r Gram matrix A Aᵀ (formed target by target when projections are redrawn
        # every update) and two [out, r] fp32 temporaries of the widest target. apply()
        # holds less: it releases each D as that target's bf16 factor U is made.
        widest = max(inter, h, v if m == "logra-sketch" else 0)
        step_scratch += sketch + moments + rank * rank * 4 + 2 * widest * rank * 4

    # ---- activations and temporaries
    saved = predict_saved_activations(
        shape, m, seq=seq, batch=batch, rank=rank, precision=precision, attention=attention,
        padded=padded, lora_rank=r_lora)
    head_saved = saved.head
    logits_temp = 2 * n_tok * v * 4
    if logits_chunk:
        chunk = min(logits_chunk, n_tok)
        head_saved = saved.head - 4 * v * n_tok + 4 * h * n_tok
        logits_temp = 3 * chunk * v * 4
    layer_scratch = 3 * n_tok * inter * cb + n_tok * h * rs
    if checkpointing:
        # each layer's checkpointed input, plus one more [N, hidden] that stays alive (measured)
        boundaries = (L + 1) * n_tok * h * rs
        # the recomputed layer's first norm saves the checkpointed input itself
        recomputed = saved.layers[-1] - (4 * h * n_tok if rs == 4 else 0)
        acts_loss = saved.embed + boundaries + head_saved + (saved.layers[0] - saved.layers[-1])
        acts_layer = saved.embed + boundaries + recomputed + (saved.layers[0] - saved.layers[-1])
        layer_scratch += n_tok * h * rs
    else:
        acts_loss = saved.total - saved.head + head_saved
        acts_layer = saved.embed + sum(saved.layers)

    # gradients alive when the last layer runs backward: lm_head (or tied embedding) and
    # the final norm for dense AdamW; under FSDP also one unsharded layer's gradients.
    early_grads = 0
    if m == "adamw":
        early_grads = (v * h + h + h * inter) * pb / world   # lm_head, final norm, down_proj
        if fsdp:
            early_grads += shape.layer_parameters * cb
    elif m == "logra-sketch":
        early_grads = h * pb / world
    elif m == "lora":
        early_grads = r_lora * (h + inter) * 4 / world   # down_proj's adapters (MLP backward runs first)

    # the forward pass peaks at the loss: the logits (and their fp32 copy under bf16)
    # next to everything saved, the final hidden state held by the model output and,
    # under autocast, one more fp32 [N, hidden] (measured); a decoder layer's forward
    # scratch is smaller whenever vocab > intermediate size, as in every LLM.
    if logits_chunk:
        forward_scratch = logits_temp
    else:
        hidden_unsaved = 0 if (m == "adamw" and precision != "autocast") else rs
        forward_scratch = (n_tok * v * (cb + (4 if cb == 2 else 0))
                           + n_tok * h * (hidden_unsaved + (4 if precision == "autocast" else 0)))

    fixed_opt = states + moments + projections
    phases = {
        "forward (loss)": {
            "parameters": params_resident + working, "gradients": sketch, "optimizer": fixed_opt,
            "activations": acts_loss, "temporaries": forward_scratch,
        },
        "loss backward": {
            "parameters": params_resident + working, "gradients": sketch, "optimizer": fixed_opt,
            "activations": acts_loss, "temporaries": logits_temp,
        },
        "last layer backward": {
            "parameters": params_resident + working, "gradients": sketch + early_grads, "optimizer": fixed_opt,
            "activations": acts_layer, "temporaries": layer_scratch,
        },
        "optimizer step": {
            "parameters": params_resident, "gradients": sketch + grads_full, "optimizer": fixed_opt + step_scratch,
            "activations": 0, "temporaries": 0,
        },
    }
    phases = {p: {k: int(math.ceil(x)) for k, x in cats.items()} for p, cats in phases.items()}
    peak = max(PHASES, key=lambda p: sum(phases[p].values()))
    settings = dict(seq=seq, batch=batch, rank=rank, gpus=gpus, shard=shard, checkpointing=checkpointing,
                    dtype=dtype, autocast=autocast, attention=attention, padded=padded, adam_impl=adam_impl,
                    lora_rank=r_lora, logits_chunk=logits_chunk, precision=precision)
    return Estimate(
        method=m, model=shape.name, settings=settings, phases=phases, peak_phase=peak,
        gpu_bytes=int(gpu_memory_gib * GIB), reserve_bytes=int(reserve_gib * GIB),
        num_parameters=n_params, trainable_parameters=dense_numel, sketch_values=rows * rank,
    )
