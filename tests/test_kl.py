"""Predicted KL against the exact KL of the applied step; the controller; the probe."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import checkpoint, tiny_qwen2, token_batch
from logra import (
    DenseProposal,
    KLController,
    KLPredictionError,
    LoGRAConfig,
    LoGRAOptimizer,
    predicted_kl,
    probe_logits,
    realized_kl,
)


def _setup(ratio=1e-2, **cfg):
    model = tiny_qwen2(hidden=48)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=ratio, factor_dtype="float32", **cfg))
    batch = token_batch(97, batch=4, length=24, seed=1)
    response = batch["attention_mask"].clone()
    response[:, :8] = 0  # the first 8 tokens are the prompt
    model(**batch).loss.backward()
    return model, opt, batch, response


def _exact_kl_of_step(model, opt, proposal, alpha, batch, response):
    """Apply α·proposal to a copy by the spec's formula and compare the softmaxes."""
    after = copy.deepcopy(model)
    with torch.no_grad():
        for name in opt.targets:
            after.get_parameter(name).sub_(alpha * proposal.directions[name] @ opt.projection(name))
    args = (batch["input_ids"], batch["attention_mask"], response)
    return realized_kl(probe_logits(model, *args), probe_logits(after, *args))


def test_prediction_matches_exact_kl_and_error_is_second_order():
    model, opt, batch, response = _setup()
    proposal = opt.propose()
    full = predicted_kl(model, proposal, batch["input_ids"], batch["attention_mask"], response)
    errors = []
    for alpha in [30.0, 10.0, 3.0, 1.0, 0.3]:
        exact = _exact_kl_of_step(model, opt, proposal, alpha, batch, response)
        if not 1e-6 <= exact <= 1e-3:
            continue
        ratio = full * alpha**2 / exact
        assert 0.9 <= ratio <= 1.1, (alpha, ratio)
        errors.append(abs(ratio - 1))
    assert len(errors) >= 3
    assert errors[0] > errors[-1]  # the error shrinks with the step (third-order remainder)


@pytest.mark.parametrize("budget", [1e-5, 1e-4])
def test_controller_meets_budget(budget):
    model, opt, batch, response = _setup()
    proposal = opt.propose()
    kl_hat = predicted_kl(model, proposal, batch["input_ids"], batch["attention_mask"], response)
    ctl = KLController(budget=budget, schedule="constant", alpha_max=1e6)
    alpha = ctl.scale(kl_hat, step=0)
    before = probe_logits(model, batch["input_ids"], batch["attention_mask"], response)
    opt.apply(proposal, alpha)
    after = probe_logits(model, batch["input_ids"], batch["attention_mask"], response)
    assert realized_kl(before, after) == pytest.approx(budget, rel=0.2)


def test_controller_rules():
    ctl = KLController(budget=2e-4, budget_final=2e-5, schedule_steps=300)
    assert ctl.budget_at(0) == pytest.approx(2e-4) and ctl.budget_at(300) == pytest.approx(2e-5)
    assert ctl.budget_at(150) == pytest.approx(1.1e-4)
    assert ctl.budget_at(1000) == pytest.approx(2e-5)
    assert ctl.scale(1e-12, 0) == 3.0  # capped at alpha_max
    assert ctl.scale(0.0, 0) == 1.0
    assert ctl.scale(8e-4, 0) == pytest.approx(0.5)
    ctl.observe_mismatch(1e-4)  # EMA: 0.3 · 1e-4
    assert ctl.mismatch == pytest.approx(3e-5)
    assert ctl.effective_budget(0) == pytest.approx(2e-4 - 3e-5)
    ctl.observe_mismatch(1.0)
    assert ctl.effective_budget(0) == pytest.approx(1e-4)  # floored at half the budget
    before = ctl.mismatch
    ctl.observe_mismatch(-5.0)  # negative observations are clipped at 0: the EMA decays towards 0
    assert ctl.mismatch == pytest.approx(0.7 * before)
    for bad in [float("nan"), float("inf"), -1e-9]:
        with pytest.raises(KLPredictionError):
            ctl.scale(bad, 0)
    clone = KLController()
    clone.load_state_dict(ctl.state_dict())
    assert clone.state_dict() == ctl.state_dict()


def test_probe_respects_masks_chunks_and_max_tokens():
    model, opt, batch, response = _setup()
    proposal = opt.propose()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    whole = predicted_kl(model, proposal, ids, attn, response, chunk=10_000)
    assert predicted_kl(model, proposal, ids, attn, response, chunk=7) == pytest.approx(whole, rel=1e-10)
    # changing prompt tokens' mask bits or the response mask of padded positions
    # changes nothing as long as the probed positions are the same
    only_first = response.clone()
    only_first[1:] = 0
    n_first = int(response[0, 1:].sum())
    capped = predicted_kl(model, proposal, ids, attn, response, max_tokens=n_first)
    assert capped == pytest.approx(predicted_kl(model, proposal, ids, attn, only_first), rel=1e-10)
    with pytest.raises(KLPredictionError):
        predicted_kl(model, proposal, ids, attn, torch.zeros_like(response))


def test_probe_is_a_mean_over_exactly_the_masked_positions():
    model, opt, batch, response = _setup()
    proposal = opt.propose()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    first, second = response.clone(), response.clone()
    first[:, 16:] = 0
    second[:, :16] = 0
    n1, n2 = int(first[:, 1:].sum()), int(second[:, 1:].sum())
    whole = predicted_kl(model, proposal, ids, attn, response)
    parts = predicted_kl(model, proposal, ids, attn, first) * n1 + predicted_kl(model, proposal, ids, attn, second) * n2
    assert whole == pytest.approx(parts / (n1 + n2), rel=1e-9)


def test_state_restored_and_works_with_checkpointing():
    model, opt, batch, response = _setup()
    checkpoint(model)
    model.train()
    assert model.config._attn_implementation == "sdpa"
    weights = copy.deepcopy(model.state_dict())
    proposal = opt.propose()
    value = predicted_kl(model, proposal, batch["input_ids"], batch["attention_mask"], response)
    assert value > 0 and model.training and model.config._attn_implementation == "sdpa"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    # training still works afterwards (checkpointing + sketches)
    opt.apply(proposal)
    model(**batch).loss.backward()
    assert opt.sketch_buffer.abs().sum() > 0


def test_dense_adamw_proposal_predicts_its_kl():
    model = tiny_qwen2(hidden=48)
    batch = token_batch(97, batch=4, length=24, seed=1)
    response = batch["attention_mask"].clone()
    response[:, :8] = 0
    adam = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model(**batch).loss.backward()
    proposal = DenseProposal.from_optimizer(model, adam)
    args = (batch["input_ids"], batch["attention_mask"], response)
    kl_hat = predicted_kl(model, proposal, *args)
    before = probe_logits(model, *args)
    alpha = KLController(budget=1e-4, schedule="constant", alpha_max=10).scale(kl_hat, 0)
    proposal.apply(alpha)
    exact = realized_kl(before, probe_logits(model, *args))
    assert exact == pytest.approx(kl_hat * alpha**2, rel=0.1)
    assert exact == pytest.approx(1e-4, rel=0.2)


def test_nan_gradient_dense_proposal_changes_nothing():
    model = tiny_qwen2()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (model(**token_batch(97)).loss * math.nan).backward()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError):
        DenseProposal.from_optimizer(model, adam)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert len(adam.state) == 0
