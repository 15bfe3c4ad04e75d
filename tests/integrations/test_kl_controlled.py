"""`KLControlledLoGRA` built from the one `KLControlConfig` that `logra train` uses too."""

from __future__ import annotations

from conftest import tiny_qwen2
from logra import LoGRAConfig
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
