"""The examples run, with tiny settings, exactly as a user would start them (subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *flags: str, timeout: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *flags], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_trl_grpo_example_compares_memory_with_adamw():
    pytest.importorskip("trl")
    out = _run("trl_grpo_logra.py", "--steps", "2", "--hidden", "32", "--layers", "2", "--rank", "8",
               "--num-generations", "4", "--batch", "4", "--max-completion-length", "6", timeout=300)
    assert re.search(r"\[logra\] step 2: reward .* predicted KL .* alpha .* realized KL", out), out
    assert "[adamw] step 2: reward" in out
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (logra|adamw) \| (.*) \|$", out, re.M)}
    assert set(rows) == {"logra", "adamw"}, out
    m = re.search(r"gradients \+ optimizer state: LoGRA ([\d.]+) MiB vs AdamW ([\d.]+) MiB", out)
    assert m and float(m.group(1)) < float(m.group(2)), out


def test_sft_plain_pytorch_example_learns():
    out = _run("sft_plain_pytorch.py", "--steps", "4", "--batch", "16", "--hidden", "32", "--layers", "2",
               "--rank", "8", timeout=180)
    m = re.search(r"held-out loss before ([\d.]+) after ([\d.]+)", out)
    assert m, out
    assert float(m.group(2)) < float(m.group(1)), out


def test_gpu_recipe_uses_logra_train_options():
    """Every key of the GPU recipe is a `logra train` option (unknown keys exit), with the paper's values."""
    from logra.rl.cli import build_config, load_config_file

    config = build_config(load_config_file(str(EXAMPLES / "qwen2.5-math-1.5b-gpu.yaml")))
    assert config.model == "Qwen/Qwen2.5-Math-1.5B"
    assert (config.task, config.extract) == ("math:/path/to/math_train.jsonl", "boxed")
    assert (config.optimizer, config.algorithm) == ("logra", "reinforce")
    assert (config.prompts_per_update, config.responses_per_prompt, config.micro_batch) == (128, 1, 1)
    assert (config.max_new_tokens, config.temperature) == (4096, 1.0)
    assert (config.logra.rank, config.logra.update_ratio, config.logra.non_target) == (256, 6e-5, "freeze")
    assert (config.kl.budget, config.kl.budget_final, config.kl.schedule_steps) == (2e-4, 2e-5, 300)
