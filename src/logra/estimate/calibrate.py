"""Torch measurements that validate the analytic model of `logra.estimate`.

`measure_saved_activations` counts what autograd really saves (the source of the
coefficients of `logra.estimate.activations`); `compare_with_tracker` runs one training
step of a random model under `logra.memory.track_memory` next to its `estimate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..config import DEFAULT_TARGETS
from .activations import SavedActivations, canonical_method
from .model import CATEGORIES, estimate
from .shapes import ModelShape


def measure_saved_activations(model: Any, inputs: Mapping[str, Any], *, autocast: bool = False) -> SavedActivations:
    """Run one forward pass and count the bytes autograd saves, by embed / layer / head.

    Uses ``torch.autograd.graph.saved_tensors_hooks``; each storage is counted once (the
    first module that saves it owns it) and parameters are not counted (bf16 copies of
    them made by autocast are). ``model`` is a HF causal LM, possibly wrapped by PEFT or
    carrying LoGRA sketches; ``autocast`` runs the forward under bf16 autocast on the
    model's device type. Does not work with activation checkpointing, which installs
    its own hooks.
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    layers = list(decoder.layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = ["embed"]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: where.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda _m, _a, _o: where.__setitem__(0, "head")))
    seen: set[int] = set()
    result = SavedActivations(layers=[0] * len(layers))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen:
            return t
        seen.add(ptr)
        if where[0] == "embed":
            result.embed += storage.nbytes()
        elif where[0] == "head":
            result.head += storage.nbytes()
        else:
            result.layers[where[0]] += storage.nbytes()
        return t

    device_type = next(model.parameters()).device.type
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                out = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    del out
    return result



def build_random_model(shape: ModelShape, *, dtype: str = "float32", attention: str = "sdpa", seed: int = 0) -> Any:
    """A randomly initialised HF causal LM of ``shape`` (Qwen2 if it has q/k/v biases, else Llama)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=4096, pad_token_id=0, attn_implementation=attention,
    )
    torch.manual_seed(seed)
    if shape.qkv_bias:
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    return model.to(torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32)


def compare_with_tracker(
    shape: ModelShape,
    method: str,
    *,
    batch: int = 2,
    seq: int = 128,
    rank: int = 64,
    dtype: Literal["float32", "bfloat16"] = "float32",
    autocast: bool = False,
    checkpointing: bool = False,
    attention: Literal["sdpa", "eager"] = "sdpa",
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, dict[str, int]]:
    """Measure one steady-state training step with `logra.memory.track_memory` and predict it.

    Builds a random model of ``shape``, takes one untracked step (so optimizer state
    exists, as in a long run), then tracks ``forward → backward → step → zero_grad``.
    AdamW (and LoRA's AdamW) run with ``foreach=True``; LoRA uses PEFT with fp32 adapters.

    Returns:
        ``{'measured': {...}, 'predicted': {...}}``, each with `CATEGORIES` and ``'total'``
        in bytes (measured 'temporaries' is MemTracker's 'temporary'; its 'buffers' and
        'other' are counted in the total only).
    """
    import torch

    from ..config import LoGRAConfig
    from ..memory import enable_activation_checkpointing, track_memory
    from ..optimizer import LoGRAOptimizer

    m = canonical_method(method)
    model = build_random_model(shape, dtype=dtype, attention=attention, seed=seed).to(device)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
        model.config.use_cache = False
    if m.startswith("logra"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 weights warn about merge precision; irrelevant here
            opt = LoGRAOptimizer(model, LoGRAConfig(rank=rank, non_target=m.split("-")[1]))
    elif m == "lora":
        import peft

        from ..sketch import target_module_names

        lora = peft.LoraConfig(r=rank, target_modules=target_module_names(model, DEFAULT_TARGETS), lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, shape.vocab_size, (batch, seq), generator=g).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step() -> None:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with track_memory(model, opt, device=device) as report:
        step()
    measured = {c: report.peak_by_category.get(c, 0) for c in CATEGORIES[:-1]}
    measured["temporaries"] = report.peak_by_category.get("temporary", 0)
    measured["total"] = report.peak_total
    est = estimate(shape, m, seq=seq, batch=batch, rank=rank, dtype=dtype, autocast=autocast,
                   checkpointing=checkpointing, attention=attention, adam_impl="foreach")
    predicted = dict(est.categories)
    predicted["total"] = est.total
    return {"measured": measured, "predicted": predicted, "peak_phase": {"predicted": est.peak_phase}}  # type: ignore[dict-item]

