"""RowAdam / SGD against the spec's formulas, projections, resume, deltas, bad input."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch

from conftest import resumed_run, tiny_qwen2, token_batch, train_steps
from logra import (
    DeltaMismatchError,
    LoGRAConfig,
    LoGRAOptimizer,
    NonFiniteSketchError,
    PolicyDelta,
    StaleProposalError,
    apply_delta,
)
from logra.projection import make_projection, pack_signs, projection_seed, rademacher_signs, unpack_projection


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


# ---------------------------------------------------------------- the update rule
def _reference_row_adam(sketches, v, t, beta2=0.95, eps=1e-8):
    """Spec §3, written out independently of the library."""
    out, new_v = {}, {}
    for name, s in sketches.items():
        s = s.double()
        vv = beta2 * v[name].double() + (1 - beta2) * (s**2).mean(1, keepdim=True)
        rms = torch.sqrt(vv / (1 - beta2**t))
        den = rms + max(eps * rms.mean().item(), torch.finfo(torch.float32).tiny)
        d = s / den
        d = d * (s.norm() / d.norm())
        out[name], new_v[name] = d, vv
    return out, new_v


@pytest.mark.parametrize("optimizer", ["row_adam", "sgd"])
def test_update_matches_reference_formula(optimizer):
    ratio = 1e-3
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, optimizer=optimizer, update_ratio=ratio, factor_dtype="float32"))
    v = {n: torch.zeros(w.shape[0], 1) for n, w in opt.sketches().items()}
    for t in range(1, 4):
        model(**token_batch(97, seed=t)).loss.backward()
        sketches = {n: s.clone() for n, s in opt.sketches().items()}
        proj = {n: opt.projection(n).clone() for n in opt.targets}
        before = {n: p.detach().clone() for n, p in model.named_parameters() if n in proj}
        if optimizer == "row_adam":
            dirs, v = _reference_row_adam(sketches, v, t)
        else:
            dirs = {n: s.double() for n, s in sketches.items()}
        updates = {n: dirs[n] @ proj[n].double() for n in dirs}
        wnorm = math.sqrt(sum((w.double() ** 2).sum().item() for w in before.values()))
        unorm = math.sqrt(sum((u**2).sum().item() for u in updates.values()))
        opt.step()
        opt.zero_grad()
        after = dict(model.named_parameters())
        for n, u in updates.items():
            expected = before[n].double() - ratio * wnorm / unorm * u
            torch.testing.assert_close(after[n].detach().double(), expected, rtol=1e-5, atol=1e-7)
        total = math.sqrt(sum(((after[n].double() - before[n].double()) ** 2).sum().item() for n in updates))
        assert total == pytest.approx(ratio * wnorm, rel=1e-4)


def test_lr_mode_with_weight_decay():
    model = tiny_qwen2()
    cfg = LoGRAConfig(rank=8, optimizer="sgd", update_ratio=None, lr=0.1, weight_decay=0.5, factor_dtype="float32")
    opt = LoGRAOptimizer(model, cfg)
    model(**token_batch(97)).loss.backward()
    name = opt.targets[0]
    s, a = opt.sketches()[name].clone(), opt.projection(name).clone()
    w0 = dict(model.named_parameters())[name].detach().clone()
    opt.step()
    expected = w0 * (1 - 0.1 * 0.5) - 0.1 * s @ a
    torch.testing.assert_close(dict(model.named_parameters())[name].detach(), expected, rtol=1e-5, atol=1e-7)


def test_gradient_clipping_uses_projected_norm():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, optimizer="sgd", update_ratio=None, lr=1.0, max_grad_norm=1e-4))
    model(**token_batch(97)).loss.backward()
    full = math.sqrt(sum(((s @ opt.projection(n)) ** 2).sum().item() for n, s in opt.sketches().items()))
    p = opt.propose()
    assert p.sketch_norm == pytest.approx(full, rel=1e-4)
    assert p.update_norm == pytest.approx(1e-4, rel=1e-3)


def test_zero_sketch_gives_zero_step():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    before = copy.deepcopy(model.state_dict())
    proposal = opt.propose()
    assert proposal.update_norm == 0
    delta = opt.apply(proposal)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.num_updates == 1 and all(u.abs().sum() == 0 for u in delta.factors.values())


# ---------------------------------------------------------------- resume and delta
def test_resume_is_bitwise(tmp_path):
    """3 updates, checkpoint, 2 more = the checkpoint loaded into a fresh model + 2 (asserted inside)."""
    resumed_run(LoGRAConfig(rank=8), tmp_path, before=3, after=2)


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


# ---------------------------------------------------------------- bad input
def test_bad_config_values():
    for kw in [{"rank": 0}, {"rank": -3}, {"distribution": "uniform"}, {"optimizer": "adamw"}, {"factor_dtype": "fp8"}]:
        with pytest.raises(ValueError):
            LoGRAConfig(**kw)
    with pytest.raises(ValueError, match="exceeds the input size"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=33))


def test_no_matching_target_names_what_exists():
    with pytest.raises(ValueError, match="q_proj"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(target_modules=("c_attn",)))


def test_non_linear_target_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="Conv1D"):
        LoGRAOptimizer(gpt2, LoGRAConfig(rank=4, target_modules=("c_attn",)))


def test_non_finite_loss_changes_nothing():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    train_steps(model, opt, 2)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    (model(**token_batch(97)).loss * float("nan")).backward()
    with pytest.raises(NonFiniteSketchError):
        opt.step()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert opt.num_updates == state["num_updates"]
    for n, v in opt.state_dict()["second_moments"].items():
        assert torch.equal(v, state["second_moments"][n])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_sketch_entry_is_caught(value):
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    model(**token_batch(97)).loss.backward()
    opt.sketches()[opt.targets[3]][2, 1] = value
    with pytest.raises(NonFiniteSketchError):
        opt.propose()


def test_stale_and_foreign_proposals():
    model, other = tiny_qwen2(), tiny_qwen2()
    opt, opt2 = LoGRAOptimizer(model, LoGRAConfig(rank=4)), LoGRAOptimizer(other, LoGRAConfig(rank=4))
    model(**token_batch(97)).loss.backward()
    p = opt.propose()
    with pytest.raises(StaleProposalError, match="another optimizer"):
        opt2.apply(p)
    opt.apply(p)
    with pytest.raises(StaleProposalError, match="stale"):
        opt.apply(p)
    with pytest.raises(StaleProposalError, match="stale"):
        p.perturbed(torch.tensor(0.0))


@pytest.mark.parametrize("refresh", [False, True])
def test_step_norm_uses_the_projection_in_force(refresh):
    """The Gram matrices behind ‖D A‖ follow the projections, also one set directly."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, refresh=refresh, update_ratio=1e-3))
    f64 = torch.float64
    for step in range(3):
        model(**token_batch(97, seed=step)).loss.backward()
        if step == 2:  # a projection assigned from outside, after the Grams were formed
            for i, name in enumerate(opt.targets):
                t = opt.sketch_target(name)
                t.projection = make_projection(4, t.in_features, 1000 + i)
        p = opt.propose()
        exact = sum(float((p.directions[n].to(f64) @ opt.projection(n).to(f64)).square().sum()) for n in opt.targets)
        assert p.update_norm == pytest.approx(exact**0.5, rel=1e-5)
        opt.apply(p)
        opt.zero_grad()


def test_adamw_non_targets_train_and_resume(tmp_path):
    cfg = LoGRAConfig(rank=8, non_target="adamw", non_target_lr=1e-2)
    model = tiny_qwen2()
    emb0 = model.get_input_embeddings().weight.detach().clone()
    opt = LoGRAOptimizer(model, cfg)
    assert len(opt.param_groups) == 2
    train_steps(model, opt, 2)
    assert not torch.equal(emb0, model.get_input_embeddings().weight)
    state = opt.state_dict()
    torch.save(state, tmp_path / "s.pt")
    opt.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))


def test_freeze_mode_changes_only_targets():
    model = tiny_qwen2()
    before = copy.deepcopy(model.state_dict())
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8))
    train_steps(model, opt, 3)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == set(opt.targets)


def test_tiny_language_model_learns():
    """Memorise a fixed text: the loss must fall clearly with LoGRA alone."""
    torch.manual_seed(0)
    model = tiny_qwen2(hidden=64, vocab=40)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=16, update_ratio=2e-2, non_target="sketch", non_target_lr=3e-3))
    g = torch.Generator().manual_seed(0)
    text = torch.randint(1, 40, (4, 24), generator=g)
    losses = []
    for _ in range(60):
        loss = model(input_ids=text, labels=text).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses[::10]


def test_rank_that_saves_no_memory_warns():
    import warnings

    with pytest.warns(UserWarning, match="as large as the dense gradients"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=8))


def test_rademacher_projections_are_stored_as_sign_bits_bitwise():
    """Compact storage changes memory, not results: same weights as fp32-stored projections."""
    cfg = LoGRAConfig(rank=4, refresh_every=2, beta1=0.9)
    compact, plain = tiny_qwen2(), tiny_qwen2()
    opt_c, opt_p = LoGRAOptimizer(compact, cfg), LoGRAOptimizer(plain, cfg)
    for step in range(5):
        for t in opt_p._sketches.targets.values():
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


@pytest.mark.parametrize("width", [1, 7, 8, 13, 64])
def test_packed_sign_bits_rebuild_the_projection_bitwise(width):
    seed = 1234 + width
    bits = pack_signs(rademacher_signs(5, width, seed))
    assert bits.dtype == torch.uint8 and bits.shape == (5, (width + 7) // 8)
    assert torch.equal(unpack_projection(bits, width), make_projection(5, width, seed))
