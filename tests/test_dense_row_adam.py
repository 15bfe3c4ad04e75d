"""`DenseRowAdam` (LoGRA's rule on the exact gradient) equals LoGRA with identity projections."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer
from logra.optimizer import DenseRowAdam

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")  # all with in = hidden = 32


@pytest.mark.parametrize("extra", [{}, {"beta1": 0.9}, {"trust_ratio": "layer"}, {"trust_ratio": "element"}])
def test_dense_row_adam_is_logra_with_identity_projection(extra):
    # fp32 factors: LoGRA otherwise rounds U to bf16 before merging
    cfg = LoGRAConfig(rank=32, refresh=False, target_modules=TARGETS, update_ratio=1e-2, factor_dtype="float32",
                      **extra)
    a, b = tiny_qwen2(), tiny_qwen2()
    logra = LoGRAOptimizer(a, cfg)
    for t in map(logra.sketch_target, logra.targets):
        t.projection = torch.eye(32)  # S = G: the sketch is the exact gradient
    dense = DenseRowAdam(b, cfg)
    assert len(dense.param_groups) == 1 and not any(p.requires_grad for n, p in b.named_parameters() if "norm" in n)
    for step in range(4):
        for model, opt in ((a, logra), (b, dense)):
            model(**token_batch(97, seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
    moved = 0
    for (n, wa), wb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        moved += not torch.equal(wa, tiny_qwen2().state_dict()[n])
    assert moved >= 12


@pytest.mark.parametrize("extra", [{}, {"beta1": 0.9, "refresh_every": 2}])
def test_logra_with_full_rank_orthogonal_projections_is_dense_row_adam(extra):
    # AᵀA = I for every freshly drawn A: sketch, reconstruction and momentum transfer lose nothing
    cfg = LoGRAConfig(rank=32, distribution="orthogonal", target_modules=TARGETS, update_ratio=1e-2,
                      factor_dtype="float32", **extra)
    a, b = tiny_qwen2(), tiny_qwen2()
    logra, dense = LoGRAOptimizer(a, cfg), DenseRowAdam(b, cfg)
    for step in range(4):
        for model, opt in ((a, logra), (b, dense)):
            model(**token_batch(97, seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
    for (n, wa), wb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(wa, wb, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_dense_row_adam_trains_non_targets_and_resumes(tmp_path):
    cfg = LoGRAConfig(rank=8, non_target="sketch", non_target_lr=1e-3, beta1=0.9)
    model = tiny_qwen2()
    opt = DenseRowAdam(model, cfg)
    assert len(opt.param_groups) == 2 and any(p.dim() == 1 for p in opt.param_groups[1]["params"])

    def train(m, o, steps, seed0):
        for i in range(steps):
            m(**token_batch(97, seed=seed0 + i)).loss.backward()
            o.step()
            o.zero_grad()

    train(model, opt, 2, 0)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.pt")
    train(model, opt, 2, 2)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    fresh = tiny_qwen2(seed=5)
    fresh.load_state_dict(state["model"])
    opt2 = DenseRowAdam(fresh, cfg)
    opt2.load_state_dict(state["opt"])
    train(fresh, opt2, 2, 2)
    for (n, x), y in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(x, y), n


def test_dense_row_adam_refuses_settings_it_does_not_implement():
    with pytest.raises(ValueError, match="row_adam"):
        DenseRowAdam(tiny_qwen2(), LoGRAConfig(rank=4, optimizer="adam"))
    with pytest.raises(ValueError, match="float32"):
        DenseRowAdam(tiny_qwen2(), LoGRAConfig(rank=4, moment_dtype="bfloat16", beta1=0.9))
