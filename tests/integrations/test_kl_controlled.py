"""`KLControlledLoGRA`: built from the one `KLControlConfig` that `logra train` uses too; pooled over ranks."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_qwen2, token_batch
from logra import KLController, LoGRAConfig, LoGRAError
from logra.integrations import KLControlledLoGRA
from logra.kl import KLControlConfig


def test_from_config_takes_the_controller_and_probe_settings():
    kl = KLControlConfig(budget=3e-4, budget_final=3e-5, schedule_steps=0, alpha_max=2.0, probe_max_tokens=77)
    opt = KLControlledLoGRA.from_config(tiny_qwen2(), LoGRAConfig(rank=4), kl, total_updates=50, temperature=0.7)
    c = opt.controller
    assert (c.budget, c.budget_final, c.schedule_steps, c.alpha_max) == (3e-4, 3e-5, 50, 2.0)
    assert opt.probe_max_tokens == 77 and opt.temperature == 0.7
    off = KLControlledLoGRA.from_config(tiny_qwen2(), LoGRAConfig(rank=4), KLControlConfig(enabled=False), 50)
    assert off.controller is None


def _pooled_with(calls: list[list[float]], *others: list[float]):
    """A `reduce` for one rank of two: adds the other rank's values, call by call."""
    it = iter(others)

    def reduce(values: list[float]) -> list[float]:
        calls.append(list(values))
        return [a + b for a, b in zip(values, next(it), strict=True)]

    return reduce


def test_a_rank_without_a_probe_joins_the_pooled_reductions():
    """Data parallel: a rank whose micro-batches gave no probe takes part in every reduction
    (no rank is left waiting) and applies the α of the other ranks' probes."""
    model = tiny_qwen2()
    calls: list[list[float]] = []
    # the other rank: has a probe; predicted KL 4e-4, the guard's exact KL 1.5e-4 (within twice
    # the budget) and realised KL 1e-4, over 10 positions
    reduce = _pooled_with(calls, [1.0], [4e-4 * 10, 10], [1.5e-4 * 10, 10], [1e-4 * 10, 10])
    opt = KLControlledLoGRA(model, LoGRAConfig(rank=4), KLController(budget=1e-4, schedule="constant"), reduce=reduce)
    model(**token_batch(97)).loss.backward()
    weights = opt.param_groups[0]["params"]
    before = [p.clone() for p in weights]
    opt.step()  # no set_probe on this rank
    assert calls == [[0.0], [0.0, 0], [0.0, 0], [0.0, 0]]
    assert opt.last_stats["predicted_kl"] == pytest.approx(4e-4)
    assert opt.last_stats["alpha"] == pytest.approx(0.5)  # sqrt(budget / predicted)
    assert opt.last_stats["guard_kl"] == pytest.approx(1.5e-4) and opt.last_stats["backtracks"] == 0
    assert opt.last_stats["realized_kl"] == pytest.approx(1e-4)
    assert opt.num_updates == 1 and any(not torch.equal(p, b) for p, b in zip(weights, before, strict=True))


def test_a_rank_without_a_probe_shrinks_its_step_with_the_others_guard():
    """The guard's decisions follow the pooled exact KL, so every rank backtracks alike."""
    model = tiny_qwen2()
    calls: list[list[float]] = []
    # predicted 4e-4 → α 0.5; exact at α 0.5: 9e-4 (9× the budget) → α 0.5·sqrt(1/9); then 1e-4
    reduce = _pooled_with(calls, [1.0], [4e-4 * 10, 10], [9e-4 * 10, 10], [1e-4 * 10, 10], [1e-4 * 10, 10])
    opt = KLControlledLoGRA(model, LoGRAConfig(rank=4), KLController(budget=1e-4, schedule="constant"), reduce=reduce)
    model(**token_batch(97)).loss.backward()
    opt.step()
    assert len(calls) == 5
    assert opt.last_stats["alpha"] == pytest.approx(0.5 / 3) and opt.last_stats["backtracks"] == 1
    assert opt.last_stats["expected_kl"] == pytest.approx(4e-4 / 36)
    assert opt.last_stats["guard_kl"] == pytest.approx(1e-4)


def test_no_probe_on_any_rank_is_refused_on_every_rank():
    model = tiny_qwen2()
    calls: list[list[float]] = []
    opt = KLControlledLoGRA(model, LoGRAConfig(rank=4), KLController(), reduce=_pooled_with(calls, [0.0]))
    model(**token_batch(97)).loss.backward()
    with pytest.raises(LoGRAError, match="set_probe"):
        opt.step()
    assert calls == [[0.0]] and opt.num_updates == 0
