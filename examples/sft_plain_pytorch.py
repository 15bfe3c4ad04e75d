"""Supervised fine-tuning in a plain PyTorch loop with `LoGRAOptimizer` as a drop-in optimizer.

The loop is the ordinary one — ``loss.backward(); opt.step(); opt.zero_grad()`` — only
the optimizer changes: ``torch.optim.AdamW(model.parameters())`` becomes
``LoGRAOptimizer(model, LoGRAConfig(...))``. The target layers' weights no longer get a
dense ``.grad``; their backward pass accumulates a ``[out, rank]`` sketch instead.

The data are reasoning-gym ``basic_arithmetic`` demonstrations (question → answer), the
model a small random Qwen2 over a byte-level tokenizer, so it runs anywhere:

    python examples/sft_plain_pytorch.py                       # 60 steps, held-out loss before/after
    python examples/sft_plain_pytorch.py --steps 3 --hidden 32 --layers 2 --rank 8   # tiny

On a GPU, the same loop runs in bf16 autocast over fp32 weights (``--device cuda``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="demonstrations per step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the random Qwen2")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--rank", type=int, default=32, help="LoGRA sketch rank")
    p.add_argument("--update-ratio", type=float, default=2e-2, help="‖ΔW‖/‖W‖ of every step (LoGRA's step size)")
    p.add_argument("--non-target", choices=("freeze", "adamw", "sketch"), default="adamw",
                   help="embeddings, norms, biases: frozen (paper, RL), AdamW, or sketched too")
    p.add_argument("--non-target-lr", type=float, default=3e-3, help="AdamW learning rate of non-target parameters")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def demonstrations(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    """``(token ids, prompt length)`` of reasoning-gym arithmetic demonstrations ending in eos."""
    import reasoning_gym

    task = reasoning_gym.create_dataset("basic_arithmetic", size=n, seed=seed, min_terms=2, max_terms=2,
                                        min_digits=1, max_digits=1)
    out = []
    for entry in task:
        prompt = tokenizer(entry["question"] + " Answer:", add_special_tokens=False)["input_ids"]
        answer = tokenizer(" " + entry["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def collate(items: list[tuple[list[int], int]], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Right-padded batch whose labels are the answer tokens only (-100 elsewhere)."""
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(items):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        labels[row, prompt_len: len(ids)] = torch.tensor(ids[prompt_len:])
    return {k: v.to(device) for k, v in {"input_ids": input_ids, "attention_mask": mask, "labels": labels}.items()}


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over answer tokens, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return loss, int((labels != -100).sum())


def _autocast(device: str) -> contextlib.AbstractContextManager:
    # bf16 compute over fp32 weights on GPU; plain fp32 on CPU.
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def mean_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager]
) -> float:
    """Held-out mean token loss (eval mode)."""
    model.eval()
    with autocast():
        total, count = token_loss_sum(model, batch)
    model.train()
    return float(total) / count


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    opts = _parser().parse_args(argv)
    torch.set_num_threads(opts.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logra import LoGRAConfig, LoGRAOptimizer
    from logra.rl.tiny import byte_tokenizer

    tokenizer = byte_tokenizer(padding_side="right")
    heads = max(1, opts.hidden // 32)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=opts.hidden, intermediate_size=3 * opts.hidden,
        num_hidden_layers=opts.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(opts.seed)
    model = Qwen2ForCausalLM(config).float().to(opts.device)  # fp32 weights: tiny updates must not round away
    model.train()

    # The one line that differs from an AdamW loop.
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=opts.rank, update_ratio=opts.update_ratio,
                                            non_target=opts.non_target, non_target_lr=opts.non_target_lr))

    autocast = lambda: _autocast(opts.device)  # noqa: E731
    per_step = opts.batch * opts.grad_accum
    data = demonstrations(tokenizer, opts.steps * per_step, opts.seed)
    held_out = collate(demonstrations(tokenizer, 64, opts.seed + 10**6), tokenizer.pad_token_id, opts.device)
    before = mean_loss(model, held_out, autocast)
    print(f"held-out loss before: {before:.4f}  ({len(opt.targets)} sketched weights, rank {opts.rank}, "
          f"sketch buffer {opt.sketch_buffer.numel() * 4 / 2**20:.2f} MiB)")

    start = time.perf_counter()
    for step in range(opts.steps):
        chunk = data[step * per_step: (step + 1) * per_step]
        micro = [collate(chunk[i: i + opts.batch], tokenizer.pad_token_id, opts.device)
                 for i in range(0, per_step, opts.batch)]
        # Divide by the tokens of the whole step so that accumulation sums to a mean.
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        total = 0.0
        for batch in micro:
            with autocast():
                loss, _ = token_loss_sum(model, batch)
            (loss / tokens).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        if step % max(1, opts.steps // 10) == 0 or step == opts.steps - 1:
            print(f"step {step + 1:4d}  train loss {total / tokens:.4f}")
    after = mean_loss(model, held_out, autocast)
    print(f"{opts.steps} steps in {time.perf_counter() - start:.1f} s")
    print(f"held-out loss before {before:.4f} after {after:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
