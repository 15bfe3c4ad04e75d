"""Sketches against dense autograd: S = G Aᵀ exactly, inputs' gradients unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer
from logra.memory import enable_activation_checkpointing, track_memory


def _dense_reference(model, batches, checkpointing=False):
    ref = copy.deepcopy(model)
    if checkpointing:
        enable_activation_checkpointing(ref, reentrant=False)
    ref.train()
    for b in batches:
        ref(**b).loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _assert_sketches_exact(opt, dense):
    for name, s in opt.sketches().items():
        expected = dense[name] @ opt.projection(name).T
        scale = expected.abs().max()
        torch.testing.assert_close(s, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(("checkpointing", "share"), [(False, False), (True, False), (False, True), (True, True)])
def test_sketch_equals_dense_gradient_times_projection(arch, checkpointing, share):
    model = tiny_qwen2() if arch == "qwen2" else tiny_llama()
    vocab = model.config.vocab_size
    batches = [token_batch(vocab, seed=s) for s in range(3)]  # three accumulated micro-batches
    dense = _dense_reference(model, batches, checkpointing)
    if checkpointing:
        enable_activation_checkpointing(model, reentrant=False)
    model.train()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, share_projections=share))
    for b in batches:
        model(**b).loss.backward()
    assert len(opt.sketches()) == 7 * model.config.num_hidden_layers
    _assert_sketches_exact(opt, dense)
    q, k, o = (opt.projection(f"model.layers.0.self_attn.{x}_proj.weight") for x in "qko")
    assert torch.equal(q, k) is share and not torch.equal(q, o)
    for name in opt.targets:
        assert dict(model.named_parameters())[name].grad is None


def test_input_gradients_unchanged():
    model = tiny_qwen2()
    ref = copy.deepcopy(model)
    b = token_batch(97)
    embeds = model.get_input_embeddings()(b["input_ids"]).detach().requires_grad_(True)
    ref_embeds = embeds.detach().clone().requires_grad_(True)
    LoGRAOptimizer(model, LoGRAConfig(rank=8))
    kw = {"attention_mask": b["attention_mask"], "labels": b["labels"]}
    model(inputs_embeds=embeds, **kw).loss.backward()
    ref(inputs_embeds=ref_embeds, **kw).loss.backward()
    torch.testing.assert_close(embeds.grad, ref_embeds.grad, rtol=1e-5, atol=1e-7)


def test_backward_twice_adds_twice_and_zero_grad_clears():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    b = token_batch(97)
    model(**b).loss.backward()
    once = {n: s.clone() for n, s in opt.sketches().items()}
    model(**b).loss.backward()
    for n, s in opt.sketches().items():
        torch.testing.assert_close(s, 2 * once[n])
    opt.zero_grad()
    assert opt.sketch_buffer.abs().sum() == 0


@pytest.mark.parametrize("tie", [False, True])
def test_sketch_mode_embeddings_and_lm_head(tie):
    model = tiny_qwen2(tie=tie)
    batches = [token_batch(97, seed=s) for s in range(2)]
    dense = _dense_reference(model, batches)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, non_target="sketch"))
    names = set(opt.targets)
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) is (not tie)  # tied: one target, one sketch
    for b in batches:
        model(**b).loss.backward()
    _assert_sketches_exact(opt, dense)
    # norms stay with AdamW and get ordinary gradients
    assert all(p.grad is not None for p in opt.dense_parameters())


def test_only_projection_is_saved_for_backward():
    layer = nn.Linear(64, 16)
    wrapper = nn.Module()
    wrapper.proj = layer
    LoGRAOptimizer(wrapper, LoGRAConfig(rank=4, target_modules=("proj",)))
    x = torch.randn(10, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert (10, 64) not in shapes, "the full input X must not be kept for backward"
    assert (10, 4) in shapes


def test_shared_projection_is_computed_and_saved_once_per_input():
    """q/k/v and gate/up save one ``X Aᵀ`` per group: 4 per layer instead of 7."""
    saved: dict[bool, set[int]] = {}
    for share in (False, True):
        model = tiny_qwen2()
        opt = LoGRAOptimizer(model, LoGRAConfig(rank=5, share_projections=share))  # 5: no other dim is 5
        ptrs: set[int] = set()
        def pack(t, ptrs=ptrs):
            if t.dim() and t.shape[-1] == 5:  # the saved P = X Aᵀ
                ptrs.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**token_batch(model.config.vocab_size)).loss
        loss.backward()
        saved[share] = ptrs
        caches = {id(t.shared_input): t.shared_input for t in map(opt.sketch_target, opt.targets) if t.shared_input}
        assert len(caches) == (2 * model.config.num_hidden_layers if share else 0)
        assert all(c._p is None for c in caches.values())  # nothing outlives the forward pass
    layers = tiny_qwen2().config.num_hidden_layers
    assert (len(saved[False]), len(saved[True])) == (7 * layers, 4 * layers)


def test_memtracker_sees_no_dense_target_gradients():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    with track_memory(model, opt) as report:
        for s in range(2):
            model(**token_batch(97, seed=s)).loss.backward()
    # the only 'gradient' memory is the sketch buffer: Σ out · r · 4 bytes
    assert report.peak_by_category["gradients"] == opt.sketch_buffer.numel() * 4
    dense_bytes = sum(dict(model.named_parameters())[n].numel() * 4 for n in opt.targets)
    assert report.peak_by_category["gradients"] < dense_bytes / 4


def test_reentrant_checkpointing_still_sketches_first_layer():
    model = tiny_qwen2()
    batches = [token_batch(97)]
    dense = _dense_reference(model, batches)
    enable_activation_checkpointing(model, reentrant=True)
    model.train()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8))
    model(**batches[0]).loss.backward()
    _assert_sketches_exact(opt, dense)
