"""`LoGRAConfig`: every knob of the method, with the paper's defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: Every 2-D ``nn.Linear`` weight inside the decoder blocks (`logra.sketch.DECODER_LINEAR`),
#: fused or not; on Llama / Qwen / Mistral exactly q/k/v/o_proj and gate/up/down_proj, in
#: that order.
DEFAULT_TARGETS: tuple[str, ...] = ("decoder-linear",)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_CHOICES = {
    "distribution": ("rademacher", "gaussian", "orthogonal", "inputs"),
    "optimizer": ("row_adam", "adam", "sgd"),
    "non_target": ("freeze", "adamw", "sketch"),
    "factor_dtype": tuple(_DTYPES),
    "momentum_refresh": ("transfer", "reset"),
    "second_moment": ("sketch", "momentum"),
    "second_moment_refresh": ("reset", "row_mean"),
    "trust_ratio": ("global", "layer", "element"),
    "column_scale": ("none", "input"),
    "moment_dtype": tuple(_DTYPES),
}

#: Fields that decide the projections and the delta format. A rollout worker or a
#: resumed run must agree with the trainer on every one of them.
SYNC_FIELDS: tuple[str, ...] = (
    "rank", "seed", "distribution", "refresh", "refresh_every", "factor_dtype", "share_projections",
)


@dataclass
class LoGRAConfig:
    """Configuration of LoGRA (arXiv:2610.06647); defaults are the paper's.

    Attributes:
        rank: rows ``r`` of every projection ``A`` (``[r, in]``).
        seed: base seed; seeded projections (every one, or with ``'inputs'`` those of the
            targets it does not fit) are rebuilt from (seed, update index, layer name).
        distribution: ``'rademacher'`` (±1/√r, paper), ``'gaussian'`` (N(0, 1/r)) or
            ``'orthogonal'`` (orthonormal rows × √(in/r): ``AᵀA = I`` exactly at r = in), or
            ``'inputs'`` (not in the paper): each ``nn.Linear`` target's projection spans the
            top-``r`` principal subspace of its inputs, fitted by
            `LoGRAOptimizer.fit_projections` before the first update (``logra train`` fits it on
            that update's prompts) and scaled like ``'orthogonal'``; other targets
            (embeddings) draw Rademacher projections from the seed. The accumulated update of a
            fixed projection lives in its row space, and the inputs' principal subspace holds
            most of dense AdamW's update where a random one holds ``r / in`` of it
            (docs/learning.md). With ``refresh=True`` they are fitted anew at the start of
            every ``refresh_every``-update window (≥ 2), to the inputs of the policy then.
            Needs ``column_scale='none'``; the fitted projections travel with the first delta
            of each stream and of each window, and in the optimizer state.
            The default of ``logra train``'s recipes (not of this class: its defaults are the paper's).
        refresh: draw new projections after updates (paper) instead of keeping one.
        refresh_every: refresh after every k-th update (1 = every update).
        optimizer: ``'row_adam'`` (paper: one second moment per output row), ``'adam'``
            (not in the paper: one per sketch entry, ``[out, r]``, one more sketch-sized
            buffer, zeroed at every projection refresh because its coordinates change; meant
            with ``refresh=False``, where on the embedded recipe it added 2.0 ± 0.5 points
            of Pass@1 over RowAdam, docs/learning.md) or ``'sgd'``.
        beta2: RowAdam second-moment decay.
        eps: RowAdam epsilon, relative to the mean row RMS of the layer.
        update_ratio: global ‖ΔW‖_F / ‖W‖_F of every step before KL scaling; ``None``
            switches to the plain learning rate ``lr``.
        lr: learning rate when ``update_ratio`` is None.
        weight_decay: decoupled weight decay (lr mode only), applied as ``W *= 1 - lr·wd``.
        target_modules: the ``nn.Linear`` layers to sketch: ``'decoder-linear'`` (default:
            every 2-D linear weight of the decoder blocks, fused ``qkv_proj`` / ``gate_up_proj``
            / ``query_key_value`` / ``fc1`` included), module-name suffixes (``'q_proj'``
            matches ``...self_attn.q_proj``) or regular expressions (any entry with a regex
            metacharacter, matched with ``re.search``).
        non_target: what happens to every other parameter: ``'freeze'`` (paper: the
            low-rank deltas are the whole policy change), ``'adamw'`` (a native AdamW
            trains them) or ``'sketch'`` (lm_head and input embeddings are sketched too;
            norms and biases use AdamW).
        non_target_lr: learning rate of that AdamW.
        factor_dtype: dtype of the update factor ``U`` that trainer and rollout share.
        max_grad_norm: clip the global norm of the sketched gradient ``‖S A‖_F`` (and of
            dense non-target gradients) to this value; ``None`` disables clipping.
        beta1: first-moment decay (not in the paper; 0 = the paper's update, bitwise). A
            momentum ``M ← β1·M + (1-β1)·S`` is kept per target in sketch space (``[out, r]``,
            one buffer shaped like the sketch buffer) and fed to RowAdam in place of the
            sketch, bias-corrected as in Adam. Meant with a fixed projection (``refresh=False``,
            as the recipes run it) or ``refresh_every`` > 1.
        momentum_refresh: what happens to the momentum when the projections are redrawn:
            ``'transfer'`` carries it into the new projection, ``M ← M·(A_old A_newᵀ)``
            (the sketch under ``A_new`` of its reconstruction ``M A_old``; for projections
            fitted to the inputs ``M·(A_old A_oldᵀ)⁻¹A_old·A_newᵀ``, exact on the subspaces'
            overlap); ``'reset'``
            zeroes it (and restarts its bias correction).
        second_moment: what RowAdam's row second moment is computed from when ``beta1`` > 0:
            ``'sketch'`` (the raw sketch of this update, as Adam does) or ``'momentum'``.
        second_moment_refresh: what happens to the element-wise second moment
            (``optimizer='adam'``) when the projections are redrawn: ``'reset'`` zeroes it and
            restarts its bias correction; ``'row_mean'`` gives every entry of a row that row's
            mean and keeps the bias correction running. Under a new random projection every
            entry of row ``i`` of the sketch has the same expected square, ``‖G_i‖² / r``
            (times the column scales' mean square), which the old row mean estimates; the
            element-wise detail is rebuilt at rate ``beta2``. In a basis fitted to the inputs
            (ordered by input variance) the entries' squares differ and the row mean only
            sets their scale. Not in the paper.
        trust_ratio: ``'global'`` (paper: one ‖ΔW‖/‖W‖ = ``update_ratio`` over all targets
            together), ``'layer'`` (each target's ‖ΔW_l‖ = ``update_ratio``·‖W_l‖, LARS/LAMB
            style) or ``'element'`` (each target's ‖ΔW_l‖ = ``update_ratio``·RMS(W)·√numel_l:
            every element moves by about the same amount, as under Adam, and the total is
            the global ratio's). Only in ``update_ratio`` mode.
        share_projections: layers that read the same input share one projection (not in
            the paper): q/k/v, and gate/up, of a Llama/Qwen/Mistral decoder layer
            (`logra.projection.SHARED_INPUT_GROUPS`). ``X Aᵀ`` is then computed and saved once
            per input instead of once per layer; each layer's sketch is still exactly
            ``G Aᵀ``, but the members' projection noise is the same draw (correlated), and
            with a fixed projection they move in one common input subspace: it cost
            1.2 ± 0.7 points of Pass@1 over 3 seeds of the embedded recipe (docs/learning.md).
        column_scale: ``'none'`` (paper) or ``'input'``: precondition each target's input
            side through its projection (not in the paper). The projection in force is
            ``A·diag(c)`` with ``c_j = (C_j / mean(C) + 0.1)^(-1/4)``, where ``C_j`` is a running
            mean (decay ``beta2`` per update) of the squared input of channel ``j``; ``c`` is
            recomputed at every projection refresh and sent in each `PolicyDelta`. The sketch
            stays exact for the projection used, and the update approximates
            ``D_row·G·diag(c²)``: RowAdam's rows times an input-channel (K-FAC-diagonal)
            column factor, like Adafactor's factored second moment. Cost: one ``[in]``
            vector per target and one reduction of ``x²`` per forward. On the embedded
            recipe it cost 0.9 ± 0.2 points of Pass@1 over 3 seeds (docs/learning.md).
        moment_dtype: storage dtype of the two sketch-sized moment buffers (the first moment
            with ``beta1`` > 0, the element-wise second moment with ``optimizer='adam'``); not
            in the paper, which keeps neither. ``'bfloat16'`` halves them: each update is
            computed in fp32 from the stored values and rounded to nearest once when stored.
            The row second moments of RowAdam stay fp32 (they are ``[out, 1]``).
    """

    rank: int = 256
    seed: int = 42
    distribution: Literal["rademacher", "gaussian", "orthogonal", "inputs"] = "rademacher"
    refresh: bool = True
    refresh_every: int = 1
    optimizer: Literal["row_adam", "adam", "sgd"] = "row_adam"
    beta2: float = 0.95
    eps: float = 1e-8
    update_ratio: float | None = 6e-5
    lr: float = 1e-3
    weight_decay: float = 0.0
    target_modules: tuple[str, ...] = field(default_factory=lambda: DEFAULT_TARGETS)
    non_target: Literal["freeze", "adamw", "sketch"] = "freeze"
    non_target_lr: float = 1e-5
    factor_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    max_grad_norm: float | None = None
    beta1: float = 0.0
    momentum_refresh: Literal["transfer", "reset"] = "transfer"
    second_moment: Literal["sketch", "momentum"] = "sketch"
    second_moment_refresh: Literal["reset", "row_mean"] = "reset"
    trust_ratio: Literal["global", "layer", "element"] = "global"
    share_projections: bool = False
    column_scale: Literal["none", "input"] = "none"
    moment_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"LoGRAConfig.{name}={value!r} is not one of {allowed}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(f"LoGRAConfig.rank must be a positive int, got {self.rank!r}")
        if self.refresh_every < 1:
            raise ValueError(f"LoGRAConfig.refresh_every must be >= 1, got {self.refresh_every}")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"LoGRAConfig.beta2 must be in [0, 1), got {self.beta2}")
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"LoGRAConfig.beta1 must be in [0, 1), got {self.beta1}")
        if self.update_ratio is not None and not 0 < self.update_ratio < math.inf:
            raise ValueError(f"LoGRAConfig.update_ratio must be > 0 or None, got {self.update_ratio}")
        if not (0 < self.lr < math.inf and 0 < self.eps < math.inf and 0 <= self.weight_decay < math.inf):
            raise ValueError("LoGRAConfig.lr and eps must be > 0 and weight_decay >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"LoGRAConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not self.target_modules:
            raise ValueError("LoGRAConfig.target_modules is empty")
        self._refuse_options_that_do_nothing()
        if self.distribution == "inputs" and (self.refresh and self.refresh_every == 1 or self.column_scale != "none"):
            raise ValueError("LoGRAConfig.distribution='inputs' fits projections to the inputs, once (refresh=False) "
                             "or at the start of each refresh window (refresh=True, refresh_every >= 2: each fit "
                             "is a forward pass over that update's prompts), and needs column_scale='none' "
                             "(projections redrawn from the seed at every update: distribution='rademacher', "
                             "the paper's)")
        if self.column_scale != "none" and not self.refresh:
            raise ValueError("LoGRAConfig.column_scale='input' sets the scales at projection refreshes: "
                             "it needs refresh=True")

    def _refuse_options_that_do_nothing(self) -> None:
        """An option set away from its default must change something: a combination in which
        it would be silently ignored is refused, naming the option and what it needs."""
        needs = [
            (self.second_moment != "sketch", self.beta1 > 0 and self.optimizer == "row_adam",
             f"second_moment={self.second_moment!r} needs optimizer='row_adam' and beta1 > 0"),
            (self.moment_dtype != "float32", self.beta1 > 0 or self.optimizer == "adam",
             f"moment_dtype={self.moment_dtype!r} needs a moment to store (beta1 > 0 or optimizer='adam')"),
            (self.second_moment_refresh != "reset", self.optimizer == "adam" and self.refresh,
             f"second_moment_refresh={self.second_moment_refresh!r} needs optimizer='adam' and refresh=True"),
            (self.momentum_refresh != "transfer", self.beta1 > 0,
             f"momentum_refresh={self.momentum_refresh!r} needs beta1 > 0"),
            (self.lr != _DEFAULT_LR, self.update_ratio is None,
             "lr sizes steps in lr mode only: set update_ratio=None (otherwise update_ratio sizes them)"),
            (self.weight_decay > 0, self.update_ratio is None,
             "weight_decay applies in lr mode only: set update_ratio=None (the update ratio sizes steps without it)"),
            (self.trust_ratio != "global", self.update_ratio is not None,
             f"trust_ratio={self.trust_ratio!r} needs update_ratio (lr mode has no trust ratio)"),
            (self.refresh_every != 1, self.refresh, f"refresh_every={self.refresh_every} needs refresh=True"),
        ]
        for is_set, meaningful, message in needs:
            if is_set and not meaningful:
                raise ValueError(f"LoGRAConfig: {message}")

    @property
    def torch_factor_dtype(self) -> torch.dtype:
        """``factor_dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.factor_dtype]

    @property
    def torch_moment_dtype(self) -> torch.dtype:
        """``moment_dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.moment_dtype]

    def sync_fields(self) -> dict[str, Any]:
        """The fields (`SYNC_FIELDS`) that trainer and rollout workers must share."""
        return {name: getattr(self, name) for name in SYNC_FIELDS}

    def sync_mismatch(self, sync: dict[str, Any]) -> tuple[str, Any, Any] | None:
        """The first sync field where ``sync`` (a delta's or a checkpoint's) differs from
        this config, as ``(field, theirs, ours)``; None if they agree. A field missing from
        ``sync`` (written before the field existed) counts as its default."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in SYNC_FIELDS:
            theirs, ours = sync.get(name, defaults[name]), getattr(self, name)
            if theirs != ours:
                return name, theirs, ours
        return None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (lists instead of tuples), for YAML/JSON."""
        out = dataclasses.asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out


_DEFAULT_LR = next(f.default for f in dataclasses.fields(LoGRAConfig) if f.name == "lr")
