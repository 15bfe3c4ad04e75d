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


@pytest.mark.parametrize("non_target", ["freeze", "sketch"])
def test_apply_delta_reproduces_trainer_bitwise(non_target):
    cfg = LoGRAConfig(rank=8, non_target=non_target)
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trainer, cfg)
    if non_target == "sketch":  # norms move densely: sync them by hand, as the sync layer does
        dense = [n for n, p in trainer.named_parameters() if p.requires_grad]
    for delta in train_steps(trainer, opt, 20):
        wire = PolicyDelta.from_bytes(delta.to_bytes())
        apply_delta(receiver, wire, cfg)
        if non_target == "sketch":
            with torch.no_grad():
                for n in dense:
                    receiver.get_parameter(n).copy_(trainer.get_parameter(n))
    for (n, a), b in zip(trainer.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert delta.nbytes == sum(p.shape[0] * 8 * 2 for n, p in trainer.named_parameters() if n in opt.targets)


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
