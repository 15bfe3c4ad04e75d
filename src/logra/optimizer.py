"""`LoGRAOptimizer`: RowAdam (or SGD) on gradient sketches, with a propose/apply split.

``propose()`` turns the accumulated sketches into the step that would be taken (weights
and optimizer state unchanged); a controller may then choose a scale ``α``;
``apply(proposal, α)`` merges ``W ← W - U A`` with ``U = α·D`` in ``factor_dtype``,
advances the step, refreshes the projections and returns the `PolicyDelta` a rollout
engine needs. ``step()`` is ``apply(propose())`` for ordinary training loops.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from .config import LoGRAConfig
from .delta import PolicyDelta, merge_update, set_policy_step
from .errors import NonFiniteSketchError, StaleProposalError
from .projection import make_projection, pack_signs, projection_index, projection_key, projection_seed, rademacher_signs
from .sketch import SketchSet, SketchTarget

_TINY = torch.finfo(torch.float32).tiny
_owner_ids = itertools.count()


def row_adam_direction(
    s: torch.Tensor, v: torch.Tensor, t: int, beta2: float, eps: float, m: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One RowAdam step on a sketch: returns ``(D, v_new)`` and changes nothing.

    ``s`` is ``[out, r]`` (already divided by the token count), ``v`` the per-row second
    moment ``[out, 1]``, ``t`` the 1-based step. ``D`` has the Frobenius norm of ``s``.
    With ``m`` (a bias-corrected first moment, same shape), the second moment is still
    updated from ``s`` but ``m`` is the numerator and ``D`` has the norm of ``m``.
    """
    v_new = v * beta2 + (1.0 - beta2) * s.square().mean(dim=1, keepdim=True)
    rms = (v_new / (1.0 - beta2**t)).sqrt()
    den = rms + torch.clamp(eps * rms.mean(), min=_TINY)
    x = s if m is None else m
    # Scale by min(den)/den rather than 1/den: no overflow for rows with tiny RMS.
    d = x * (den.min() / den)
    s_norm, d_norm = torch.linalg.vector_norm(x), torch.linalg.vector_norm(d)
    if d_norm > 0:
        d = d * (s_norm / d_norm)
    return d, v_new


def layer_step_norms(update_ratio: float, trust_ratio: str, weights: list[torch.Tensor]) -> list[float]:
    """Each target's ``‖ΔW_l‖_F`` under a per-layer trust ratio.

    ``'layer'``: ``update_ratio·‖W_l‖_F``. ``'element'``: ``update_ratio·RMS(W)·√numel_l`` with
    the RMS over all targets together, so every element moves by ``update_ratio·RMS(W)`` on
    average (as Adam moves each by about its learning rate) and the total is the paper's
    global ``update_ratio·‖W‖_F``.
    """
    norms = [float(torch.linalg.vector_norm(w, dtype=torch.float32)) for w in weights]
    if trust_ratio == "layer":
        return [update_ratio * n for n in norms]
    if trust_ratio == "element":
        rms = math.sqrt(sum(n * n for n in norms) / sum(w.numel() for w in weights))
        return [update_ratio * rms * math.sqrt(w.numel()) for w in weights]
    raise ValueError(f"no per-layer step norms for trust_ratio={trust_ratio!r}")


def _gram(a: torch.Tensor) -> torch.Tensor:
    """``A Aᵀ`` (``[r, r]``)."""
    return a @ a.T


def adam_direction(x: torch.Tensor, v: torch.Tensor, k: int, beta2: float, eps: float) -> torch.Tensor:
    """Element-wise Adam on sketch coordinates: ``x / (√v̂ + ε·mean √v̂)`` with ``v̂ = v/(1-β2^k)``,
    rescaled to the Frobenius norm of ``x`` (as `row_adam_direction`). ``v`` is the updated
    second moment (already including this update)."""
    rms = (v / (1.0 - beta2**k)).sqrt_()
    den = rms.add_(torch.clamp(eps * rms.mean(), min=_TINY))
    d = x * (den.min() / den)  # min/den: no overflow where v is tiny
    x_norm, d_norm = torch.linalg.vector_norm(x), torch.linalg.vector_norm(d)
    return d * (x_norm / d_norm) if d_norm > 0 else d


def _all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``. Min and max propagate NaN and show ±Inf, and need no copy of
    ``x``: ``torch.isfinite`` of the whole sketch buffer would allocate 1.75× its size."""
    return x.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


# The next moments, in new fp32 tensors from the stored state (fp32 or bf16). `propose` and
# `apply` both call these, so the state stores exactly the values the proposal used.
def _next_first_moment(m: torch.Tensor, s: torch.Tensor, beta1: float, clip: float) -> torch.Tensor:
    """``β1·M + (1-β1)·clip·S``."""
    return (m.to(torch.float32) * beta1).add_(s, alpha=(1.0 - beta1) * clip)


def _next_element_v(v: torch.Tensor, s: torch.Tensor, beta2: float, clip: float) -> torch.Tensor:
    """``β2·V + (1-β2)·(clip·S)²``, element-wise."""
    return (v.to(torch.float32) * beta2).addcmul_(s, s, value=(1.0 - beta2) * clip * clip)


def _sketch_update_sq_norm(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``‖D A‖_F²`` from the ``r×r`` Gram matrix ``A Aᵀ``, without forming ``D A``."""
    return ((d @ gram) * d).sum()


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
    _second_moments: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
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
    ``update_ratio``, ``weight_decay``, ``beta2`` and ``eps`` (schedulers may edit them);
    with ``non_target`` ``'adamw'``/``'sketch'``, ``param_groups[1]`` is the AdamW group
    of the remaining trainable parameters.
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig | None = None) -> None:
        self.config = config = config or LoGRAConfig()
        self.model = model
        self._sketches = SketchSet(model, config.target_modules, config.rank, config.non_target == "sketch",
                                   input_statistics=config.column_scale == "input",
                                   share_inputs=config.share_projections)
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
        self._uid = next(_owner_ids)
        self._step = 0
        self._second_moments = {
            n: torch.zeros(t.out_features, 1, dtype=torch.float32, device=t.weight.device) for n, t in targets.items()
        }
        # First moment (beta1 > 0): one [Σ out, r] buffer laid out like the sketch buffer.
        self._momentum: torch.Tensor | None = None
        self._momentum_steps = 0  # updates folded into the momentum since it was last zeroed
        if config.beta1 > 0:
            self._momentum = torch.zeros_like(self._sketches.sketch_rows, dtype=config.torch_moment_dtype)
        # optimizer='adam': an element-wise second moment of the sketches, in the coordinates
        # of the projections in force (zeroed when they are redrawn).
        self._element_v: torch.Tensor | None = None
        self._element_v_steps = 0
        if config.optimizer == "adam":
            self._element_v = torch.zeros_like(self._sketches.sketch_rows, dtype=config.torch_moment_dtype)
        # column_scale='input': per target, a running mean of its squared inputs per channel
        # (targets read only as embeddings see no input vectors and keep c = 1).
        self._input_means = {n: torch.zeros_like(t.input_sq) for n, t in targets.items() if t.input_sq is not None}
        self._input_updates = 0
        self._column_scales: dict[str, torch.Tensor] = {}  # the c of the projections in force
        # A Aᵀ of the projections in force by id of the stored projection (kept with it), formed
        # at the first proposal after a refresh: with fixed projections, once per run.
        self._grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._projection_index: int | None = None
        self._refresh_projections()

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

    def projection(self, name: str) -> torch.Tensor:
        """The projection ``A`` (``[r, in]`` fp32) currently in force for target ``name`` (a
        fresh tensor: Rademacher projections are stored as packed sign bits)."""
        return self._sketches.targets[name].projection

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The optimizer's own tensors by memory category, for `logra.memory.track_memory`.

        The sketch buffer replaces gradients; second moments and projections are state.
        """
        targets = self._sketches.targets.values()
        shared = {id(t.stored_projection): t.stored_projection for t in targets}  # shared: count once
        state = list(self._second_moments.values()) + list(shared.values())
        state += list(self._input_means.values()) + list(self._column_scales.values())
        state += [b for b in (self._momentum, self._element_v) if b is not None]
        state += [gram for _, gram in self._grams.values()]
        if self._dense is not None:
            state += [v for s in self._dense.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"gradients": [self._sketches.buffer], "optimizer": state}

    def momenta(self) -> dict[str, torch.Tensor]:
        """Per target, its first moment ``[out, r]`` (views; empty without ``beta1``)."""
        return self._views(self._momentum) if self._momentum is not None else {}

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per target, the rows of a ``[Σ out, r]`` buffer laid out like the sketch buffer."""
        out, offset = {}, 0
        for name, target in self._sketches.targets.items():
            rows = target.sketch.shape[0]  # fixed at install (a row-sharded weight may be swapped in)
            out[name] = buffer[offset: offset + rows]
            offset += rows
        return out

    def dense_parameters(self) -> list[nn.Parameter]:
        """Non-target parameters trained by the internal AdamW (empty with 'freeze')."""
        return list(self._dense.param_groups[0]["params"]) if self._dense else []

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the sketches and the dense gradients of non-target parameters."""
        self._sketches.zero_()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def propose(self) -> Proposal:
        """The step that would be taken now; weights and optimizer state are unchanged.

        Raises:
            NonFiniteSketchError: a sketch or dense gradient holds NaN/Inf.
        """
        with record_function("logra.propose"):  # a named range: `logra bench memory` times it
            return self._propose()

    def _propose(self) -> Proposal:
        buffer = self._sketches.buffer
        dense_grads = [p.grad for p in self.dense_parameters() if p.grad is not None]
        if not _all_finite(buffer) or not all(_all_finite(g) for g in dense_grads):
            raise NonFiniteSketchError(
                f"non-finite gradient sketch before update {self._step} (NaN/Inf loss?); nothing was changed")
        group = self.param_groups[0]
        targets = self._sketches.targets
        # A Aᵀ per target: kept while the projections stay (fixed, or refresh windows); with a
        # refresh after every update, formed target by target so that no two exist at once.
        keep = not self.config.refresh or self.config.refresh_every > 1

        def gram(name: str) -> torch.Tensor:
            return self._cached_gram(targets[name]) if keep else _gram(targets[name].projection)
        sketch_sq: dict[str, torch.Tensor] = {}

        def sketch_norm() -> float:
            sq = sum(sketch_sq[n] for n in targets) + sum(g.square().sum() for g in dense_grads)
            return math.sqrt(max(float(sq), 0.0))

        clip = 1.0
        if self.config.max_grad_norm is not None:  # the clip scales every direction: all norms first
            sketch_sq = {n: _sketch_update_sq_norm(t.sketch, gram(n)) for n, t in targets.items()}
            norm = sketch_norm()
            if norm > self.config.max_grad_norm:
                clip = self.config.max_grad_norm / (norm + 1e-6)
        directions, moments, layer_sq = {}, {}, {}
        t_next = self._step + 1
        # The new moments are formed one target at a time (no second [Σ out, r] buffer).
        beta1 = group["beta1"] if self._momentum is not None else None
        old_momenta = self._views(self._momentum) if beta1 is not None else {}
        correction = 1.0 - beta1 ** (self._momentum_steps + 1) if beta1 is not None else 1.0
        old_element_v = self._views(self._element_v) if self._element_v is not None else {}
        for name, target in targets.items():
            a_gram = gram(name)
            if name not in sketch_sq:
                sketch_sq[name] = _sketch_update_sq_norm(target.sketch, a_gram)
            s = target.sketch * clip if clip != 1.0 else target.sketch
            m = None
            if beta1 is not None:
                m = _next_first_moment(old_momenta[name], target.sketch, beta1, clip).div_(correction)
            if self.config.optimizer == "row_adam":
                v_in = m if (m is not None and self.config.second_moment == "momentum") else s
                directions[name], moments[name] = row_adam_direction(
                    v_in, self._second_moments[name], t_next, group["beta2"], group["eps"], m)
            elif self.config.optimizer == "adam":
                v_new = _next_element_v(old_element_v[name], target.sketch, group["beta2"], clip)
                directions[name] = adam_direction(s if m is None else m, v_new, self._element_v_steps + 1,
                                                  group["beta2"], group["eps"])
            else:
                directions[name] = (s if m is None else m).clone()
            layer_sq[name] = _sketch_update_sq_norm(directions[name], a_gram)
        update_sq = float(sum(layer_sq.values()))
        decay = 0.0
        per_layer = self.config.trust_ratio != "global"
        if group["update_ratio"] is not None and per_layer:
            norms = layer_step_norms(group["update_ratio"], self.config.trust_ratio,
                                     [t.weight for t in targets.values()])
            update_sq = 0.0
            for (name, sq_l), norm_l in zip(layer_sq.items(), norms, strict=True):
                sq_l = float(sq_l)
                scale_l = norm_l / math.sqrt(sq_l) if sq_l > 0 else 0.0
                directions[name].mul_(scale_l)
                update_sq += scale_l * scale_l * sq_l
            scale = 1.0
        elif group["update_ratio"] is not None:
            weight_norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(t.weight, dtype=torch.float32) for t in targets.values()])))
            scale = group["update_ratio"] * weight_norm / math.sqrt(update_sq) if update_sq > 0 else 0.0
        else:
            scale = group["lr"]
            decay = group["lr"] * group["weight_decay"]
        if scale != 1.0 or not per_layer:
            for d in directions.values():
                d.mul_(scale)
        return Proposal(
            step=self._step, directions=directions, decay=decay, sketch_norm=sketch_norm(),
            update_norm=scale * math.sqrt(update_sq), _owner=self, _second_moments=moments, _clip=clip,
            _beta1=beta1,
        )

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
        with record_function("logra.merge"):
            for name, target in self._sketches.targets.items():
                # released as merged: the factors U replace the directions, not add to them
                u = (proposal.directions.pop(name) * alpha).to(dtype)
                merge_update(target.weight, u, target.projection, decay)
                factors[name] = u
        self._second_moments.update(proposal._second_moments)
        # One target at a time: a bf16 state is rounded once, when stored, and no
        # [Σ out, r] fp32 copy is made.
        sketches = self.sketches()
        if proposal._beta1 is not None:
            for name, m in self.momenta().items():
                m.copy_(_next_first_moment(m, sketches[name], proposal._beta1, proposal._clip))
            self._momentum_steps += 1
        if self._element_v is not None:
            beta2 = self.param_groups[0]["beta2"]
            for name, v in self._views(self._element_v).items():
                v.copy_(_next_element_v(v, sketches[name], beta2, proposal._clip))
            self._element_v_steps += 1
        if self._input_means:
            self._fold_input_statistics(self.param_groups[0]["beta2"])
        if self._dense is not None:
            group = self._dense.param_groups[0]
            lr = group["lr"]
            group["lr"] = lr * alpha  # AdamW's displacement is linear in lr
            if proposal._clip != 1.0:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(proposal._clip)
            try:
                self._dense.step()
            finally:
                group["lr"] = lr
        delta = PolicyDelta(
            step=self._step, projection_index=self._projection_index,
            sync=self.config.sync_fields(), factors=factors, decay=decay,
            column_scales=dict(self._column_scales),
        )
        self._step += 1
        set_policy_step(self.model, self._step)
        with record_function("logra.refresh"):
            self._refresh_projections(after_update=True)
        self._sketches.zero_()
        return delta

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """``apply(propose())``: one full-size update (no KL control)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply(self.propose())
        return loss

    def _cached_gram(self, target: SketchTarget) -> torch.Tensor:
        """``A Aᵀ`` of ``target``'s projection in force, formed once per stored projection
        (shared projections share it; a projection set anew gets a new one)."""
        source = target.stored_projection
        entry = self._grams.get(id(source))
        if entry is None or entry[0] is not source:
            entry = self._grams[id(source)] = (source, _gram(target.projection))
        return entry[1]

    # ------------------------------------------------------------------ state
    def _fold_input_statistics(self, beta: float) -> None:
        """Fold this update's mean squared inputs into the running means; reset the sums."""
        for name, mean in self._input_means.items():
            target = self._sketches.targets[name]
            count = float(target.input_count)
            if count:
                mean.mul_(beta).add_(target.input_sq, alpha=(1.0 - beta) / count)
        self._input_updates += 1  # the sums are zeroed with the sketches

    def _next_column_scales(self) -> dict[str, torch.Tensor]:
        """``c = (C / mean(C) + 0.1)^(-1/4)`` per target from the bias-corrected running means."""
        if not self._input_updates:
            return {}
        correction = 1.0 - self.param_groups[0]["beta2"] ** self._input_updates
        scales = {}
        for name, mean in self._input_means.items():
            c = mean / correction
            # the floor keeps silent channels from amplifying the projection's noise without bound
            scales[name] = (c / c.mean().clamp_min(_TINY)).add_(0.1).pow_(-0.25)
        return scales

    def _refresh_projections(self, after_update: bool = False,
                             scales: dict[str, torch.Tensor] | None = None) -> None:
        """Install the projections in force now. ``after_update``: state kept in the old
        projections' coordinates follows them (the first moment is transferred or zeroed,
        the element-wise second moment zeroed). ``scales`` (default: computed from the
        input statistics) are the column scales ``c`` of the new projections ``A·diag(c)``."""
        index = projection_index(self._step, self.config.refresh, self.config.refresh_every)
        if index == self._projection_index:
            return
        cfg = self.config
        momenta = self.momenta() if after_update else {}
        if momenta and cfg.momentum_refresh == "reset":
            self._momentum.zero_()
            self._momentum_steps = 0
            momenta = {}
        scales = self._next_column_scales() if scales is None else scales
        if after_update and self._element_v is not None:
            self._element_v.zero_()  # its coordinates are those of the old projections
            self._element_v_steps = 0
        drawn: dict[str, torch.Tensor] = {}  # by projection key: shared members share the tensor
        for name, target in self._sketches.targets.items():
            key = projection_key(name, cfg.share_projections)
            seed = projection_seed(cfg.seed, index, key)
            old = target.projection if name in momenta else None  # rebuilt only where it is used
            if cfg.distribution == "rademacher" and name not in scales:
                # signs packed as bits: 1/32 of the memory, and `projection` rebuilds the same fp32 bits
                if key not in drawn:
                    signs = rademacher_signs(cfg.rank, target.in_features, seed)
                    drawn[key] = pack_signs(signs).to(target.weight.device)
                target.projection = drawn[key]
                new = target.projection if name in momenta else None
            else:
                if key not in drawn:
                    drawn[key] = make_projection(cfg.rank, target.in_features, seed, cfg.distribution,
                                                 target.weight.device)
                new = drawn[key]
                if name in scales:
                    new = new * scales[name]
                target.projection = new
            if name in momenta:
                # M reconstructs G·diag(c_old²) through A_old·diag(c_old); its sketch under the
                # new projection is M·(A_old diag(c_old)⁻¹)(A_new diag(c_new))ᵀ = M·(A_old A_newᵀ) at c = 1.
                if name in self._column_scales:
                    old = old / self._column_scales[name].square()
                m = momenta[name]
                m.copy_(m.float() @ (old @ new.T))
        self._column_scales = scales
        self._projection_index = index
        self._grams = {}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Tensors and plain values only: loads with ``torch.load(weights_only=True)``.

        Projections are not stored; they are rebuilt from the seeds.
        """
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {
            "num_updates": self._step,
            "sync": self.config.sync_fields(),
            "hyper": hyper,
            "second_moments": {n: v.clone() for n, v in self._second_moments.items()},
            "momentum": self._momentum.clone() if self._momentum is not None else None,
            "momentum_steps": self._momentum_steps,
            "element_v": self._element_v.clone() if self._element_v is not None else None,
            "element_v_steps": self._element_v_steps,
            "input_means": {n: v.clone() for n, v in self._input_means.items()},
            "input_updates": self._input_updates,
            "column_scales": {n: v.clone() for n, v in self._column_scales.items()},
            "non_target": self._dense.state_dict() if self._dense is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a `state_dict`; the sync fields and targets must match this optimizer."""
        mismatch = self.config.sync_mismatch(state_dict["sync"])
        if mismatch is not None:
            key, theirs, ours = mismatch
            raise ValueError(f"optimizer state was saved with {key}={theirs!r}, config has {ours!r}")
        names = set(state_dict["second_moments"])
        if names != set(self._second_moments):
            raise ValueError(f"optimizer state targets differ: {sorted(names ^ set(self._second_moments))[:3]}")
        if (state_dict["non_target"] is None) != (self._dense is None):
            raise ValueError("optimizer state and this optimizer disagree on non-target training")
        momentum = state_dict.get("momentum")
        if (momentum is None) != (self._momentum is None):
            raise ValueError("optimizer state and this optimizer disagree on the first moment (beta1 > 0)")
        for name, v in state_dict["second_moments"].items():
            self._second_moments[name] = v.to(self._second_moments[name])
        for saved, ours in ((momentum, self._momentum), (state_dict.get("element_v"), self._element_v)):
            if saved is not None and ours is not None and saved.dtype != ours.dtype:
                warnings.warn(f"optimizer state has {saved.dtype} moments and moment_dtype is {ours.dtype}: "
                              "they are cast, so this resume is not bitwise", stacklevel=2)
                break
        if momentum is not None:
            self._momentum.copy_(momentum)
            self._momentum_steps = state_dict["momentum_steps"]
        self.param_groups[0].update(state_dict["hyper"])
        if self._dense is not None:
            self._dense.load_state_dict(state_dict["non_target"])
        self._step = state_dict["num_updates"]
        set_policy_step(self.model, self._step)
        element_v = state_dict.get("element_v")
        if (element_v is None) != (self._element_v is None):
            raise ValueError("optimizer state and this optimizer disagree on optimizer='adam'")
        if element_v is not None:
            self._element_v.copy_(element_v)
            self._element_v_steps = state_dict["element_v_steps"]
        if set(state_dict.get("input_means", {})) != set(self._input_means):
            raise ValueError("optimizer state and this optimizer disagree on column_scale")
        for name, mean in state_dict.get("input_means", {}).items():
            self._input_means[name].copy_(mean)
        self._input_updates = state_dict.get("input_updates", 0)
        self._sketches.zero_()
        # the saved scales, not fresh ones: they define the projection in force
        self._projection_index = None
        targets = self._sketches.targets
        scales = {n: c.to(targets[n].weight.device) for n, c in state_dict.get("column_scales", {}).items()}
        self._refresh_projections(scales=scales)

    def remove(self) -> None:
        """Uninstall the sketches: target weights get their normal forward and gradients back."""
        self._sketches.remove()


class DenseRowAdam(torch.optim.Optimizer):
    """LoGRA's update rule on the exact dense gradient: a diagnostic baseline, no projection.

    For every weight LoGRA would sketch (same ``target_modules``; lm_head and input
    embeddings too with ``non_target='sketch'``): RowAdam's per-row second moment, the
    direction renormalised to the layer's gradient norm, and one global update ratio
    ``‖ΔW‖_F = update_ratio·‖W‖_F`` over all of them (``config.trust_ratio`` as in
    `LoGRAOptimizer`). With ``config.beta1`` > 0 an element-wise first moment (dense, the
    size of the weights) is the numerator, as in Adam. Every other trainable parameter
    gets AdamW (betas 0.9/0.95) at ``non_target_lr`` (frozen with ``'freeze'``). It
    isolates the projection: with the same settings `LoGRAOptimizer` differs from it by
    ``G → S A`` (and the first moment is element-wise here, in sketch space there). Uses
    ``update_ratio`` mode only; ``max_grad_norm`` and ``second_moment='momentum'`` are not
    implemented (the second moment always comes from the gradient, as Adam's).
    """

    def __init__(self, model: nn.Module, config: LoGRAConfig) -> None:
        from .sketch import find_targets

        if config.update_ratio is None:
            raise ValueError("DenseRowAdam needs LoGRAConfig.update_ratio")
        if config.optimizer != "row_adam" or config.moment_dtype != "float32":
            raise ValueError("DenseRowAdam is RowAdam with fp32 state: it needs LoGRAConfig.optimizer='row_adam' and "
                             f"moment_dtype='float32' (got {config.optimizer!r}, {config.moment_dtype!r}; in logra "
                             "train: --logra.optimizer row_adam)")
        self.config = config
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
        param_groups = [{"params": targets, "name": "row_adam"}]
        if rest:
            param_groups.append({"params": rest, "name": "non_target_adamw"})
        super().__init__(param_groups, {"lr": config.non_target_lr})

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
                state["m"].mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
                m = state["m"] / (1 - cfg.beta1**t)
            d, state["row_v"] = row_adam_direction(g, state["row_v"], t, cfg.beta2, cfg.eps, m)
            directions.append(d)
        sq = [float(d.square().sum()) for d in directions]
        if cfg.trust_ratio != "global":
            norms = layer_step_norms(cfg.update_ratio, cfg.trust_ratio, targets)
            scales = [n / math.sqrt(s) if s > 0 else 0.0 for n, s in zip(norms, sq, strict=True)]
        else:
            w = math.sqrt(sum(float(torch.linalg.vector_norm(p.float())) ** 2 for p in targets))
            total = math.sqrt(sum(sq))
            scales = [cfg.update_ratio * w / total if total > 0 else 0.0] * len(targets)
        for p, d, s in zip(targets, directions, scales, strict=True):
            p.sub_((d * s).to(p.dtype))
        for group in self.param_groups[1:]:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                t = int(state["step"])
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                denom = (state["v"] / (1 - 0.95**t)).sqrt_().add_(1e-8)
                p.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - 0.9**t))
        return loss
