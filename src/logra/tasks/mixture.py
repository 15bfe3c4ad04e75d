"""`MixtureTask`: several tasks sampled by weight, each problem graded by its own task."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from .base import Problem, Task, check_count, check_split, derive_seed


class MixtureTask(Task):
    """Several tasks sampled by weight; each problem is graded by its own task.

    ``problems(split, n, seed)`` draws the task of each of the ``n`` slots
    with probabilities proportional to ``weights`` (deterministic in ``seed``),
    then asks each component for its share with a seed derived from ``seed``
    and the component's name. Components keep their own train/eval split, so
    the mixture's splits are disjoint too.

    Args:
        tasks: Component tasks with distinct names, nested mixtures included
            (problems are routed back to their grader by ``Problem.task``, the
            name of the leaf task that made them).
        weights: Non-negative sampling weights, one per task, not all zero;
            None means equal weights.
        name: Mixture name; defaults to ``'a:w1,b:w2'`` (a :func:`make_task`
            spec for reasoning-gym components).

    Raises:
        ValueError: On empty tasks, duplicate names, or bad weights.
    """

    def __init__(self, tasks: Sequence[Task], weights: Sequence[float] | None = None, name: str | None = None) -> None:
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError("MixtureTask needs at least one task")
        weights = [1.0] * len(self.tasks) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.tasks):
            raise ValueError(f"got {len(weights)} weights for {len(self.tasks)} tasks")
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all zero, got {weights}")
        # Problems carry the name of the leaf task that made them, so a nested
        # mixture is routed by its leaves' names.
        routes = [(leaf, t) for t in self.tasks for leaf in (t._by_name if isinstance(t, MixtureTask) else [t.name])]
        leaves = [leaf for leaf, _ in routes]
        duplicates = sorted({x for x in leaves if leaves.count(x) > 1})
        if duplicates:
            raise ValueError(f"mixture component names must be distinct; repeated: {duplicates}")
        self.weights = weights
        self._by_name = dict(routes)
        self.name = name or ",".join(f"{t.name}:{w:g}" for t, w in zip(self.tasks, weights, strict=True))

    @property
    def failures(self) -> int:  # type: ignore[override]
        """Grading failures summed over the components (each counts its own)."""
        return sum(t.failures for t in self.tasks)

    def _component(self, problem: Problem) -> Task:
        try:
            return self._by_name[problem.task]
        except KeyError:
            raise ValueError(f"problem of task {problem.task!r} is not from mixture {self.name!r}") from None

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split`` mixed by weight, deterministic in ``seed``.

        Args:
            split: 'train' or 'eval'.
            n: Number of problems.
            seed: Random seed.

        Returns:
            The problems, in the sampled interleaved order.
        """
        check_split(split)
        check_count(n)
        rng = random.Random(derive_seed("mixture", split, seed))
        picks = rng.choices(range(len(self.tasks)), weights=self.weights, k=n)
        pools = [
            iter(task.problems(split, picks.count(j), derive_seed(task.name, seed)) if j in picks else [])
            for j, task in enumerate(self.tasks)
        ]
        return [next(pools[j]) for j in picks]

    def score(self, problem: Problem, response: str) -> float:
        """Reward from the component task that made ``problem``; never raises for grader errors.

        Args:
            problem: A problem produced by this mixture.
            response: The model's response text.

        Returns:
            The component's reward.

        Raises:
            ValueError: If ``problem`` came from no component (a caller bug,
                not a grading failure).
        """
        return self._component(problem).score(problem, response)

    def _grade(self, problem: Problem, response: str) -> float:
        return self._component(problem)._grade(problem, response)

    def reference_response(self, problem: Problem) -> str:
        """A full-credit response in the format of the component that made ``problem``.

        Args:
            problem: A problem produced by this mixture.

        Returns:
            The SFT demonstration for ``problem``.
        """
        return self._component(problem).reference_response(problem)

