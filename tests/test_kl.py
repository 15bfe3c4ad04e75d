"""Predicted KL against the exact KL of the applied step; the controller; the probe."""

from __future__ import annotations

import copy
import math
import types

import peft
import pytest
import torch
from torch import nn

from conftest import tiny_qwen2, token_batch
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
from logra.kl import controlled_update
from logra.memory import enable_activation_checkpointing


def _batch_and_response(seed=1):
    batch = token_batch(97, batch=4, length=24, seed=seed)
    response = batch["attention_mask"].clone()
    response[:, :8] = 0  # the first 8 tokens are the prompt
    return batch, response


def _setup(ratio=1e-2, **cfg):
    model = tiny_qwen2(hidden=48)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=ratio, factor_dtype="float32", **cfg))
    batch, response = _batch_and_response()
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


def test_guard_backtracking_rule():
    ctl = KLController(budget=2e-4, schedule="constant", max_backtracks=2)
    assert ctl.scale(8e-4, 0) == pytest.approx(0.5)
    assert ctl.backtrack(0.5, 4e-4) is None  # exactly twice the budget is accepted
    assert ctl.backtrack(0.5, 8e-4) == pytest.approx(0.25)  # α·sqrt(B / KL)
    assert ctl.last["backtracks"] == 1 and ctl.last["expected_kl"] == pytest.approx(8e-4 * 0.25**2)
    assert ctl.backtrack(0.25, 1.8e-3) == pytest.approx(0.25 / 3)
    assert ctl.backtrack(0.25 / 3, 1.0) is None  # max_backtracks reached: the step is taken
    off = KLController(budget=2e-4, schedule="constant", overshoot_limit=0)
    off.scale(8e-4, 0)
    assert off.backtrack(0.5, 1.0) is None
    for bad in [dict(overshoot_limit=0.5), dict(overshoot_limit=float("inf")), dict(max_backtracks=-1)]:
        with pytest.raises(ValueError):
            KLController(**bad)


class _BiasPolicy(nn.Module):
    """Logits = a fixed random table of the input token + a bias: moving one token's bias is a
    pure logit shift, whose exact KL is ``log(1 - p_t + p_t·e^α) - α·p_t`` per position."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.table(input_ids) + self.bias)


@pytest.mark.parametrize("limit", [0.0, 2.0])
def test_guard_catches_a_step_the_second_order_prediction_underestimates(limit):
    """A rare token's logit raised: the KL grows exponentially in α, so the α sized by the
    second-order prediction overshoots the budget several-fold; the guard measures the exact
    KL before applying and shrinks the step until it is within twice the budget."""
    torch.manual_seed(0)
    model = _BiasPolicy()
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    probe = (ids, torch.ones_like(ids), torch.ones_like(ids))
    with torch.no_grad():
        p = torch.softmax(model(ids).logits[:, :-1].double(), -1)
    token = int(p.mean((0, 1)).argmin())  # the rarest token on average
    proposal = DenseProposal(model, {model.bias: torch.nn.functional.one_hot(torch.tensor(token), 64).float()})
    budget = 0.05
    ctl = KLController(budget=budget, schedule="constant", alpha_max=1e6, overshoot_limit=limit)
    _, stats = controlled_update(model, proposal, proposal.apply, ctl, 0, probe)

    def exact(alpha):  # the reference formula, over the probe positions
        pt = p[..., token]
        return float((torch.log(1 - pt + pt * math.exp(alpha)) - alpha * pt).mean())

    assert stats["realized_kl"] == pytest.approx(exact(stats["alpha"]), rel=1e-5)
    assert stats["predicted_kl"] * stats["alpha"] ** 2 == pytest.approx(stats["expected_kl"])
    if limit == 0:  # the paper's controller: the scenario is a real overshoot
        assert stats["realized_kl"] > 3 * budget and "backtracks" not in stats
    else:
        assert stats["backtracks"] >= 1 and stats["realized_kl"] <= limit * budget
        assert stats["guard_kl"] == pytest.approx(stats["realized_kl"], rel=1e-5)


def test_guard_leaves_a_step_within_budget_unchanged():
    model, opt, batch, response = _setup()
    proposal = opt.propose()
    probe = (batch["input_ids"], batch["attention_mask"], response)
    kl_hat = predicted_kl(model, proposal, *probe)
    ctl = KLController(budget=1e-5, schedule="constant", alpha_max=1e6)
    _, stats = controlled_update(model, proposal, lambda a: opt.apply(proposal, a), ctl, 0, probe)
    assert stats["backtracks"] == 0 and stats["alpha"] == pytest.approx(math.sqrt(1e-5 / kl_hat))
    # the guard's forward at θ + α·Δθ is the policy the step produced (LoGRA's perturbed targets)
    assert stats["guard_kl"] == pytest.approx(stats["realized_kl"], rel=1e-4)


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
    enable_activation_checkpointing(model)
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
    batch, response = _batch_and_response()
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


@pytest.mark.parametrize("method", ["adamw", "lora", "logra"])
def test_controlled_steps_do_not_depend_on_the_step_size(method):
    # Adam's moments (RowAdam's too) do not depend on the rate and the step is linear in it,
    # so while α stays below its cap the controller takes the same steps at any learning rate
    # or update ratio; LoRA's two factors included (docs/learning.md, section 48).
    args_of = []
    for seed in range(3):
        batch, response = _batch_and_response(seed)
        args_of.append((batch, (batch["input_ids"], batch["attention_mask"], response)))
    moved = {}
    for rate in (1e-4, 1e-2):
        model = tiny_qwen2(hidden=48)
        if method == "lora":
            torch.manual_seed(0)  # the same adapters at both rates
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "up_proj"]))
        start = copy.deepcopy(model.state_dict())
        if method != "logra":
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trained, lr=rate, weight_decay=0.1)
        else:
            opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=rate, factor_dtype="float32"))
        controller = KLController(budget=1e-4, schedule="constant", alpha_max=1e6)
        for step, (batch, args) in enumerate(args_of):
            opt.zero_grad()
            model(**batch).loss.backward()
            if method != "logra":
                proposal = DenseProposal.from_optimizer(model, opt)
                proposal.apply(controller.scale(predicted_kl(model, proposal, *args), step))
            else:
                proposal = opt.propose()
                opt.apply(proposal, controller.scale(predicted_kl(model, proposal, *args), step))
        moved[rate] = torch.cat([(v - start[k]).flatten() for k, v in model.state_dict().items()])
    assert moved[1e-4].norm() > 0
    assert (moved[1e-4] - moved[1e-2]).norm() <= 1e-3 * moved[1e-2].norm()


def test_nan_gradient_dense_proposal_changes_nothing():
    model = tiny_qwen2()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (model(**token_batch(97)).loss * math.nan).backward()
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError):
        DenseProposal.from_optimizer(model, adam)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert len(adam.state) == 0
