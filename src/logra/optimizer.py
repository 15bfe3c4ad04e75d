"""`LoGRAOptimizer`: update rules on gradient sketches, with a propose/apply split.

This module is wiring. The sketches come from `logra.sketch`, the projections from
`logra.projection.Projector`, each update rule and its state from `logra.rules`, the
step size from `logra.rules.step_scales`, and the merge and the delta from
`logra.delta`. ``propose()`` turns the accumulated sketches into the step that would be
taken (weights and optimizer state unchanged); a controller may then choose a scale
``α``; ``apply(proposal, α)`` merges ``W ← W - U A`` with ``U = α·D`` in ``factor_dtype``,
commits the rules' state, advances the step, refreshes the projections and returns the
`PolicyDelta` a rollout engine needs. ``step()`` is ``apply(propose())``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from .config import LoGRAConfig
from .delta import PolicyDelta, merge_update, set_policy_step, weights_checksum
from .errors import NonFiniteSketchError, StaleProposalError
from .projection import Projector, projection_key, stable_name
from .rules import (
    AdamRule,
    FirstMoment,
    SketchRule,
    make_rule,
    next_first_moment,
    row_adam,
    sketch_update_sq_norm,
    step_scales,
)
from .sketch import SketchSet, SketchTarget


def _is_sharded(weight: torch.Tensor) -> bool:
    """A DTensor (FSDP2 row sharding): no single process holds the whole weight."""
    return hasattr(weight, "device_mesh")


def _all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``. Min and max propagate NaN and show ±Inf, and need no copy of
    ``x``: ``torch.isfinite`` of the whole sketch buffer would allocate 1.75× its size."""
    return x.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


@dataclass(eq=False)
class Proposal:
    """The step `LoGRAOptimizer.propose` would take: ``ΔW = -(D A) - decay·W`` per target.

    Attributes:
        step: the optimizer's update count when proposed; `apply` refuses it afterwards.
        directions: per target, ``D`` ``[out, r]`` fp32, already including the step size
            (emptied by `LoGRAOptimizer.apply`, which consumes the proposal).
        decay: decoupled weight decay coefficient of the step (0 unless lr mode with wd).
        sketch_norm: global ``‖S A‖_F`` of the (clipped) sketched gradient.
        update_norm: global ``‖D A‖_F`` of the proposed update.
    """

    step: int
    directions: dict[str, torch.Tensor]
    decay: float
    sketch_norm: float
    update_norm: float
    _owner: LoGRAOptimizer = field(repr=False)
    _pending: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # the rule's state to commit
    _clip: float = field(repr=False, default=1.0)
    _beta1: float | None = field(repr=False, default=None)

    def perturbed(self, eps: torch.Tensor) -> AbstractContextManager[None]:
        """Within the block the model computes at ``θ + ε·Δ`` (a dual ``ε`` gives the tangent).

        Raises:
            StaleProposalError: the proposal was applied (or the optimizer stepped since).
        """
        if self.step != self._owner.num_updates:
            raise StaleProposalError(f"proposal of update {self.step} is stale: the optimizer is at update "
                                     f"{self._owner.num_updates}")
        return self._owner._sketches.probing(eps, self.directions, self.decay)


class LoGRAOptimizer(torch.optim.Optimizer):
    """Low-rank gradient-sketch optimizer (LoGRA, arXiv:2610.06647).

    Installs sketches on ``model``'s target layers (their weights get
    ``requires_grad=False``), then behaves like a ``torch.optim.Optimizer``: call
    ``loss.backward()``, ``step()``, ``zero_grad()``. Divide the loss by the number of
    loss-bearing tokens of the whole update (as for any optimizer) so that gradient
    accumulation over micro-batches sums to a mean.

    ``param_groups[0]`` holds the sketched weights and the live values of ``lr``,
    ``update_ratio``, ``weight_decay``, ``beta2``, ``eps`` and ``beta1`` (schedulers may
    edit them); with ``non_target`` ``'adamw'``/``'sketch'``, ``param_groups[1]`` is the
    AdamW group of the remaining trainable parameters.

    Attributes:
        config: the `LoGRAConfig`.
        model: the model whose targets are sketched.
        rule: the update rule and its state (`logra.rules`: RowAdam, Adam or SGD).
        first_moment: the `logra.rules.FirstMoment` with ``beta1`` > 0, else None.
        projector: the `logra.projection.Projector` of the projections in force.
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig | None = None) -> None:
        self.config = config = config or LoGRAConfig()
        self.model = model
        self._sketches = SketchSet(model, config.target_modules, config.rank, config.non_target == "sketch",
                                   input_statistics=config.column_scale == "input",
                                   share_inputs=config.share_projections, non_target=config.non_target)
        targets = self._sketches.targets
        low_precision = [n for n, t in targets.items() if t.weight.dtype in (torch.bfloat16, torch.float16)]
        if low_precision:
            warnings.warn(
                f"{len(low_precision)} target weights are {targets[low_precision[0]].weight.dtype}: tiny updates "
                "are rounded away when merged. Keep fp32 weights and compute in bf16 with autocast.",
                stacklevel=2,
            )
        group = {
            "params": [t.weight for t in targets.values()], "name": "logra", "lr": config.lr,
            "update_ratio": config.update_ratio, "weight_decay": config.weight_decay,
            "beta2": config.beta2, "eps": config.eps, "beta1": config.beta1,
        }
        super().__init__([group], {})
        target_ids = {id(t.weight) for t in targets.values()}
        rest = [p for p in model.parameters() if id(p) not in target_ids and p.requires_grad]
        self._dense: torch.optim.AdamW | None = None
        if config.non_target == "freeze":
            for p in rest:
                p.requires_grad_(False)
        elif rest:
            self._dense = torch.optim.AdamW(rest, lr=config.non_target_lr, betas=(0.9, 0.95), weight_decay=0.0)
            self._dense.param_groups[0]["name"] = "non_target_adamw"
            self.param_groups.append(self._dense.param_groups[0])
        # the stable names under which the dense part of each delta travels
        dense_ids = {id(p) for p in self.dense_parameters()}
        self._dense_names = {id(p): stable_name(n) for n, p in model.named_parameters() if id(p) in dense_ids}
        self._stream_started = False  # whether a delta with the starting weights' digest was made
        self._refitted = False  # fitted projections re-fitted since the last delta: the next carries them
        self._step = 0
        rows = self._sketches.sketch_rows
        self.rule: SketchRule = make_rule(config.optimizer, {n: t.out_features for n, t in targets.items()}, rows,
                                          self._sketches.views, config.torch_moment_dtype, config.second_moment,
                                          config.second_moment_refresh)
        self.first_moment = (FirstMoment(rows, self._sketches.views, config.torch_moment_dtype,
                                         config.momentum_refresh) if config.beta1 > 0 else None)
        self.projector = Projector(config, targets)
        self._refresh(after_update=False)

    @property
    def needs_fit(self) -> bool:
        """True while ``distribution='inputs'`` projections wait for `fit_projections`: before
        the first update and, with refresh windows, at the first update of each window."""
        return self.projector.needs_fit

    def fit_projections(self, batches: Iterable[Mapping[str, torch.Tensor]]) -> int:
        """Fit the projections of ``distribution='inputs'`` to the inputs the model sees.

        Runs ``model(**batch)`` for every batch without gradients (padding excluded through
        the batch's ``attention_mask``) and gives each ``nn.Linear`` target the projection
        ``√(in/r)·Qᵀ``, ``Q`` the top-``r`` eigenvectors of ``Σ x xᵀ`` over its input tokens
        (`logra.projection.InputMoment`). The projections are saved in `state_dict` and travel
        with the first delta of each stream and the first delta after each re-fit. Call it
        whenever `needs_fit` is True, before that update's backward, with representative
        prompts (``logra train`` passes that update's): before the first update, and with
        ``refresh=True`` at the first update of every ``refresh_every``-update window, where
        the first moment follows the new projections (``m·(A_old A_oldᵀ)⁻¹A_old·A_newᵀ`` with
        ``momentum_refresh='transfer'``) and the element-wise second moment of
        ``optimizer='adam'`` is reset or averaged per row (``second_moment_refresh``). Under
        data parallelism pass the same batches on every rank, so that every rank fits the
        same projections. Returns the number of tokens fitted on.

        Raises:
            ValueError: the config's distribution is not ``'inputs'``, the projections in
                force are this update's already, a target saw no tokens, or layers that
                share a fit (q/k/v, gate/up) read different inputs (cross-attention). A target
                that saw fewer tokens than the rank is fitted with a warning.
        """
        cfg = self.config
        if cfg.distribution != "inputs":
            raise ValueError(f"fit_projections needs LoGRAConfig.distribution='inputs', not "
                             f"{cfg.distribution!r} (those projections are drawn from the seed)")
        if not self.needs_fit:
            when = (f" and at the first update of each {cfg.refresh_every}-update refresh window" if cfg.refresh
                    else " once")
            raise ValueError(f"fit_projections after {self._step} updates: the projections are fitted before the "
                             f"first update{when}; those in force are this update's (a resumed optimizer has "
                             "them from its state)")
        transfer = bool(self._step) and self.first_moment is not None and self.first_moment.transfers
        tokens, bases = self.projector.fit(self.model, batches, self._step, self.param_groups[0]["beta2"],
                                           bases=transfer)
        if self._step:  # a re-fit: state kept in the last window's coordinates follows the new ones
            self.rule.on_refresh()
            if self.first_moment is not None:
                self.first_moment.on_refresh(bases or {})
            self._refitted = True
        return tokens

    # ------------------------------------------------------------------ accessors
    @property
    def num_updates(self) -> int:
        """Updates applied so far (also the index of the next one)."""
        return self._step

    @property
    def sketch_buffer(self) -> torch.Tensor:
        """The shared ``[Σ out, r]`` fp32 buffer of all sketches, the one tensor data
        parallelism all-reduces (with ``column_scale='input'`` a few more rows hold the
        summed input statistics)."""
        return self._sketches.buffer

    @property
    def targets(self) -> list[str]:
        """Stable names of the sketched weights."""
        return list(self._sketches.targets)

    def sketches(self) -> dict[str, torch.Tensor]:
        """Per target, its sketch ``S = G Aᵀ`` (``[out, r]`` fp32 views, not copies)."""
        return {n: t.sketch for n, t in self._sketches.targets.items()}

    def sketch_target(self, name: str) -> SketchTarget:
        """The record of target ``name``: its weight, the modules that read it, its sketch
        and projection (row sharding repoints ``weight`` at a local shard)."""
        return self._sketches.targets[name]

    def projection(self, name: str) -> torch.Tensor | None:
        """The projection ``A`` (``[r, in]`` fp32) currently in force for target ``name``; None
        for a ``distribution='inputs'`` target before `fit_projections`. Read it only: where
        the projection is stored in fp32 (fitted, Gaussian, orthogonal) this is the tensor in
        force itself (Rademacher ones, stored as packed sign bits, are unpacked afresh)."""
        return self._sketches.targets[name].projection

    def fitted_projections(self) -> dict[str, torch.Tensor]:
        """The projections fitted to the inputs, ``[r, in]`` fp32 by input group
        (`logra.projection.projection_key` with ``shared=True``): what the first delta of a
        stream carries and what a full-weight resync must send beside the weights, since a
        receiver cannot rebuild them from a seed. Empty unless ``distribution='inputs'`` and
        fitted, and while a refresh window awaits its fit (the next delta carries the new ones).
        Copies: a receiver in this process keeps them apart from the optimizer's."""
        projections = {projection_key(n, True): self.projection(n) for n in self.projector.fitted_names}
        return {k: a.clone() for k, a in projections.items() if a is not None}

    def describe(self) -> str:
        """One line: what is sketched and which 2-D weights are left to ``non_target``
        (logged once, at construction, on the ``logra.sketch`` logger)."""
        return self._sketches.describe()

    def momenta(self) -> dict[str, torch.Tensor]:
        """Per target, its first moment ``[out, r]`` (views; empty without ``beta1``)."""
        return self.first_moment.views if self.first_moment is not None else {}

    def dense_parameters(self) -> list[nn.Parameter]:
        """Non-target parameters trained by the internal AdamW (empty with 'freeze')."""
        return list(self._dense.param_groups[0]["params"]) if self._dense else []

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The optimizer's own tensors by memory category, for `logra.memory.track_memory`.

        The sketch buffer replaces gradients; the rules' moments and the projector's
        tensors are state.
        """
        state = self.rule.memory() + self.projector.memory()
        if self.first_moment is not None:
            state.append(self.first_moment.m)
        if self._dense is not None:
            state += [v for s in self._dense.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"gradients": [self._sketches.buffer], "optimizer": state}

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sketches and the dense gradients of non-target parameters."""
        self._sketches.zero_()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def propose(self, weight_norms: torch.Tensor | None = None) -> Proposal:
        """The step that would be taken now; weights and optimizer state are unchanged.

        ``weight_norms``: the fp32 ``‖W_l‖_F`` of every target, in `targets` order, for the
        update-ratio step size (default: from the weights here; a row-sharded trainer
        passes norms reduced over its ranks).

        Raises:
            NonFiniteSketchError: a sketch or dense gradient holds NaN/Inf.
            RuntimeError: the projections await `fit_projections` (`needs_fit`).
        """
        if self.needs_fit:  # no sketch was taken against this update's projections
            raise RuntimeError(f"update {self._step}: the projections await fit_projections(batches) "
                               "(distribution='inputs', before the first update and each refresh window's)")
        with record_function("logra.propose"):  # a named range: `logra bench memory` times it
            return self._propose(weight_norms)

    def _propose(self, weight_norms: torch.Tensor | None) -> Proposal:
        dense_grads = [p.grad for p in self.dense_parameters() if p.grad is not None]
        if not _all_finite(self._sketches.buffer) or not all(_all_finite(g) for g in dense_grads):
            raise NonFiniteSketchError(
                f"non-finite gradient sketch before update {self._step} (NaN/Inf loss?); nothing was changed")
        group = self.param_groups[0]
        targets = self._sketches.targets
        gram = self.projector.gram
        sketch_sq: dict[str, torch.Tensor] = {}

        def sketch_norm() -> float:
            sq = sum(sketch_sq[n] for n in targets) + sum(g.square().sum() for g in dense_grads)
            return math.sqrt(max(float(sq), 0.0))

        clip = 1.0
        if self.config.max_grad_norm is not None:  # the clip scales every direction: all norms first
            sketch_sq = {n: sketch_update_sq_norm(t.sketch, gram(n)) for n, t in targets.items()}
            norm = sketch_norm()
            if norm > self.config.max_grad_norm:
                clip = self.config.max_grad_norm / (norm + 1e-6)
        beta1 = group["beta1"] if self.first_moment is not None else None
        directions, pending, layer_sq = {}, {}, []
        for name, target in targets.items():  # one target at a time: no second [Σ out, r] buffer
            a_gram = gram(name)
            if name not in sketch_sq:
                sketch_sq[name] = sketch_update_sq_norm(target.sketch, a_gram)
            s = target.sketch * clip if clip != 1.0 else target.sketch
            m = self.first_moment.corrected(name, target.sketch, beta1, clip) if beta1 is not None else None
            directions[name], state = self.rule.direction(name, s, target.sketch, clip, m, self._step + 1,
                                                          group["beta2"], group["eps"])
            if state is not None:
                pending[name] = state
            layer_sq.append(sketch_update_sq_norm(directions[name], a_gram))
        if weight_norms is None and group["update_ratio"] is not None:
            weight_norms = torch.stack(
                [torch.linalg.vector_norm(t.weight, dtype=torch.float32) for t in targets.values()])
        size = step_scales(layer_sq, weight_norms, [t.weight.numel() for t in targets.values()],
                           update_ratio=group["update_ratio"], trust_ratio=self.config.trust_ratio,
                           lr=group["lr"], weight_decay=group["weight_decay"])
        for d, scale in zip(directions.values(), size.scales, strict=True):
            d.mul_(scale)
        return Proposal(step=self._step, directions=directions, decay=size.decay, sketch_norm=sketch_norm(),
                        update_norm=size.update_norm, _owner=self, _pending=pending, _clip=clip, _beta1=beta1)

    @torch.no_grad()
    def apply(self, proposal: Proposal, alpha: float = 1.0) -> PolicyDelta:
        """Merge ``α`` times ``proposal`` into the weights and advance one update.

        Returns the `PolicyDelta` that reproduces exactly this change elsewhere. The
        sketches are consumed (zeroed): they were taken against projections that are
        now replaced. So is ``proposal``: its directions are released target by target as
        they are merged, so that they and the delta's factors never exist in full together.

        Raises:
            StaleProposalError: the proposal is from another optimizer or an earlier step.
            ValueError: ``alpha`` is negative or non-finite.
        """
        if proposal._owner is not self:
            raise StaleProposalError("this proposal was made by another optimizer")
        if proposal.step != self._step:
            raise StaleProposalError(
                f"stale proposal: made at update {proposal.step}, optimizer is at update {self._step}")
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        dtype = self.config.torch_factor_dtype
        decay = alpha * proposal.decay
        factors = {}
        targets = self._sketches.targets
        base = None
        fitted = list(self.projector.fitted_names)
        # fitted projections cannot be rebuilt from a seed: the first delta of a stream carries
        # them, and the first after each re-fit
        carried = self.fitted_projections() if self._refitted or not self._stream_started else {}
        if not self._stream_started and not any(_is_sharded(w) for w in self.param_groups[0]["params"]):
            # once per stream: ties it to the weights it starts from (row-sharded weights skip it)
            base = weights_checksum(self.model, sorted(targets))
        with record_function("logra.merge"):
            for name, target in self._sketches.targets.items():
                # released as merged: the factors U replace the directions, not add to them
                u = (proposal.directions.pop(name) * alpha).to(dtype)
                merge_update(target.weight, u, target.projection, decay)
                factors[name] = u
        beta2 = self.param_groups[0]["beta2"]
        sketches = self.sketches()
        self.rule.commit(proposal._pending, sketches, proposal._clip, beta2)
        if self.first_moment is not None:
            self.first_moment.commit(sketches, proposal._beta1, proposal._clip)
        if self.projector.input_means:
            self.projector.fold_input_statistics(beta2)
        dense = {}
        if self._dense is not None:
            self._dense_step(alpha, proposal._clip)
            dense = {self._dense_names[id(p)]: p.detach().clone() for p in self.dense_parameters()}
        delta = PolicyDelta(
            step=self._step, projection_index=self.projector.index, sync=self.config.sync_fields(),
            factors=factors, decay=decay, column_scales=dict(self.projector.column_scales), dense=dense,
            shapes={n: [t.out_features, t.in_features] for n, t in targets.items()}, base_checksum=base,
            dtype=str(next(iter(targets.values())).weight.dtype).removeprefix("torch.") if base else None,
            fitted=fitted, projections=carried,
        )
        self._stream_started, self._refitted = True, False
        self._step += 1
        set_policy_step(self.model, self._step)
        with record_function("logra.refresh"):
            self._refresh(after_update=True)
        self._sketches.zero_()
        return delta

    def _dense_step(self, alpha: float, clip: float) -> None:
        """The non-target AdamW's step, scaled by ``α`` (its displacement is linear in lr)."""
        group = self._dense.param_groups[0]
        lr = group["lr"]
        group["lr"] = lr * alpha
        if clip != 1.0:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(clip)
        try:
            self._dense.step()
        finally:
            group["lr"] = lr

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """``apply(propose())``: one full-size update (no KL control)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply(self.propose())
        return loss

    def _refresh(self, after_update: bool) -> None:
        """Install the projections in force now; after an update, state kept in the old
        projections' coordinates follows them (`SketchRule.on_refresh`, `FirstMoment.on_refresh`)."""
        transfer = after_update and self.first_moment is not None and self.first_moment.transfers
        bases = self.projector.install(self._step, self.param_groups[0]["beta2"], bases=transfer)
        if bases is None or not after_update:
            return
        self.rule.on_refresh()
        if self.first_moment is not None:
            self.first_moment.on_refresh(bases)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Tensors and plain values only: loads with ``torch.load(weights_only=True)``.

        Seeded projections are not stored, they are rebuilt from the seeds; fitted ones
        (``distribution='inputs'``) are.
        """
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        state = {"num_updates": self._step, "sync": self.config.sync_fields(), "hyper": hyper,
                 "layout": self._layout(), "momentum": None, "element_v": None}
        state.update(self.rule.state_dict())
        if self.first_moment is not None:
            state.update(self.first_moment.state_dict())
        state.update(self.projector.state_dict())
        state["non_target"] = self._dense.state_dict() if self._dense is not None else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a `state_dict` saved by an optimizer with the same sync fields, targets
        and options. Everything is checked before anything changes: a refused state
        (`ValueError`, naming what differs) leaves this optimizer as it was."""
        self._check_state(state_dict)
        # as torch optimizers do, the state's step settings win over the config's: said, since
        # a resume with a changed config would otherwise run with values it does not show
        ours = self.param_groups[0]
        changed = [f"{k}={v!r} (config: {ours[k]!r})" for k, v in state_dict["hyper"].items()
                   if k in _CONFIG_HYPER and v != ours[k]]
        if changed:
            warnings.warn(f"optimizer state restores its own {', '.join(changed)}; set "
                          "optimizer.param_groups[0][name] after loading to change them", stacklevel=2)
        for saved, ours in ((state_dict.get("momentum"), self.first_moment and self.first_moment.m),
                            (state_dict.get("element_v"), getattr(self.rule, "v", None))):
            if torch.is_tensor(saved) and torch.is_tensor(ours) and saved.dtype != ours.dtype:
                warnings.warn(f"optimizer state has {saved.dtype} moments and moment_dtype is {ours.dtype}: "
                              "they are cast, so this resume is not bitwise", stacklevel=2)
                break
        if self._dense is not None:  # torch checks the groups and sizes before it changes anything
            self._dense.load_state_dict(state_dict["non_target"])
            self.param_groups[1] = self._dense.param_groups[0]
        self.rule.load_state(state_dict)
        if self.first_moment is not None:
            self.first_moment.load_state(state_dict)
        self.param_groups[0].update(state_dict["hyper"])
        self._step = state_dict["num_updates"]
        set_policy_step(self.model, self._step)
        self._stream_started = False  # the resumed stream is tied to the weights it resumes from
        self._refitted = False
        self._sketches.zero_()
        self.projector.load_state(state_dict, self._step, self.param_groups[0]["beta2"])

    def _layout(self) -> list[list[Any]]:
        """``[name, rows]`` of every target in buffer order: the flat moments' layout."""
        return [[name, t.sketch.shape[0]] for name, t in self._sketches.targets.items()]

    def _check_state(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` if `load_state_dict` must refuse ``state``; changes nothing."""
        mismatch = self.config.sync_mismatch(state["sync"])
        if mismatch is not None:
            key, theirs, ours = mismatch
            raise ValueError(f"optimizer state was saved with {key}={theirs!r}, config has {ours!r}")
        # the first moment and the element-wise second moment are flat over every target's
        # rows: of the same size, another set of targets would load without complaint
        saved, ours = state.get("layout"), self._layout()  # absent from states of older versions
        if saved is not None and [list(e) for e in saved] != ours:
            theirs, mine = next((a, b) for a, b in zip([*saved, None], [*ours, None], strict=True) if a != b)
            raise ValueError(f"optimizer state was saved for other targets: first difference {theirs} (saved) vs "
                             f"{mine} (this optimizer's [name, rows])")
        if (state["non_target"] is None) != (self._dense is None):
            raise ValueError("optimizer state and this optimizer disagree on non-target training")
        if (state.get("momentum") is None) != (self.first_moment is None):
            raise ValueError("optimizer state and this optimizer disagree on the first moment (beta1 > 0)")
        if (state.get("element_v") is not None) != isinstance(self.rule, AdamRule):
            raise ValueError("optimizer state and this optimizer disagree on optimizer='adam'")
        self.rule.check_state(state)
        if self.first_moment is not None:
            self.first_moment.check_state(state)
        self.projector.check_state(state)
        if self.projector.fitted_keys and state["num_updates"] and not state.get("fitted_projections"):
            raise ValueError(f"optimizer state after {state['num_updates']} updates has no fitted projections "
                             "(distribution='inputs'): the update it continues cannot be rebuilt")

    def remove(self) -> None:
        """Uninstall the sketches: target weights get their normal forward and gradients back."""
        self._sketches.remove()


class DenseRowAdam(torch.optim.Optimizer):
    """LoGRA's update rule on the exact dense gradient: a diagnostic baseline, no projection.

    For every weight LoGRA would sketch (same ``target_modules``; lm_head and input
    embeddings too with ``non_target='sketch'``): `logra.rules.row_adam` on the gradient
    (the per-row second moment, the direction renormalised to the layer's gradient norm),
    and the update-ratio step size of `logra.rules.step_scales` (``config.trust_ratio`` as
    in `LoGRAOptimizer`). With ``config.beta1`` > 0 an element-wise first moment (dense, the
    size of the weights) is the numerator, as in Adam. Every other trainable parameter
    gets ``torch.optim.AdamW`` (betas 0.9/0.95) at ``non_target_lr`` (frozen with
    ``'freeze'``). It isolates the projection: with the same settings `LoGRAOptimizer`
    differs from it by ``G → S A`` (and the first moment is element-wise here, in sketch
    space there).
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig) -> None:
        from .sketch import check_materialized, find_targets

        if config.update_ratio is None:
            raise ValueError("DenseRowAdam needs LoGRAConfig.update_ratio")
        if config.optimizer != "row_adam" or config.moment_dtype != "float32":
            raise ValueError("DenseRowAdam is RowAdam with fp32 state: it needs LoGRAConfig.optimizer='row_adam' and "
                             f"moment_dtype='float32' (got {config.optimizer!r}, {config.moment_dtype!r}; in logra "
                             "train: --logra.optimizer row_adam)")
        if config.max_grad_norm is not None or config.second_moment != "sketch":
            raise ValueError("DenseRowAdam implements neither max_grad_norm nor second_moment='momentum' "
                             "(its second moment comes from the gradient, as Adam's): unset them")
        self.config = config
        check_materialized(model)
        groups = find_targets(model, config.target_modules, config.non_target == "sketch")
        targets = []
        for modules in groups.values():
            w = modules[0][1].weight
            if all(w is not t for t in targets):
                targets.append(w)
        ids = {id(w) for w in targets}
        rest = [p for p in model.parameters() if id(p) not in ids and p.requires_grad]
        if config.non_target == "freeze":
            for p in rest:
                p.requires_grad_(False)
            rest = []
        super().__init__([{"params": targets, "name": "row_adam"}], {})
        self._dense: torch.optim.AdamW | None = None
        if rest:
            self._dense = torch.optim.AdamW(rest, lr=config.non_target_lr, betas=(0.9, 0.95), weight_decay=0.0)
            self._dense.param_groups[0]["name"] = "non_target_adamw"
            # in param_groups too: `DenseProposal` displaces every parameter the step moves
            self.param_groups.append(self._dense.param_groups[0])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cfg = self.config
        targets = [p for p in self.param_groups[0]["params"] if p.grad is not None]
        directions = []
        for p in targets:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros(())
                state["row_v"] = torch.zeros(p.shape[0], 1, dtype=torch.float32, device=p.device)
                if cfg.beta1 > 0:
                    state["m"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = int(state["step"])
            g = p.grad.float()
            m = None
            if cfg.beta1 > 0:
                state["m"] = next_first_moment(state["m"], g, cfg.beta1, 1.0)
                m = state["m"] / (1 - cfg.beta1**t)
            d, state["row_v"] = row_adam(g, state["row_v"], t, cfg.beta2, cfg.eps, m)
            directions.append(d)
        if targets:
            norms = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) for p in targets])
            size = step_scales([d.square().sum() for d in directions], norms, [p.numel() for p in targets],
                               update_ratio=cfg.update_ratio, trust_ratio=cfg.trust_ratio, lr=0.0, weight_decay=0.0)
            for p, d, scale in zip(targets, directions, size.scales, strict=True):
                p.sub_((d * scale).to(p.dtype))
        if self._dense is not None:
            self._dense.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The row-AdamW state of the targets and the non-target AdamW's own state dict."""
        return {"row_adam": super().state_dict(),
                "non_target": self._dense.state_dict() if self._dense is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore `state_dict`."""
        if "row_adam" not in state_dict or (state_dict["non_target"] is None) != (self._dense is None):
            raise ValueError("this state was not saved by a DenseRowAdam with the same non_target mode")
        if self._dense is not None:
            self._dense.load_state_dict(state_dict["non_target"])
        super().load_state_dict(state_dict["row_adam"])
        if self._dense is not None:  # torch's load makes new group dicts: share AdamW's again
            self.param_groups[1] = self._dense.param_groups[0]


#: the LoGRA group's settings taken from the config that no scheduler changes (``lr`` is
#: scheduled by trainers that wrap the optimizer)
_CONFIG_HYPER = ("update_ratio", "weight_decay", "beta1", "beta2", "eps")
