"""Deltas into vLLM's fused, tensor-parallel layout: bitwise equal to `apply_delta` on HF weights."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config

from conftest import tiny_llama, tiny_qwen2, token_batch
from logra import DeltaMismatchError, LoGRAConfig, LoGRAOptimizer, apply_delta
from logra.parallel.vllm import (
    ChecksumMismatchError,
    DeltaGapError,
    FusedLayout,
    FusedReceiver,
    LayoutError,
    NeedsResyncError,
    apply_delta_fused,
    expected_fused_checksum,
    fuse_state_dict,
    fused_checksum,
)
from logra.projection import stable_name

STEPS = 6


def hf_state(model) -> dict[str, torch.Tensor]:
    return {stable_name(n): p.detach() for n, p in model.named_parameters()}


def layouts(model, tp: int) -> list[FusedLayout]:
    return [FusedLayout.from_hf_config(model.config, tp_size=tp, tp_rank=r) for r in range(tp)]


def assert_fused_equal(fused: dict[str, torch.Tensor], reference_model, layout: FusedLayout) -> None:
    want = fuse_state_dict(hf_state(reference_model), layout)
    assert sorted(fused) == sorted(want)
    for name, t in want.items():
        assert fused[name].dtype == t.dtype and fused[name].device == t.device
        assert torch.equal(fused[name], t), f"{name} differs on tp rank {layout.tp_rank}"


class Trainer:
    """A real LoGRA run on a tiny HF model; yields (delta, dense HF tensors after the update)."""

    def __init__(self, model, **cfg) -> None:
        self.model = model
        self.config = LoGRAConfig(rank=4, update_ratio=1e-2, **cfg)
        self.opt = LoGRAOptimizer(model, self.config)
        ids = {id(p) for p in self.opt.dense_parameters()}
        self.dense_names = [stable_name(n) for n, p in model.named_parameters() if id(p) in ids]
        self.i = 0

    def step(self):
        self.model(**token_batch(self.model.config.vocab_size, seed=self.i)).loss.backward()
        delta = self.opt.apply(self.opt.propose())
        self.opt.zero_grad()
        self.i += 1
        params = hf_state(self.model)
        return delta, {n: params[n].clone() for n in self.dense_names}


def rollout_copy(model, dtype, device="cpu"):
    """A rollout copy of the initial policy: what vLLM would load, as an HF model."""
    return copy.deepcopy(model).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- the layout itself
def test_layout_matches_vllm_stacking_tp1():
    model = tiny_qwen2()
    (lay,) = layouts(model, 1)
    fused, p = fuse_state_dict(hf_state(model), lay), hf_state(model)
    pre = "model.layers.1."
    assert torch.equal(fused[pre + "self_attn.qkv_proj.weight"], torch.cat(
        [p[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(fused[pre + "self_attn.qkv_proj.bias"], torch.cat(
        [p[pre + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(fused[pre + "mlp.gate_up_proj.weight"], torch.cat(
        [p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"]]))
    assert torch.equal(fused[pre + "self_attn.o_proj.weight"], p[pre + "self_attn.o_proj.weight"])
    emb = fused["model.embed_tokens.weight"]
    assert emb.shape == (128, 32) and torch.equal(emb[:97], p["model.embed_tokens.weight"]) and not emb[97:].any()
    assert not any("q_proj" in n or "gate_proj" in n for n in fused)


def test_layout_shards_tp2_and_replicates_kv_tp4():
    model = tiny_llama()  # 4 heads, 2 kv heads, head_dim 8, intermediate 72, vocab 89
    p = hf_state(model)
    pre = "model.layers.0."
    q, k, v = (p[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
    for lay in layouts(model, 2):
        r = lay.tp_rank
        fused = fuse_state_dict(p, lay)
        assert torch.equal(fused[pre + "self_attn.qkv_proj.weight"],
                           torch.cat([q[16 * r: 16 * (r + 1)], k[8 * r: 8 * (r + 1)], v[8 * r: 8 * (r + 1)]]))
        o, down = p[pre + "self_attn.o_proj.weight"], p[pre + "mlp.down_proj.weight"]
        assert torch.equal(fused[pre + "self_attn.o_proj.weight"], o[:, 16 * r: 16 * (r + 1)])
        assert torch.equal(fused[pre + "mlp.down_proj.weight"], down[:, 36 * r: 36 * (r + 1)])
        up = p[pre + "mlp.up_proj.weight"][36 * r: 36 * (r + 1)]
        assert torch.equal(fused[pre + "mlp.gate_up_proj.weight"][36:], up)
        assert torch.equal(fused["model.norm.weight"], p["model.norm.weight"])
    for lay in layouts(model, 4):  # 2 kv heads on 4 ranks: ranks 0,1 hold kv head 0; ranks 2,3 kv head 1
        r, kv = lay.tp_rank, lay.tp_rank // 2
        qkv = fuse_state_dict(p, lay)[pre + "self_attn.qkv_proj.weight"]
        assert torch.equal(qkv, torch.cat([q[8 * r: 8 * (r + 1)], k[8 * kv: 8 * (kv + 1)], v[8 * kv: 8 * (kv + 1)]]))
    # vocab 89 padded to 128, 32 rows per rank: rank 3 holds only padding
    lm = [fuse_state_dict(p, lay)["lm_head.weight"] for lay in layouts(model, 4)]
    assert torch.equal(torch.cat(lm)[:89], p["lm_head.weight"]) and not torch.cat(lm)[89:].any()


def test_layout_refuses_what_vllm_cannot_shard():
    cfg = tiny_llama().config
    with pytest.raises(LayoutError, match="not divisible by tensor-parallel size 3"):
        FusedLayout.from_hf_config(cfg, tp_size=3)
    cfg3 = copy.deepcopy(cfg)
    cfg3.num_attention_heads, cfg3.num_key_value_heads, cfg3.head_dim = 6, 3, 8
    cfg3.intermediate_size = 48
    with pytest.raises(LayoutError, match="neither divides"):
        FusedLayout.from_hf_config(cfg3, tp_size=2)
    with pytest.raises(LayoutError, match="not supported"):
        FusedLayout.from_hf_config(GPT2Config(), tp_size=1)
    with pytest.raises(LayoutError, match="tensor-parallel rank"):
        FusedLayout.from_hf_config(cfg, tp_size=2, tp_rank=2)
    lay = FusedLayout.from_hf_config(cfg)
    with pytest.raises(LayoutError, match="no place"):
        lay.slot("model.layers.0.self_attn.rotary.weight")
    with pytest.raises(LayoutError, match="no place"):
        lay.fused_name("model.layers.0.self_attn.gate_proj.weight")
    with pytest.raises(LayoutError, match="out of range"):
        lay.slot("model.layers.5.mlp.up_proj.weight")
    with pytest.raises(LayoutError, match="needs all of its members"):
        fuse_state_dict({"model.layers.0.self_attn.q_proj.weight": hf_state(tiny_llama())[
            "model.layers.0.self_attn.q_proj.weight"]}, lay)


# ---------------------------------------------------------------- deltas, bitwise
@pytest.mark.parametrize("make,tp,dtype,strategy", [
    (tiny_qwen2, 1, torch.float32, "full"), (tiny_qwen2, 2, torch.float32, "full"),
    (tiny_qwen2, 2, torch.bfloat16, "full"), (tiny_llama, 1, torch.float32, "full"),
    (tiny_llama, 2, torch.bfloat16, "full"), (tiny_llama, 4, torch.float32, "full"),
    (tiny_llama, 4, torch.bfloat16, "full"),
    # 'slice' (matmul on the shard itself): bitwise on these shapes with this CPU's BLAS;
    # with tiny_llama tp=4 fp32 (a 32x8 o_proj shard) it differed in the last bit.
    (tiny_qwen2, 2, torch.float32, "slice"), (tiny_llama, 2, torch.bfloat16, "slice"),
])
def test_deltas_bitwise_equal_to_apply_delta(make, tp, dtype, strategy):
    model = make()
    trainer = Trainer(model)
    reference = rollout_copy(model, dtype)  # an HF rollout copy receiving apply_delta
    lays = layouts(model, tp)
    receivers = [FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config, strategy=strategy)
                 for lay in lays]
    before = {n: t.clone() for n, t in receivers[-1].params.items()}
    for _ in range(STEPS):
        delta, _ = trainer.step()
        apply_delta(reference, delta, trainer.config)
        for rcv in receivers:
            expected = expected_fused_checksum(hf_state(reference), rcv.layout, rcv.checked_names(delta))
            rcv.apply(delta, checksum=expected)
    if dtype == torch.float32:  # the fp32 rollout copy is bitwise the trainer
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    for rcv in receivers:
        assert rcv.step == STEPS
        assert_fused_equal(dict(rcv.params), reference, rcv.layout)
    changed = [n for n, t in before.items() if not torch.equal(t, receivers[-1].params[n])]
    assert any("qkv_proj.weight" in n for n in changed) and any("down_proj" in n for n in changed)


@pytest.mark.parametrize("strategy", ["full", "slice"])
def test_fitted_projections_reach_fused_receivers_with_the_first_delta(strategy):
    """``distribution='inputs'``: each tp rank keeps the projections of the stream's first
    delta and merges the later ones bitwise as `apply_delta` does; a rank that joined later
    refuses, unchanged, until a full resync hands it the trainer's projections, and a full resync
    that hands it none leaves none kept."""
    model = tiny_llama()
    trainer = Trainer(model, distribution="inputs", refresh=False)
    batch = token_batch(model.config.vocab_size, batch=4, seed=50)
    trainer.opt.fit_projections([{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}])
    reference = rollout_copy(model, torch.float32)
    receivers = [FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config, strategy=strategy)
                 for lay in layouts(model, 2)]
    for _ in range(STEPS):
        delta, _ = trainer.step()
        apply_delta(reference, delta, trainer.config)
        for rcv in receivers:
            rcv.apply(delta, checksum=expected_fused_checksum(hf_state(reference), rcv.layout,
                                                              rcv.checked_names(delta)))
    for rcv in receivers:
        assert_fused_equal(dict(rcv.params), reference, rcv.layout)
    lay = layouts(model, 2)[0]
    late = FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config, step=STEPS)
    before = {n: t.clone() for n, t in late.params.items()}
    delta, _ = trainer.step()
    with pytest.raises(DeltaMismatchError, match="first delta of the stream"):
        late.apply(delta)
    assert late.step == STEPS and all(torch.equal(t, before[n]) for n, t in late.params.items())
    apply_delta(reference, delta, trainer.config)
    late.resync(hf_state(reference), STEPS + 1, fitted=trainer.opt.fitted_projections())
    delta, _ = trainer.step()
    apply_delta(reference, delta, trainer.config)
    late.apply(delta)
    assert_fused_equal(dict(late.params), reference, lay)
    # a resync that sends no projections (the receiver reused for another run) leaves none kept
    late.resync(hf_state(reference), late.step)
    with pytest.raises(DeltaMismatchError, match="first delta of the stream"):
        late.apply(trainer.step()[0])


def test_gap_refused_then_resync_restores():
    model = tiny_qwen2()
    trainer = Trainer(model)
    reference = rollout_copy(model, torch.float32)
    lays = layouts(model, 2)
    receivers = [FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config) for lay in lays]
    for i in range(STEPS):
        delta, _ = trainer.step()
        apply_delta(reference, delta, trainer.config)
        if i == 2:  # update 2 is lost in transit
            continue
        for rcv in receivers:
            if i == 3:
                before = rcv.checksum()
                with pytest.raises(DeltaGapError, match="gap") as err:
                    rcv.apply(delta)
                assert (err.value.have, err.value.got) == (2, 3) and rcv.checksum() == before  # nothing changed
                full = hf_state(reference)
                rcv.resync(full, step=4, checksum=expected_fused_checksum(full, rcv.layout))
                assert rcv.resyncs == 1
                assert_fused_equal(dict(rcv.params), reference, rcv.layout)
            else:
                rcv.apply(delta, checksum=expected_fused_checksum(hf_state(reference), rcv.layout,
                                                                   rcv.checked_names(delta)))
    for rcv in receivers:
        with pytest.raises(DeltaGapError, match="stale"):
            rcv.apply(delta)  # a late duplicate is refused too
        assert rcv.step == STEPS
        assert_fused_equal(dict(rcv.params), reference, rcv.layout)


def test_wrong_checksum_refused_then_resync_restores():
    model = tiny_llama()
    trainer = Trainer(model)
    reference = rollout_copy(model, torch.float32)
    (lay,) = layouts(model, 1)
    rcv = FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config)
    for i in range(STEPS):
        delta, _ = trainer.step()
        apply_delta(reference, delta, trainer.config)
        expected = expected_fused_checksum(hf_state(reference), lay, rcv.checked_names(delta))
        if i == 1:  # a factor corrupted in transit: the trainer's checksum catches it
            delta.factors[next(iter(delta.factors))] = delta.factors[next(iter(delta.factors))] * 2
            with pytest.raises(ChecksumMismatchError, match="full resync is needed"):
                rcv.apply(delta, checksum=expected)
            assert rcv.needs_resync and rcv.step == 1
            delta2, _ = trainer.step()
            apply_delta(reference, delta2, trainer.config)
            with pytest.raises(NeedsResyncError):
                rcv.apply(delta2)
            full = hf_state(reference)
            rcv.resync(full, step=3, checksum=expected_fused_checksum(full, lay))
            assert not rcv.needs_resync and rcv.step == 3
            assert_fused_equal(dict(rcv.params), reference, lay)
        elif i == 3:  # a wrong checksum on a good delta is refused as well
            with pytest.raises(ChecksumMismatchError):
                rcv.apply(delta, checksum="0" * 32)
            full = hf_state(reference)
            rcv.resync(full, step=5)
        else:
            rcv.apply(delta, checksum=expected)
    assert rcv.step == trainer.i
    assert_fused_equal(dict(rcv.params), reference, lay)


def test_resync_checksum_and_coverage_refused():
    model = tiny_qwen2()
    (lay,) = layouts(model, 1)
    rcv = FusedReceiver(fuse_state_dict(hf_state(model), lay), lay, LoGRAConfig(rank=4))
    full = hf_state(model)
    with pytest.raises(ChecksumMismatchError):
        rcv.resync(full, step=0, checksum="f" * 32)
    assert rcv.needs_resync
    partial = {n: t for n, t in full.items() if "layers.1.mlp" not in n}
    with pytest.raises(LayoutError, match="miss fused tensors"):
        rcv.resync(partial, step=0)
    with pytest.raises(LayoutError, match="no silent casts"):
        rcv.resync({n: t.double() for n, t in full.items()}, step=0)
    rcv.resync(full, step=0, checksum=expected_fused_checksum(full, lay))
    assert not rcv.needs_resync and rcv.checksum() == fused_checksum(fuse_state_dict(full, lay))


def test_mismatched_delta_changes_nothing():
    model = tiny_qwen2()
    trainer = Trainer(model)
    delta, _ = trainer.step()
    (lay,) = layouts(model, 1)
    fused = fuse_state_dict(hf_state(tiny_qwen2()), lay)
    before = fused_checksum(fused)
    with pytest.raises(DeltaMismatchError, match="rank"):
        apply_delta_fused(fused, delta, LoGRAConfig(rank=8, update_ratio=1e-2), lay)
    bad = copy.copy(delta)
    bad.factors = {**delta.factors, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 4, dtype=torch.bfloat16)}
    with pytest.raises(DeltaMismatchError, match="factor for model.layers.0.mlp.up_proj.weight"):
        apply_delta_fused(fused, bad, trainer.config, lay)
    with pytest.raises(ValueError, match="strategy"):
        apply_delta_fused(fused, delta, trainer.config, lay, strategy="fast")
    assert fused_checksum(fused) == before


# ---------------------------------------------------------------- non_target='sketch'
@pytest.mark.parametrize("mode,tie,tp", [("sketch", False, 2), ("sketch", True, 4), ("adamw", False, 2)])
def test_non_target_embeddings_and_dense(mode, tie, tp):
    """'sketch': embeddings/lm_head are sketched (vocab-parallel rows, padding untouched), norms and biases
    dense; 'adamw': embeddings, lm_head, norms and biases all arrive as dense tensors."""
    model = tiny_qwen2(tie=tie)
    trainer = Trainer(model, non_target=mode)
    dense_embeddings = "model.embed_tokens.weight" in trainer.dense_names
    assert ("model.embed_tokens.weight" in trainer.opt.targets) is (mode == "sketch") is (not dense_embeddings)
    assert ("lm_head.weight" in trainer.opt.targets) is (mode == "sketch" and not tie)
    assert any("q_proj.bias" in n for n in trainer.dense_names)
    reference = rollout_copy(model, torch.float32)
    lays = layouts(model, tp)
    receivers = [FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config) for lay in lays]
    assert ("lm_head.weight" in receivers[0].params) is (not tie)
    for _ in range(STEPS):
        delta, dense = trainer.step()
        replay(reference, delta, dense, trainer.config)
        for rcv in receivers:
            names = rcv.checked_names(delta, dense)
            assert "model.embed_tokens.weight" in names and any("qkv_proj.bias" in n for n in names)
            rcv.apply(delta, checksum=expected_fused_checksum(hf_state(reference), rcv.layout, names), dense=dense)
    for rcv in receivers:
        assert_fused_equal(dict(rcv.params), reference, rcv.layout)


def replay(reference, delta, dense, config) -> None:
    """What an HF rollout copy does with an update: merge the delta, copy the dense tensors."""
    apply_delta(reference, delta, config)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if stable_name(n) in dense:
                p.copy_(dense[stable_name(n)])


def test_tied_lm_head_in_delta_refused():
    model = tiny_qwen2(tie=True)
    trainer = Trainer(model)
    delta, _ = trainer.step()
    (lay,) = layouts(model, 1)
    fused = fuse_state_dict(hf_state(model), lay)
    delta.factors["lm_head.weight"] = torch.zeros(97, 4, dtype=torch.bfloat16)
    with pytest.raises(DeltaMismatchError, match="ties it"):
        apply_delta_fused(fused, delta, trainer.config, lay)


# ---------------------------------------------------------------- CUDA (run by scripts/gpu_check.sh)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp,strategy", [(1, "full"), (2, "full"), (4, "full"), (2, "slice"), (4, "slice")])
def test_fused_bitwise_cuda(tp, strategy):
    """bf16 rollout copy on the GPU vs fused bf16 shards on the GPU (cuBLAS on shards vs whole weights)."""
    model = tiny_qwen2(hidden=256, layers=2)
    trainer = Trainer(model, non_target="sketch")
    reference = rollout_copy(model, torch.bfloat16, "cuda")
    receivers = [FusedReceiver(fuse_state_dict(hf_state(reference), lay), lay, trainer.config, strategy=strategy)
                 for lay in layouts(model, tp)]
    for _ in range(STEPS):
        delta, dense = trainer.step()
        dense = {n: t.to("cuda", torch.bfloat16) for n, t in dense.items()}
        replay(reference, delta, dense, trainer.config)
        for rcv in receivers:
            names = rcv.checked_names(delta, dense)
            rcv.apply(delta, checksum=expected_fused_checksum(hf_state(reference), rcv.layout, names), dense=dense)
    for rcv in receivers:
        assert_fused_equal(dict(rcv.params), reference, rcv.layout)
