"""``column_scale='input'``: projections ``A·diag(c)`` from running input statistics.

Checked against a float64 re-implementation of the statistics and scales written here,
against dense autograd (the sketch is exact for the scaled projection), and for bitwise
resume and delta replay.
"""

from __future__ import annotations

import pytest
import torch

from conftest import resumed_run, tiny_qwen2, token_batch, train_steps
from logra import LoGRAConfig, LoGRAOptimizer, PolicyDelta, apply_delta
from logra.projection import make_projection, projection_seed


def _config(**kw) -> LoGRAConfig:
    base = {"rank": 4, "refresh_every": 2, "column_scale": "input", "beta2": 0.9, "update_ratio": 1e-2}
    return LoGRAConfig(**{**base, **kw})


def _reference_scales(inputs: list[list[torch.Tensor]], beta: float) -> torch.Tensor:
    """float64: per update the mean over tokens of x², a bias-corrected running mean, then c."""
    mean = torch.zeros(inputs[0][0].shape[-1], dtype=torch.float64)
    for update in inputs:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in update]).double()
        mean = beta * mean + (1 - beta) * x.square().mean(dim=0)
    c = mean / (1 - beta ** len(inputs))
    return (c / c.mean() + 0.1) ** -0.25


def test_scales_match_float64_reference_and_travel_in_the_delta():
    cfg = _config()
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    name = "model.layers.1.mlp.down_proj.weight"
    module = model.get_submodule("model.layers.1.mlp.down_proj")
    seen: list[list[torch.Tensor]] = []
    module.register_forward_pre_hook(lambda m, args: seen[-1].append(args[0].detach().clone()))
    a0 = opt.projection(name).clone()
    deltas = []
    for i in range(2):
        seen.append([])
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        deltas.append(opt.apply(opt.propose()))
        opt.zero_grad()
    assert not deltas[0].column_scales and not deltas[1].column_scales  # window 0: A as drawn
    assert torch.equal(a0, make_projection(4, a0.shape[1], projection_seed(cfg.seed, 0, name)))
    c = _reference_scales(seen, cfg.beta2)
    assert float(c.max() / c.min()) > 1.1  # the statistics really vary across channels
    want = make_projection(4, a0.shape[1], projection_seed(cfg.seed, 2, name)).double() * c
    torch.testing.assert_close(opt.projection(name).double(), want, rtol=1e-5, atol=1e-7)
    model(**token_batch(model.config.vocab_size, seed=2)).loss.backward()
    delta = opt.apply(opt.propose())
    torch.testing.assert_close(delta.column_scales[name].double(), c, rtol=1e-5, atol=0)
    # embeddings read as embeddings see no inputs: with non_target='freeze' they are not targets
    assert all(".layers." in n for n in delta.column_scales)


def test_needs_refreshed_projections():
    with pytest.raises(ValueError, match="needs refresh=True"):
        LoGRAConfig(column_scale="input", refresh=False)


def test_sketch_is_exact_for_the_scaled_projection():
    cfg = _config(refresh_every=1)
    model, dense = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    train_steps(model, opt, 2)
    dense.load_state_dict(model.state_dict())
    batch = token_batch(model.config.vocab_size, seed=7)
    model(**batch).loss.backward()
    dense(**batch).loss.backward()
    params = dict(dense.named_parameters())
    for name, s in opt.sketches().items():
        a = opt.projection(name)
        assert not torch.allclose(a.abs(), torch.full_like(a, a.abs().max()))  # scaled: not plain ±1/√r
        torch.testing.assert_close(s, params[name].grad @ a.T, rtol=1e-5, atol=1e-7)


def test_resume_is_bitwise(tmp_path):
    """Saved mid-window (update 3, window 2..3), resumed across the next refresh."""
    (_, opt), (_, opt2) = resumed_run(_config(beta1=0.9), tmp_path, before=3, after=4)
    for name in opt.targets:
        assert torch.equal(opt.projection(name), opt2.projection(name)), name
    with pytest.raises(ValueError, match="column_scale"):
        LoGRAOptimizer(tiny_qwen2(), _config(beta1=0.9, column_scale="none")).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("extra", [{}, {"beta1": 0.9, "trust_ratio": "layer", "non_target": "sketch"}])
def test_apply_delta_replays_bitwise(extra):
    cfg = _config(**extra)
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trainer, cfg)
    for delta in train_steps(trainer, opt, 7):
        apply_delta(receiver, PolicyDelta.from_bytes(delta.to_bytes()), cfg)
    # deltas carry the targets (with non_target='sketch', norms and biases are AdamW's)
    got = dict(receiver.named_parameters())
    for name, w in trainer.named_parameters():
        if name in opt.targets:
            assert torch.equal(w, got[name]), name
    assert delta.column_scales and delta.nbytes > sum(u.numel() * u.element_size() for u in delta.factors.values())


def test_momentum_transfer_keeps_the_gradient_space_moment_at_full_rank():
    """With AᵀA = I (orthogonal, full rank), M·A·diag(c)⁻¹ — the moment in gradient space —
    is unchanged by a refresh that draws new A and new c."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")  # in = 32
    cfg = _config(rank=32, distribution="orthogonal", beta1=0.9, target_modules=targets)
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    train_steps(model, opt, 3)  # update 2 refreshed with scales; update 3 is the last of its window
    model(**token_batch(model.config.vocab_size, seed=3)).loss.backward()

    def gradient_space(m, name):
        a = opt.projection(name).double()
        return m.double() @ a / opt.projector.column_scales[name].double().square()

    want = {n: gradient_space(0.9 * m + 0.1 * opt.sketches()[n], n) for n, m in opt.momenta().items()}
    old = {n: opt.projection(n).clone() for n in opt.targets}
    opt.apply(opt.propose())
    for name, m in opt.momenta().items():
        assert not torch.equal(old[name], opt.projection(name))
        torch.testing.assert_close(gradient_space(m, name), want[name], rtol=1e-4, atol=1e-6)
