"""Predicted-KL step control: size every update before it is applied.

For a proposed displacement ``Δθ`` (LoGRA's ``ΔW = -D A`` per target, or any dense
optimizer's step), one forward-mode AD pass gives the logits' directional derivative
``δz``; the softmax Fisher quadratic ``½ Σ_v p_v (d_v - Σ_u p_u d_u)²`` with ``d = δz/T``
is the second-order KL between the policies before and after the step. A
`KLController` turns it into a scale ``α`` that meets a (scheduled) KL budget.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from .errors import KLPredictionError, NonFiniteSketchError


class Displacement(Protocol):
    """A proposed parameter change ``Δθ`` that can be evaluated along ``θ + ε·Δθ``."""

    def perturbed(self, eps: torch.Tensor) -> AbstractContextManager[None]:
        """Within the block the model computes at ``θ + ε·Δθ``."""
        ...


# ----------------------------------------------------------------------- probing
def _probe_positions(response_mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Boolean ``[B, L]`` mask of positions whose next-token distribution made a response token."""
    pos = torch.zeros_like(response_mask, dtype=torch.bool)
    pos[:, :-1] = response_mask[:, 1:].bool()
    if max_tokens is not None and int(pos.sum()) > max_tokens:
        keep = pos.flatten().cumsum(0) <= max_tokens
        pos = pos & keep.view_as(pos)
    if not pos.any():
        raise KLPredictionError("the response mask selects no positions to probe")
    return pos


@contextmanager
def _probe_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and eager attention (SDPA kernels lack forward AD); restored afterwards.

    Enter it before a proposal swaps the parameters out: transformers (5.x, with the
    ``kernels`` package) re-kernelizes a model on a train/eval switch and reads its device
    from its parameters, which a dense proposal has all replaced. Nested entries change
    nothing.
    """
    was_training = model.training
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    try:
        if was_training:
            model.eval()
        if attn not in (None, "eager"):
            model.set_attn_implementation("eager")
        yield
    finally:
        if attn not in (None, "eager"):
            model.set_attn_implementation(attn)
        if was_training:
            model.train()


def hidden_and_head(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, nn.Module]:
    """Final hidden states and the output head, so logits can be formed chunk by chunk.

    A model without a separate decoder and head gives its logits and an identity head.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = getattr(model, "config", None)
    # models that transform the head's output (Gemma 2 soft-capping, Granite and Cohere
    # scaling) are asked for their logits, so every consumer sees the policy that samples
    transformed = any(getattr(config, k, None) not in (None, 1, 1.0)
                      for k in ("final_logit_softcapping", "logits_scaling", "logit_scale"))
    if head is None or base is None or base is model or transformed:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits, nn.Identity()
    return base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state, head


def _trim(input_ids, attention_mask, positions):
    """Drop sequences without probe positions and columns after the last one (causal)."""
    rows = positions.any(dim=1)
    last = int(positions.nonzero()[:, 1].max()) + 1
    ids = input_ids[rows, :last]
    mask = attention_mask[rows, :last] if attention_mask is not None else None
    return ids, mask, positions[rows, :last]


def predicted_kl(
    model: nn.Module,
    proposal: Displacement,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    max_tokens: int = 4096,
    chunk: int = 64,
) -> float:
    """Second-order KL(π_θ ‖ π_θ+Δθ) of ``proposal``, averaged over response positions.

    One forward-mode AD pass with every parameter perturbed along its proposed change
    gives the logits' tangent ``δz`` without changing any weight; the softmax Fisher
    quadratic is evaluated in float64, ``chunk`` positions at a time. Only positions
    that generated a ``response_mask`` token count (prompt and padding do not), the
    first ``max_tokens`` of them. The model's train/eval mode and attention
    implementation are restored afterwards.

    Raises:
        KLPredictionError: empty response mask, or a non-finite or negative prediction.
    """
    positions = _probe_positions(response_mask, max_tokens)
    ids, mask, positions = _trim(input_ids, attention_mask, positions)
    device = ids.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    with _probe_mode(model), torch.no_grad(), fwAD.dual_level():
        eps = fwAD.make_dual(torch.zeros((), device=device), torch.ones((), device=device))
        with proposal.perturbed(eps):
            hidden, head = hidden_and_head(model, ids, mask)
            selected = hidden[positions]
            for start in range(0, selected.shape[0], chunk):
                primal, tangent = fwAD.unpack_dual(head(selected[start: start + chunk]))
                if tangent is None:  # nothing depends on the displacement
                    continue
                z = primal.double() / temperature
                d = tangent.double() / temperature
                p = torch.softmax(z, dim=-1)
                centred = d - (p * d).sum(-1, keepdim=True)
                total += 0.5 * (p * centred.square()).sum()
    value = float(total) / int(positions.sum())
    if not math.isfinite(value) or value < 0:
        raise KLPredictionError(f"predicted KL is {value}; refusing an uncontrolled step")
    return value


@torch.no_grad()
def probe_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    response_mask: torch.Tensor,
    max_tokens: int = 4096,
) -> torch.Tensor:
    """Logits ``[n, vocab]`` (fp32) at the probe positions `predicted_kl` uses (eval mode)."""
    positions = _probe_positions(response_mask, max_tokens)
    ids, mask, positions = _trim(input_ids, attention_mask, positions)
    with _probe_mode(model):
        hidden, head = hidden_and_head(model, ids, mask)
        return head(hidden[positions]).float()


def realized_kl(logits_before: torch.Tensor, logits_after: torch.Tensor, temperature: float = 1.0) -> float:
    """Exact mean KL(before ‖ after) over rows of `probe_logits` taken before and after a step."""
    lp = torch.log_softmax(logits_before.double() / temperature, dim=-1)
    lq = torch.log_softmax(logits_after.double() / temperature, dim=-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


# ----------------------------------------------------------------------- dense proposals
class DenseProposal:
    """The displacement of any dense optimizer's step, so the same controller can scale it.

    `from_optimizer` takes one real ``optimizer.step()`` (so the learning rate,
    moments, preconditioning and weight decay are all included), records
    ``Δθ = θ_after - θ_before`` and puts the weights back; `apply` then sets
    ``θ = θ_before + α·Δθ``. The optimizer's internal state (moments) has advanced by
    that step, which is right for any ``α``: Adam's moments do not depend on the step
    size. Works for AdamW, LoRA adapters (``Δθ`` of the adapter weights), SGD, ...

    Attributes:
        model: the model whose parameters are displaced.
        displacements: parameter → its ``Δθ`` (parameters that did not move are left out).
    """

    def __init__(self, model: nn.Module, displacements: dict[nn.Parameter, torch.Tensor]) -> None:
        self.model = model
        self.displacements = displacements
        self._applied = False

    @classmethod
    @torch.no_grad()
    def from_optimizer(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> DenseProposal:
        """Step ``optimizer`` once, record the displacement, restore the weights.

        Raises:
            NonFiniteSketchError: a gradient is NaN/Inf (nothing was stepped).
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
            raise NonFiniteSketchError("non-finite gradient; the optimizer was not stepped")
        before = [p.detach().clone() for p in params]
        optimizer.step()
        displacements = {}
        for p, old in zip(params, before, strict=True):
            delta = p.detach() - old
            p.copy_(old)
            if delta.any():
                displacements[p] = delta
        return cls(model, displacements)

    @contextmanager
    def perturbed(self, eps: torch.Tensor) -> Iterator[None]:
        """Swap each displaced parameter for ``θ + ε·Δθ`` in every module that holds it."""
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for module in self.model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and p in self.displacements:
                        swapped.append((module, name, p))
                        del module._parameters[name]
                        setattr(module, name, p.detach() + eps * self.displacements[p])
            yield
        finally:
            for module, name, p in swapped:
                delattr(module, name)
                module._parameters[name] = p

    def norm(self) -> float:
        """Global ``‖Δθ‖`` of the displacement (fp32 accumulation)."""
        return math.sqrt(sum(float(d.float().square().sum()) for d in self.displacements.values()))

    @torch.no_grad()
    def apply(self, alpha: float = 1.0) -> None:
        """``θ ← θ + α·Δθ`` (once)."""
        if self._applied:
            raise RuntimeError("this DenseProposal was already applied")
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        for p, delta in self.displacements.items():
            p.add_(delta, alpha=alpha)
        self._applied = True


# ----------------------------------------------------------------------- the controller
class KLController:
    """Scale each update so its predicted KL meets a budget (docs/method.md §5).

    The budget follows a cosine (or constant) schedule from ``budget`` to
    ``budget_final`` over ``schedule_steps`` updates. The observed KL between the rollout
    policy and the trainer policy (an EMA with weight ``mismatch_ema``, clipped at 0) is
    subtracted from it, but never below ``mismatch_floor`` × the budget. The scale is
    ``α = min(alpha_max, sqrt(B_eff / KL̂))`` and 1 when ``KL̂ = 0``.

    ``overshoot_limit`` and ``max_backtracks`` are the guard `controlled_update` applies
    (ours, not the paper's): before the step is taken, its exact KL on the probe at ``α``
    is measured, and while it exceeds ``overshoot_limit × B_eff`` the scale shrinks, at
    most ``max_backtracks`` times. ``overshoot_limit=0`` turns the guard off.
    """

    def __init__(
        self,
        budget: float = 2e-4,
        budget_final: float = 2e-5,
        schedule_steps: int = 300,
        schedule: Literal["cosine", "constant"] = "cosine",
        alpha_max: float = 3.0,
        mismatch_ema: float = 0.3,
        mismatch_floor: float = 0.5,
        overshoot_limit: float = 2.0,
        max_backtracks: int = 3,
    ) -> None:
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
        if not (budget > 0 and budget_final > 0 and alpha_max > 0) or schedule_steps < 1 \
                or not math.isfinite(budget + budget_final + alpha_max):  # NaN compares false
            raise ValueError("budgets, alpha_max and schedule_steps must be positive")
        if not 0 < mismatch_ema <= 1 or not 0 <= mismatch_floor <= 1:
            raise ValueError("mismatch_ema must be in (0, 1] and mismatch_floor in [0, 1]")
        if not (overshoot_limit == 0 or 1 <= overshoot_limit < math.inf) or max_backtracks < 0:
            raise ValueError("overshoot_limit must be 0 (off) or in [1, inf), and max_backtracks >= 0; "
                             f"got {overshoot_limit} and {max_backtracks}")
        self.budget, self.budget_final, self.schedule_steps = budget, budget_final, schedule_steps
        self.schedule, self.alpha_max = schedule, alpha_max
        self.mismatch_ema, self.mismatch_floor = mismatch_ema, mismatch_floor
        self.overshoot_limit, self.max_backtracks = overshoot_limit, max_backtracks
        self.mismatch = 0.0
        self.last: dict[str, float] = {}

    def budget_at(self, step: int) -> float:
        """The scheduled budget ``B`` at update ``step`` (before mismatch subtraction)."""
        if self.schedule == "constant":
            return self.budget
        frac = min(step / self.schedule_steps, 1.0)
        return self.budget_final + (self.budget - self.budget_final) * 0.5 * (1 + math.cos(math.pi * frac))

    def effective_budget(self, step: int) -> float:
        """``max(B - m, floor·B)`` with ``m`` the mismatch EMA."""
        b = self.budget_at(step)
        return max(b - self.mismatch, self.mismatch_floor * b)

    def scale(self, predicted_kl: float, step: int) -> float:
        """The step scale ``α`` for a proposal whose full-size predicted KL is ``predicted_kl``.

        Raises:
            KLPredictionError: ``predicted_kl`` is non-finite or negative.
        """
        if not math.isfinite(predicted_kl) or predicted_kl < 0:
            raise KLPredictionError(f"predicted KL is {predicted_kl}; refusing an uncontrolled step")
        b = self.effective_budget(step)
        alpha = 1.0 if predicted_kl == 0 else min(self.alpha_max, math.sqrt(b / predicted_kl))
        self.last = {
            "predicted_kl": predicted_kl, "alpha": alpha, "budget": self.budget_at(step),
            "effective_budget": b, "expected_kl": predicted_kl * alpha**2, "mismatch": self.mismatch,
        }
        return alpha

    def backtrack(self, alpha: float, exact_kl: float) -> float | None:
        """The guard's next, smaller scale after measuring ``exact_kl`` at ``alpha``; None to accept.

        The step is accepted when its exact KL is within ``overshoot_limit × B_eff`` (of the
        update `scale` last sized), when the guard is off, or after ``max_backtracks``
        shrinks. Otherwise ``α·sqrt(B_eff / exact_kl)``: the scale at which the KL would meet
        the budget if it grew as ``α²``; a KL that grows faster ends below the budget.
        """
        b = self.last["effective_budget"]
        tries = self.last.get("backtracks", 0)
        if not self.overshoot_limit or exact_kl <= self.overshoot_limit * b or tries >= self.max_backtracks:
            return None
        alpha *= math.sqrt(b / exact_kl)
        self.last.update(alpha=alpha, expected_kl=self.last["predicted_kl"] * alpha**2, backtracks=tries + 1)
        return alpha

    def observe_mismatch(self, kl: float) -> None:
        """Feed the observed rollout-vs-trainer KL of completed responses (clipped at 0)."""
        if not math.isfinite(kl):
            return
        self.mismatch = (1 - self.mismatch_ema) * self.mismatch + self.mismatch_ema * max(kl, 0.0)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (its settings and the mismatch EMA)."""
        return {
            "budget": self.budget, "budget_final": self.budget_final, "schedule_steps": self.schedule_steps,
            "schedule": self.schedule, "alpha_max": self.alpha_max, "mismatch_ema": self.mismatch_ema,
            "mismatch_floor": self.mismatch_floor, "overshoot_limit": self.overshoot_limit,
            "max_backtracks": self.max_backtracks, "mismatch": self.mismatch,
        }

    def load_state_dict(self, state: dict[str, Any], settings: bool = False) -> None:
        """Restore the mismatch EMA of `state_dict` (and its settings too if ``settings``).

        By default the settings given to the constructor win, so a resumed run can
        change its budget on purpose.
        """
        self.mismatch = state["mismatch"]
        if settings:
            for key, value in state.items():
                setattr(self, key, value)


# ----------------------------------------------------------------------- one controlled update
@dataclass
class KLControlConfig:
    """Predicted-KL step control: the `KLController`'s settings and the probe's.

    Defaults are the paper's (docs/method.md §5).

    Attributes:
        enabled: scale every update to the KL budget (off: α = 1 always).
        budget: KL budget at the first update.
        budget_final: KL budget at the end of the schedule.
        schedule_steps: updates over which the budget decays (0 = the run's number of updates).
        schedule: 'cosine' or 'constant'.
        alpha_max: largest scale (the step may grow up to this factor).
        mismatch_ema: EMA weight of the rollout-vs-trainer KL subtracted from the budget.
        mismatch_floor: the effective budget never drops below this fraction of the budget.
        overshoot_limit: before a step is applied, its exact KL on the probe must be within
            this multiple of the effective budget, or its scale shrinks (ours; 0 = off, the
            paper's controller).
        max_backtracks: at most this many shrinks per update (then the step is taken).
        probe_responses: responses of the batch used as probe data.
        probe_max_tokens: at most this many probe positions.
    """

    enabled: bool = True
    budget: float = 2e-4
    budget_final: float = 2e-5
    schedule_steps: int = 300
    schedule: Literal["cosine", "constant"] = "cosine"
    alpha_max: float = 3.0
    mismatch_ema: float = 0.3
    mismatch_floor: float = 0.5
    overshoot_limit: float = 2.0
    max_backtracks: int = 3
    probe_responses: int = 2
    probe_max_tokens: int = 4096

    def __post_init__(self) -> None:
        self.controller()  # the controller validates its settings
        if self.probe_responses < 1 or self.probe_max_tokens < 1:
            raise ValueError("KLControlConfig.probe_responses and probe_max_tokens must be >= 1")

    def controller(self, total_updates: int = 300) -> KLController:
        """A `KLController` with these settings (``schedule_steps=0`` → ``total_updates``)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _CONTROLLER_ARGS}
        kw["schedule_steps"] = self.schedule_steps or total_updates
        return KLController(**kw)


_CONTROLLER_ARGS = frozenset(
    ("budget", "budget_final", "schedule_steps", "schedule", "alpha_max", "mismatch_ema", "mismatch_floor",
     "overshoot_limit", "max_backtracks"))
_T = TypeVar("_T")
Probe = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]


def probe_count(response_mask: torch.Tensor, max_tokens: int) -> int:
    """Number of positions `predicted_kl` averages over (so ranks can pool their means exactly)."""
    return min(int(response_mask[:, 1:].sum()), max_tokens)


def controlled_update(
    model: nn.Module,
    proposal: Displacement,
    apply: Callable[[float], _T],
    controller: KLController | None,
    step: int,
    probe: Probe | None,
    *,
    temperature: float = 1.0,
    max_tokens: int = 4096,
    chunk: int = 64,
    measure_realized: bool = True,
    reduce: Callable[[list[float]], list[float]] | None = None,
) -> tuple[_T, dict[str, float]]:
    """One KL-controlled update: predicted KL of ``proposal`` → ``α`` → guard → ``apply(α)`` → realised KL.

    ``apply`` is what takes the step (``optimizer.apply(proposal, α)`` for LoGRA,
    ``proposal.apply(α)`` for a `DenseProposal`); its result is returned with the
    statistics. ``reduce`` sums lists of floats over data-parallel ranks, so every rank
    gets the same pooled prediction and ``α``; with it every rank takes part in the
    reductions, one without a probe adding nothing. Without a controller (or a probe on
    any rank) ``α = 1``. With the controller's guard on (``overshoot_limit`` > 0), the
    step's exact KL on the probe at ``α`` is measured before it is applied, and ``α``
    shrinks while it overshoots (`KLController.backtrack`).

    Returns:
        ``(apply's result, stats)``; stats holds ``alpha`` (the applied scale), ``time_kl``,
        ``time_guard`` and, where measured, ``predicted_kl`` (the full proposal),
        ``expected_kl`` (its second-order KL at the applied ``α``), ``budget``,
        ``effective_budget``, ``mismatch``, ``backtracks`` and ``guard_kl`` (the guard's shrinks
        and the exact probe KL it accepted), ``realized_kl`` and ``time_check`` (the
        realised-KL measurement alone).

    Raises:
        KLPredictionError: a non-finite or negative prediction, or a non-finite exact KL
            (nothing is applied).
    """
    pool = reduce or (lambda values: values)
    n = probe_count(probe[2], max_tokens) if probe is not None else 0
    stats: dict[str, float] = {}
    alpha = 1.0
    t0 = time.perf_counter()
    # With `reduce`, a rank without a probe still joins the collectives (or the others would wait forever).
    pooled = probe is not None or reduce is not None
    sized = False  # the controller sized this update (some rank had probe positions)
    if controller is not None and pooled:
        kl = 0.0 if probe is None else predicted_kl(
            model, proposal, *probe, temperature=temperature, max_tokens=max_tokens, chunk=chunk)
        kl_sum, n_sum = pool([kl * n, n])
        sized = n_sum > 0
        if sized:
            alpha = controller.scale(kl_sum / n_sum, step)
            stats.update(controller.last)
    stats["time_kl"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    measure = measure_realized and pooled
    guard = sized and controller.overshoot_limit > 0
    before = probe_logits(model, *probe, max_tokens=max_tokens) if (measure or guard) and probe is not None \
        else None
    t2 = time.perf_counter()
    if guard:
        alpha = _guard(model, proposal, controller, alpha, probe, before, n, pool, temperature, max_tokens, stats)
    stats["time_guard"] = time.perf_counter() - t2
    result = apply(alpha)
    t3 = time.perf_counter()
    if measure:
        real = 0.0
        if before is not None:
            real = realized_kl(before, probe_logits(model, *probe, max_tokens=max_tokens), temperature) * n
        real_sum, n_sum = pool([real, n])
        if n_sum > 0:
            stats["realized_kl"] = real_sum / n_sum
        stats["time_check"] = (t2 - t1) + (time.perf_counter() - t3)
    stats["alpha"] = alpha
    return result, stats


def _guard(
    model: nn.Module,
    proposal: Displacement,
    controller: KLController,
    alpha: float,
    probe: Probe | None,
    before: torch.Tensor | None,
    n: int,
    pool: Callable[[list[float]], list[float]],
    temperature: float,
    max_tokens: int,
    stats: dict[str, float],
) -> float:
    """The overshoot guard: the exact probe KL of the step at ``α`` before it is taken, and
    smaller ``α`` while it exceeds the controller's limit (`KLController.backtrack`).

    The second-order prediction assumes logits that move linearly with ``α`` and a softmax
    in its quadratic regime; a step that bends the logits (their change grows faster than
    ``α``) has a KL far above it. The exact KL along ``θ + α·Δθ`` catches that before any
    weight changes. Every rank pools every measurement, so all take the same decisions.
    """
    stats["backtracks"] = 0
    device = before.device if before is not None else None
    while True:
        kl = 0.0
        if before is not None:
            with _probe_mode(model), proposal.perturbed(torch.tensor(alpha, device=device)):
                kl = realized_kl(before, probe_logits(model, *probe, max_tokens=max_tokens), temperature) * n
        kl_sum, n_sum = pool([kl, n])
        exact = kl_sum / n_sum
        if not math.isfinite(exact):
            raise KLPredictionError(f"the step's exact KL on the probe is {exact}; refusing it")
        smaller = controller.backtrack(alpha, exact)
        if smaller is None:
            stats.update(controller.last)
            stats["guard_kl"] = exact
            return alpha
        alpha = smaller
