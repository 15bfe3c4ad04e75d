"""`PolicyDelta` and `apply_delta`: receivers hold the trainer's weights bitwise; bad deltas change nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_qwen2, train_steps
from logra import (
    DeltaMismatchError,
    LoGRAConfig,
    LoGRAOptimizer,
    PolicyDelta,
    apply_delta,
)


@pytest.mark.parametrize("non_target", ["freeze", "sketch", "adamw"])
def test_apply_delta_reproduces_trainer_bitwise(non_target):
    """Every parameter, the AdamW-trained non-targets included (the delta carries them)."""
    cfg = LoGRAConfig(rank=8, non_target=non_target, non_target_lr=1e-3)
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trainer, cfg)
    for delta in train_steps(trainer, opt, 20):
        wire = PolicyDelta.from_bytes(delta.to_bytes())
        apply_delta(receiver, wire, cfg)
    for (n, a), b in zip(trainer.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    low_rank = sum(p.shape[0] * 8 * 2 for n, p in trainer.named_parameters() if n in opt.targets)
    dense = sum(p.numel() * p.element_size() for p in opt.dense_parameters())
    assert (dense > 0) == (non_target != "freeze") and delta.nbytes == low_rank + dense


def test_apply_delta_refuses_bad_deltas():
    cfg = LoGRAConfig(rank=8)
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trainer, cfg)
    d0, d1 = train_steps(trainer, opt, 2)
    before = copy.deepcopy(receiver.state_dict())
    with pytest.raises(DeltaMismatchError, match="out-of-order"):
        apply_delta(receiver, d1, cfg)
    with pytest.raises(DeltaMismatchError, match="rank"):
        apply_delta(receiver, d0, LoGRAConfig(rank=4))
    with pytest.raises(DeltaMismatchError, match="seed"):
        apply_delta(receiver, d0, LoGRAConfig(rank=8, seed=1))
    with pytest.raises(DeltaMismatchError, match="not in this model"):
        foreign = PolicyDelta(**{**d0.__dict__, "factors": {"x.weight": d0.factors[opt.targets[0]]}})
        apply_delta(tiny_qwen2(layers=1), foreign, cfg)
    wide = tiny_qwen2(hidden=48)
    with pytest.raises(DeltaMismatchError, match="factor"):
        apply_delta(wide, d0, cfg)
    assert all(torch.equal(before[k], v) for k, v in receiver.state_dict().items())


def test_apply_delta_refuses_a_receiver_that_differs_only_in_input_width():
    cfg = LoGRAConfig(rank=4, target_modules=("o_proj",))  # o_proj: [hidden, heads·head_dim]
    trainer = tiny_qwen2()
    d0, = train_steps(trainer, LoGRAOptimizer(trainer, cfg), 1)
    receiver = tiny_qwen2()
    for layer in receiver.model.layers:  # same out, wider in
        layer.self_attn.o_proj = torch.nn.Linear(48, 32, bias=False)
    before = copy.deepcopy(receiver.state_dict())
    with pytest.raises(DeltaMismatchError, match="made for a"):
        apply_delta(receiver, d0, cfg)
    assert all(torch.equal(before[k], v) for k, v in receiver.state_dict().items())


def test_apply_delta_refuses_non_finite_values_and_other_starting_weights():
    cfg = LoGRAConfig(rank=4)
    trainer = tiny_qwen2()
    d0, d1 = train_steps(trainer, LoGRAOptimizer(trainer, cfg), 2)
    assert d0.base_checksum is not None and d1.base_checksum is None  # the first delta ties the stream
    receiver = tiny_qwen2()
    before = copy.deepcopy(receiver.state_dict())
    bad = dict(d0.factors)
    name = sorted(bad)[0]
    bad[name] = bad[name].clone()
    bad[name][0, 0] = float("nan")
    with pytest.raises(DeltaMismatchError, match=f"factor for {name} holds NaN"):
        apply_delta(receiver, PolicyDelta(**{**d0.__dict__, "factors": bad}), cfg)
    other = tiny_qwen2(seed=1)
    with pytest.raises(DeltaMismatchError, match="starts from other weights"):
        apply_delta(other, d0, cfg)
    assert all(torch.equal(before[k], v) for k, v in receiver.state_dict().items())
    apply_delta(receiver, d0, cfg)  # the right receiver takes the same delta
    apply_delta(receiver, d1, cfg)

