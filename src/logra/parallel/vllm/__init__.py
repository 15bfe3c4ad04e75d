"""`PolicyDelta` into vLLM's fused, tensor-parallel weight layout (no vLLM import needed).

vLLM stores a Llama / Qwen2 / Mistral decoder with fused projections (``qkv_proj``,
``gate_up_proj``), sharded over tensor-parallel ranks. `layout` maps every transformers
parameter to its place there (`FusedLayout`, `fuse_state_dict`); `receiver` merges each
update's `PolicyDelta` into the fused tensors bitwise as `apply_delta` would into the HF
weights, and verifies step order and checksums like `logra.parallel`'s rollout workers
(`FusedReceiver`).

`engine.LoGRAWorkerExtension` brings the same merge into a running vLLM engine
(``worker_extension_cls``), and `driver.VLLMPolicy` drives it from the trainer's process.
"""

from ...errors import ChecksumMismatchError, DeltaGapError, LayoutError, NeedsResyncError
from .driver import EXTENSION, VLLMPolicy, make_engine, shutdown_engine, track_process_group
from .engine import LoGRAWorkerExtension
from .layout import DEFAULT_VOCAB_PADDING, FusedLayout, Slot, copy_into_fused, fuse_state_dict
from .receiver import STRATEGIES, FusedReceiver, apply_delta_fused, expected_fused_checksum, fused_checksum

__all__ = [
    "DEFAULT_VOCAB_PADDING", "EXTENSION", "STRATEGIES", "ChecksumMismatchError", "DeltaGapError", "FusedLayout",
    "FusedReceiver", "LayoutError", "LoGRAWorkerExtension", "NeedsResyncError", "Slot", "VLLMPolicy",
    "apply_delta_fused", "copy_into_fused", "expected_fused_checksum", "fuse_state_dict", "fused_checksum",
    "make_engine", "shutdown_engine", "track_process_group",
]
