"""Issue 20, item 1: nothing the warm start (or any earlier backward) left in `.grad` reaches RL.

A cold cache trains the warm start in this process; a warm cache loads it from disk. Both
must hand RL the same policy, so the same `logra train` command ends with the same weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra.config import LoGRAConfig
from logra.rl import KLControlConfig, RLConfig, RLTrainer
from logra.rl.cli import main as train_main
from logra.rl.tiny import TinyPolicyConfig, build_tiny_policy, byte_tokenizer, warm_start

# a few updates of the embedded recipe on a shrunken tiny policy and warm start
RUN = ["--updates", "3", "--prompts_per_update", "2", "--responses_per_prompt", "2", "--eval_problems", "2",
       "--eval_every", "0", "--checkpoint_every", "0", "--kl.probe_responses", "2", "--logra.rank", "4",
       "--tiny.sft_steps", "3", "--tiny.sft_batch_size", "4", "--tiny.num_demonstrations", "16",
       "--tiny.hidden_size", "32", "--tiny.intermediate_size", "64", "--tiny.num_layers", "2", "--quiet",
       "--train_pool", "0"]  # not the recipe's pool of 179 200 draws (~5 s to build)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # some reasoning-gym generators write scratch files to the working directory


def test_warm_start_leaves_no_gradients():
    cfg = TinyPolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           max_position_embeddings=32, sft_steps=2, sft_batch_size=4, sft_warmup_steps=1,
                           num_demonstrations=8)
    model, tok = build_tiny_policy(cfg)
    warm_start(model, tok, [(f"{a} + 1 =", f" {a + 1}") for a in range(8)], cfg, progress=False)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_cold_and_warm_cache_train_the_same_weights(tmp_path, optimizer):
    """The cold run trains the warm start, the warm run loads it: same command, same final weights."""
    argv = [*RUN, "--optimizer", optimizer, "--cache_dir", str(tmp_path / "cache")]
    assert train_main([*argv, "--run_dir", str(tmp_path / "cold")]) == 0
    assert train_main([*argv, "--run_dir", str(tmp_path / "warm")]) == 0
    cold = load_file(tmp_path / "cold" / "checkpoint" / "model.safetensors")
    warm = load_file(tmp_path / "warm" / "checkpoint" / "model.safetensors")
    assert cold.keys() == warm.keys()
    assert [n for n in cold if not torch.equal(cold[n], warm[n])] == []


def _policy() -> tuple[Qwen2ForCausalLM, object]:
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg), tok


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_stale_gradients_on_a_given_model_do_not_reach_the_first_update(tmp_path, optimizer):
    """The loop itself starts each update from zero gradients, whoever built the model."""
    weights = []
    for stale in (False, True):
        model, tok = _policy()
        if stale:  # e.g. a notebook's own supervised step left its gradients behind
            ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
            model(input_ids=ids, labels=ids).loss.backward()
        config = RLConfig(task="basic_arithmetic", optimizer=optimizer, updates=2, prompts_per_update=2,
                          responses_per_prompt=2, max_new_tokens=4, eval_every=0, eval_problems=2,
                          checkpoint_every=0, run_dir=str(tmp_path / f"run-{stale}"),
                          **({"lr": 1e-3} if optimizer in ("adamw", "lora") else {}),
                          logra=LoGRAConfig(rank=4, non_target="adamw"), kl=KLControlConfig(budget=1e-3))
        trainer = RLTrainer(config, model=model, tokenizer=tok, progress=False)
        for _ in range(2):
            trainer.train_step()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    clean, dirty = weights
    assert [n for n in clean if not torch.equal(clean[n], dirty[n])] == []
