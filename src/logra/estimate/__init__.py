"""``logra estimate``: per-GPU memory planner for dense AdamW, LoRA and LoGRA.

The model is built from first principles and calibrated against what PyTorch really
keeps alive in a Hugging Face Qwen2/Llama decoder:

* **parameters, gradients, optimizer state** are counted from the model shape
  (AdamW: two moments in the parameter dtype, as ``torch.optim.AdamW`` allocates them;
  LoRA: fp32 adapters, as PEFT creates them, with their own AdamW state; LoGRA: the
  ``[Σ out, r]`` fp32 sketch buffer in place of gradients, one fp32 second moment per
  output row and the ``[r, in]`` projections, stored as Rademacher sign bits).
* **activations** are the tensors autograd saves for backward. The per-token
  coefficients in `predict_saved_activations` were read off
  `measure_saved_activations` (``torch.autograd.graph.saved_tensors_hooks`` on tiny
  Qwen2 models) and the tests re-measure them on a model of different dimensions. What
  the measurement showed, and the formulas encode:

  - a LoGRA target saves ``P = X Aᵀ`` (``r`` values per token) instead of ``X``; the
    norm in front of q/k/v and gate/up then saves only its fp32 input and ``rsqrt``
    (its own weight is frozen too, so its normalised output is no longer kept), the
    down projection no longer keeps ``silu(gate) * up``, and o_proj's input is still
    kept because SDPA saves its own output for its backward;
  - SiLU and the gating product still save ``gate``, ``silu(gate)`` and ``up``;
  - under ``torch.autocast`` every trainable linear weight's bf16 copy is saved for
    backward (dense AdamW: a bf16 copy of all linear weights; LoRA and frozen heads:
    fresh bf16 copies of the frozen weights), and every consumer of a norm output
    saves its own bf16 cast of it;
  - the loss keeps the fp32 log-softmax ``[N, vocab]``.
* **temporaries** are the transient buffers at the peak instant: the loss backward
  holds ``dlogp`` and ``dlogits`` (two fp32 ``[N, vocab]``) next to the saved
  log-softmax; a decoder layer's backward holds three ``[N, intermediate]`` gradients;
  the optimizer step's scratch (``foreach`` AdamW: one tensor the size of the trainable
  parameters) is booked as optimizer memory, as ``MemTracker`` books it.

The peak is taken the way ``torch.distributed._tools.mem_tracker.MemTracker`` (and
`logra.memory.track_memory`) sees it: the largest of four instants of one steady-state
training step (optimizer state already allocated, gradients set to ``None`` by
``zero_grad``): *forward (loss)* (all activations + the logits and their fp32 copy),
*loss backward* (all activations + logits gradients), *last layer backward*
(activations + the layer's backward scratch + gradients produced so far) and
*optimizer step* (activations freed, all gradients + optimizer state + step scratch).
For dense AdamW the step usually wins; for LoGRA the backward does.

FSDP (``shard='fsdp'``) is modelled as FSDP2 ``fully_shard`` of every decoder layer and
the root, with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` when autocast is on:
parameters, gradients and optimizer state are divided by the GPU count; during forward
and backward each GPU also holds the unsharded root (embeddings, lm_head) and two
unsharded decoder layers (current + prefetched) in the compute dtype. LoGRA's sketch
buffer, moments and projections are not sharded (every rank holds the full sketch,
docs/method.md §7). Not modelled: the CUDA context, NCCL buffers and allocator fragmentation
(``--reserve`` keeps headroom for them when deciding whether a configuration fits).

Modules: `shapes` (model dimensions, built-in shapes), `activations` (bytes saved for
backward), `model` (the per-phase accounting: `estimate`), `calibrate` (torch
measurements that validate the model: saved-tensor hooks, MemTracker), `paper` (the
paper's Table 1/2 in its setting) and `cli` (``logra estimate``).
"""

from __future__ import annotations

from .activations import METHODS, Precision, SavedActivations, activation_precision, predict_saved_activations
from .calibrate import build_random_model, compare_with_tracker, measure_saved_activations
from .cli import main
from .model import CATEGORIES, GIB, PHASES, Estimate, estimate
from .paper import PAPER_ASSUMPTIONS, PAPER_SETTING, PAPER_TABLE, paper_comparison
from .shapes import ALIASES, BUILTIN_SHAPES, ModelShape

__all__ = [
    "ALIASES", "BUILTIN_SHAPES", "CATEGORIES", "GIB", "METHODS", "PAPER_ASSUMPTIONS", "PAPER_SETTING", "PAPER_TABLE",
    "PHASES", "Estimate", "ModelShape", "Precision", "SavedActivations", "activation_precision",
    "build_random_model", "compare_with_tracker", "estimate", "main", "measure_saved_activations",
    "paper_comparison", "predict_saved_activations",
]
