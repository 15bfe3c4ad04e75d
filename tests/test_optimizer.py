"""RowAdam / SGD against the spec's formulas, resume, bad input, the propose/apply contract."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from conftest import resumed_run, tiny_qwen2, token_batch, train_steps
from logra import (
    LoGRAConfig,
    LoGRAOptimizer,
    NonFiniteSketchError,
    StaleProposalError,
)
from logra.projection import make_projection


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
    # resume: every parameter (the AdamW-trained ones included) bitwise as the uninterrupted run's
    (_, opt), (_, opt2) = resumed_run(cfg, tmp_path, before=2, after=3)
    for p, q in zip(opt.dense_parameters(), opt2.dense_parameters(), strict=True):
        assert torch.equal(p, q)


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


def test_a_refused_state_changes_nothing():
    """`load_state_dict` checks everything before it changes anything (issue 20, item 6)."""
    trained, fresh = tiny_qwen2(), tiny_qwen2()
    opt = LoGRAOptimizer(trained, LoGRAConfig(rank=4, non_target="adamw"))
    train_steps(trained, opt, 2)
    other = LoGRAOptimizer(fresh, LoGRAConfig(rank=4, non_target="adamw", column_scale="input", beta2=0.9))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="column_scale"):
        other.load_state_dict(opt.state_dict())
    after = other.state_dict()
    assert other.num_updates == 0 and after["hyper"] == before["hyper"] and after["non_target"]["state"] == {}
    assert torch.equal(torch.cat(list(after["second_moments"].values())),
                       torch.cat(list(before["second_moments"].values())))


@pytest.mark.parametrize("options", [dict(optimizer="sgd", beta1=0.9), dict(optimizer="adam")],
                         ids=["momentum", "adam"])
def test_a_state_of_other_targets_with_as_many_rows_is_refused(options):
    """The first moment and Adam's element-wise moment are flat over the targets' rows: a state
    saved for q_proj must not load into an optimizer of o_proj (same rows) as if it were its own."""
    trained = tiny_qwen2()
    opt = LoGRAOptimizer(trained, LoGRAConfig(rank=4, target_modules=("q_proj",), **options))
    train_steps(trained, opt, 2)
    other = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, target_modules=("o_proj",), **options))
    assert other.sketch_buffer.shape == opt.sketch_buffer.shape
    with pytest.raises(ValueError, match=r"other targets: first difference \['model.layers.0.self_attn.q_proj"):
        other.load_state_dict(opt.state_dict())
    LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, target_modules=("q_proj",), **options)).load_state_dict(
        opt.state_dict())


def test_a_state_restores_its_own_step_settings_and_says_so():
    """As torch optimizers do, the saved update ratio and betas win over a changed config's,
    with a warning naming both (not silently, with the config still showing the new ones)."""
    trained = tiny_qwen2()
    opt = LoGRAOptimizer(trained, LoGRAConfig(rank=4, update_ratio=1e-2))
    train_steps(trained, opt, 1)
    changed = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, update_ratio=1e-3, beta2=0.9))
    with pytest.warns(UserWarning, match=r"update_ratio=0.01 \(config: 0.001\), beta2=0.95 \(config: 0.9\)"):
        changed.load_state_dict(opt.state_dict())
    assert changed.param_groups[0]["update_ratio"] == 1e-2 and changed.param_groups[0]["beta2"] == 0.95
    same = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, update_ratio=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(opt.state_dict())
