"""`logra.rules`: the step size of every trust ratio and the rules' pure functions, against formulas written here."""

from __future__ import annotations

import math

import pytest
import torch

from logra.rules import element_adam, row_adam, step_scales

F64 = torch.float64


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layer_sq = [torch.rand((), generator=g) + 0.1 for _ in range(3)]
    norms = torch.rand(3, generator=g) * 5 + 1
    numels = [12, 40, 7]
    return layer_sq, norms, numels


@pytest.mark.parametrize("trust", ["global", "layer", "element"])
def test_step_scales_meet_their_norm_targets(trust):
    layer_sq, norms, numels = _case()
    ratio = 1e-3
    size = step_scales(layer_sq, norms, numels, update_ratio=ratio, trust_ratio=trust, lr=1.0, weight_decay=0.5)
    moved = [c * float(sq) ** 0.5 for c, sq in zip(size.scales, layer_sq, strict=True)]  # ‖ΔW_l‖ per layer
    w = [float(n) for n in norms]
    if trust == "global":
        assert len(set(size.scales)) == 1
        assert math.hypot(*moved) == pytest.approx(ratio * math.hypot(*w), rel=1e-6)
    elif trust == "layer":
        assert moved == pytest.approx([ratio * x for x in w], rel=1e-6)
    else:
        rms = math.sqrt(sum(x * x for x in w) / sum(numels))
        assert moved == pytest.approx([ratio * rms * math.sqrt(n) for n in numels], rel=1e-6)
        assert math.hypot(*moved) == pytest.approx(ratio * math.hypot(*w), rel=1e-6)  # the global total
    assert size.update_norm == pytest.approx(math.hypot(*moved), rel=1e-6) and size.decay == 0.0


def test_step_scales_lr_mode_and_zero_updates():
    layer_sq, norms, numels = _case(1)
    size = step_scales(layer_sq, None, numels, update_ratio=None, trust_ratio="global", lr=0.3, weight_decay=0.1)
    assert size.scales == [0.3] * 3 and size.decay == pytest.approx(0.03)
    assert size.update_norm == pytest.approx(0.3 * math.sqrt(sum(float(x) for x in layer_sq)), rel=1e-6)
    zeros = [torch.zeros(())] * 3
    for trust in ("global", "layer", "element"):
        assert step_scales(zeros, norms, numels, update_ratio=1e-3, trust_ratio=trust, lr=1.0,
                           weight_decay=0.0).scales == [0.0] * 3


def test_row_adam_and_element_adam_match_their_formulas():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(6, 4, generator=g)
    s[2] *= 1e-20  # a near-silent row must not overflow
    v = torch.rand(6, 1, generator=g) * 1e-3
    v[2] = 0.0
    beta2, eps, t = 0.95, 0.3, 4  # a large ε: relative to the mean RMS, not absolute
    d, v_new = row_adam(s, v, t, beta2, eps)
    want_v = beta2 * v.to(F64) + (1 - beta2) * s.to(F64).square().mean(1, keepdim=True)
    rms = (want_v / (1 - beta2**t)).sqrt()
    x = s.to(F64) / (rms + eps * rms.mean())
    torch.testing.assert_close(v_new.to(F64), want_v, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(d.to(F64), x * (s.to(F64).norm() / x.norm()), rtol=1e-5, atol=1e-12)
    ve = torch.rand(6, 4, generator=g)
    de = element_adam(s, ve, 2, beta2, eps)
    rms = (ve.to(F64) / (1 - beta2**2)).sqrt()
    x = s.to(F64) / (rms + eps * rms.mean())
    torch.testing.assert_close(de.to(F64), x * (s.to(F64).norm() / x.norm()), rtol=1e-5, atol=1e-12)
    assert torch.equal(row_adam(torch.zeros(3, 2), torch.zeros(3, 1), 1, beta2, eps)[0], torch.zeros(3, 2))
