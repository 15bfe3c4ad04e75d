"""TRL's GRPOTrainer with LoGRA as the optimizer, on a reasoning-gym task.

Builds a small random Qwen2 policy with a byte-level tokenizer, saves it to a folder and
loads it by path as you would a hub model, then trains it with GRPO on reasoning-gym's
``basic_arithmetic`` (two one-digit terms). By default it runs the same training twice,
each in its own process — once with LoGRA (`LoGRAGRPOTrainer`), once with TRL's default
AdamW (`GRPOTrainer`) — and prints what each used: the bytes of gradients and optimizer
state measured at every optimizer step, the process peak RSS (separate processes, so
each figure is its own run's) and, on a GPU, ``torch.cuda.max_memory_allocated``.

    python examples/trl_grpo_logra.py                      # both runs + memory table
    python examples/trl_grpo_logra.py --optimizer logra    # one LoGRA run in this process
    python examples/trl_grpo_logra.py --steps 2 --hidden 32 --layers 2 --rank 8   # tiny

Your own model: pass ``--model-dir`` (a local folder with a causal LM and its tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback

_RESULT = "LOGRA_EXAMPLE_RESULT "


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--optimizer", choices=("both", "logra", "adamw"), default="both",
                   help="'both' runs LoGRA and AdamW in two processes and compares their memory")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the random Qwen2 policy")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the policy")
    p.add_argument("--rank", type=int, default=64, help="LoGRA sketch rank")
    p.add_argument("--update-ratio", type=float, default=1e-3, help="LoGRA ‖ΔW‖/‖W‖ before KL scaling")
    p.add_argument("--kl-budget", type=float, default=1e-3, help="KL budget per update (cosine to a tenth)")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--batch", type=int, default=8, help="completions per micro-batch (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--max-completion-length", type=int, default=16, help="generated tokens (bytes) per completion")
    p.add_argument("--model-dir", help="use this saved model + tokenizer instead of building a random one")
    p.add_argument("--output-dir", help="TRL output folder (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def build_tiny_model(path: str, hidden: int, layers: int, seed: int) -> None:
    """Save a random fp32 Qwen2 and a byte-level tokenizer to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logra.rl.tiny import byte_tokenizer

    tok = byte_tokenizer()
    heads = max(1, hidden // 32)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def arithmetic_task(size: int, seed: int) -> tuple[Any, Any]:
    """reasoning-gym ``basic_arithmetic`` (easy) as a TRL prompt dataset, and the task for scoring."""
    import reasoning_gym
    from datasets import Dataset

    task = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, min_terms=2, max_terms=2,
                                        min_digits=1, max_digits=1)
    rows = [{"prompt": entry["question"] + " Answer:", "rg_index": i} for i, entry in enumerate(task)]
    return Dataset.from_list(rows), task


def reward_functions(task: Any) -> list:
    """reasoning-gym's own score plus a small shaping term (a random policy rarely scores)."""

    def correctness(completions: list[str], rg_index: list[int], **_: Any) -> list[float]:
        return [float(task.score_answer(c.strip(), task[i])) for c, i in zip(completions, rg_index, strict=True)]

    def digits(completions: list[str], **_: Any) -> list[float]:
        # Fraction of the completion that could be part of a number: steers toward answers.
        return [sum(ch.isdigit() or ch == "-" for ch in c) / max(len(c), 1) for c in completions]

    return [correctness, digits]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class StateBytes(TrainerCallback):
    """A TrainerCallback that measures gradient and optimizer-state bytes at every optimizer step.

    Called right after ``optimizer.step()`` (gradients not yet zeroed), it sums the bytes
    of every live ``.grad`` and optimizer-state tensor; LoGRA's sketch buffer counts as
    gradients, its second moments and projections as optimizer state
    (`LoGRAOptimizer.memory_tensors`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.gradients = self.optimizer_state = 0

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the maxima so far."""
        grads = {id(p.grad): p.grad for p in self.model.parameters() if p.grad is not None}
        opt: dict[int, torch.Tensor] = {}
        for s in self.optimizer.state.values():
            opt.update({id(t): t for t in s.values() if isinstance(t, torch.Tensor)})
        if hasattr(self.optimizer, "memory_tensors"):
            for category, tensors in self.optimizer.memory_tensors().items():
                (grads if category == "gradients" else opt).update({id(t): t for t in tensors})
        self.gradients = max(self.gradients, _nbytes(grads.values()))
        self.optimizer_state = max(self.optimizer_state, _nbytes(opt.values()))


def run_one(opts: argparse.Namespace) -> dict[str, Any]:
    """Train with one optimizer in this process; return its memory figures."""
    from trl import GRPOConfig, GRPOTrainer

    from logra import KLController, LoGRAConfig
    from logra.integrations.trl import LoGRAGRPOTrainer
    from logra.memory import peak_rss_bytes

    cuda = torch.cuda.is_available()
    dataset, task = arithmetic_task(size=max(64, opts.steps * opts.batch * opts.grad_accum), seed=opts.seed)
    out = opts.output_dir
    logra = opts.optimizer == "logra"
    args = GRPOConfig(
        output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.grad_accum, num_generations=opts.num_generations,
        max_completion_length=opts.max_completion_length, temperature=1.0, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=opts.seed, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=True,
        # LoGRA clips its own sketched gradient (LoGRAConfig.max_grad_norm); TRL's clipping is for AdamW.
        max_grad_norm=0.0 if logra else 1.0,
    )
    common = dict(model=opts.model_dir, reward_funcs=reward_functions(task), args=args, train_dataset=dataset)
    if logra:
        trainer = LoGRAGRPOTrainer(
            **common, logra_config=LoGRAConfig(rank=opts.rank, update_ratio=opts.update_ratio),
            kl_controller=KLController(budget=opts.kl_budget, budget_final=opts.kl_budget / 10,
                                       schedule_steps=max(opts.steps, 1)),
        )
    else:
        trainer = GRPOTrainer(**common)
    trainer.remove_callback(PrinterCallback)  # our own per-step lines below are shorter
    # TRL reuses an optimizer that already exists; creating it here lets the callback see it.
    meter = StateBytes(trainer.model, trainer.create_optimizer())
    trainer.add_callback(meter)
    rss_before = peak_rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    for h in trainer.state.log_history:
        if "reward" in h:
            line = f"[{opts.optimizer}] step {h['step']}: reward {h['reward']:.3f}  loss {h['loss']:+.4f}"
            if "logra/predicted_kl" in h:
                line += (f"  predicted KL {h['logra/predicted_kl']:.2e}  alpha {h['logra/alpha']:.2f}"
                         f"  realized KL {h['logra/realized_kl']:.2e}  budget {h['logra/budget']:.1e}")
            print(line, flush=True)
    return {
        "optimizer": opts.optimizer, "gradients": meter.gradients, "optimizer_state": meter.optimizer_state,
        "peak_rss": peak_rss_bytes(), "rss_growth": peak_rss_bytes() - rss_before,
        "cuda_max_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "parameters": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def compare(opts: argparse.Namespace, child_flags: list[str]) -> int:
    """Run LoGRA and AdamW in separate processes (so peak RSS is per run) and print a table."""
    with tempfile.TemporaryDirectory(prefix="trl_grpo_logra_") as tmp:
        model_dir = opts.model_dir
        if model_dir is None:
            model_dir = os.path.join(tmp, "model")
            build_tiny_model(model_dir, opts.hidden, opts.layers, opts.seed)
        results = {}
        for name in ("logra", "adamw"):
            cmd = [sys.executable, __file__, *child_flags, "--optimizer", name, "--model-dir", model_dir]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            lines = proc.stdout.splitlines()
            sys.stdout.write("".join(line + "\n" for line in lines if not line.startswith(_RESULT)))
            if proc.returncode != 0:
                print(f"the {name} run failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode
            line = next(line for line in lines if line.startswith(_RESULT))
            results[name] = json.loads(line[len(_RESULT):])
    cuda = any(r["cuda_max_allocated"] is not None for r in results.values())
    print("\nMemory of the same GRPO run with each optimizer, each in its own process (MiB). gradients / optimizer "
          "state: bytes of live .grad (LoGRA: its sketch buffer) and optimizer-state tensors right after each "
          "optimizer step, max over steps; peak RSS: the process's peak resident set; growth: how much "
          "trainer.train() raised it" + ("; CUDA: torch.cuda.max_memory_allocated during train()." if cuda else ".")
          + "\n")
    head = ["optimizer", "parameters", "gradients", "optimizer state", "peak RSS", "RSS growth in train()"]
    head += ["CUDA max allocated"] if cuda else []
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in results.items():
        row = [name, _mib(r["parameters"]), _mib(r["gradients"]), _mib(r["optimizer_state"]), _mib(r["peak_rss"]),
               _mib(r["rss_growth"])] + ([_mib(r["cuda_max_allocated"])] if cuda else [])
        print("| " + " | ".join(row) + " |")
    lg, ad = results["logra"], results["adamw"]
    state_l, state_a = lg["gradients"] + lg["optimizer_state"], ad["gradients"] + ad["optimizer_state"]
    print(f"\ngradients + optimizer state: LoGRA {_mib(state_l)} MiB vs AdamW {_mib(state_a)} MiB "
          f"({state_a / max(state_l, 1):.1f}x smaller with LoGRA); peak RSS difference "
          f"{_mib(ad['peak_rss'] - lg['peak_rss'])} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = _parser().parse_args(argv)
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if opts.optimizer == "both":
        # The children get every other setting of this run.
        child = [x for k, v in vars(opts).items() if v is not None and k not in ("optimizer", "model_dir", "output_dir")
                 for x in (f"--{k.replace('_', '-')}", str(v))]
        return compare(opts, child)
    with tempfile.TemporaryDirectory(prefix=f"trl_grpo_{opts.optimizer}_") as tmp:
        if opts.model_dir is None:
            opts.model_dir = os.path.join(tmp, "model")
            build_tiny_model(opts.model_dir, opts.hidden, opts.layers, opts.seed)
        opts.output_dir = opts.output_dir or os.path.join(tmp, "trl")
        result = run_one(opts)
    print(_RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
