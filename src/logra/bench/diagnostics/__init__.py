"""``logra bench diagnostics``: the paper's gradient-compression and KL-control diagnostics.

Three parts, chosen with ``--parts`` (default all):

``cosine`` (Figure 5b/c)
    How well the sketches ``S_t = G_t A_tᵀ`` of real gradients reconstruct the dense
    gradient when they are ACCUMULATED over updates: the cosine between ``Σ_t G_t`` and
    ``Σ_t S_t A_t`` after ``t`` updates, per transformer layer (the layer's seven target
    matrices taken together as one vector) and rank. Projections are drawn exactly as
    the optimizer draws them (`logra.projection.make_projection` with
    `projection_seed` (LoGRA seed, `projection_index`, layer name)) for three variants:
    fixed Rademacher (``update_index`` stays 0), refreshed Rademacher (paper default) and
    refreshed Gaussian. With refreshed projections ``E[A_tᵀA_t] = I`` and independent
    draws average the reconstruction errors out, so the accumulated cosine rises towards
    1; with a fixed projection ``Σ_t G_t AᵀA`` keeps the error of a single draw.

    The gradients ``G_t`` are the real dense weight gradients of the RL policy-gradient
    loss (the trainer's own loss of its own rollouts: GRPO on the embedded task by
    default) while `RLTrainer` trains the embedded policy with LoGRA (the embedded
    recipe). They are recorded during the trainer's own backward pass: a forward hook on
    every target ``nn.Linear`` keeps its input ``X`` and a tensor hook on its output adds
    ``Hᵀ X`` (what dense autograd computes for the weight) into an fp32 buffer. Before
    each update applies, the optimizer's real sketches are compared with ``G_t A_tᵀ`` of
    the recorded gradients (reported as "sketch check").

    Besides the measurement the table shows the prediction for independent projections
    (ratio of expectations, exact moments): ``E⟨ΣG, ΣSA⟩ = ‖ΣG‖²`` and, per target of
    input size ``n``, ``E‖G AᵀA‖² = ‖G‖²(n + r ∓ 1)/r`` (− Rademacher, + Gaussian), so
    refreshed: ``cos ≈ ‖ΣG‖ / sqrt(‖ΣG‖² + Σ_t Σ_m ‖G_tm‖²(n_m ∓ 1)/r)`` and fixed:
    ``cos ≈ ‖ΣG‖ / sqrt(Σ_m ‖ΣG_m‖²(n_m + r ∓ 1)/r)``.

``rank`` (Figure 5a)
    Held-out Pass@1 against the update for several LoGRA ranks (everything else
    the embedded recipe).

``kl`` (Figure 6)
    A longer horizon with three step controls: the cosine budget schedule (paper), a
    constant budget (``kl.budget`` throughout) and none (``kl.enabled=False``: every step
    is the optimizer's own ``update_ratio`` step). The cosine schedule is stretched to the
    horizon (``kl.schedule_steps = --kl-updates``).

Modules: `common` (protocol, shared run helpers), `gradients` (dense-gradient recording),
`cosine`, `rank`, `kl` (one per part) and `cli` (the command line, `main`).

Every RL run is an in-process `RLTrainer` with its run directory under ``--out-dir``
(``rank/r{R}-s{S}``, ``kl/{variant}-s{S}``). Every flag this command does not know is a
``logra train`` option applied to every run (e.g. ``--task chain_sum``). Whatever is
smaller than the full protocol is labelled REDUCED in the output and in the plots.
"""

from __future__ import annotations

from .cli import build_parser, main
from .common import FULL, KL_VARIANTS, PARTS, run_variant
from .cosine import (
    VARIANTS,
    ProjectionVariant,
    cosines,
    group_by_layer,
    layer_of,
    predicted_cosines,
    reconstruction_stats,
    run_cosine,
)
from .gradients import DenseGradientRecorder, coherence, record_gradients
from .kl import kl_values, run_kl
from .rank import run_rank

__all__ = [
    "FULL", "KL_VARIANTS", "PARTS", "VARIANTS", "DenseGradientRecorder", "ProjectionVariant", "build_parser",
    "coherence", "cosines", "group_by_layer", "kl_values", "layer_of", "main", "predicted_cosines",
    "reconstruction_stats", "record_gradients", "run_cosine", "run_kl", "run_rank", "run_variant",
]
