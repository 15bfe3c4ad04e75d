"""Verifiable reasoning tasks: problem generation and reward functions.

This is the reward side of the RL loop. A :class:`Task` produces
:class:`Problem` objects (the prompt the policy sees plus whatever the grader
needs), the loop samples responses, and :meth:`Task.score` turns each response
into a reward in ``[0, 1]``.

Three kinds of task are provided:

* :class:`ReasoningGymTask` wraps one procedural dataset of ``reasoning_gym``;
* :class:`MathJsonlTask` reads MATH-style problems from a JSONL file and grades
  them with ``math_verify``;
* :class:`MixtureTask` samples from several tasks by weight.

:func:`make_task` builds any of them from a short spec string.

Train/eval separation: both the reasoning-gym and the JSONL tasks assign every
problem to a split by a hash of its question text (a fixed fraction,
``eval_fraction``, goes to eval). The split is therefore a property of the
problem's content, not of the seed, so no seed of ``'train'`` can ever produce
an ``'eval'`` problem. Seeds alone would not guarantee this: reasoning-gym
builds item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``, so the
datasets for seeds ``s`` and ``s + 1`` are shifted copies of each other, and
small problem spaces repeat questions under any seed.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import random
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._optional import require

__all__ = [
    "EXTRACT_MODES",
    "REASONING_GYM_HARD",
    "MathJsonlTask",
    "MixtureTask",
    "Problem",
    "ReasoningGymTask",
    "Task",
    "extract_answer",
    "format_answer",
    "is_correct",
    "list_tasks",
    "make_task",
    "pass_at_k",
    "pass_at_k_mean",
]

logger = logging.getLogger(__name__)

#: Answer-extraction modes understood by :func:`extract_answer`.
EXTRACT_MODES: tuple[str, ...] = ("answer", "boxed", "last_line", "full", "tag")

#: The reasoning-gym mixture used in the LoGRA paper (equal weights).
REASONING_GYM_HARD: tuple[str, ...] = (
    "codeio",
    "emoji_mystery",
    "rectangle_count",
    "word_ladder",
    "pool_matrix",
    "tsumego",
)

_SPLITS: tuple[str, ...] = ("train", "eval")

# Scorers compute rewards in floating point (e.g. len(a) / len(b)); a reward
# this close to 1 is full credit, not a meaningful partial one.
_FULL_CREDIT_TOL = 1e-9

# The instruction appended to each question, telling the model the format that
# the task's extraction mode will read back.
_INSTRUCTIONS: dict[str, str] = {
    "answer": "End your response with 'Answer: ' followed by your final answer.",
    "boxed": "Put your final answer within \\boxed{}.",
    "last_line": "Write your final answer alone on the last line.",
    "full": "Reply with only the answer.",
    "tag": "Put your final answer between <answer> and </answer>.",
}

# Reasoning-gym datasets are generated in chunks of this many items, each chunk
# with its own derived seed: some datasets pre-generate or validate their whole
# `size` at construction (acre, word_ladder caps it at 20000), so one huge
# dataset is not an option. A fixed chunk size keeps `problems(split, n, seed)`
# a prefix of `problems(split, m, seed)` for n <= m.
_CHUNK = 1000


# --------------------------------------------------------------------------
# Problems and answer extraction
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt the policy is conditioned on plus grading data.

    Attributes:
        prompt: The text given to the policy: the task's question followed by a
            short instruction about the answer format the task will extract.
        answer: The reference answer (for SFT demonstrations and display; see
            :meth:`Task.reference_response` for a full-credit response).
        task: Name of the task that produced the problem and grades it.
        index: Position of the problem in its task's deterministic source
            (generator stream or file), for reproducing it.
        metadata: Whatever the grader needs (e.g. reasoning-gym's entry).
    """

    prompt: str
    answer: str
    task: str
    index: int
    # A dict is unhashable; leaving it out of the hash keeps Problem usable in
    # sets while equality still compares it.
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)


def _check_mode(mode: str) -> str:
    if mode not in EXTRACT_MODES:
        raise ValueError(f"unknown extraction mode {mode!r}; expected one of {list(EXTRACT_MODES)}")
    return mode


_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BLANK_LINE_RE = re.compile(r"\n[ \t]*\n")


def _strip_markdown(text: str) -> str:
    # Chat models write "**Answer:** 42"; the bold markers are not the answer.
    return text.strip().strip("*").strip()


def _balanced_braces(text: str, start: int) -> str | None:
    """Content of the brace group opened just before ``start``, or None if unclosed."""
    depth = 1
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            # An escaped brace (\{ or \}) is a literal, e.g. in \boxed{\{1,2\}}.
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_answer(response: str, mode: str) -> str | None:
    """Extract the final answer from a model response.

    Modes:
        ``'answer'``: text after the last ``Answer:`` (case-insensitive), first
            line, stripped, with markdown bold markers removed. If nothing
            follows ``Answer:`` on its line, the next paragraph (up to a blank
            line) is the answer, so multi-line answers (e.g. matrices) can be
            written below an ``Answer:`` line.
        ``'boxed'``: content of the last ``\\boxed{...}`` (or ``\\fbox{...}``),
            with nested and escaped braces handled. An unclosed last box (a
            truncated response) yields None rather than an earlier box.
        ``'last_line'``: the last non-blank line, stripped.
        ``'full'``: the whole response, stripped.
        ``'tag'``: content of the last ``<answer>...</answer>``, stripped
            (reasoning-gym's own convention).

    Args:
        response: The model's response text.
        mode: One of :data:`EXTRACT_MODES`.

    Returns:
        The extracted answer, or None if the response contains none (an empty
        extraction is also None).

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    _check_mode(mode)
    text: str | None = None
    if mode == "answer":
        matches = list(_ANSWER_RE.finditer(response))
        if matches:
            rest = response[matches[-1].end() :]
            first, _, below = rest.partition("\n")
            text = _strip_markdown(first)
            if not text:
                text = _strip_markdown(_BLANK_LINE_RE.split(below.strip("\n"), maxsplit=1)[0])
    elif mode == "boxed":
        matches = list(_BOXED_RE.finditer(response))
        if matches:
            inner = _balanced_braces(response, matches[-1].end())
            text = inner.strip() if inner is not None else None
    elif mode == "last_line":
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        text = lines[-1] if lines else None
    elif mode == "full":
        text = response.strip()
    else:  # tag
        found = _TAG_RE.findall(response)
        text = found[-1].strip() if found else None
    return text or None


def format_answer(answer: str, mode: str) -> str:
    """Write ``answer`` as a response that :func:`extract_answer` reads back.

    The inverse of :func:`extract_answer` for the given mode, used to build SFT
    demonstrations: ``extract_answer(format_answer(a, m), m) == a.strip()`` for
    any non-empty answer without blank lines (and, for ``'boxed'``, with
    balanced braces).

    Args:
        answer: The answer text.
        mode: One of :data:`EXTRACT_MODES`.

    Returns:
        A response string in the format of ``mode``.

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    _check_mode(mode)
    answer = answer.strip()
    if mode == "answer":
        return f"Answer:\n{answer}" if "\n" in answer else f"Answer: {answer}"
    if mode == "boxed":
        return f"\\boxed{{{answer}}}"
    if mode == "tag":
        return f"<answer>{answer}</answer>"
    return answer


def _build_prompt(question: str, mode: str, instruction: str | None) -> str:
    instruction = _INSTRUCTIONS[mode] if instruction is None else instruction
    question = question.strip()
    return f"{question}\n\n{instruction}" if instruction else question


# --------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Split and seed helpers
# --------------------------------------------------------------------------


def _check_split(split: str) -> str:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(_SPLITS)}")
    return split


def _check_fraction(eval_fraction: float) -> float:
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    return eval_fraction


def _split_of(text: str, eval_fraction: float) -> str:
    """The split a question belongs to, from a hash of its text (stable across runs)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction else "train"


def _derive_seed(*parts: object) -> int:
    """A 32-bit seed from arbitrary parts; far-apart seeds keep reasoning-gym's
    ``Random(seed + i)`` streams from overlapping."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big")


def _check_count(n: int) -> int:
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    return n


# --------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------


class Task(ABC):
    """A verifiable task: makes problems and grades responses.

    Subclasses implement :meth:`problems` and ``_grade`` (the raw grader, which
    may raise); :meth:`score` wraps ``_grade`` so that a grader error never
    crashes the training loop: the sample gets reward 0.0 and :attr:`failures`
    is incremented.

    Attributes:
        name: Task name, stored in each problem's ``task`` field.
        extract: Answer-extraction mode (see :func:`extract_answer`).
        failures: Number of responses whose grading raised (or returned a
            non-finite value) and were scored 0.0.
    """

    name: str
    extract: str = "answer"
    failures: int = 0

    @abstractmethod
    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split`` ('train' or 'eval'), deterministic in ``seed``.

        Train and eval problems are disjoint.
        """

    @abstractmethod
    def _grade(self, problem: Problem, response: str) -> float:
        """Raw reward for ``response``; may raise."""

    def score(self, problem: Problem, response: str) -> float:
        """Reward in ``[0, 1]`` for ``response`` to ``problem``; never raises.

        A grader exception or a non-finite reward scores 0.0 and increments
        :attr:`failures` (logged as a warning the first time, at debug level
        after that).

        Args:
            problem: A problem produced by this task.
            response: The model's response text.

        Returns:
            The reward, clipped to ``[0, 1]``.
        """
        try:
            reward = float(self._grade(problem, response))
            if not math.isfinite(reward):
                raise ValueError(f"grader returned non-finite reward {reward}")
        except Exception:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            logger.log(level, "grading failed for %s problem %d; scored 0.0", problem.task, problem.index, exc_info=True)
            return 0.0
        return min(1.0, max(0.0, reward))

    def reference_response(self, problem: Problem) -> str:
        """A response that earns full credit: the reference answer in this task's format.

        Args:
            problem: A problem produced by this task.

        Returns:
            The SFT demonstration for ``problem``.
        """
        return format_answer(problem.answer, self.extract)


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
        self.extract = _check_mode(extract)
        self.partial_credit = partial_credit
        self.eval_fraction = _check_fraction(eval_fraction)
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
        _check_split(split)
        _check_count(n)
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
                self.name, size=_CHUNK, seed=_derive_seed(self.name, split, seed, chunk), **self.config
            )
            for i in range(_CHUNK):
                entry = dataset[i]
                if _split_of(entry["question"], self.eval_fraction) == split:
                    out.append(self._problem(entry, chunk * _CHUNK + i))
                    if len(out) == n:
                        break
            draw = (chunk + 1) * _CHUNK
        return out

    def _problem(self, entry: dict[str, Any], index: int) -> Problem:
        answer = entry.get("answer")
        return Problem(
            prompt=_build_prompt(entry["question"].removeprefix(self.strip_prefix), self.extract, self.instruction),
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

    Raises:
        ValueError: On a malformed line, naming the file and 1-based line.
    """

    def __init__(
        self,
        path: str,
        extract: str = "boxed",
        *,
        eval_fraction: float = 0.1,
        instruction: str | None = None,
    ) -> None:
        self.path = str(path)
        self.name = f"math:{self.path}"
        self.extract = _check_mode(extract)
        self.eval_fraction = _check_fraction(eval_fraction)
        self.instruction = instruction
        self.failures = 0
        records = _read_math_jsonl(Path(path))
        self._records = records
        self._splits: dict[str, list[int]] = {s: [] for s in _SPLITS}
        for i, (_, problem, _) in enumerate(records):
            self._splits[_split_of(problem, self.eval_fraction)].append(i)

    def num_problems(self, split: str) -> int:
        """Number of distinct problem lines in ``split``.

        Args:
            split: 'train' or 'eval'.

        Returns:
            The size of the split.
        """
        return len(self._splits[_check_split(split)])

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
        _check_split(split)
        _check_count(n)
        pool = self._splits[split]
        if n and not pool:
            raise ValueError(
                f"{self.path}: the {split!r} split is empty ({len(self._records)} problems, "
                f"eval_fraction={self.eval_fraction})"
            )
        rng = random.Random(_derive_seed(self.path, split, seed))
        order: list[int] = []
        while len(order) < n:
            epoch = list(pool)
            rng.shuffle(epoch)
            order.extend(epoch)
        return [self._problem(i) for i in order[:n]]

    def _problem(self, i: int) -> Problem:
        lineno, problem, answer = self._records[i]
        return Problem(
            prompt=_build_prompt(problem, self.extract, self.instruction),
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
        self.name = name or ",".join(f"{t.name}:{w:g}" for t, w in zip(self.tasks, weights))

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
        _check_split(split)
        _check_count(n)
        rng = random.Random(_derive_seed("mixture", split, seed))
        picks = rng.choices(range(len(self.tasks)), weights=self.weights, k=n)
        pools = [
            iter(task.problems(split, picks.count(j), _derive_seed(task.name, seed)) if j in picks else [])
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


# --------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------


def _rg_hard(**kw: Any) -> MixtureTask:
    installed = set(list_tasks())
    missing = [n for n in REASONING_GYM_HARD if n not in installed]
    if missing:
        version = getattr(require("reasoning_gym"), "__version__", "unknown")
        raise ValueError(
            f"the 'rg-hard' preset needs reasoning-gym tasks {missing}, which the installed "
            f"reasoning_gym (version {version}) does not provide; build a MixtureTask of the others explicitly"
        )
    return MixtureTask([ReasoningGymTask(n, **kw) for n in REASONING_GYM_HARD], name="rg-hard")


def _split_weight(part: str) -> tuple[str, float]:
    head, sep, tail = part.rpartition(":")
    if sep:
        try:
            return head.strip(), float(tail)
        except ValueError:
            pass  # a colon that is not a weight, as in "math:/path.jsonl"
    return part, 1.0


def make_task(spec: str, **kw: Any) -> Task:
    """Build a task from a spec string.

    Specs:
        ``'<name>'``: a reasoning-gym task (:class:`ReasoningGymTask`);
        ``'rg-hard'``: the :data:`REASONING_GYM_HARD` mixture, equal weights;
        ``'math:/path/file.jsonl'``: a :class:`MathJsonlTask`;
        ``'a:0.7,b:0.3'``: a weighted :class:`MixtureTask` whose components are
        themselves specs (a component without ``:weight`` has weight 1, so
        ``'a,b'`` is an equal mixture and ``'math:/f.jsonl:0.5,chain_sum:0.5'``
        works; paths must not contain commas).

    Args:
        spec: The spec string.
        **kw: Keyword arguments forwarded to every leaf task's constructor
            (e.g. ``extract``, ``partial_credit``, ``config``).

    Returns:
        The task.

    Raises:
        ValueError: On an empty or unknown spec, or when ``'rg-hard'`` names a
            task the installed reasoning_gym lacks.
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("empty task spec")
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 1:
        name, weight = _split_weight(spec)
        if name == spec:
            if spec == "rg-hard":
                return _rg_hard(**kw)
            if spec.startswith("math:"):
                return MathJsonlTask(spec[len("math:") :], **kw)
            return ReasoningGymTask(spec, **kw)
    if any(not p for p in parts):
        raise ValueError(f"empty component in task spec {spec!r}")
    named = [_split_weight(p) for p in parts]
    return MixtureTask([make_task(n, **kw) for n, _ in named], [w for _, w in named])
