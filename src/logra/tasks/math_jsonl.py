"""MATH-style problems from a JSONL file (`MathJsonlTask`), graded with math-verify."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path
from typing import Any

from .._optional import require
from .base import (
    SPLITS,
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


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse_math(text: str) -> list[Any]:
    parse = require("math_verify").parse

    # math_verify's timeout uses signal.alarm, which only works in the main
    # thread; elsewhere it must be disabled or parse raises.
    timeout = 5 if _main_thread() else None
    # Bare answers like "\frac{1}{2}" are only recognised as LaTeX inside math
    # delimiters; plain "0.5" or "1/2" parse either way.
    parsed = parse(text if "$" in text else f"${text}$", parsing_timeout=timeout)
    return parsed or parse(text, parsing_timeout=timeout)


def _normalize_text(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$").rstrip(".")


def _math_equal(gold: str, pred: str) -> bool:
    verify = require("math_verify").verify

    gold_parsed = _parse_math(gold)
    pred_parsed = _parse_math(pred)
    if gold_parsed and pred_parsed:
        timeout = 5 if _main_thread() else None
        if verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
            return True
    # Answers math_verify cannot parse (words, multiple-choice letters) still
    # deserve credit when written identically.
    return _normalize_text(gold) == _normalize_text(pred)


_PROBLEM_KEYS = ("problem", "question", "prompt")


def _read_math_jsonl(path: Path) -> list[tuple[int, str, str]]:
    """(line number, problem, answer) for each non-blank line of ``path``."""
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            problem = next((obj[k] for k in _PROBLEM_KEYS if isinstance(obj.get(k), str) and obj[k].strip()), None)
            if problem is None:
                raise ValueError(f"{where}: no non-empty string under any of {list(_PROBLEM_KEYS)}")
            answer = obj.get("answer")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)
            if isinstance(answer, str) and "####" in answer:
                # GSM8K style: rationale, then "#### <final answer>".
                answer = answer.rsplit("####", 1)[1]
            if answer is None and isinstance(obj.get("solution"), str):
                # MATH style: the final answer is the last \boxed{} of the solution.
                answer = extract_answer(obj["solution"], "boxed")
            if not isinstance(answer, str) or not answer.strip():
                raise ValueError(
                    f"{where}: no answer (expected a non-empty 'answer', or a 'solution' containing \\boxed{{...}})"
                )
            records.append((lineno, problem.strip(), answer.strip()))
    if not records:
        raise ValueError(f"{path}: no problems in file")
    return records


class MathJsonlTask(Task):
    """MATH-style problems from a JSONL file, graded with math-verify.

    Each non-blank line is a JSON object with the problem under ``problem``
    (or ``question`` / ``prompt``) and the reference answer under ``answer``
    (a GSM8K-style ``... #### 42`` keeps the part after ``####``); without
    ``answer``, the last ``\\boxed{}`` of ``solution`` is used. The whole file
    is validated at construction.

    Grading: the extracted answer and the reference are parsed and compared by
    ``math_verify`` (so ``\\frac{1}{2}`` equals ``0.5``); answers it cannot
    parse get credit only if identical up to whitespace.

    Splits: a problem is in eval when a SHA-256 hash of its text falls in the
    lowest ``eval_fraction`` of the hash range, else in train. The split is
    fixed by the problem text alone, so it does not depend on the seed, on line
    order, or on other lines of the file; duplicate problems land in the same
    split. ``problems(split, n, seed)`` shuffles the split with ``seed`` and
    returns ``n`` problems, cycling through fresh shuffles when ``n`` exceeds
    the split (see :meth:`num_problems`).

    Args:
        path: The JSONL file.
        extract: Answer-extraction mode, also chosen as the prompt's format
            instruction.
        eval_fraction: Fraction of problems held out for eval.
        instruction: Format instruction appended to each problem; None uses
            the default for ``extract``, '' appends nothing.
        partial_credit: Accepted so that one setting can go to every task of a
            mixture; MATH answers are right or wrong, so it changes nothing.

    Raises:
        ValueError: On a malformed line, naming the file and 1-based line, or a
            file that cannot be read.
    """

    def __init__(
        self,
        path: str,
        extract: str = "boxed",
        *,
        eval_fraction: float = 0.1,
        instruction: str | None = None,
        partial_credit: bool = False,
    ) -> None:
        self.path = str(path)
        self.name = f"math:{self.path}"
        self.extract = check_mode(extract)
        self.eval_fraction = check_fraction(eval_fraction)
        self.instruction = instruction
        self.failures = 0
        records = _read_math_jsonl(Path(path))
        self._records = records
        self._splits: dict[str, list[int]] = {s: [] for s in SPLITS}
        for i, (_, problem, _) in enumerate(records):
            self._splits[split_of(problem, self.eval_fraction)].append(i)

    def num_problems(self, split: str) -> int:
        """Number of distinct problem lines in ``split``.

        Args:
            split: 'train' or 'eval'.

        Returns:
            The size of the split.
        """
        return len(self._splits[check_split(split)])

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split`` in a ``seed``-shuffled order.

        Args:
            split: 'train' or 'eval'.
            n: Number of problems; above :meth:`num_problems` the split is
                repeated, each pass in a new shuffle.
            seed: Shuffle seed.

        Returns:
            The problems; ``index`` is the 0-based record number in the file.

        Raises:
            ValueError: If ``n > 0`` and the split is empty (a file too small
                for ``eval_fraction``).
        """
        check_split(split)
        check_count(n)
        pool = self._splits[split]
        if n and not pool:
            raise ValueError(
                f"{self.path}: the {split!r} split is empty ({len(self._records)} problems, "
                f"eval_fraction={self.eval_fraction})"
            )
        rng = random.Random(derive_seed(self.path, split, seed))
        order: list[int] = []
        while len(order) < n:
            epoch = list(pool)
            rng.shuffle(epoch)
            order.extend(epoch)
        return [self._problem(i) for i in order[:n]]

    def _problem(self, i: int) -> Problem:
        lineno, problem, answer = self._records[i]
        return Problem(
            prompt=build_prompt(problem, self.extract, self.instruction),
            answer=answer,
            task=self.name,
            index=i,
            metadata={"answer": answer, "path": self.path, "line": lineno},
        )

    def _grade(self, problem: Problem, response: str) -> float:
        pred = extract_answer(response, self.extract)
        if pred is None:
            return 0.0
        return 1.0 if _math_equal(problem.metadata["answer"], pred) else 0.0
