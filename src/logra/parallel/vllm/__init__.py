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
`FusedReceiver` adds the checks of `logra.parallel`: the step must be the next one, the
fused state's checksum must match the trainer's per-rank expectation
(`expected_fused_checksum`), and `FusedReceiver.resync` rebuilds the fused tensors from
a full HF state dict (`fuse_state_dict` / `copy_into_fused`).

Bitwise equality needs the same dtype and device arithmetic on both sides: a bf16 vLLM
engine matches a bf16 HF copy that applied the same deltas, not a fp32 trainer's
weights cast to bf16.
"""

from ...errors import ChecksumMismatchError, DeltaGapError, LayoutError, NeedsResyncError
from .layout import DEFAULT_VOCAB_PADDING, FusedLayout, Slot, copy_into_fused, fuse_state_dict
from .receiver import STRATEGIES, FusedReceiver, apply_delta_fused, expected_fused_checksum, fused_checksum

__all__ = [
    "DEFAULT_VOCAB_PADDING", "STRATEGIES", "ChecksumMismatchError", "DeltaGapError", "FusedLayout", "FusedReceiver",
    "LayoutError", "NeedsResyncError", "Slot", "apply_delta_fused", "copy_into_fused", "expected_fused_checksum",
    "fuse_state_dict", "fused_checksum",
]
