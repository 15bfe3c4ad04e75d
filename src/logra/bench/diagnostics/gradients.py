"""Dense gradients of real training updates for the cosine part: `DenseGradientRecorder`
hooks the target layers, `record_gradients` trains and keeps ``G_t`` of every update."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from logra.optimizer import LoGRAOptimizer
from logra.rl import RLConfig, RLTrainer
from logra.sketch import find_targets

from .common import log


class DenseGradientRecorder:
    """Dense weight gradients ``G = Σ Hᵀ X`` of target layers, taken during an ordinary backward.

    A forward hook on every target ``nn.Linear`` (grad mode only) keeps the layer's input
    ``X`` and registers a hook on its output that adds ``Hᵀ X`` in fp32 when ``H = dL/dY``
    arrives, which is exactly the weight gradient dense autograd would produce. It works
    whether or not LoGRA's sketches are installed (they keep ``X`` out of autograd, the
    hook keeps it here for the diagnostic only).

    Attributes:
        targets: stable weight name → the module(s) computing with it.
        grads: stable weight name → accumulated fp32 gradient ``[out, in]``.
    """

    def __init__(self, model: nn.Module, patterns: Sequence[str]) -> None:
        groups = find_targets(model, tuple(patterns))
        self.targets = {name: [m for _, m in modules] for name, modules in groups.items()}
        self.grads: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, modules in self.targets.items():
            w = modules[0].weight
            self.grads[name] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for module in modules:
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = inputs[0].detach()
            grad = self.grads[name]

            def add(h: torch.Tensor) -> None:
                grad.addmm_(h.reshape(-1, h.shape[-1]).T.float(), x.reshape(-1, x.shape[-1]).float())

            output.register_hook(add)

        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last `pop` (copies); the buffers are zeroed."""
        out = {name: g.clone() for name, g in self.grads.items()}
        for g in self.grads.values():
            g.zero_()
        return out

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _sketch_error(optimizer: torch.optim.Optimizer, grads: Mapping[str, torch.Tensor]) -> float | None:
    """Largest ``‖S − G Aᵀ‖ / ‖G Aᵀ‖`` over LoGRA's targets (None for other optimizers)."""
    if not isinstance(optimizer, LoGRAOptimizer):
        return None
    worst = 0.0
    for name, sketch in optimizer.sketches().items():
        expected = grads[name] @ optimizer.projection(name).T
        scale = float(torch.linalg.vector_norm(expected))
        if scale > 0:
            worst = max(worst, float(torch.linalg.vector_norm(sketch - expected)) / scale)
    return worst


class _GradientKeeper:
    """Keeps the dense gradient of every update of an `RLTrainer` and checks its sketches against it.

    It runs as the trainer's gradient hook, after an update's backward passes: the
    sketches (if LoGRA) still hold this update's ``G Aᵀ`` there.
    """

    def __init__(self, trainer: RLTrainer) -> None:
        self.trainer = trainer
        self.recorder = DenseGradientRecorder(trainer.model, trainer.config.logra.target_modules)
        self.recorded: list[dict[str, torch.Tensor]] = []
        self.sketch_errors: list[float] = []
        trainer.add_gradient_hook(lambda _: self.keep())

    def keep(self) -> None:
        """Store the gradient recorded since the last call and check the sketches against it."""
        grads = self.recorder.pop()
        self.recorded.append({n: g.cpu() for n, g in grads.items()})
        err = _sketch_error(self.trainer.optimizer, grads)
        if err is not None:
            self.sketch_errors.append(err)


def _sft_batch(tokenizer: Any, pairs: Sequence[tuple[str, str]], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer + eos; labels only on answer and eos (as the warm start)."""
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a for _, a in pairs], add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers, strict=True)]
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (q, p) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, : len(q)] = torch.tensor(q)
        mask[i, : len(q)] = 1
        labels[i, len(p): len(q)] = ids[i, len(p): len(q)]
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def record_gradients(
    config: RLConfig, updates: int, model: nn.Module | None = None, tokenizer: Any = None, task: Any = None,
    loss: str = "rl", sft_batch: int = 64,
) -> tuple[list[dict[str, torch.Tensor]], list[float], dict[str, Any]]:
    """Train ``updates`` updates with the optimizer of ``config`` and return the dense gradient of each.

    ``loss='rl'``: the trainer's own RL updates (rollouts, policy-gradient loss, KL-controlled
    step). ``loss='sft'``: supervised next-token loss on ``sft_batch`` fresh task
    demonstrations (prompt + reference response) per update, plain ``optimizer.step()``.
    Returns ``(grads, sketch_errors, info)``: per update, stable weight name → fp32 ``G``
    (CPU) of the loss the update was computed from; per update, the largest relative
    difference between the optimizer's sketch and ``G Aᵀ`` (LoGRA only); per-update records.
    """
    trainer = RLTrainer(config, model=model, tokenizer=tokenizer, task=task, progress=False)
    keeper = _GradientKeeper(trainer)
    records: list[dict[str, Any]] = []
    try:
        if loss == "rl":
            for i in range(updates):
                records.append(trainer.train_step())
                r = records[-1]
                log(f"cosine: update {i + 1}/{updates}: reward {r['reward']:.3f}, alpha {r['alpha']:.2f}, "
                     f"{r['time_update']:.1f} s")
        elif loss == "sft":
            problems = trainer.task.problems("train", updates * sft_batch, seed=config.seed + 1_000)
            trainer.model.train()
            for i in range(updates):
                trainer.fit_projections()  # before the first update, and each refresh window's
                chunk = problems[i * sft_batch: (i + 1) * sft_batch]
                batch = _sft_batch(trainer.tokenizer, [(p.prompt, trainer.task.reference_response(p)) for p in chunk],
                                   trainer.device)
                value = trainer.model(**batch).loss
                value.backward()
                keeper.keep()
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                records.append({"loss": float(value.detach())})
                log(f"cosine: SFT update {i + 1}/{updates}: loss {records[-1]['loss']:.3f}")
        else:
            raise ValueError(f"loss must be 'rl' or 'sft', got {loss!r}")
    finally:
        keeper.recorder.remove()
    return keeper.recorded, keeper.sketch_errors, {"records": records, "task": getattr(trainer.task, "name", "?")}


def coherence(grads: Sequence[Mapping[str, torch.Tensor]], layers: Mapping[str, Sequence[str]]) -> np.ndarray:
    """Per layer, ``‖Σ_t G_t‖² / Σ_t ‖G_t‖²``: 1 for uncorrelated updates, T for identical ones.

    Refreshed projections can only beat a single draw when this exceeds 1: their
    independent errors add up like ``Σ_t ‖G_t‖²`` while the signal grows like ``‖Σ_t G_t‖²``.
    """
    out = []
    for members in layers.values():
        total = sum(float(sum(step[n].double() for step in grads).square().sum()) for n in members)
        own = sum(float(step[n].double().square().sum()) for step in grads for n in members)
        out.append(total / own if own > 0 else float("nan"))
    return np.array(out)

