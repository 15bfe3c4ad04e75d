"""The RL post-training job behind `logra train` (a TRL-style config/trainer split).

Module map, in the order data flows through one update:

- `config`: `RLConfig` (every setting), `build_task`, named recipes (`RECIPES`, `recipe_config`,
  `rank_for_width`);
- `build`: the policy (local model or the embedded `tiny` one) and its optimizer;
- `rollout`: sampling responses and their log-probabilities; `workers`: rollouts on
  processes kept in sync by verified low-rank deltas;
- `loss`: advantages and the GRPO / REINFORCE objective;
- `trainer`: `RLTrainer`, the loop (KL control through `logra.kl.controlled_update`);
- `evaluation`: held-out Pass@k and the summary; `checkpoint`, `metrics`, `plots`,
  `collective` (data-parallel reductions).
"""

from ..kl import KLControlConfig
from .config import RECIPES, Recipe, RLConfig, build_task, rank_for_width, recipe_config
from .evaluation import format_summary
from .loss import advantages, policy_loss
from .trainer import RLTrainer

__all__ = [
    "KLControlConfig", "RECIPES", "Recipe", "RLConfig", "RLTrainer", "advantages", "build_task", "format_summary",
    "policy_loss", "rank_for_width", "recipe_config",
]
