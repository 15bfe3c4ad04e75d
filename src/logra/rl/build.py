"""What a run trains: the policy (a local/hub model or the embedded tiny one) and its optimizer."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._optional import package_version, require
from ..optimizer import DenseRowAdam, LoGRAOptimizer
from ..sketch import target_module_names
from ..tasks import Task
from .config import TASK_OPTIONS, RLConfig
from .pretrained import plain_copy, resolve_model
from .tiny import load_or_warm_start


def load_policy(config: RLConfig, task: Task, progress: bool = True) -> tuple[nn.Module, Any, dict[str, Any]]:
    """``(model, tokenizer, info)``: ``config.model`` in fp32, or the embedded policy warm-started on ``task``.

    ``info`` says where the policy came from (for the embedded one: its cache entry).

    Raises:
        ValueError: ``config.model`` is not a loadable causal language model (or has no chat
            template while ``config.chat_template`` asks for one).
    """
    if not config.model:
        return load_or_warm_start(config.tiny, Path(config.cache_dir).expanduser(),
                                  lambda: warm_start_demonstrations(config, task),
                                  warm_start_data_key(config, task), progress=progress)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(config.model)
    info = {"source": config.model}
    if source.endswith(".gguf"):
        info["gguf"] = source
        source = str(plain_copy(source, config.cache_dir, progress=progress))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"--model {config.model!r} is not a loadable causal language model: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if config.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat_template=True, but the tokenizer of --model {config.model!r} has no chat template")
    return model, tokenizer, {**info, "loaded_from": source}


def warm_start_demonstrations(config: RLConfig, task: Task) -> list[tuple[str, str]]:
    """The embedded policy's SFT demonstrations: ``(prompt, reference response)`` for
    ``config.tiny.num_demonstrations`` training problems of ``task``."""
    problems = task.problems("train", config.tiny.num_demonstrations, seed=config.tiny.seed + 1)
    return [(p.prompt, task.reference_response(p)) for p in problems]


def warm_start_data_key(config: RLConfig, task: Task) -> str:
    """What identifies the embedded policy's demonstrations in its cache key
    (`TinyPolicyConfig.cache_key`): the task, its options, the generator's version and the
    digests of its data files, so a warm start is reused only where they are the same."""
    data = {k: getattr(config, k) for k in TASK_OPTIONS}
    data.update(task=getattr(task, "name", config.task), reasoning_gym=package_version("reasoning-gym"),
                files=_file_digests(task))
    return json.dumps(data, sort_keys=True)


def _file_digests(task: Task) -> dict[str, str]:
    """SHA-256 of every data file behind ``task`` (MATH JSONL), so an edited file retrains."""
    out: dict[str, str] = {}
    for leaf in getattr(task, "tasks", [task]):
        if getattr(leaf, "tasks", None):
            out.update(_file_digests(leaf))
        elif getattr(leaf, "path", None):
            out[leaf.path] = hashlib.sha256(Path(leaf.path).read_bytes()).hexdigest()
    return out


def build_optimizer(
    config: RLConfig, model: nn.Module
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """``(model, optimizer, scheduler)`` for ``config.optimizer``.

    LoGRA installs its sketches on ``model``; it and its dense diagnostic twin
    `DenseRowAdam` get no scheduler (the KL controller sizes each step). Dense AdamW and
    LoRA (``model`` wrapped by peft) get ``config.lr_schedule`` over the run: cosine decay
    to 0 at the last update, or a constant rate.
    """
    if config.optimizer == "logra":
        return model, LoGRAOptimizer(model, config.logra), None
    if config.optimizer == "dense_row_adam":  # diagnostic: LoGRA's rule on the exact gradient
        return model, DenseRowAdam(model, config.logra), None
    betas = (config.adam_beta1, 0.95)
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=betas, weight_decay=0.0)
    else:
        peft = require("peft")
        rank = config.lora_rank or config.logra.rank
        lora = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                               target_modules=target_module_names(model, config.logra.target_modules))
        # The adapters are part of the run's start: drawn from its seed, not from torch's global
        # generator, which torch seeds afresh in every process (so two runs of one command, or
        # two data-parallel ranks, would start from different adapters).
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(config.seed)
            model = peft.get_peft_model(model, lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                      betas=betas, weight_decay=0.0)
    total = max(config.updates, 1)

    def factor(step: int) -> float:  # a scheduler for both, so checkpoints have one layout
        if config.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
