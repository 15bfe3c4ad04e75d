"""`LoGRAConfig`: values and combinations it refuses, in one line naming the option."""

from __future__ import annotations

import pytest

from conftest import tiny_qwen2
from logra import (
    LoGRAConfig,
    LoGRAOptimizer,
)


def test_bad_config_values():
    for kw in [{"rank": 0}, {"rank": -3}, {"distribution": "uniform"}, {"optimizer": "adamw"}, {"factor_dtype": "fp8"}]:
        with pytest.raises(ValueError):
            LoGRAConfig(**kw)
    with pytest.raises(ValueError, match="exceeds the input size"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=33))


@pytest.mark.parametrize("options, option", [
    ({"rank": True}, "rank"),
    ({"second_moment": "momentum"}, "second_moment"),  # no first moment to take it from
    ({"second_moment": "momentum", "beta1": 0.9, "optimizer": "adam"}, "second_moment"),  # adam ignores it
    ({"moment_dtype": "bfloat16"}, "moment_dtype"),  # nothing to store
    ({"momentum_refresh": "reset"}, "momentum_refresh"),
    ({"lr": 1e-2}, "lr"),  # the update ratio sizes the steps
    ({"weight_decay": 0.1}, "weight_decay"),  # the update ratio ignores it
    ({"trust_ratio": "layer", "update_ratio": None}, "trust_ratio"),
    ({"refresh_every": 5, "refresh": False}, "refresh_every"),
])
def test_options_that_would_do_nothing_are_refused(options, option):
    with pytest.raises(ValueError, match=option):
        LoGRAConfig(**options)


def test_the_same_options_are_accepted_where_they_act():
    LoGRAConfig(second_moment="momentum", beta1=0.9)
    LoGRAConfig(moment_dtype="bfloat16", optimizer="adam")
    LoGRAConfig(momentum_refresh="reset", beta1=0.5)
    LoGRAConfig(weight_decay=0.1, update_ratio=None)
    LoGRAConfig(lr=1e-2, update_ratio=None)
    LoGRAConfig(trust_ratio="element")
    LoGRAConfig(refresh_every=5)


def test_dense_row_adam_refuses_what_it_does_not_implement():
    from logra.optimizer import DenseRowAdam

    for options in ({"max_grad_norm": 1.0}, {"second_moment": "momentum", "beta1": 0.9}):
        with pytest.raises(ValueError, match="DenseRowAdam implements neither"):
            DenseRowAdam(tiny_qwen2(), LoGRAConfig(rank=4, **options))
