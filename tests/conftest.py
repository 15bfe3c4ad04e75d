"""Tiny random models shared by the tests (built locally; nothing comes from a hub)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from logra.tasks import Problem, Task

torch.set_num_threads(2)


def tiny_qwen2(
    seed: int = 0, tie: bool = False, vocab: int = 97, hidden: int = 32, layers: int = 2
) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with biases on q/k/v, fp32, eager-friendly sizes."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).float()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama, fp32."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=89, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).float()


def save_local_model(path, chat_template: str | None = None):
    """A saved random 2-layer Qwen2 with the byte-level tokenizer (and ``chat_template``), as a
    user's ``--model`` path; returns ``path``."""
    from logra.rl.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = chat_template
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def qwen2() -> Qwen2ForCausalLM:
    return tiny_qwen2()


def token_batch(vocab: int, batch: int = 3, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids (no pad id 0) with a ragged attention mask, labels = ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fit_if_needed(model, opt) -> None:
    """Fit ``distribution='inputs'`` projections on a fixed ragged batch (the same one in every
    process, as data parallelism needs); nothing for seeded projections."""
    if opt.needs_fit:
        b = token_batch(model.config.vocab_size, batch=4, seed=999)
        opt.fit_projections([{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}])


def train_steps(model, opt, steps: int, seed0: int = 0) -> list:
    """``steps`` LoGRA updates on fresh random batches; the policy deltas they produced."""
    deltas = []
    for i in range(steps):
        model(**token_batch(model.config.vocab_size, seed=seed0 + i)).loss.backward()
        deltas.append(opt.apply(opt.propose()))
        opt.zero_grad()
    return deltas


def resumed_run(cfg, tmp_path, before: int, after: int):
    """Train ``before`` updates, checkpoint, ``after`` more; then load the checkpoint into a
    differently initialised model and optimizer and train the same ``after``.
    Returns ``((model, opt), (resumed model, resumed opt))``."""
    from logra import LoGRAOptimizer

    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, cfg)
    train_steps(model, opt, before)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    train_steps(model, opt, after, seed0=before)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = tiny_qwen2(seed=123)
    fresh.load_state_dict(state["model"])
    opt2 = LoGRAOptimizer(fresh, cfg)
    opt2.load_state_dict(state["opt"])
    train_steps(fresh, opt2, after, seed0=before)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    return (model, opt), (fresh, opt2)


class VowelTask(Task):
    """Reward = fraction of response characters that are 'a': dense, so a random policy gets
    varied rewards and non-zero GRPO advantages from the first update."""

    name = "vowels"
    extract = "full"

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        offset = 0 if split == "train" else 10_000
        return [Problem(f"{offset + seed * n + i}:", "aaaa", self.name, i) for i in range(n)]

    def _grade(self, problem: Problem, response: str) -> float:
        return response.count("a") / max(len(response), 1)

