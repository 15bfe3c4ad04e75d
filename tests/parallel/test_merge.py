"""`merge_update`: a bf16 weight is updated with one rounding (fp32 compute), in row blocks at large widths."""

from __future__ import annotations

import pytest
import torch

from logra.delta import merge_update
from logra.projection import make_projection


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits), as float64."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, e - 7)


@pytest.mark.parametrize("shape", [(96, 320), (130, 1 << 17)])  # the second spans two row blocks
@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_bf16_merge_rounds_once(shape, decay):
    out, inp = shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).bfloat16()
    u = (torch.randn(out, 8, generator=g) * 0.05).bfloat16()
    a = make_projection(8, inp, seed=3, distribution="rademacher")
    exact = (1 - decay) * w.double() - u.double() @ a.double()
    merged = w.clone()
    merge_update(merged, u, a, decay)
    err = (merged.double() - exact).abs()
    # one rounding: within half a bf16 ulp of the exact result, plus the fp32 noise of
    # computing it (relative to the operands: it matters only where W and U A cancel)
    fp32_noise = 2.0 ** -21 * (w.double().abs() + u.double().abs() @ a.double().abs())
    assert bool((err <= 0.5 * _ulp_bf16(exact) + fp32_noise).all()), float((err - 0.5 * _ulp_bf16(exact)).max())


def test_fp32_merge_unchanged_without_decay():
    """fp32 weights keep the plain in-place addmm (bits of earlier releases and checkpoints)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g)
    u = torch.randn(64, 16, generator=g).bfloat16()
    a = make_projection(16, 96, seed=5, distribution="rademacher")
    merged = w.clone()
    merge_update(merged, u, a, 0.0)
    assert torch.equal(merged, w.addmm(u.float(), a, alpha=-1.0))
