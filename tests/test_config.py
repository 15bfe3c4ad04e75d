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
