"""Use LoGRA inside the training loops people already have.

- `KLControlledLoGRA`: a `LoGRAOptimizer` whose ``step()`` is the whole controlled
  update (propose → predicted KL on a probe batch → scale α → apply). Any loop that
  only calls ``optimizer.step()`` — Hugging Face ``Trainer``, accelerate's
  ``AcceleratedOptimizer``, a hand-written loop — gets KL control without changes;
  the loop's owner hands it a probe batch with `KLControlledLoGRA.set_probe`.
- `logra.integrations.trl.LoGRAGRPOTrainer`: TRL's ``GRPOTrainer`` with LoGRA as its
  optimizer (imported lazily, so ``trl`` stays an optional dependency).

A plain PyTorch loop needs nothing from here: `logra.LoGRAOptimizer` is a drop-in
``torch.optim.Optimizer`` (``loss.backward(); opt.step(); opt.zero_grad()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import LoGRAConfig
from ..delta import PolicyDelta
from ..errors import LoGRAError
from ..kl import KLControlConfig, KLController
from ..optimizer import LoGRAOptimizer
from ..updater import LoGRAUpdater, controlled_step

if TYPE_CHECKING:
    from .trl import LoGRAGRPOTrainer

__all__ = ["KLControlledLoGRA", "LoGRAGRPOTrainer"]

#: Keys of `KLControlledLoGRA.last_stats` (``None`` values are left out).
STAT_KEYS: tuple[str, ...] = (
    "predicted_kl", "alpha", "budget", "effective_budget", "expected_kl", "backtracks", "guard_kl", "realized_kl",
    "sketch_norm", "update_norm",
)


class KLControlledLoGRA(LoGRAOptimizer):
    """`LoGRAOptimizer` whose ``step()`` sizes every update with a `KLController`.

    ``step()`` runs ``propose()``, predicts the KL of the proposal on the probe batch
    last given to `set_probe` (forward-mode AD, weights untouched), asks the controller
    for ``α`` and ``apply(proposal, α)``. With ``controller=None`` it is a plain
    `LoGRAOptimizer` (α = 1) that still reports its statistics.

    The controller's state travels in `state_dict` under ``"kl_controller"``, so a
    framework that checkpoints ``optimizer.state_dict()`` (HF ``Trainer``'s
    ``optimizer.pt``) saves and restores it without knowing about it.

    Data parallel: all-reduce the sketches before ``step()``
    (`logra.parallel.allreduce_sketches`) and pass ``reduce`` (e.g.
    `logra.parallel.sum_over_ranks`); each rank sets its own probe, the KL sums are pooled
    over ranks and every rank applies the same ``α``.

    Attributes:
        controller: the `KLController` (or None: no KL control).
        temperature: sampling temperature of the policy (logits are divided by it).
        probe_max_tokens: at most this many probe positions per prediction.
        probe_chunk: positions per chunk of the float64 Fisher quadratic.
        measure_realized_kl: also log the exact KL on the probe before/after the step
            (two extra forward passes over the probe).
        reduce: sums a list of floats over data-parallel ranks (None: one process).
        last_stats: the statistics of the last step (keys in `STAT_KEYS`).
        last_delta: the `PolicyDelta` of the last step, for rollout engines.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoGRAConfig | None = None,
        controller: KLController | None = None,
        *,
        temperature: float = 1.0,
        probe_max_tokens: int = 4096,
        probe_chunk: int = 64,
        measure_realized_kl: bool = True,
        reduce: Callable[[list[float]], list[float]] | None = None,
    ) -> None:
        super().__init__(model, config)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.controller = controller
        self.temperature = temperature
        self.probe_max_tokens = probe_max_tokens
        self.probe_chunk = probe_chunk
        self.measure_realized_kl = measure_realized_kl
        self.reduce = reduce
        self.last_stats: dict[str, float] = {}
        self.last_delta: PolicyDelta | None = None
        self._probe: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self._step_callbacks: list[Callable[[dict[str, float]], None]] = []

    @classmethod
    def from_config(
        cls, model: nn.Module, config: LoGRAConfig | None, kl: KLControlConfig, total_updates: int,
        temperature: float = 1.0, measure_realized_kl: bool = True,
    ) -> KLControlledLoGRA:
        """Built from the one `KLControlConfig` the RL job uses too (``kl.enabled=False``: no control)."""
        controller = kl.controller(total_updates) if kl.enabled else None
        return cls(model, config, controller, temperature=temperature, probe_max_tokens=kl.probe_max_tokens,
                   measure_realized_kl=measure_realized_kl)

    def set_probe(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, response_mask: torch.Tensor
    ) -> None:
        """The sequences the next ``step()`` predicts (and measures) the KL on.

        ``response_mask`` marks generated tokens (prompt and padding 0), aligned with
        ``input_ids``. The tensors are copied; the probe is used by one step only.
        """
        if input_ids.shape != response_mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and response_mask {tuple(response_mask.shape)} differ")
        mask = attention_mask.detach().clone() if attention_mask is not None else None
        self._probe = (input_ids.detach().clone(), mask, response_mask.detach().clone())

    @property
    def has_probe(self) -> bool:
        """Whether a probe batch is waiting for the next step."""
        return self._probe is not None

    def add_step_callback(self, fn: Callable[[dict[str, float]], None]) -> None:
        """Call ``fn(last_stats)`` after every step (e.g. to feed a logger)."""
        self._step_callbacks.append(fn)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One KL-controlled update: propose → predicted KL → α → apply.

        Raises:
            LoGRAError: KL control is on, the proposal is non-zero and no probe was set
                (with ``reduce``: on no rank; every rank raises).
            NonFiniteSketchError, KLPredictionError: as `propose` / `predicted_kl`
                (nothing is changed).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        proposal = self.propose()
        probe, self._probe = self._probe, None
        missing = probe is None
        if self.controller is not None and self.reduce is not None:
            # Ranks decide together: one rank raising alone would leave the others waiting in a collective.
            missing = self.reduce([float(not missing)])[0] == 0
        if self.controller is not None and missing and proposal.update_norm != 0.0:
            raise LoGRAError(
                "KL control needs a probe batch: call set_probe(input_ids, attention_mask, response_mask) "
                "after the backward pass and before step(), or build the optimizer with controller=None")
        self.last_delta, record = controlled_step(
            LoGRAUpdater(self), self.model, self.controller, self.num_updates, probe, proposal=proposal,
            temperature=self.temperature, max_tokens=self.probe_max_tokens, chunk=self.probe_chunk,
            measure_realized=self.measure_realized_kl, reduce=self.reduce)
        stats = {k: v for k, v in record.items() if k in STAT_KEYS}
        self.last_stats = stats
        for fn in self._step_callbacks:
            fn(stats)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """`LoGRAOptimizer.state_dict` plus ``"kl_controller"`` (None without a controller)."""
        state = super().state_dict()
        state["kl_controller"] = self.controller.state_dict() if self.controller is not None else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`, the controller's state included when both have one."""
        state = dict(state_dict)
        controller_state = state.pop("kl_controller", None)
        super().load_state_dict(state)
        if self.controller is not None and controller_state is not None:
            self.controller.load_state_dict(controller_state)


def __getattr__(name: str) -> Any:
    # `trl` is optional: import the TRL integration only when it is asked for.
    if name == "LoGRAGRPOTrainer":
        from .trl import LoGRAGRPOTrainer

        return LoGRAGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
