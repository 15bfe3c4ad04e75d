"""The RL post-training loop: rollout → reward → loss → sketch → proposal → KL scale → apply → delta.

`RLConfig` holds every setting (TRL-style config/trainer split); `RLTrainer` runs the
loop with LoGRA (default), dense AdamW or LoRA (peft) as the optimizer and the same
predicted-KL controller for all three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn
from tqdm.auto import tqdm

from .config import LoGRAConfig
from .delta import weights_checksum
from .distributed import allreduce_sketches, global_token_count, init_from_env, verify_projections
from .kl import DenseProposal, KLController, predicted_kl, probe_logits, realized_kl
from .memory import GIB, peak_rss_bytes
from .optimizer import LoGRAOptimizer
from .rollout import Rollout, generate_rollouts, layout_rollouts, token_logprobs
from .tasks import Problem, Task, is_correct, make_task, pass_at_k
from .tiny import TinyPolicyConfig

_CHECKPOINT = "checkpoint"
_TASK_FIELDS = ("task", "task_config", "extract", "instruction", "strip_prefix", "partial_credit", "eval_fraction")


@dataclass
class KLControlConfig:
    """Predicted-KL step control (spec §5); the paper's defaults.

    Attributes:
        enabled: scale every update to the KL budget (off: α = 1 always).
        budget: KL budget at the first update.
        budget_final: KL budget at the end of the schedule.
        schedule_steps: updates over which the budget decays (0 = the run's number of updates).
        schedule: 'cosine' or 'constant'.
        alpha_max: largest scale (the step may grow up to this factor).
        mismatch_ema: EMA weight of the rollout-vs-trainer KL subtracted from the budget.
        mismatch_floor: the effective budget never drops below this fraction of the budget.
        probe_responses: responses of the batch used as probe data.
        probe_max_tokens: at most this many probe positions.
    """

    enabled: bool = True
    budget: float = 2e-4
    budget_final: float = 2e-5
    schedule_steps: int = 300
    schedule: str = "cosine"
    alpha_max: float = 3.0
    mismatch_ema: float = 0.3
    mismatch_floor: float = 0.5
    probe_responses: int = 2
    probe_max_tokens: int = 4096


@dataclass
class RLConfig:
    """Everything `logra train` needs. Defaults are the embedded default run.

    The embedded default sizes steps for a 0.8M-parameter byte-level policy: its KL
    budget (1e-3 → 1e-4) is larger than the paper's 2e-4 → 2e-5 for 1.5B-27B models,
    lm_head/embeddings are sketched and norms trained by AdamW (``non_target='sketch'``),
    and the probe uses 32 short responses instead of the paper's 2 long ones.

    Attributes:
        model: local path or hub name of a causal LM; empty = the embedded tiny policy.
        task: reasoning-gym task name, 'rg-hard', a weighted mix 'a:0.7,b:0.3', or
            'math:/path/file.jsonl'.
        task_config: difficulty settings passed to reasoning-gym's dataset config.
        extract: answer extraction: 'answer' (after "Answer:"), 'boxed', 'last_line', 'full', 'tag'.
        instruction: format instruction appended to prompts; 'default' = the one matching
            ``extract``, '' = none (short prompts for tiny models).
        strip_prefix: boilerplate removed from the front of reasoning-gym questions.
        partial_credit: keep reasoning-gym's partial rewards (else 1 for full credit, 0 otherwise).
        eval_fraction: share of the task's distinct questions held out for evaluation
            (split by a hash of the question text: never trained on, never in the warm start).
        optimizer: 'logra', 'adamw' (dense Adam baseline), 'lora' (peft) or 'dense_row_adam'
            (diagnostic: LoGRA's update rule and ``logra`` settings on the exact dense gradient).
        algorithm: 'grpo' (group-normalised advantages, clipped ratio) or 'reinforce'
            (running baseline, truncated importance sampling).
        updates: number of optimizer updates.
        prompts_per_update: prompts sampled per update.
        responses_per_prompt: responses per prompt (the GRPO group size).
        micro_batch: sequences per forward/backward pass.
        temperature: sampling temperature (also used in the loss and KL probe).
        top_p: nucleus sampling threshold.
        max_new_tokens: response length limit (longer responses are truncated).
        clip_eps: GRPO ratio clip.
        is_cap: REINFORCE truncated importance-sampling cap.
        baseline_decay: REINFORCE running-baseline EMA decay.
        ref_kl_coef: weight of a KL penalty to the initial policy (0 = off, as in the paper).
        lr: learning rate of the adamw / lora baselines (cosine schedule).
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
            every update as a verified low-rank delta (`logra.sync`) and generate the
            training rollouts (LoGRA, one trainer process; 0 = generate in the trainer).
    """

    model: str = ""
    task: str = "chain_sum"
    task_config: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1})
    extract: str = "full"
    instruction: str = ""
    strip_prefix: str = "State the final answer to the following arithmetic problem: "
    partial_credit: bool = False
    eval_fraction: float = 0.2
    optimizer: str = "logra"
    algorithm: str = "grpo"
    updates: int = 2000
    prompts_per_update: int = 32
    responses_per_prompt: int = 8
    micro_batch: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    clip_eps: float = 0.2
    is_cap: float = 2.0
    baseline_decay: float = 0.9
    ref_kl_coef: float = 0.0
    lr: float = 1e-4
    adam_beta1: float = 0.9
    lora_rank: int = 0
    logra: LoGRAConfig = field(default_factory=lambda: LoGRAConfig(
        rank=48, update_ratio=3e-3, non_target="sketch", non_target_lr=1e-4))
    kl: KLControlConfig = field(default_factory=lambda: KLControlConfig(
        budget=1e-3, budget_final=1e-4, schedule_steps=0, probe_responses=32))
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

    def __post_init__(self) -> None:
        choices = {"optimizer": ("logra", "adamw", "lora", "dense_row_adam"), "algorithm": ("grpo", "reinforce"),
                   "extract": ("answer", "boxed", "last_line", "full", "tag")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        positive = ("updates", "prompts_per_update", "responses_per_prompt", "micro_batch", "max_new_tokens",
                    "eval_problems")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.algorithm == "grpo" and self.responses_per_prompt < 2:
            raise ValueError("GRPO needs responses_per_prompt >= 2 (advantages are group-normalised)")
        if self.dp < 1 or self.prompts_per_update % self.dp:
            raise ValueError(f"prompts_per_update ({self.prompts_per_update}) must be a multiple of dp ({self.dp})")
        if self.rollout_workers and (self.dp > 1 or self.optimizer != "logra"):
            raise ValueError("rollout_workers needs optimizer='logra' and dp=1 (workers receive LoGRA deltas)")
        if self.eval_samples < 4:
            raise ValueError("eval_samples must be >= 4 to estimate Pass@4")
        if not 0 < self.temperature or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be > 0 and top_p in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready)."""
        out = dataclasses.asdict(self)
        out["logra"] = self.logra.to_dict()
        return out


def build_task(config: RLConfig) -> Task:
    """The task of ``config`` (options that only reasoning-gym tasks take are passed only if set)."""
    kw: dict[str, Any] = {"extract": config.extract, "eval_fraction": config.eval_fraction}
    if config.instruction != "default":
        kw["instruction"] = config.instruction
    if config.task_config:
        kw["config"] = config.task_config
    if config.strip_prefix:
        kw["strip_prefix"] = config.strip_prefix
    if not config.partial_credit:
        kw["partial_credit"] = False
    try:
        return make_task(config.task, **kw)
    except TypeError as e:
        raise ValueError(f"task {config.task!r} does not take these options {sorted(kw)}: {e}") from None


# ----------------------------------------------------------------------- the loss
def advantages(rewards: torch.Tensor, group: int, algorithm: str, baseline: float) -> torch.Tensor:
    """Per-response advantages: GRPO group-normalised, or reward minus a running baseline."""
    if algorithm == "grpo":
        r = rewards.view(-1, group)
        return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    return rewards - baseline


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, config: RLConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed token loss of a micro-batch (divide by the update's token count outside).

    GRPO: ``-min(ρ·A, clip(ρ, 1±ε)·A)``. REINFORCE: ``-min(ρ, cap)·A·log π`` with the
    truncated ratio treated as a constant weight. Optional k3 penalty to a reference.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    if config.algorithm == "grpo":
        clipped = torch.clamp(ratio, 1 - config.clip_eps, 1 + config.clip_eps)
        per_token = -torch.minimum(ratio * a, clipped * a)
        clip_frac = ((ratio - clipped).abs() > 0).float()
    else:
        weight = torch.clamp(ratio, max=config.is_cap).detach()
        per_token = -weight * a * logp
        clip_frac = (ratio > config.is_cap).float()
    if ref_logp is not None and config.ref_kl_coef > 0:
        log_r = ref_logp - logp
        per_token = per_token + config.ref_kl_coef * (torch.exp(log_r) - log_r - 1)
    stats = {"clip_frac_sum": float((clip_frac * mask).sum())}
    return (per_token * mask).sum(), stats


# ----------------------------------------------------------------------- helpers
def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cosine_lambda(total: int):
    return lambda step: 0.5 * (1 + math.cos(math.pi * min(step / max(total, 1), 1.0)))


def _rollout_worker_main(rank: int, world: int, store: str, policy_dir: str, logra: dict[str, Any]) -> None:
    """A rollout worker process: its own policy copy, kept current by verified deltas."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from .sync import RolloutWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        worker = RolloutWorker(model, LoGRAConfig(**logra), trainer_rank=0)
        worker.connect()
        worker.serve()
    finally:
        dist.destroy_process_group()


class _StopAtBoundary:
    """Ctrl-C finishes the current update, then the loop checkpoints and stops cleanly.

    A second Ctrl-C interrupts at once. Only the main thread can install the handler;
    elsewhere Ctrl-C keeps its default behaviour.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: finishing this update, then writing a checkpoint (Ctrl-C again to abort)", flush=True)

    def __enter__(self) -> _StopAtBoundary:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _MetricsLog:
    """metrics.jsonl (and optionally TensorBoard) in the run directory."""

    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("update", 0)
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "update":
                    self.writer.add_scalar(prefix + k, v, step)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------- the trainer
class RLTrainer:
    """Runs `RLConfig`: build policy, task and optimizer, then train, evaluate, checkpoint.

    ``model``/``tokenizer``/``task`` may be passed in to override what the config
    would build (tests and notebooks do this).
    """

    def __init__(
        self,
        config: RLConfig,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        task: Task | None = None,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.dist = init_from_env()
        self.rank, self.world = self.dist.rank, self.dist.world_size
        if config.prompts_per_update % self.world:
            raise ValueError(f"prompts_per_update ({config.prompts_per_update}) must be a multiple of the "
                             f"world size ({self.world})")
        self.progress = progress and self.rank == 0
        if config.threads:
            torch.set_num_threads(max(1, config.threads // self.world))
        self.device = self.dist.device if self.dist.backend == "nccl" else _resolve_device(config.device)
        self.task = task or build_task(config)
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if model is None:
            model, tokenizer, self.model_info = self._load_policy()
        else:
            self.model_info = {"source": "given"}
        self.tokenizer = tokenizer
        self.model = model.to(self.device)
        self.reference = None
        if config.ref_kl_coef > 0:
            import copy

            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._build_optimizer()
        if self.world > 1 and isinstance(self.optimizer, LoGRAOptimizer):
            verify_projections(self.optimizer)
        # each rank samples its own responses; a fixed function of (seed, rank)
        torch.manual_seed(config.seed * 1_000 + self.rank)
        self.publisher = self._start_rollout_workers() if config.rollout_workers else None
        self.controller = KLController(
            budget=config.kl.budget, budget_final=config.kl.budget_final,
            schedule_steps=config.kl.schedule_steps or config.updates,
            schedule=config.kl.schedule, alpha_max=config.kl.alpha_max, mismatch_ema=config.kl.mismatch_ema,
            mismatch_floor=config.kl.mismatch_floor,
        )
        self.update = 0
        self.baseline = 0.0
        self.log = _MetricsLog(self.run_dir, config.tensorboard)
        self._autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        )

    # ------------------------------------------------------------- construction
    def _load_policy(self):
        cfg = self.config
        if not cfg.model:
            from .tiny import load_or_warm_start

            def demonstrations() -> list[tuple[str, str]]:
                problems = self.task.problems("train", cfg.tiny.num_demonstrations, seed=cfg.tiny.seed + 1)
                return [(p.prompt, self.task.reference_response(p)) for p in problems]

            # the demonstrations are a function of the task options: they key the cache too
            data_key = json.dumps({k: getattr(cfg, k) for k in _TASK_FIELDS}, sort_keys=True)
            return load_or_warm_start(cfg.tiny, Path(cfg.cache_dir).expanduser(), demonstrations, data_key,
                                      progress=self.progress)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        except (ValueError, OSError, KeyError) as e:
            raise ValueError(f"--model {cfg.model!r} is not a loadable causal language model: {e}") from e
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer, {"source": cfg.model}

    def _build_optimizer(self) -> None:
        cfg = self.config
        self.scheduler = None
        if cfg.optimizer == "logra":
            self.optimizer = LoGRAOptimizer(self.model, cfg.logra)
        elif cfg.optimizer == "dense_row_adam":  # diagnostic: LoGRA's rule on the exact gradient
            from .optimizer import DenseRowAdam

            self.optimizer = DenseRowAdam(self.model, cfg.logra)
        elif cfg.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, 0.95), weight_decay=0.0)
        else:
            from peft import LoraConfig, get_peft_model

            rank = cfg.lora_rank or cfg.logra.rank
            lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(cfg.logra.target_modules), lora_dropout=0.0)
            self.model = get_peft_model(self.model, lora)
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.adam_beta1, 0.95), weight_decay=0.0)
        if cfg.optimizer not in ("logra", "dense_row_adam"):
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _cosine_lambda(cfg.updates))

    # ------------------------------------------------------------- data
    def _train_problems(self, update: int) -> list[Problem]:
        """The prompts of ``update``: a fixed function of (seed, update), so resume is exact."""
        if not hasattr(self, "_pool"):
            self._pool = self.task.problems("train", max(2000, 4 * self.config.prompts_per_update), seed=self.config.seed)
        rng = random.Random(self.config.seed * 1_000_003 + update)
        chosen = rng.sample(self._pool, self.config.prompts_per_update)
        return chosen[self.rank:: self.world]  # whole groups per rank

    def _score(self, problems: list[Problem], texts: list[str]) -> torch.Tensor:
        return torch.tensor([self.task.score(p, t) for p, t in zip(problems, texts)], dtype=torch.float32)

    # ------------------------------------------------------------- one update
    def _rollout(self, problems: list[Problem], samples: int, workers: bool = False) -> tuple[list[Problem], Rollout]:
        expanded = [p for p in problems for _ in range(samples)]
        if workers and self.publisher is not None:
            ids = self.tokenizer([p.prompt for p in expanded])["input_ids"]
            samples_ = self.publisher.generate(ids, self.config.max_new_tokens, self.config.temperature,
                                               seed=self.config.seed * 1_000_003 + self.update * len(ids),
                                               eos_token_id=self.tokenizer.eos_token_id)
            rows = [(s.prompt_ids, s.response_ids, s.logprobs, self.tokenizer.eos_token_id not in s.response_ids)
                    for s in samples_]
            return expanded, layout_rollouts(rows, self.tokenizer, self.device)
        rollout = generate_rollouts(
            self.model, self.tokenizer, [p.prompt for p in expanded], temperature=self.config.temperature,
            top_p=self.config.top_p, max_new_tokens=self.config.max_new_tokens, batch_size=max(self.config.micro_batch, 64),
        )
        return expanded, rollout

    def train_step(self) -> dict[str, Any]:
        """One update: rollout → reward → loss → sketch → proposal → KL scale → apply."""
        cfg = self.config
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        problems, rollout = self._rollout(self._train_problems(self.update), cfg.responses_per_prompt, workers=True)
        rewards = self._score(problems, rollout.responses)
        t_rollout = time.perf_counter()

        adv = advantages(rewards, cfg.responses_per_prompt, cfg.algorithm, self.baseline).to(self.device)
        n_local = len(rollout)
        reward_sum, correct, n_all = self._sum([float(rewards.sum()), sum(is_correct(r) for r in rewards.tolist()),
                                                n_local])
        self.baseline = cfg.baseline_decay * self.baseline + (1 - cfg.baseline_decay) * reward_sum / n_all
        n_tokens = int(rollout.response_mask.sum())
        if self.world > 1:  # (a process group may also exist for rollout workers alone)
            n_tokens = global_token_count(n_tokens)
        self.model.train()
        loss_sum, clip_sum, mismatch_sum = 0.0, 0.0, 0.0
        for start in range(0, len(rollout), cfg.micro_batch):
            rows = list(range(start, min(start + cfg.micro_batch, len(rollout))))
            mb = rollout.select(rows)
            with self._autocast:
                logp = token_logprobs(self.model, mb.input_ids, mb.attention_mask, cfg.temperature)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = token_logprobs(self.reference, mb.input_ids, mb.attention_mask, cfg.temperature)
            loss, stats = policy_loss(logp, mb.logprobs, adv[rows], mb.response_mask, cfg, ref)
            (loss / n_tokens).backward()
            loss_sum += float(loss.detach())
            clip_sum += stats["clip_frac_sum"]
            with torch.no_grad():  # k3 estimate of KL(rollout ‖ trainer) on the sampled tokens
                log_r = (logp.detach() - mb.logprobs) * mb.response_mask
                mismatch_sum += float(((torch.exp(log_r) - log_r - 1) * mb.response_mask).sum())
        if self.world > 1:
            self._allreduce_gradients()
        loss_sum, clip_sum, mismatch_sum, trunc = self._sum(
            [loss_sum, clip_sum, mismatch_sum, float(rollout.truncated.float().sum())])
        mismatch = mismatch_sum / n_tokens
        self.controller.observe_mismatch(mismatch)
        t_backward = time.perf_counter()

        record = self._apply_update(rollout)
        t_apply = time.perf_counter()
        record.update({
            "kind": "train", "update": self.update, "reward": reward_sum / n_all, "pass_rate": correct / n_all,
            "loss": loss_sum / n_tokens, "response_len": n_tokens / n_all,
            "truncation_rate": trunc / n_all, "clip_frac": clip_sum / n_tokens,
            "mismatch_kl": mismatch, "time_rollout": t_rollout - t0, "time_train": t_backward - t_rollout,
            "time_sync": t_apply - t_backward, "time_update": t_apply - t0,
            "reward_failures": getattr(self.task, "failures", 0),
        })
        record.update(self._memory())
        if self.scheduler is not None:
            self.scheduler.step()
        self.update += 1
        return record

    def _apply_update(self, rollout: Rollout) -> dict[str, Any]:
        cfg = self.config
        if isinstance(self.optimizer, LoGRAOptimizer):
            proposal = self.optimizer.propose()
            extra = {"sketch_norm": proposal.sketch_norm, "update_norm": proposal.update_norm}
        else:
            proposal = DenseProposal.from_optimizer(self.model, self.optimizer)
            extra = {"update_norm": math.sqrt(sum(float(d.float().square().sum()) for d in proposal.displacements.values()))}
        probe = rollout.select(slice(0, min(cfg.kl.probe_responses, len(rollout))))
        args = (probe.input_ids, probe.attention_mask, probe.response_mask)
        # positions predicted_kl averages over, so ranks can pool their means exactly
        n_probe = min(int(probe.response_mask[:, 1:].sum()), cfg.kl.probe_max_tokens)
        alpha, kl_hat = 1.0, float("nan")
        t0 = time.perf_counter()
        if cfg.kl.enabled:
            kl_local = predicted_kl(self.model, proposal, *args, temperature=cfg.temperature,
                                    max_tokens=cfg.kl.probe_max_tokens)
            kl_sum, n_sum = self._sum([kl_local * n_probe, n_probe])
            kl_hat = kl_sum / n_sum
            alpha = self.controller.scale(kl_hat, self.update)
        extra["time_kl"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        before = probe_logits(self.model, *args, max_tokens=cfg.kl.probe_max_tokens)
        t2 = time.perf_counter()
        if isinstance(self.optimizer, LoGRAOptimizer):
            delta = self.optimizer.apply(proposal, alpha)
            extra["delta_bytes"] = delta.nbytes
            if self.publisher is not None:
                report = self.publisher.publish(delta)
                extra["rollout_workers_live"] = len(self.publisher.live)
                extra["sync_bytes"] = report.sent_bytes
                extra["resyncs"] = sum(o.startswith("resynced") for o in report.outcome.values())
        else:
            proposal.apply(alpha)
            extra["delta_bytes"] = sum(p.numel() * 2 for p in self.model.parameters() if p.requires_grad)
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        after = probe_logits(self.model, *args, max_tokens=cfg.kl.probe_max_tokens)
        real_sum, n_sum = self._sum([realized_kl(before, after, cfg.temperature) * n_probe, n_probe])
        extra["time_check"] = (t2 - t1) + (time.perf_counter() - t3)  # realised-KL logging only
        extra.update({
            "predicted_kl": kl_hat * alpha**2 if cfg.kl.enabled else float("nan"), "predicted_kl_full": kl_hat,
            "alpha": alpha, "budget": self.controller.effective_budget(self.update),
            "realized_kl": real_sum / n_sum,
        })
        return extra

    # ------------------------------------------------------------- rollout workers
    def _start_rollout_workers(self):
        """Spawn the workers, form a gloo group (trainer = rank 0) and hand-shake."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from .sync import PolicyPublisher

        if dist.is_initialized():
            raise ValueError("rollout_workers cannot share a process group with data parallelism")
        n = self.config.rollout_workers
        policy_dir = self.run_dir / "rollout-policy"
        self.model.save_pretrained(policy_dir)
        store = self.run_dir / f"rollout-store-{time.time_ns()}"
        ctx = mp.get_context("spawn")
        self._worker_procs = [
            ctx.Process(target=_rollout_worker_main, args=(rank, n + 1, str(store), str(policy_dir),
                                                           self.config.logra.to_dict()), daemon=True)
            for rank in range(1, n + 1)
        ]
        for proc in self._worker_procs:
            proc.start()
        dist.init_process_group("gloo", store=dist.FileStore(str(store), n + 1), rank=0, world_size=n + 1)
        return PolicyPublisher(self.model, self.config.logra, list(range(1, n + 1)), optimizer=self.optimizer)

    def close(self) -> None:
        """Stop the rollout workers (if any) and leave their process group."""
        if self.publisher is None:
            return
        import torch.distributed as dist

        self.publisher.close()
        for proc in self._worker_procs:
            proc.join(timeout=60)
        dist.destroy_process_group()
        self.publisher = None

    # ------------------------------------------------------------- data parallelism
    def _stop_requested(self, stop: _StopAtBoundary) -> bool:
        """Ranks agree on stopping (Ctrl-C reaches them at slightly different times)."""
        if self.world == 1:
            return stop.requested
        stop.requested = self._sum([float(stop.requested)])[0] > 0
        return stop.requested

    def _sum(self, values: list[float]) -> list[float]:
        """Sum scalars over ranks (identity in one process)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def _allreduce_gradients(self) -> None:
        """One collective for LoGRA's sketch buffer; dense baselines reduce their gradients."""
        if isinstance(self.optimizer, LoGRAOptimizer):
            allreduce_sketches(self.optimizer)
            return
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def _memory(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {"peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / GIB}
        return {"peak_rss_gib": peak_rss_bytes() / GIB}

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, problems: int | None = None, samples: int | None = None) -> dict[str, Any]:
        """Pass@1 / Pass@4 (unbiased estimator over ``samples`` per problem) and mean reward
        on held-out problems, sampling at the training temperature."""
        cfg = self.config
        n, k = problems or cfg.eval_problems, samples or cfg.eval_samples
        if getattr(self, "_eval_size", None) != n:
            self._eval_pool, self._eval_size = self._distinct_eval_problems(n), n
        n = len(self._eval_pool)
        state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed + 7)  # the same evaluation samples whenever we evaluate
        try:
            expanded, rollout = self._rollout(self._eval_pool, k)
        finally:
            torch.random.set_rng_state(state)
        rewards = self._score(expanded, rollout.responses).view(n, k)
        correct = [sum(is_correct(r) for r in row) for row in rewards.tolist()]
        p1 = [pass_at_k(k, c, 1) for c in correct]
        mean1 = sum(p1) / n
        stderr = math.sqrt(sum((x - mean1) ** 2 for x in p1) / max(n - 1, 1) / n)
        return {
            "kind": "eval", "update": self.update, "pass@1": mean1, "pass@1_stderr": stderr,
            "pass@4": sum(pass_at_k(k, c, 4) for c in correct) / n, "reward": float(rewards.mean()),
            "problems": n, "samples": k, "correct": correct,
        }

    def _distinct_eval_problems(self, n: int) -> list[Problem]:
        """``n`` held-out problems with distinct prompts (fewer, with a warning, if the split is smaller)."""
        seen: dict[str, Problem] = {}
        draws = n
        while len(seen) < n and draws <= 64 * n:
            try:
                pool = self.task.problems("eval", draws, seed=self.config.seed)
            except RuntimeError:
                break
            for p in pool:
                seen.setdefault(p.prompt, p)
            draws *= 2
        chosen = list(seen.values())[:n]
        if len(chosen) < n:
            print(f"warning: the eval split holds only {len(chosen)} distinct problems (asked {n})")
        return chosen

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Weights (safetensors) + optimizer, controller, scheduler and RNG state.

        Under data parallelism rank 0 writes the checkpoint and every rank its RNG state.
        """
        path = self.run_dir / _CHECKPOINT
        if self.world > 1:
            torch.save(torch.random.get_rng_state(), self.run_dir / f"rng-rank{self.rank}.pt")
            torch.distributed.barrier()
            if self.rank != 0:
                torch.distributed.barrier()
                return path
        tmp = self.run_dir / (_CHECKPOINT + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(tmp / "model.safetensors"))
        state = {
            "update": self.update, "baseline": self.baseline, "optimizer": self.optimizer.state_dict(),
            "controller": self.controller.state_dict(), "rng": torch.random.get_rng_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }
        torch.save(state, tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
        if self.world > 1:
            for rank in range(self.world):
                (self.run_dir / f"rng-rank{rank}.pt").rename(path / f"rng-rank{rank}.pt")
            torch.distributed.barrier()
        return path

    def load_checkpoint(self) -> None:
        """Continue from ``run_dir/checkpoint`` exactly where it stopped."""
        path = self.run_dir / _CHECKPOINT
        load_model(self.model, str(path / "model.safetensors"))
        state = torch.load(path / "state.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.controller.load_state_dict(state["controller"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        rng = path / f"rng-rank{self.rank}.pt"
        torch.random.set_rng_state(torch.load(rng, weights_only=True) if self.world > 1 else state["rng"])
        self.update, self.baseline = state["update"], state["baseline"]
        if self.rank != 0:
            return
        # drop metrics written after the checkpoint, so the log matches the resumed run
        kept = [r for r in self.log.read() if r["update"] < self.update or (r["kind"] == "eval" and r["update"] == self.update)]
        self.log.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    # ------------------------------------------------------------- the run
    def train(self) -> dict[str, Any]:
        """Run the remaining updates with evaluations, checkpoints, plots and a summary."""
        cfg = self.config
        if self.rank == 0:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        if self.update == 0:
            self._evaluate_and_log()
        bar = tqdm(total=cfg.updates, initial=self.update, desc="logra train", disable=not self.progress,
                   dynamic_ncols=True)
        stop = _StopAtBoundary()
        with stop:
            while self.update < cfg.updates and not self._stop_requested(stop):
                record = self.train_step()
                if self.rank == 0:
                    self.log.write(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward']:.3f}", kl=f"{record['realized_kl']:.1e}",
                                alpha=f"{record['alpha']:.2f}", s=f"{record['time_update']:.1f}")
                if cfg.eval_every and self.update % cfg.eval_every == 0 and self.update < cfg.updates:
                    self._evaluate_and_log(bar)
                if cfg.checkpoint_every and self.update % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        bar.close()
        if stop.requested:
            path = self.save_checkpoint()
            if self.rank == 0:
                print(f"interrupted: checkpoint at update {self.update} written to {path}; continue with "
                      f"`logra train --resume {self.run_dir}`")
            return {"interrupted": True, "update": self.update}
        self._evaluate_and_log()
        self.save_checkpoint()
        if self.publisher is not None:
            self.log.write({"kind": "sync", "update": self.update, "trainer": weights_checksum(self.model),
                            "workers": self.publisher.checksums()})
        self.close()
        return self._finish() if self.rank == 0 else {"rank": self.rank, "updates": self.update}

    def _evaluate_and_log(self, bar: tqdm | None = None) -> dict[str, Any] | None:
        if self.rank != 0:  # the policy is identical on every rank; rank 0 evaluates it
            torch.distributed.barrier()
            return None
        result = self.evaluate()
        if self.world > 1:
            torch.distributed.barrier()
        self.log.write(result)
        message = (f"eval @ update {result['update']}: pass@1 {result['pass@1']:.3f} ± {result['pass@1_stderr']:.3f}"
                   f"  pass@4 {result['pass@4']:.3f}  reward {result['reward']:.3f}")
        if self.progress:
            (bar.write if bar is not None else print)(message)
        return result

    def _finish(self) -> dict[str, Any]:
        from .plots import plot_run

        records = self.log.read()
        evals = [r for r in records if r["kind"] == "eval"]
        train = [r for r in records if r["kind"] == "train"]
        first, last = evals[0], evals[-1]
        gain = last["pass@1"] - first["pass@1"]
        se = math.sqrt(first["pass@1_stderr"] ** 2 + last["pass@1_stderr"] ** 2)
        # the same problems are evaluated each time: the paired standard error of the gain
        n, k = first["problems"], first["samples"]
        diffs = [(b - a) / k for a, b in zip(first["correct"], last["correct"])]
        paired = math.sqrt(sum((d - gain) ** 2 for d in diffs) / max(n - 1, 1) / n)
        summary = {
            "updates": self.update, "pass@1_start": first["pass@1"], "pass@1_end": last["pass@1"],
            "pass@1_gain": gain, "gain_in_stderr": gain / se if se > 0 else 0.0,
            "gain_in_paired_stderr": gain / paired if paired > 0 else 0.0,
            "pass@4_start": first["pass@4"], "pass@4_end": last["pass@4"],
            "peak_pass@1": max(e["pass@1"] for e in evals), "peak_pass@4": max(e["pass@4"] for e in evals),
            "mean_update_s": sum(r["time_update"] for r in train) / max(len(train), 1),
            "updates_per_hour": 3600 * len(train) / max(sum(r["time_update"] for r in train), 1e-9),
            "plots": [str(p) for p in plot_run(records, self.run_dir)],
        }
        mem_key = "peak_mem_gib" if train and "peak_mem_gib" in train[-1] else "peak_rss_gib"
        if train:
            summary[mem_key] = max(r[mem_key] for r in train)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if self.progress:
            print(format_summary(summary, self.config))
        return summary


def format_summary(summary: dict[str, Any], config: RLConfig) -> str:
    """A short markdown table of a finished run."""
    rows = [
        ("optimizer", config.optimizer), ("updates", summary["updates"]),
        ("Pass@1 start → end", f"{summary['pass@1_start']:.3f} → {summary['pass@1_end']:.3f}"),
        ("Pass@1 gain", f"{summary['pass@1_gain']:+.3f} ({summary['gain_in_stderr']:.1f} standard errors unpaired, "
                        f"{summary['gain_in_paired_stderr']:.1f} paired)"),
        ("Pass@4 start → end", f"{summary['pass@4_start']:.3f} → {summary['pass@4_end']:.3f}"),
        ("peak Pass@1 / Pass@4", f"{summary['peak_pass@1']:.3f} / {summary['peak_pass@4']:.3f}"),
        ("updates / hour", f"{summary['updates_per_hour']:.0f}"),
    ]
    for key in ("peak_mem_gib", "peak_rss_gib"):
        if key in summary:
            rows.append((key.replace("_gib", " (GiB)"), f"{summary[key]:.2f}"))
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
