"""Update rules on gradient sketches, and the step size: each rule's whole behaviour in one place.

A rule turns a target's sketch ``S`` (``[out, r]``, divided by the update's token count,
clipped) into a direction ``D`` of the same shape; the update is ``ΔW = -c·D A`` with ``c``
from `step_scales`. The math lives in pure functions over tensors (`row_adam`,
`element_adam`, `first_moment`, ...), in the style of ``torch.optim``'s functional Adam;
the state a rule keeps between updates lives in a small class beside it
(`RowAdamRule`, `AdamRule`, `SGDRule`, `FirstMoment`) that says how the state is made,
committed after an update, reset at a projection refresh, checkpointed and counted
as memory. `logra.optimizer.LoGRAOptimizer` only wires these together, and
`logra.optimizer.DenseRowAdam` runs the same functions on exact dense gradients.

Propose/apply split: a rule's ``direction`` changes nothing; what it would store is
returned as ``pending`` and stored by ``commit`` only when the update is applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_TINY = torch.finfo(torch.float32).tiny

#: Per target, the rows of a ``[Σ out, r]`` buffer laid out like the sketch buffer.
Views = Callable[[torch.Tensor], dict[str, torch.Tensor]]


# ----------------------------------------------------------------------------- pure functions
def _normalised(x: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``x / den`` rescaled to the Frobenius norm of ``x``. Computed as ``x·(min den / den)``:
    no overflow where ``den`` is tiny."""
    d = x * (den.min() / den)
    x_norm, d_norm = torch.linalg.vector_norm(x), torch.linalg.vector_norm(d)
    return d * (x_norm / d_norm) if d_norm > 0 else d


def _denominator(v: torch.Tensor, correction: float, eps: float) -> torch.Tensor:
    """``√(v / correction) + max(ε·mean √(v / correction), tiny)``: Adam's denominator with
    an epsilon relative to the layer's mean RMS."""
    rms = (v / correction).sqrt_()
    return rms.add_(torch.clamp(eps * rms.mean(), min=_TINY))


def row_adam(
    s: torch.Tensor, v: torch.Tensor, t: int, beta2: float, eps: float, numerator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RowAdam (the paper's rule): one second moment per output row. Returns ``(D, v_new)``.

    ``v_new = β2·v + (1-β2)·mean_j s_ij²`` (``v`` is ``[out, 1]``), ``D = x / den`` row-wise with
    ``den = √(v_new / (1-β2^t)) + max(ε·mean(√·), tiny)``, rescaled so ``‖D‖_F = ‖x‖_F``;
    ``x`` is ``numerator`` if given (a bias-corrected first moment), else ``s``. ``t`` is
    the 1-based step. Changes nothing.
    """
    v_new = v * beta2 + (1.0 - beta2) * s.square().mean(dim=1, keepdim=True)
    x = s if numerator is None else numerator
    return _normalised(x, _denominator(v_new, 1.0 - beta2**t, eps)), v_new


def element_adam(x: torch.Tensor, v: torch.Tensor, k: int, beta2: float, eps: float) -> torch.Tensor:
    """Adam on sketch coordinates: ``x / (√v̂ + ε·mean √v̂)`` element-wise, ``v̂ = v/(1-β2^k)``,
    rescaled to ``‖x‖_F``. ``v`` is the second moment already including this update
    (`next_element_v`), ``k`` the updates folded into it."""
    return _normalised(x, _denominator(v, 1.0 - beta2**k, eps))


def next_first_moment(m: torch.Tensor, s: torch.Tensor, beta1: float, clip: float) -> torch.Tensor:
    """``β1·M + (1-β1)·clip·S`` in a new fp32 tensor (``m`` may be stored in bf16)."""
    return (m.to(torch.float32) * beta1).add_(s, alpha=(1.0 - beta1) * clip)


def next_element_v(v: torch.Tensor, s: torch.Tensor, beta2: float, clip: float) -> torch.Tensor:
    """``β2·V + (1-β2)·(clip·S)²`` element-wise, in a new fp32 tensor."""
    return (v.to(torch.float32) * beta2).addcmul_(s, s, value=(1.0 - beta2) * clip * clip)


def sketch_update_sq_norm(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``‖D A‖_F²`` from the ``r×r`` Gram matrix ``A Aᵀ``, without forming ``D A``."""
    return ((d @ gram) * d).sum()


# ----------------------------------------------------------------------------- the step size
@dataclass(frozen=True)
class StepSize:
    """What `step_scales` decided. ``scales[i]`` multiplies target ``i``'s direction;
    ``update_norm`` is the global ``‖ΔW‖_F`` that results; ``decay`` the decoupled weight
    decay ``W ← (1 - decay)·W`` of the step (lr mode only)."""

    scales: list[float]
    update_norm: float
    decay: float = 0.0


def step_scales(
    layer_sq: list[torch.Tensor],
    weight_norms: torch.Tensor | None,
    numels: list[int],
    *,
    update_ratio: float | None,
    trust_ratio: str,
    lr: float,
    weight_decay: float,
) -> StepSize:
    """The step size of one update, from each target's ``‖D_l A_l‖²`` and weight norm.

    - ``update_ratio`` set, ``trust_ratio='global'`` (paper): one scale for all targets with
      ``‖ΔW‖_F = update_ratio·‖W‖_F`` over all of them together.
    - ``'layer'``: each target's ``‖ΔW_l‖_F = update_ratio·‖W_l‖_F`` (LARS/LAMB style).
    - ``'element'``: ``‖ΔW_l‖_F = update_ratio·RMS(W)·√numel_l`` with the RMS over all targets,
      so every element moves by about the same amount (as under Adam) and the total is the
      global ratio's.
    - ``update_ratio`` None: the learning rate, ``ΔW = -lr·D A - lr·wd·W``.

    ``layer_sq`` are 0-d fp32 tensors, ``weight_norms`` the fp32 ``‖W_l‖_F`` (needed with an
    update ratio). They are inputs, not read from the weights, so a row-sharded trainer
    passes norms reduced over its ranks and every trust ratio works sharded.
    """
    if update_ratio is None:
        update_sq = float(sum(layer_sq))
        return StepSize([lr] * len(layer_sq), lr * math.sqrt(update_sq), lr * weight_decay)
    if weight_norms is None:
        raise ValueError("the update-ratio step size needs the weight norms")
    if trust_ratio == "global":
        update_sq = float(sum(layer_sq))
        weight_norm = float(torch.linalg.vector_norm(weight_norms))
        scale = update_ratio * weight_norm / math.sqrt(update_sq) if update_sq > 0 else 0.0
        return StepSize([scale] * len(layer_sq), scale * math.sqrt(update_sq))
    norms = [float(n) for n in weight_norms]
    if trust_ratio == "layer":
        targets = [update_ratio * n for n in norms]
    elif trust_ratio == "element":
        rms = math.sqrt(sum(n * n for n in norms) / sum(numels))
        targets = [update_ratio * rms * math.sqrt(n) for n in numels]
    else:
        raise ValueError(f"unknown trust_ratio {trust_ratio!r} (global | layer | element)")
    scales, update_sq = [], 0.0
    for sq, target in zip(layer_sq, targets, strict=True):
        sq = float(sq)
        scale = target / math.sqrt(sq) if sq > 0 else 0.0
        scales.append(scale)
        update_sq += scale * scale * sq
    return StepSize(scales, math.sqrt(update_sq))


# ----------------------------------------------------------------------------- rules and their state
class SketchRule:
    """A rule on sketches with its state. The default keeps no state (`SGDRule`).

    ``direction(name, s, sketch, clip, m, t, beta2, eps)`` gets the clipped sketch ``s``, the
    raw ``sketch`` and ``clip`` (so state is folded from the same numbers the proposal
    used), the bias-corrected first moment ``m`` (or None), the 1-based step ``t`` and
    the live hyper-parameters. It returns ``(D, pending)``; `commit` stores the pending
    values of every target once the update is applied.
    """

    name = "sgd"

    def direction(self, name: str, s: torch.Tensor, sketch: torch.Tensor, clip: float, m: torch.Tensor | None,
                  t: int, beta2: float, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``D = m`` if a first moment is kept, else ``S`` (a copy)."""
        return (s if m is None else m).clone(), None

    def commit(self, pending: dict[str, torch.Tensor], sketches: dict[str, torch.Tensor], clip: float,
               beta2: float) -> None:
        """Store the state of an applied update."""

    def on_refresh(self) -> None:
        """The projections were redrawn: state in the old coordinates is dropped."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint entries (tensors and plain values)."""
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` if `load_state` would refuse ``state`` (nothing is changed)."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s entries (after `check_state`)."""

    def memory(self) -> list[torch.Tensor]:
        """The state's tensors (optimizer memory)."""
        return []


class SGDRule(SketchRule):
    """``D = S`` (or the first moment): no state."""


class RowAdamRule(SketchRule):
    """RowAdam (paper): `row_adam` with one fp32 second moment per output row ``[out, 1]``.

    The second moment is per row of the weight, not per sketch coordinate, so it survives
    projection refreshes. ``from_momentum``: fold the first moment instead of the sketch
    into it (``LoGRAConfig.second_moment='momentum'``).
    """

    name = "row_adam"

    def __init__(self, rows: dict[str, int], device: torch.device, from_momentum: bool = False) -> None:
        self.v = {n: torch.zeros(out, 1, dtype=torch.float32, device=device) for n, out in rows.items()}
        self.from_momentum = from_momentum

    def direction(self, name, s, sketch, clip, m, t, beta2, eps):
        folded = m if (m is not None and self.from_momentum) else s
        return row_adam(folded, self.v[name], t, beta2, eps, m)

    def commit(self, pending, sketches, clip, beta2):
        self.v.update(pending)

    def state_dict(self):
        return {"second_moments": {n: v.clone() for n, v in self.v.items()}}

    def check_state(self, state):
        names = set(state.get("second_moments", {}))
        if names != set(self.v):
            raise ValueError(f"optimizer state's row second moments are for other targets: "
                             f"{sorted(names ^ set(self.v))[:3]}")
        for n, v in state["second_moments"].items():
            if v.shape != self.v[n].shape:
                raise ValueError(f"optimizer state's row second moment of {n} is {tuple(v.shape)}, "
                                 f"expected {tuple(self.v[n].shape)}")

    def load_state(self, state):
        self.v = {n: v.to(self.v[n]) for n, v in state["second_moments"].items()}

    def memory(self):
        return list(self.v.values())


class AdamRule(SketchRule):
    """Adam in sketch coordinates (not in the paper): `element_adam` with one second moment
    per sketch entry, one ``[Σ out, r]`` buffer in ``dtype``. Its coordinates are those of
    the projections in force, so a refresh zeroes it and restarts its bias correction
    (``refresh='reset'``) or sets each row to its mean and keeps the correction running
    (``'row_mean'``: under a new random projection every entry of a row has the same
    expected square, which the old row mean estimates)."""

    name = "adam"

    def __init__(self, like: torch.Tensor, views: Views, dtype: torch.dtype, refresh: str = "reset") -> None:
        self.v = torch.zeros_like(like, dtype=dtype)
        self.refresh = refresh
        self.steps = 0  # updates folded in since the last reset
        #: per target, its rows of the second moment
        self.views = views(self.v)

    def direction(self, name, s, sketch, clip, m, t, beta2, eps):
        v_new = next_element_v(self.views[name], sketch, beta2, clip)
        return element_adam(s if m is None else m, v_new, self.steps + 1, beta2, eps), None

    def commit(self, pending, sketches, clip, beta2):
        # recomputed target by target (no second buffer kept between propose and apply);
        # a bf16 state is rounded once, when stored
        for name, v in self.views.items():
            v.copy_(next_element_v(v, sketches[name], beta2, clip))
        self.steps += 1

    def on_refresh(self):
        if self.refresh == "row_mean":
            self.v.copy_(self.v.float().mean(dim=1, keepdim=True).expand_as(self.v))
            return
        self.v.zero_()
        self.steps = 0

    def state_dict(self):
        return {"element_v": self.v.clone(), "element_v_steps": self.steps}

    def check_state(self, state):
        _check_buffer(state.get("element_v"), self.v, "the element-wise second moment (optimizer='adam')")

    def load_state(self, state):
        self.v.copy_(state["element_v"])
        self.steps = state["element_v_steps"]

    def memory(self):
        return [self.v]


def make_rule(optimizer: str, rows: dict[str, int], like: torch.Tensor, views: Views, dtype: torch.dtype,
              second_moment: str, second_moment_refresh: str = "reset") -> SketchRule:
    """The rule ``LoGRAConfig.optimizer`` names."""
    if optimizer == "row_adam":
        return RowAdamRule(rows, like.device, from_momentum=second_moment == "momentum")
    if optimizer == "adam":
        return AdamRule(like, views, dtype, refresh=second_moment_refresh)
    return SGDRule()


class FirstMoment:
    """A first moment of the sketches (``LoGRAConfig.beta1`` > 0; not in the paper).

    ``M ← β1·M + (1-β1)·clip·S`` per target, one ``[Σ out, r]`` buffer in ``dtype``, fed to the
    rule bias-corrected (``M / (1 - β1^k)``, ``k`` the updates folded in since the last reset).
    At a projection refresh it is carried into the new coordinates, ``M ← M·(B_old A_newᵀ)``
    (``refresh='transfer'``: the sketch under ``A_new`` of its reconstruction ``M B_old``; the
    `Projector` gives ``B_old = A_old`` for a seeded projection, as Flora does, and
    ``(A_old A_oldᵀ)⁻¹A_old`` for one fitted to the inputs), or zeroed (``'reset'``).
    """

    def __init__(self, like: torch.Tensor, views: Views, dtype: torch.dtype, refresh: str) -> None:
        self.m = torch.zeros_like(like, dtype=dtype)
        self.steps = 0
        self.refresh = refresh
        #: per target, its rows of the first moment
        self.views = views(self.m)

    def corrected(self, name: str, sketch: torch.Tensor, beta1: float, clip: float) -> torch.Tensor:
        """This update's bias-corrected first moment of target ``name`` (changes nothing)."""
        correction = 1.0 - beta1 ** (self.steps + 1)
        return next_first_moment(self.views[name], sketch, beta1, clip).div_(correction)

    def commit(self, sketches: dict[str, torch.Tensor], beta1: float, clip: float) -> None:
        """Fold an applied update's sketches in (target by target, rounded once when stored)."""
        for name, m in self.views.items():
            m.copy_(next_first_moment(m, sketches[name], beta1, clip))
        self.steps += 1

    @property
    def transfers(self) -> bool:
        """Whether a refresh carries the moment over (and so needs the old projections)."""
        return self.refresh == "transfer"

    def on_refresh(self, bases: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Follow the projections: ``bases[name] = (A_old·diag(c_old)⁻¹, A_new·diag(c_new))``."""
        if not self.transfers:
            self.m.zero_()
            self.steps = 0
            return
        for name, m in self.views.items():
            old, new = bases[name]
            m.copy_(m.float() @ (old @ new.T))

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint entries."""
        return {"momentum": self.m.clone(), "momentum_steps": self.steps}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` if `load_state` would refuse ``state``."""
        _check_buffer(state.get("momentum"), self.m, "the first moment (beta1 > 0)")

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s entries."""
        self.m.copy_(state["momentum"])
        self.steps = state["momentum_steps"]


def _check_buffer(saved: torch.Tensor | None, ours: torch.Tensor, what: str) -> None:
    if saved is None:
        raise ValueError(f"optimizer state has no {what}, which this optimizer keeps")
    if saved.shape != ours.shape:
        raise ValueError(f"optimizer state's {what} is {tuple(saved.shape)}, expected {tuple(ours.shape)}")
