"""Reasoning-gym tasks: `ReasoningGymTask` (one procedural dataset) and the paper's
`REASONING_GYM_HARD` mixture (``'rg-hard'``)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from .._optional import package_version, require
from .base import (
    Problem,
    Task,
    build_prompt,
    check_count,
    check_fraction,
    check_mode,
    check_split,
    derive_seed,
    extract_answer,
    split_of,
)
from .mixture import MixtureTask
from .passk import is_correct

#: The reasoning-gym mixture used in the LoGRA paper (equal weights).
REASONING_GYM_HARD: tuple[str, ...] = (
    "codeio",
    "emoji_mystery",
    "rectangle_count",
    "word_ladder",
    "pool_matrix",
    "tsumego",
)

# Reasoning-gym datasets are generated in chunks of this many items, each chunk
# with its own derived seed: some datasets pre-generate or validate their whole
# `size` at construction (acre, word_ladder caps it at 20000), so one huge
# dataset is not an option. A fixed chunk size keeps `problems(split, n, seed)`
# a prefix of `problems(split, m, seed)` for n <= m.
_CHUNK = 1000


def list_tasks() -> list[str]:
    """Names of all reasoning-gym datasets installed, sorted.

    Returns:
        The dataset names accepted by :class:`ReasoningGymTask`.
    """
    # Imported lazily: reasoning_gym takes seconds to import, which users of
    # the JSONL task alone should not pay.
    return sorted(require("reasoning_gym.factory").DATASETS)


def _unknown_task_error(name: str, valid: Sequence[str]) -> ValueError:
    nearest = difflib.get_close_matches(name, valid, n=1, cutoff=0.0)
    hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
    return ValueError(f"unknown reasoning-gym task {name!r}.{hint} Valid names: {', '.join(valid)}")


class ReasoningGymTask(Task):
    """One reasoning-gym procedural dataset.

    Problems come from ``reasoning_gym.create_dataset(name, size=..., seed=...,
    **config)``; grading extracts the answer with ``extract`` and calls the
    dataset's ``score_answer(answer, entry)``. A response with no extractable
    answer scores 0.0 without calling the scorer.

    Splits: each question is assigned to train or eval by a hash of its text
    (``eval_fraction`` of the question space goes to eval), and problems are
    drawn from a seed-derived generator stream, keeping only those of the
    requested split. Eval therefore costs about ``1 / eval_fraction`` generated
    items per problem, and a problem space too small to hold enough eval
    questions raises ``RuntimeError``. Within a split, small problem spaces
    repeat problems.

    Args:
        name: A reasoning-gym dataset name (see :func:`list_tasks`).
        extract: Answer-extraction mode, also chosen as the prompt's format
            instruction.
        partial_credit: Keep reasoning-gym's partial rewards (e.g. 0.01 for a
            present but wrong answer); if False the reward is 1.0 for full
            credit and 0.0 otherwise.
        config: Keyword arguments of the dataset's config dataclass (difficulty
            settings such as ``min_digits``); ``size`` and ``seed`` are managed
            by the task.
        eval_fraction: Fraction of the question space held out for eval.
        instruction: Format instruction appended to each question; None uses
            the default for ``extract``, '' appends nothing (short prompts for
            tiny models).
        strip_prefix: Boilerplate removed from the front of every question
            (e.g. chain_sum's fixed preamble; byte-level prompts pay per byte).

    Raises:
        ValueError: For an unknown task name (listing the valid names and the
            nearest match), an unknown extraction mode, or an invalid config.
    """

    def __init__(
        self,
        name: str,
        extract: str = "answer",
        partial_credit: bool = True,
        config: dict[str, Any] | None = None,
        *,
        eval_fraction: float = 0.1,
        instruction: str | None = None,
        strip_prefix: str = "",
    ) -> None:
        reasoning_gym = require("reasoning_gym")
        valid = list_tasks()
        if name not in valid:
            raise _unknown_task_error(name, valid)
        self.config = dict(config or {})
        managed = {"size", "seed"} & set(self.config)
        if managed:
            raise ValueError(f"config must not set {sorted(managed)}: the task controls size and seed")
        self.name = name
        self.extract = check_mode(extract)
        self.partial_credit = partial_credit
        self.eval_fraction = check_fraction(eval_fraction)
        self.instruction = instruction
        self.strip_prefix = strip_prefix
        self.failures = 0
        self._create = reasoning_gym.create_dataset
        # Built now so a bad config fails at construction, not mid-training;
        # score_answer may read the config (or, e.g. word_ladder, a word list).
        self._scorer = self._create(name, size=1, seed=0, **self.config)

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split``, deterministic in ``seed``.

        ``problems(split, n, seed)`` is a prefix of ``problems(split, m, seed)``
        for ``n <= m``; ``Problem.index`` is the item's position in the
        generator stream of ``(split, seed)``.

        Args:
            split: 'train' or 'eval'.
            n: Number of problems.
            seed: Random seed.

        Returns:
            The problems; reasoning-gym's entry is in ``metadata['entry']``.

        Raises:
            RuntimeError: If the problem space holds too few questions of
                ``split`` to find ``n`` within a generous number of draws.
        """
        check_split(split)
        check_count(n)
        fraction = self.eval_fraction if split == "eval" else 1.0 - self.eval_fraction
        max_draws = int(10 * n / fraction) + 1000
        out: list[Problem] = []
        draw = 0
        while len(out) < n:
            if draw >= max_draws:
                raise RuntimeError(
                    f"{self.name}: found only {len(out)} of {n} {split!r} problems in {draw} draws; "
                    f"the problem space (config {self.config}) is too small for eval_fraction={self.eval_fraction}"
                )
            chunk = draw // _CHUNK
            dataset = self._create(
                self.name, size=_CHUNK, seed=derive_seed(self.name, split, seed, chunk), **self.config
            )
            for i in range(_CHUNK):
                entry = dataset[i]
                if split_of(entry["question"], self.eval_fraction) == split:
                    out.append(self._problem(entry, chunk * _CHUNK + i))
                    if len(out) == n:
                        break
            draw = (chunk + 1) * _CHUNK
        return out

    def _problem(self, entry: dict[str, Any], index: int) -> Problem:
        answer = entry.get("answer")
        return Problem(
            prompt=build_prompt(entry["question"].removeprefix(self.strip_prefix), self.extract, self.instruction),
            answer="" if answer is None else str(answer),
            task=self.name,
            index=index,
            metadata={"entry": entry},
        )

    def _grade(self, problem: Problem, response: str) -> float:
        answer = extract_answer(response, self.extract)
        if answer is None:
            return 0.0
        reward = float(self._scorer.score_answer(answer, problem.metadata["entry"]))
        if self.partial_credit:
            return reward
        return 1.0 if is_correct(reward) else 0.0



def rg_hard(**kw: Any) -> MixtureTask:
    """The `REASONING_GYM_HARD` mixture, equal weights, named ``'rg-hard'``; ``kw`` goes to every task.

    Raises:
        ValueError: the installed reasoning_gym lacks one of its tasks.
    """
    installed = set(list_tasks())
    missing = [n for n in REASONING_GYM_HARD if n not in installed]
    if missing:
        version = package_version("reasoning-gym") or "unknown"
        raise ValueError(
            f"the 'rg-hard' preset needs reasoning-gym tasks {missing}, which the installed "
            f"reasoning_gym (version {version}) does not provide; build a MixtureTask of the others explicitly"
        )
    return MixtureTask([ReasoningGymTask(n, **kw) for n in REASONING_GYM_HARD], name="rg-hard")

