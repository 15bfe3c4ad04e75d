"""LoGRA's optional first moment (``beta1``), refresh windows and per-layer trust ratio.

Exactness against a float64 re-implementation of the formulas written here, resume
bitwise, delta replay bitwise and 2-rank data parallelism equal to one process.
"""

from __future__ import annotations

import pytest
import torch

from conftest import resumed_run, tiny_qwen2, token_batch, train_steps
from logra import LoGRAConfig, LoGRAOptimizer, PolicyDelta, apply_delta


def _momentum_config(**kw) -> LoGRAConfig:
    base = {"rank": 4, "beta1": 0.9, "refresh_every": 2, "non_target": "sketch", "non_target_lr": 1e-3}
    return LoGRAConfig(**{**base, **kw})


# ---------------------------------------------------------------- the formula
def _reference_step(s, m, k, v, t, w_norms, cfg, grams, numels):
    """One update written out in float64: returns (directions, m, k, v).

    s, m: per target [out, r] sketch and first moment; k: updates in the moment; v: per
    target [out, 1] row second moment; t: 1-based update; w_norms: per target ‖W‖_F;
    numels: per target element count.
    """
    b1, b2, eps = cfg.beta1, cfg.beta2, cfg.eps
    m = {n: b1 * m[n] + (1 - b1) * s[n] for n in s}
    k = k + 1
    d = {}
    for n in s:
        m_hat = m[n] / (1 - b1**k)
        src = s[n] if cfg.second_moment == "sketch" else m_hat
        if cfg.optimizer == "adam":  # element-wise; t counts updates since the last refresh
            v[n] = b2 * v[n] + (1 - b2) * s[n] ** 2
        else:
            v[n] = b2 * v[n] + (1 - b2) * (src**2).mean(dim=1, keepdim=True)
        rms = torch.sqrt(v[n] / (1 - b2**t))
        den = rms + eps * rms.mean()
        x = m_hat / den
        d[n] = x * (m_hat.norm() / x.norm())
    sq = {n: float(((d[n] @ grams[n]) * d[n]).sum()) for n in d}  # ‖D A‖_F²
    if cfg.trust_ratio == "global":
        scale = cfg.update_ratio * float(torch.tensor(list(w_norms.values()), dtype=torch.float64).norm())
        scale /= sum(sq.values()) ** 0.5
        d = {n: x * scale for n, x in d.items()}
    elif cfg.trust_ratio == "layer":
        d = {n: x * (cfg.update_ratio * w_norms[n] / sq[n] ** 0.5) for n, x in d.items()}
    else:  # 'element': every element moves by update_ratio · RMS of all target weights
        rms = (sum(w * w for w in w_norms.values()) / sum(numels.values())) ** 0.5
        d = {n: x * (cfg.update_ratio * rms * numels[n] ** 0.5 / sq[n] ** 0.5) for n, x in d.items()}
    return d, m, k, v


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 vs float64: relative 1e-4, absolute 1e-5 of the tensor's largest entry (cancellation)."""
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("transfer", ["transfer", "reset"])
@pytest.mark.parametrize("extra", [{}, {"second_moment": "momentum"}, {"trust_ratio": "layer"},
                                   {"trust_ratio": "element"}, {"optimizer": "adam", "trust_ratio": "layer"},
                                   {"optimizer": "adam", "second_moment_refresh": "row_mean"}])
def test_direction_matches_float64_reference(transfer, extra):
    cfg = _momentum_config(momentum_refresh=transfer, **extra)
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    names = opt.targets
    f64 = torch.float64
    element = cfg.optimizer == "adam"
    m = {n: torch.zeros_like(opt.sketches()[n], dtype=f64) for n in names}
    v = {n: torch.zeros(opt.sketches()[n].shape[0], opt.sketches()[n].shape[1] if element else 1, dtype=f64)
         for n in names}
    k = 0
    since_refresh = 0
    refreshed = 0
    for step in range(5):  # refresh_every=2: new projections after updates 2 and 4
        model(**token_batch(model.config.vocab_size, seed=step)).loss.backward()
        s = {n: x.to(f64) for n, x in opt.sketches().items()}
        a_old = {n: opt.projection(n).to(f64) for n in names}
        grams = {n: a @ a.T for n, a in a_old.items()}
        targets = {n: opt.sketch_target(n) for n in names}
        w_norms = {n: float(targets[n].weight.to(f64).norm()) for n in names}
        numels = {n: targets[n].weight.numel() for n in names}
        since_refresh += 1
        t = since_refresh if element else step + 1
        want, m, k, v = _reference_step(s, m, k, v, t, w_norms, cfg, grams, numels)
        proposal = opt.propose()
        for n in names:
            _close(proposal.directions[n], want[n])
        opt.apply(proposal)
        opt.zero_grad()
        a_new = {n: opt.projection(n).to(f64) for n in names}
        if not torch.equal(a_new[names[0]], a_old[names[0]]):
            refreshed += 1
            if element and cfg.second_moment_refresh == "row_mean":  # row means carried, correction runs on
                v = {n: v[n].mean(dim=1, keepdim=True).expand_as(v[n]).clone() for n in names}
            elif element:  # the element-wise second moment restarts with the new coordinates
                v = {n: torch.zeros_like(v[n]) for n in names}
                since_refresh = 0
            if transfer == "transfer":
                m = {n: m[n] @ (a_old[n] @ a_new[n].T) for n in names}
            else:
                m = {n: torch.zeros_like(m[n]) for n in names}
                k = 0
        for n in names:
            _close(opt.momenta()[n], m[n])
    assert refreshed == 2


@pytest.mark.parametrize("trust_ratio", ["layer", "global"])
def test_bfloat16_moments_follow_the_reference_one_update_at_a_time(trust_ratio):
    """``moment_dtype='bfloat16'``: from the stored bf16 state, each update's direction is the
    float64 formula's (to fp32 rounding) and the new state is its value rounded to bf16."""
    cfg = _momentum_config(optimizer="adam", refresh=False, refresh_every=1, trust_ratio=trust_ratio,
                           moment_dtype="bfloat16")
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    names, f64 = opt.targets, torch.float64
    targets = {n: opt.sketch_target(n) for n in names}
    v_views = opt.rule.views
    assert opt.first_moment.m.dtype == opt.rule.v.dtype == torch.bfloat16
    grams = {n: (opt.projection(n).to(f64) @ opt.projection(n).to(f64).T) for n in names}
    numels = {n: targets[n].weight.numel() for n in names}
    for step in range(4):
        model(**token_batch(model.config.vocab_size, seed=step)).loss.backward()
        s = {n: x.to(f64) for n, x in opt.sketches().items()}
        m = {n: x.to(f64) for n, x in opt.momenta().items()}
        v = {n: x.to(f64) for n, x in v_views.items()}
        w_norms = {n: float(targets[n].weight.to(f64).norm()) for n in names}
        want, m, _, v = _reference_step(s, m, step, v, step + 1, w_norms, cfg, grams, numels)
        proposal = opt.propose()
        for n in names:
            _close(proposal.directions[n], want[n])
        opt.apply(proposal)
        opt.zero_grad()
        bf16_ulp = 2.0**-8  # round to nearest: within half an ulp of the exact value
        for n in names:
            torch.testing.assert_close(opt.momenta()[n].to(f64), m[n], rtol=bf16_ulp, atol=1e-30)
            torch.testing.assert_close(v_views[n].to(f64), v[n], rtol=bf16_ulp, atol=1e-30)
    assert any(float(x.abs().max()) > 0 for x in opt.momenta().values())


def test_bfloat16_moments_halve_their_memory_and_resume_bitwise(tmp_path):
    cfg = _momentum_config(optimizer="adam", moment_dtype="bfloat16")
    fp32 = LoGRAOptimizer(tiny_qwen2(), _momentum_config(optimizer="adam"))
    nbytes = [sum(t.numel() * t.element_size() for t in o.memory_tensors()["optimizer"])
              for o in (fp32, LoGRAOptimizer(tiny_qwen2(), cfg))]
    assert nbytes[0] - nbytes[1] == fp32.sketch_buffer.numel() * 2 * 2  # two buffers, 2 bytes saved each
    (_, opt), (_, opt2) = resumed_run(cfg, tmp_path, before=3, after=5)  # checks the weights
    for name, m in opt.momenta().items():
        assert torch.equal(m, opt2.momenta()[name]), name
    with pytest.warns(UserWarning, match="not bitwise"):  # fp32 ← bf16 moments: cast, and said so
        LoGRAOptimizer(tiny_qwen2(), _momentum_config(optimizer="adam")).load_state_dict(opt.state_dict())


def test_beta1_zero_is_the_paper_update_and_keeps_no_first_moment():
    """``beta1=0`` (the default) is the paper's RowAdam on the sketch, and no first-moment
    buffer is kept: the optimizer's state is the row second moments and the projections."""
    cfg = LoGRAConfig(rank=4, beta1=0.0)
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    names, f64 = opt.targets, torch.float64
    assert opt.first_moment is None and opt.momenta() == {}
    v = {n: torch.zeros(opt.sketches()[n].shape[0], 1, dtype=f64) for n in names}
    m = {n: torch.zeros_like(opt.sketches()[n], dtype=f64) for n in names}
    for step in range(3):
        model(**token_batch(model.config.vocab_size, seed=step)).loss.backward()
        s = {n: x.to(f64) for n, x in opt.sketches().items()}
        grams = {n: opt.projection(n).to(f64) @ opt.projection(n).to(f64).T for n in names}
        w_norms = {n: float(opt.sketch_target(n).weight.to(f64).norm()) for n in names}
        numels = {n: opt.sketch_target(n).weight.numel() for n in names}
        want, m, _, v = _reference_step(s, m, 0, v, step + 1, w_norms, cfg, grams, numels)
        proposal = opt.propose()
        for n in names:
            _close(proposal.directions[n], want[n])
        opt.apply(proposal)
        opt.zero_grad()
    rows = sum(opt.sketches()[n].shape[0] for n in names)
    packed = sum(opt.sketch_target(n).stored_projection.numel() for n in names)  # uint8 sign bits
    assert sum(t.numel() for t in opt.memory_tensors()["optimizer"]) == rows + packed


def test_momentum_is_counted_as_optimizer_memory():
    opt0 = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4))
    opt1 = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, beta1=0.9))
    n0 = sum(t.numel() for t in opt0.memory_tensors()["optimizer"])
    n1 = sum(t.numel() for t in opt1.memory_tensors()["optimizer"])
    assert n1 - n0 == opt1.sketch_buffer.numel()
    # one buffer laid out like the sketch buffer: per-target views share its storage
    for name, view in opt1.momenta().items():
        assert view.shape == opt1.sketches()[name].shape
        assert view.untyped_storage().data_ptr() == opt1.first_moment.m.untyped_storage().data_ptr()


def test_bad_beta1():
    with pytest.raises(ValueError, match="beta1"):
        LoGRAConfig(beta1=1.0)
    with pytest.raises(ValueError, match="momentum_refresh"):
        LoGRAConfig(momentum_refresh="keep")
    with pytest.raises(ValueError, match="second_moment_refresh='row_mean' needs optimizer='adam' and refresh=True"):
        LoGRAConfig(optimizer="adam", refresh=False, second_moment_refresh="row_mean")
    with pytest.raises(ValueError, match="second_moment_refresh='row_mean' needs optimizer='adam'"):
        LoGRAConfig(second_moment_refresh="row_mean")


# ---------------------------------------------------------------- resume and replay
@pytest.mark.parametrize(("transfer", "optimizer"), [("transfer", "row_adam"), ("reset", "row_adam"),
                                                     ("transfer", "adam")])
def test_resume_is_bitwise(tmp_path, transfer, optimizer):
    """Saved just after a refresh (update 3), resumed across the next one."""
    cfg = _momentum_config(momentum_refresh=transfer, refresh_every=3, optimizer=optimizer)
    # adam: saved mid-window, so a non-zero element-wise second moment is restored
    (_, opt), (_, opt2) = resumed_run(cfg, tmp_path, before=3 if optimizer == "row_adam" else 4, after=4)
    for name, m in opt.momenta().items():
        assert torch.equal(m, opt2.momenta()[name]), name
    with pytest.raises(ValueError, match="first moment"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, refresh_every=3, non_target="sketch",
                                                 non_target_lr=1e-3)).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("extra", [{}, {"trust_ratio": "layer"}, {"optimizer": "adam", "trust_ratio": "element"},
                                   {"share_projections": True}])
def test_apply_delta_replays_bitwise(extra):
    cfg = _momentum_config(non_target="freeze", **extra)
    trainer, receiver = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trainer, cfg)
    for delta in train_steps(trainer, opt, 7):
        apply_delta(receiver, PolicyDelta.from_bytes(delta.to_bytes()), cfg)
    for (n, a), b in zip(trainer.state_dict().items(), receiver.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    moved = zip(trainer.state_dict().values(), tiny_qwen2().state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in moved)
