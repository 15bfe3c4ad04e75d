"""LoGRA: low-rank gradient sketches for memory-efficient RL post-training (arXiv:2610.06647).

The data flow of one update: rollout → reward → loss → sketch → proposal → KL scale →
apply → delta. `LoGRAOptimizer` covers sketch → apply, `predicted_kl` and `KLController`
the KL scale, `PolicyDelta` / `apply_delta` the delta sent to rollout engines.
"""

from .config import DEFAULT_TARGETS, LoGRAConfig
from .delta import PolicyDelta, apply_delta, policy_step, set_policy_step, weights_checksum
from .errors import DeltaMismatchError, KLPredictionError, LoGRAError, NonFiniteSketchError, StaleProposalError
from .kl import DenseProposal, KLController, predicted_kl, probe_logits, realized_kl
from .optimizer import LoGRAOptimizer, Proposal

__all__ = [
    "DEFAULT_TARGETS", "LoGRAConfig", "LoGRAOptimizer", "Proposal", "PolicyDelta", "apply_delta",
    "policy_step", "set_policy_step", "weights_checksum", "LoGRAError", "NonFiniteSketchError",
    "StaleProposalError", "DeltaMismatchError", "KLPredictionError", "DenseProposal", "KLController",
    "predicted_kl", "probe_logits", "realized_kl",
]
__version__ = "0.1.0"
