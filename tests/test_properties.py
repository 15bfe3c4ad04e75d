"""Invariants every option must keep, over random configurations and model shapes.

A seeded loop draws valid combinations of `LoGRAConfig`'s options and a tiny Qwen2 shape,
and checks for each: resume from a checkpoint is bitwise, and a receiver that replays
the deltas holds bitwise every parameter the trainer holds (the dense part included).
Data parallelism equal to one process is checked over random configurations in
``tests/parallel/test_properties_dp.py``. The default suite draws a few configurations;
``-m slow`` draws many more.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import fit_if_needed, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer, apply_delta


def random_config(rng: random.Random) -> LoGRAConfig:
    """A valid `LoGRAConfig` with every option drawn (options that would do nothing are not set)."""
    o: dict = {"rank": rng.choice([2, 4, 8]), "seed": rng.randrange(1000),
               "distribution": rng.choice(["rademacher", "gaussian", "orthogonal"]),
               "optimizer": rng.choice(["row_adam", "adam", "sgd"]),
               "non_target": rng.choice(["freeze", "adamw", "sketch"]), "non_target_lr": 1e-3,
               "factor_dtype": rng.choice(["bfloat16", "float32"]),
               "max_grad_norm": rng.choice([None, 0.05]), "share_projections": rng.random() < 0.3,
               "refresh": rng.random() < 0.7}
    if o["refresh"]:
        o["refresh_every"] = rng.choice([1, 2, 3])
        o["column_scale"] = rng.choice(["none", "input"])
    if rng.random() < 0.5:
        o["beta1"] = 0.9
        o["momentum_refresh"] = rng.choice(["transfer", "reset"])
        if o["optimizer"] == "row_adam":
            o["second_moment"] = rng.choice(["sketch", "momentum"])
    if o.get("beta1") or o["optimizer"] == "adam":
        o["moment_dtype"] = rng.choice(["float32", "bfloat16"])
    if o["optimizer"] == "adam" and o["refresh"]:
        # from a value already drawn, so adding the option left every case's other draws as they were
        o["second_moment_refresh"] = ("reset", "row_mean")[o["seed"] % 2]
    if rng.random() < 0.25:
        o.update(update_ratio=None, lr=rng.choice([0.01, 0.1]), weight_decay=rng.choice([0.0, 0.1]))
    else:
        o.update(update_ratio=rng.choice([6e-3, 3e-2]), trust_ratio=rng.choice(["global", "layer", "element"]))
    if not o["refresh"] and o["seed"] % 3 == 1:  # from values already drawn, as above
        o["distribution"] = "inputs"
    return LoGRAConfig(**o)


def random_shape(rng: random.Random) -> dict:
    return {"hidden": rng.choice([32, 64]), "layers": rng.choice([1, 2]), "tie": rng.random() < 0.3,
            "vocab": rng.choice([61, 97])}


def _train(model, opt, updates: int, first: int = 0) -> list:
    deltas = []
    for i in range(first, first + updates):
        model(**token_batch(model.config.vocab_size, seed=i)).loss.backward()
        deltas.append(opt.apply(opt.propose()))
        opt.zero_grad()
    return deltas


def _same(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (n, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), f"{what}: {n} differs"


def check_invariants(case: int, tmp_path) -> None:
    rng = random.Random(case)
    cfg, shape = random_config(rng), random_shape(rng)
    where = f"case {case}: {cfg} {shape}"
    model, receiver = tiny_qwen2(**shape), tiny_qwen2(**shape)
    opt = LoGRAOptimizer(model, cfg)
    fit_if_needed(model, opt)
    for delta in _train(model, opt, 3):
        apply_delta(receiver, delta, cfg)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / f"{case}.pt")
    for delta in _train(model, opt, 3, first=3):
        apply_delta(receiver, delta, cfg)
    _same(model, receiver, f"replay, {where}")
    state = torch.load(tmp_path / f"{case}.pt", weights_only=True)
    resumed = tiny_qwen2(seed=7, **shape)
    resumed.load_state_dict(state["model"])
    opt2 = LoGRAOptimizer(resumed, cfg)
    opt2.load_state_dict(state["opt"])
    _train(resumed, opt2, 3, first=3)
    _same(model, resumed, f"resume, {where}")


# 21 and 27 resume an element-wise second moment in the middle of its window; 8 fits its
# projections to the inputs
DEFAULT_CASES = [*range(6), 8, 21, 27]


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_resume_and_replay_are_bitwise_for_random_options(case, tmp_path):
    check_invariants(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in range(60) if c not in DEFAULT_CASES])
def test_resume_and_replay_are_bitwise_for_many_random_options(case, tmp_path):
    check_invariants(case, tmp_path)
