"""Seeded projections: the same bits in every process, isotropy, refresh, packed signs, the one builder."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import tiny_qwen2, train_steps
from logra import (
    LoGRAConfig,
    LoGRAOptimizer,
)
from logra.projection import (
    build_projection,
    make_projection,
    pack_signs,
    projection_key,
    projection_seed,
    rademacher_signs,
    unpack_projection,
)


# ---------------------------------------------------------------- projections
def test_projection_same_in_fresh_process():
    seed = projection_seed(42, 3, "model.layers.0.mlp.up_proj.weight")
    here = make_projection(16, 40, seed, "rademacher")
    code = (
        "import torch,sys; from logra.projection import make_projection, projection_seed;"
        "a=make_projection(16,40,projection_seed(42,3,'module.model.layers.0.mlp.up_proj.weight'),'rademacher');"
        "sys.stdout.write(a.numpy().tobytes().hex())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert here.numpy().tobytes().hex() == there  # wrapper prefix 'module.' does not change the seed


@pytest.mark.parametrize("dist", ["rademacher", "gaussian"])
def test_projection_is_isotropic(dist):
    r, n, draws = 32, 24, 400
    acc = torch.zeros(n, n)
    for i in range(draws):
        a = make_projection(r, n, projection_seed(0, i, "w"), dist)
        acc += a.T @ a
    err = (acc / draws - torch.eye(n)).abs().max()
    assert err < 0.1  # E[AᵀA] = I; the Monte-Carlo error is ~ 1/sqrt(r·draws)
    if dist == "rademacher":
        assert torch.allclose(a.abs(), torch.full_like(a, 1 / math.sqrt(r)))


def test_orthogonal_projection_is_exact_at_full_rank_and_isotropic_below():
    a = make_projection(24, 24, projection_seed(0, 0, "w"), "orthogonal")
    torch.testing.assert_close(a.T @ a, torch.eye(24), rtol=0, atol=1e-5)
    r, n, draws = 8, 24, 400
    acc = torch.zeros(n, n, dtype=torch.float64)
    for i in range(draws):
        a = make_projection(r, n, projection_seed(0, i, "w"), "orthogonal").double()
        torch.testing.assert_close(a @ a.T, torch.eye(r, dtype=torch.float64) * n / r, rtol=0, atol=1e-5)
        acc += a.T @ a
    assert (acc / draws - torch.eye(n)).abs().max() < 0.15  # E[AᵀA] = I
    with pytest.raises(ValueError, match="rank <= in_features"):
        make_projection(30, 24, 1, "orthogonal")


@pytest.mark.parametrize("refresh", [True, False])
def test_projection_refresh(refresh):
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, refresh=refresh))
    name = opt.targets[0]
    before = opt.projection(name).clone()
    train_steps(model, opt, 1)
    assert torch.equal(before, opt.projection(name)) is (not refresh)


def test_refresh_every_k():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, refresh_every=2))
    name = opt.targets[0]
    seen = [opt.projection(name).clone()]
    for i in range(4):
        train_steps(model, opt, 1, seed0=i)
        seen.append(opt.projection(name).clone())
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    assert torch.equal(seen[2], seen[3]) and not torch.equal(seen[3], seen[4])



@pytest.mark.parametrize("refresh_every, share", [(1, False), (2, True)])
def test_the_next_projections_are_drawn_ahead_and_installed_as_drawn(refresh_every, share, monkeypatch):
    """Each install starts drawing the Rademacher projections one update later on host
    threads (one job per torch thread) where they will change; the next install puts those
    very bits in force, equal to the projections of the new index drawn in place."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    model = tiny_qwen2()
    cfg = LoGRAConfig(rank=4, refresh_every=refresh_every, share_projections=share)
    opt = LoGRAOptimizer(model, cfg)
    for step in range(4):
        ahead = opt.projector._ahead
        if (step + 1) % refresh_every:
            assert ahead is None  # the projections in force stay for the next update
            train_steps(model, opt, 1, seed0=step)
            continue
        assert ahead.index == step + 1 and len(ahead.jobs) == 2
        drawn = {key: bits for job in ahead.jobs for key, bits in job.result().items()}
        train_steps(model, opt, 1, seed0=step)
        for name in opt.targets:
            t, key = opt.sketch_target(name), projection_key(name, share)
            assert t.stored_projection is drawn[key]
            reference = make_projection(4, t.in_features, projection_seed(cfg.seed, step + 1, key))
            assert torch.equal(t.projection, reference), name


def test_a_draw_ahead_is_not_used_by_another_process_nor_for_fp32_projections():
    """A forked child draws in place (its parent's threads are not its own); Gaussian
    projections (fp32, 32x the host memory of sign bits) are never drawn ahead."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    inherited = opt.projector._ahead._replace(pid=-1)  # as a forked child sees it
    drawn = {key: bits for job in inherited.jobs for key, bits in job.result().items()}
    opt.projector._ahead = inherited
    train_steps(model, opt, 1)
    for name in opt.targets:
        t = opt.sketch_target(name)
        assert t.stored_projection is not drawn[name] and torch.equal(t.stored_projection, drawn[name])
    gaussian = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, distribution="gaussian"))
    assert gaussian.projector._ahead is None


@pytest.mark.parametrize("width", [1, 7, 8, 13, 64])
def test_packed_sign_bits_rebuild_the_projection_bitwise(width):
    seed = 1234 + width
    bits = pack_signs(rademacher_signs(5, width, seed))
    assert bits.dtype == torch.uint8 and bits.shape == (5, (width + 7) // 8)
    assert torch.equal(unpack_projection(bits, width), make_projection(5, width, seed))



def test_rademacher_projections_are_stored_as_sign_bits_bitwise():
    """Compact storage changes memory, not results: same weights as fp32-stored projections."""
    cfg = LoGRAConfig(rank=4, refresh_every=2, beta1=0.9)
    compact, plain = tiny_qwen2(), tiny_qwen2()
    opt_c, opt_p = LoGRAOptimizer(compact, cfg), LoGRAOptimizer(plain, cfg)
    for step in range(5):
        for t in map(opt_p.sketch_target, opt_p.targets):
            t.projection = t.projection  # store the fp32 matrix the signs stand for
        train_steps(compact, opt_c, 1, seed0=step)
        train_steps(plain, opt_p, 1, seed0=step)
    for (n, a), b in zip(compact.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for name in opt_c.targets:
        t = opt_c.sketch_target(name)
        assert t.stored_projection.dtype == torch.uint8
        assert t.stored_projection.shape == (4, -(-t.in_features // 8))
        assert torch.equal(t.projection, make_projection(4, t.in_features, projection_seed(cfg.seed, 4, name)))
    state_bytes = [sum(x.numel() * x.element_size() for x in o.memory_tensors()["optimizer"]) for o in (opt_c, opt_p)]
    fp32_bytes = sum(4 * opt_c.projection(n).numel() for n in opt_c.targets)
    bit_bytes = sum(opt_c.sketch_target(n).stored_projection.numel() for n in opt_c.targets)
    assert state_bytes[1] - state_bytes[0] == fp32_bytes - bit_bytes


@pytest.mark.parametrize("options", [
    {}, {"distribution": "gaussian", "share_projections": True}, {"distribution": "orthogonal", "refresh": False},
    {"column_scale": "input", "refresh_every": 2}, {"share_projections": True, "column_scale": "input"},
])
def test_receivers_build_the_trainers_projection_bitwise(options):
    """`build_projection` (what `apply_delta`, rollout workers and the vLLM layout call) and the
    optimizer's `Projector` give the same bits for every target, distribution and option."""
    cfg = LoGRAConfig(rank=4, **options)
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    for step in range(3):
        train_steps(model, opt, 1, seed0=step)
        for name in opt.targets:
            t = opt.sketch_target(name)
            rebuilt = build_projection(cfg, name, opt.projector.index, t.in_features,
                                       column_scale=opt.projector.column_scales.get(name))
            assert torch.equal(rebuilt, opt.projection(name)), (name, step)
    if cfg.column_scale == "input":
        assert opt.projector.column_scales  # the scaled case was exercised
