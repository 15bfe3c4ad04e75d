"""`RLTrainer`: the RL loop, rollout → reward → loss → sketch → proposal → KL scale → apply → delta.

One update (`RLTrainer.train_step`):

1. rollout: sample ``responses_per_prompt`` responses to each prompt (`rollout.py`, or
   rollout workers kept in sync by low-rank deltas, `workers.py`, or a colocated vLLM
   engine kept in sync the same way, `logra.parallel.vllm`);
2. reward: grade them with the task (`logra.tasks`);
3. loss: GRPO or REINFORCE per token (`loss.py`), backward micro-batch by micro-batch —
   LoGRA's backward fills gradient sketches instead of dense gradients;
4. reduce: one all-reduce of the gradients over data-parallel ranks (`Updater.reduce`);
5. proposal, KL scale, apply: `logra.updater.controlled_step` proposes the step (LoGRA's
   sketched step, or the displacement of a dense optimizer's), predicts its KL, scales it
   to the budget and applies it; LoGRA returns the `PolicyDelta` rollout engines receive.

Building the policy and optimizer (`build.py`), evaluation and the summary
(`evaluation.py`), checkpoints (`checkpoint.py`), data-parallel reductions
(`collective.py`) and metrics (`metrics.py`) live beside this file.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..delta import weights_checksum
from ..errors import ChecksumMismatchError, SyncError
from ..optimizer import LoGRAOptimizer
from ..parallel import global_token_count, init_from_env, verify_weights
from ..parallel.vllm import VLLMPolicy, make_engine
from ..tasks import ChatTemplateTask, Problem, Task, is_correct
from ..updater import controlled_step, make_updater
from .build import build_optimizer, load_policy
from .checkpoint import load_checkpoint, save_checkpoint
from .collective import sum_over_ranks
from .config import RLConfig, build_task
from .evaluation import distinct_problems, evaluate, format_summary, summarize
from .loss import advantages, mismatch_kl_sum, policy_loss
from .metrics import MetricsLog, memory_stats
from .rollout import Rollout, generate_rollouts, layout_rollouts, token_logprobs


class RLTrainer:
    """Runs `RLConfig`: build policy, task and optimizer, then train, evaluate, checkpoint.

    ``model``/``tokenizer``/``task`` may be passed in to override what the config
    would build (tests and notebooks do this).

    Attributes:
        model, tokenizer, task, optimizer: what the run trains, and with what.
        controller: the `KLController` sizing every update.
        num_updates: updates applied so far (also the index of the next one), as
            `LoGRAOptimizer.num_updates`.
        log: the run's `MetricsLog` (``metrics.jsonl``).
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
            model, tokenizer, self.policy_info = load_policy(config, self.task, progress=self.progress)
        else:
            self.policy_info = {"source": "given"}
        # what the run started from, by content: one cache key gives different warm starts on
        # machines (or thread counts) whose float reductions differ; runs are paired on this
        self.policy_info["checksum"] = weights_checksum(model)
        self.tokenizer = tokenizer
        if config.chat_template:
            self.task = ChatTemplateTask(self.task, tokenizer)
        model = model.to(self.device)
        # the reference is the initial policy itself: copied before sketches or adapters are installed
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if config.ref_kl_coef > 0 else None
        self.model, self.optimizer, self.scheduler = build_optimizer(config, model)
        self.updater = make_updater(self.model, self.optimizer)
        if self.world > 1:
            verify_weights(self.model)
            self.updater.check_ranks()
        torch.manual_seed(config.seed * 1_000 + self.rank)  # each rank samples its own responses
        self.workers = None
        if config.rollout_workers:
            from .workers import RolloutWorkers

            self.workers = RolloutWorkers(self.model, self.optimizer, config.logra, config.rollout_workers,
                                          self.run_dir)
        elif config.rollout_engine == "vllm":
            # `_controlled_update` publishes every delta through `self.workers.publish`
            self.workers = _start_vllm(self.model, self.optimizer, config, self.run_dir)
        self.controller = config.kl.controller(config.updates)
        self.num_updates = 0
        self.baseline = 0.0
        self._evaluated_at = -1  # the update whose evaluation is in the log (checkpointed)
        self.log = MetricsLog(self.run_dir, config.tensorboard)
        self._pool: list[Problem] | None = None
        self._eval_pool: list[Problem] | None = None
        self._eval_size = 0
        self._gradient_hooks: list[Callable[[RLTrainer], None]] = []
        self._autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                          else contextlib.nullcontext())

    # ------------------------------------------------------------- the run
    def train(self) -> dict[str, Any]:
        """Run the remaining updates with evaluations, checkpoints, plots and a summary.

        Raises:
            FileExistsError: a run that was not resumed (`load_checkpoint`) finds another run's
                records in ``run_dir``; its records, config and checkpoint are left as they were.
        """
        cfg = self.config
        if self.num_updates == 0 and self._evaluated_at < 0 and self.log.read():
            # appending would mix two runs: the summary's gain would start from the other run's
            # first evaluation, and the plots would draw both
            raise FileExistsError(
                f"{self.run_dir} already holds another run's records ({self.log.path}): continue that run "
                f"with `logra train --resume {self.run_dir}` (if it left a checkpoint), or give this one "
                f"another --run_dir, or delete {self.log.path}")
        if self.rank == 0:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        if self.num_updates == 0:
            self._evaluate_and_log()
        bar = tqdm(total=cfg.updates, initial=self.num_updates, desc="logra train", disable=not self.progress,
                   dynamic_ncols=True)
        with _StopAtBoundary() as stop:
            while self.num_updates < cfg.updates and not self._agree_to_stop(stop):
                record = self.train_step()
                if self.rank == 0:
                    self.log.write(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward']:.3f}", kl=f"{record['realized_kl']:.1e}",
                                alpha=f"{record['alpha']:.2f}", s=f"{record['time_update']:.1f}")
                if cfg.eval_every and self.num_updates % cfg.eval_every == 0 and self.num_updates < cfg.updates:
                    self._evaluate_and_log(bar)
                if cfg.checkpoint_every and self.num_updates % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        bar.close()
        if stop.requested:
            path = self.save_checkpoint()
            if self.rank == 0:
                print(f"interrupted: checkpoint at update {self.num_updates} written to {path}; continue with "
                      f"`logra train --resume {self.run_dir}`")
            return {"interrupted": True, "update": self.num_updates}
        if self._evaluated_at == self.num_updates:  # a finished run resumed again: already evaluated and saved
            self.close()
            return self._finish() if self.rank == 0 else {"rank": self.rank, "updates": self.num_updates}
        self._evaluate_and_log()
        self.save_checkpoint()
        if isinstance(self.workers, VLLMPolicy):
            self.log.write({"kind": "sync", "update": self.num_updates, "trainer": self.workers.trainer_checksum(),
                            "engine": self.workers.checksum()})
        elif self.workers is not None:
            self.log.write({"kind": "sync", "update": self.num_updates, "trainer": weights_checksum(self.model),
                            "workers": self.workers.publisher.checksums()})
        self.close()
        return self._finish() if self.rank == 0 else {"rank": self.rank, "updates": self.num_updates}

    def train_step(self) -> dict[str, Any]:
        """One update: rollout → reward → loss → sketch → proposal → KL scale → apply.

        Returns the update's record, the line `train` writes to ``metrics.jsonl``; its keys are
        listed in docs/architecture.md ("What a run writes").
        """
        cfg = self.config
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # The update's gradients are this update's alone: a policy handed over with stale
        # `.grad` (a supervised warm start, a notebook's own backward) must not be stepped on
        # them. A no-op after the first update (each update ends by zeroing).
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

        self.fit_projections()

        # rollout and reward
        problems, rollout = self._rollout(self._train_problems(self.num_updates))
        rewards = torch.tensor([self.task.score(p, t) for p, t in zip(problems, rollout.responses, strict=True)],
                               dtype=torch.float32)
        t_rollout = time.perf_counter()
        reward_sum, correct, n_all = self._sum(
            [float(rewards.sum()), sum(is_correct(r) for r in rewards.tolist()), len(rollout)])
        adv = advantages(rewards, cfg.responses_per_prompt, cfg.algorithm, self.baseline).to(self.device)
        self.baseline = cfg.baseline_decay * self.baseline + (1 - cfg.baseline_decay) * reward_sum / n_all

        # loss → gradients (LoGRA: sketches), a token mean over the whole update
        n_tokens = int(rollout.response_mask.sum())
        if self.world > 1:
            n_tokens = global_token_count(n_tokens)
        self.model.train()
        loss_sum, clip_sum, mismatch_sum = 0.0, 0.0, 0.0
        # Σ −log π of the sampled tokens under the policy that sampled them: each term's
        # expectation given its prefix is that position's entropy, so over the update it
        # estimates the sampling policy's per-token entropy without a pass over the vocabulary
        entropy_sum = -float((rollout.logprobs * rollout.response_mask).sum())
        for start in range(0, len(rollout), cfg.micro_batch):
            mb = rollout.select(list(range(start, min(start + cfg.micro_batch, len(rollout)))))
            with self._autocast:
                logp = token_logprobs(self.model, mb.input_ids, mb.attention_mask, cfg.temperature)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = token_logprobs(self.reference, mb.input_ids, mb.attention_mask, cfg.temperature)
            loss, stats = policy_loss(logp, mb.logprobs, adv[start: start + len(mb)], mb.response_mask, cfg, ref)
            (loss / n_tokens).backward()
            loss_sum += float(loss.detach())
            clip_sum += stats["clip_frac_sum"]
            mismatch_sum += mismatch_kl_sum(logp, mb.logprobs, mb.response_mask)
        if self.world > 1:
            self.updater.reduce()
        loss_sum, clip_sum, mismatch_sum, entropy_sum, truncated = self._sum(
            [loss_sum, clip_sum, mismatch_sum, entropy_sum, float(rollout.truncated.float().sum())])
        mismatch = mismatch_sum / n_tokens
        self.controller.observe_mismatch(mismatch)
        for hook in self._gradient_hooks:
            hook(self)
        t_backward = time.perf_counter()

        # proposal → KL scale → apply → delta
        record = self._controlled_update(rollout)
        self.updater.zero_grad()
        t_apply = time.perf_counter()
        record.update({
            "kind": "train", "update": self.num_updates, "reward": reward_sum / n_all, "pass_rate": correct / n_all,
            "loss": loss_sum / n_tokens, "response_len": n_tokens / n_all,
            "truncation_rate": truncated / n_all, "clip_frac": clip_sum / n_tokens,
            "mismatch_kl": mismatch, "entropy": entropy_sum / n_tokens,
            "time_rollout": t_rollout - t0, "time_train": t_backward - t_rollout,
            "time_step": t_apply - t_backward, "time_update": t_apply - t0,
            "reward_failures": getattr(self.task, "failures", 0),
        })
        record.update(memory_stats(self.device))
        if self.scheduler is not None:
            self.scheduler.step()
        self.num_updates += 1
        return record

    def _controlled_update(self, rollout: Rollout) -> dict[str, Any]:
        """Propose, size by predicted KL, apply (`logra.updater.controlled_step`), publish."""
        cfg = self.config
        probe = rollout.select(slice(0, min(cfg.kl.probe_responses, len(rollout))))
        delta, record = controlled_step(
            self.updater, self.model, self.controller if cfg.kl.enabled else None, self.num_updates,
            (probe.input_ids, probe.attention_mask, probe.response_mask), temperature=cfg.temperature,
            max_tokens=cfg.kl.probe_max_tokens, reduce=self._sum)
        if self.workers is not None:
            record.update(self.workers.publish(delta))
        if not cfg.kl.enabled:  # the same keys as a controlled run: the schedule it would follow
            record.update(predicted_kl=float("nan"), expected_kl=float("nan"),
                          budget=self.controller.budget_at(self.num_updates),
                          effective_budget=self.controller.effective_budget(self.num_updates))
        return record

    def add_gradient_hook(self, fn: Callable[[RLTrainer], None]) -> None:
        """Call ``fn(trainer)`` after each update's backward passes, before its proposal.

        The gradients of the update are complete there (sketches for LoGRA, summed over
        ranks); diagnostics read them without changing the loop.
        """
        self._gradient_hooks.append(fn)

    # ------------------------------------------------------------- rollouts and problems
    def _train_problems(self, update: int, every_rank: bool = False) -> list[Problem]:
        """This rank's prompts of ``update`` (all ranks' with ``every_rank``): a fixed function
        of (seed, update), so resume is exact."""
        if self._pool is None:
            size = self.config.train_pool or max(2000, 4 * self.config.prompts_per_update)
            self._pool = self.task.problems("train", size, seed=self.config.seed)
        rng = random.Random(self.config.seed * 1_000_003 + update)
        chosen = rng.sample(self._pool, self.config.prompts_per_update)
        return chosen if every_rank else chosen[self.rank:: self.world]  # whole groups per rank

    def fit_projections(self) -> None:
        """Fit LoGRA's ``distribution='inputs'`` projections on the prompts of the optimizer's
        next update where they await a fit (before the first update, and with refresh windows
        at each window's first). `train_step` calls it; a loop that steps ``self.optimizer``
        itself calls it before each backward."""
        if not (isinstance(self.optimizer, LoGRAOptimizer) and self.optimizer.needs_fit):
            return
        t0 = time.perf_counter()
        tokens = self.optimizer.fit_projections(self._fit_batches())
        if self.world > 1:
            self.updater.check_ranks()  # every rank fitted the same bits
        if self.progress:
            tqdm.write(f"update {self.num_updates}: projections fitted to the inputs of "
                       f"{self.config.prompts_per_update} prompts ({tokens:,} tokens) in "
                       f"{time.perf_counter() - t0:.1f} s")

    def _fit_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The batches projections are fitted on (``distribution='inputs'``): the prompts of the
        optimizer's next update (the trainer's, or a loop's of its own that steps the optimizer),
        all ranks' on every rank (so that every rank fits the same ones without a collective),
        tokenized ``micro_batch`` prompts at a time."""
        prompts = [p.prompt for p in self._train_problems(self.optimizer.num_updates, every_rank=True)]
        size = self.config.micro_batch
        for i in range(0, len(prompts), size):
            b = self.tokenizer(prompts[i: i + size], return_tensors="pt", padding=True).to(self.device)
            yield {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}

    def _rollout(self, problems: list[Problem]) -> tuple[list[Problem], Rollout]:
        cfg = self.config
        expanded = [p for p in problems for _ in range(cfg.responses_per_prompt)]
        if isinstance(self.workers, VLLMPolicy):
            ids = self.tokenizer([p.prompt for p in expanded])["input_ids"]
            rows = self.workers.generate(ids, max_new_tokens=cfg.max_new_tokens,
                                         eos_token_id=self.tokenizer.eos_token_id, temperature=cfg.temperature,
                                         top_p=cfg.top_p,
                                         seed=cfg.seed * 1_000_003 + self.num_updates * len(ids))
            return expanded, layout_rollouts(rows, self.tokenizer, self.device)
        if self.workers is None:
            return expanded, generate_rollouts(
                self.model, self.tokenizer, [p.prompt for p in expanded], temperature=cfg.temperature,
                top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=max(cfg.micro_batch, 64))
        ids = self.tokenizer([p.prompt for p in expanded])["input_ids"]
        eos = self.tokenizer.eos_token_id
        samples = self.workers.publisher.generate(ids, cfg.max_new_tokens, cfg.temperature,
                                                  seed=cfg.seed * 1_000_003 + self.num_updates * len(ids),
                                                  eos_token_id=eos, top_p=cfg.top_p)
        stale = {s.policy_step for s in samples} - {self.num_updates}
        if stale:  # the loss would weigh these samples as the current policy's
            raise SyncError(f"rollouts for update {self.num_updates} came from rollout workers holding policy step "
                            f"{sorted(stale)}")
        rows = [(s.prompt_ids, s.response_ids, s.logprobs, eos not in s.response_ids) for s in samples]
        return expanded, layout_rollouts(rows, self.tokenizer, self.device)

    # ------------------------------------------------------------- evaluation and summary
    def evaluate(self, problems: int | None = None, samples: int | None = None) -> dict[str, Any]:
        """Pass@1 / Pass@4 and mean reward on held-out problems (see `evaluation.evaluate`)."""
        n = problems or self.config.eval_problems
        if self._eval_pool is None or self._eval_size != n:
            self._eval_pool, self._eval_size = distinct_problems(self.task, n, self.config.seed), n
        return evaluate(self.model, self.tokenizer, self.task, self._eval_pool, samples or self.config.eval_samples,
                        self.config, self.num_updates)

    def _evaluate_and_log(self, bar: tqdm | None = None) -> dict[str, Any] | None:
        self._evaluated_at = self.num_updates
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
        summary = summarize(records, self.policy_info)
        summary["plots"] = [str(p) for p in plot_run(records, self.run_dir)]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if self.progress:
            print(format_summary(summary, self.config))
        return summary

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Weights (safetensors) + optimizer, controller, scheduler and RNG state (see `checkpoint.py`)."""
        state = {
            "update": self.num_updates, "baseline": self.baseline, "evaluated_at": self._evaluated_at,
            "optimizer": self.optimizer.state_dict(),
            "controller": self.controller.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "start_checksum": self.policy_info["checksum"],
        }
        return save_checkpoint(self.run_dir, self.model, state, self.config.to_dict(), self.rank, self.world)

    def load_checkpoint(self) -> None:
        """Continue from ``run_dir/checkpoint`` exactly where it stopped.

        Rollout workers and a vLLM engine are resynced to the checkpoint's weights before any
        rollout. The checkpoint holds every weight, so a starting policy that differs from the one the
        run started from (a warm-start cache rebuilt since, or another machine) only matters
        when the run's KL penalty takes it as its reference: then the checkpoint is refused.
        The summary keeps naming the weights the run started from.

        Raises:
            CheckpointError: the checkpoint is missing or a file of it is damaged, or the run has
                a KL reference and the starting policy loaded now is not the one it started from
                (nothing loaded).
            NoWorkersLeftError: no rollout worker took the checkpoint's weights.
            ChecksumMismatchError: the vLLM engine does not hold them after the resync.
        """
        start = self.policy_info["checksum"] if self.reference is not None else None
        state = load_checkpoint(self.run_dir, self.model, self.rank, self.world, start_checksum=start)
        self.policy_info["checksum"] = state.get("start_checksum", self.policy_info["checksum"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.controller.load_state_dict(state["controller"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.num_updates, self.baseline = state["update"], state["baseline"]
        self._evaluated_at = state.get("evaluated_at", -1)  # absent from checkpoints of older versions
        if isinstance(self.workers, VLLMPolicy):  # the engine holds the checkpoint's weights, verified
            got = self.workers.resync(str(self.run_dir / "checkpoint" / "model.safetensors"), self.num_updates)
            if got != self.workers.trainer_checksum():
                raise ChecksumMismatchError(f"vLLM engine after resume: checksum {got} differs from the trainer's "
                                            f"{self.workers.trainer_checksum()}")
        elif self.workers is not None:
            self.workers.resync(self.num_updates)
        if self.rank == 0:  # metrics written after the checkpoint are dropped: the log matches the run
            self.log.truncate(self.num_updates, evaluated=self._evaluated_at == self.num_updates)

    def close(self) -> None:
        """Stop the rollout workers (if any)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    # ------------------------------------------------------------- data parallelism
    def _sum(self, values: list[float]) -> list[float]:
        return sum_over_ranks(values, self.world, self.device)

    def _agree_to_stop(self, stop: _StopAtBoundary) -> bool:
        """Ranks agree on stopping (Ctrl-C reaches them at slightly different times)."""
        if self.world > 1:
            stop.requested = self._sum([float(stop.requested)])[0] > 0
        return stop.requested


def _start_vllm(model: nn.Module, optimizer: LoGRAOptimizer, config: RLConfig, run_dir: Path) -> VLLMPolicy:
    """A colocated vLLM engine over the initial policy (saved to ``run_dir/vllm-policy``), in the
    trainer's dtype so every delta's checksum is verified in the engine."""
    folder = run_dir / "vllm-policy"
    model.save_pretrained(folder)
    dtype = str(next(p for p in model.parameters()).dtype).replace("torch.", "")
    llm = make_engine(str(folder), dtype=dtype, seed=config.seed)
    engine = VLLMPolicy(llm, config.logra, step=0, model=model, optimizer=optimizer)
    engine.verify()
    return engine


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _StopAtBoundary:
    """Ctrl-C finishes the current update, then the loop checkpoints and stops cleanly.

    A second Ctrl-C interrupts at once. Only the main thread can install the handler;
    elsewhere Ctrl-C keeps its default behaviour.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handler(self, signum: int, frame: object) -> None:
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
