"""Correctness of a reward and the unbiased pass@k estimator."""

from __future__ import annotations

from collections.abc import Iterable

# Scorers compute rewards in floating point (e.g. len(a) / len(b)); a reward
# this close to 1 is full credit, not a meaningful partial one.
_FULL_CREDIT_TOL = 1e-9


def is_correct(reward: float) -> bool:
    """Whether a reward counts as a correct response: full credit (>= 1.0).

    Partial credit (e.g. reasoning-gym's 0.01 for a present but wrong answer)
    is not correct. Rewards within 1e-9 of 1.0 count as full credit to absorb
    floating-point rounding in scorers.

    Args:
        reward: A reward returned by :meth:`Task.score`.

    Returns:
        True for full credit.
    """
    return reward >= 1.0 - _FULL_CREDIT_TOL


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator of Chen et al. (2021).

    Computes ``1 - C(n - c, k) / C(n, k)``, the probability that at least one of
    ``k`` responses drawn without replacement from ``n`` samples (``c`` of them
    correct) is correct, as the product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``,
    which avoids the huge binomials.

    Args:
        n: Number of samples drawn for the problem.
        c: Number of correct samples, ``0 <= c <= n``.
        k: The k of pass@k, ``1 <= k <= n``.

    Returns:
        The estimate in ``[0, 1]``.

    Raises:
        ValueError: If the arguments are out of range.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        # Every k-subset contains a correct sample.
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_mean(correct_counts: Iterable[int], n: int, k: int) -> float:
    """Mean of :func:`pass_at_k` over problems that each drew ``n`` samples.

    Args:
        correct_counts: Number of correct samples for each problem.
        n: Samples drawn per problem.
        k: The k of pass@k.

    Returns:
        The mean pass@k estimate.

    Raises:
        ValueError: If ``correct_counts`` is empty or any count is out of range.
    """
    values = [pass_at_k(n, c, k) for c in correct_counts]
    if not values:
        raise ValueError("pass_at_k_mean needs at least one problem")
    return sum(values) / len(values)
