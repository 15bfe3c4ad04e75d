"""The policy-gradient loss: advantages and the per-token objective (GRPO or REINFORCE)."""

from __future__ import annotations

import torch

from .config import RLConfig


def advantages(rewards: torch.Tensor, group: int, algorithm: str, baseline: float) -> torch.Tensor:
    """Per-response advantages: GRPO group-normalised, or reward minus a running baseline."""
    if algorithm == "grpo":
        r = rewards.view(-1, group)
        return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    return rewards - baseline


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, config: RLConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed token loss of a micro-batch (divide by the update's token count outside).

    GRPO: ``-min(ρ·A, clip(ρ, 1±ε)·A)``. REINFORCE: ``-min(ρ, cap)·A·log π`` with the
    truncated ratio treated as a constant weight. Optional k3 penalty to a reference.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    if config.algorithm == "grpo":
        clipped = torch.clamp(ratio, 1 - config.clip_eps, 1 + config.clip_eps)
        per_token = -torch.minimum(ratio * a, clipped * a)
        clip_frac = ((ratio - clipped).abs() > 0).float()
    else:
        weight = torch.clamp(ratio, max=config.is_cap).detach()
        per_token = -weight * a * logp
        clip_frac = (ratio > config.is_cap).float()
    if ref_logp is not None and config.ref_kl_coef > 0:
        log_r = ref_logp - logp
        per_token = per_token + config.ref_kl_coef * (torch.exp(log_r) - log_r - 1)
    stats = {"clip_frac_sum": float((clip_frac * mask).sum())}
    return (per_token * mask).sum(), stats




def mismatch_kl_sum(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ over sampled tokens of the k3 estimate of KL(rollout ‖ trainer), ``e^x - x - 1`` with
    ``x = log π_trainer - log π_rollout``: unbiased, never negative. Divided by the token
    count it is the rollout/trainer mismatch the KL controller subtracts from its budget."""
    with torch.no_grad():
        log_r = (trainer_logp.detach() - rollout_logp) * mask
        return float(((torch.exp(log_r) - log_r - 1) * mask).sum())
