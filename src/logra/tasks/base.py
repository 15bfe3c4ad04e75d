"""The base of every task: `Problem`, `Task`, answer extraction and formatting, and the
content-hash train/eval split shared by the task kinds (see `logra.tasks`)."""

from __future__ import annotations

import hashlib
import logging
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Answer-extraction modes understood by :func:`extract_answer`.
EXTRACT_MODES: tuple[str, ...] = ("answer", "boxed", "last_line", "full", "tag", "last_number")

#: The two splits of every task.
SPLITS: tuple[str, ...] = ("train", "eval")

# The instruction appended to each question, telling the model the format that
# the task's extraction mode will read back.
_INSTRUCTIONS: dict[str, str] = {
    "answer": "End your response with 'Answer: ' followed by your final answer.",
    "boxed": "Put your final answer within \\boxed{}.",
    "last_line": "Write your final answer alone on the last line.",
    "full": "Reply with only the answer.",
    "tag": "Put your final answer between <answer> and </answer>.",
    "last_number": "Reply with only the result.",
}


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


def check_mode(mode: str) -> str:
    """``mode`` if it is one of `EXTRACT_MODES`, else ValueError."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"unknown extraction mode {mode!r}; expected one of {list(EXTRACT_MODES)}")
    return mode


_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BLANK_LINE_RE = re.compile(r"\n[ \t]*\n")
# a signed integer or decimal; thousands separators are removed before matching
_NUMBER_RE = re.compile(r"[-−]?\d+(?:\.\d+)?")


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
        ``'last_number'``: the last number in the response, as written
            (thousands commas dropped, a Unicode minus read as ``-``), so
            "7 + 5 = 12." reads ``12``: what chat models write for arithmetic.

    Args:
        response: The model's response text.
        mode: One of :data:`EXTRACT_MODES`.

    Returns:
        The extracted answer, or None if the response contains none (an empty
        extraction is also None).

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    check_mode(mode)
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
    elif mode == "tag":
        found = _TAG_RE.findall(response)
        text = found[-1].strip() if found else None
    else:  # last_number
        found = _NUMBER_RE.findall(response.replace(",", ""))
        text = found[-1].replace("−", "-") if found else None
    return text or None


def format_answer(answer: str, mode: str) -> str:
    """Write ``answer`` as a response that :func:`extract_answer` reads back.

    The inverse of :func:`extract_answer` for the given mode, used to build SFT
    demonstrations: ``extract_answer(format_answer(a, m), m) == a.strip()`` for
    any non-empty answer without blank lines (for ``'boxed'``, with balanced
    braces; for ``'last_number'``, a number).

    Args:
        answer: The answer text.
        mode: One of :data:`EXTRACT_MODES`.

    Returns:
        A response string in the format of ``mode``.

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    check_mode(mode)
    answer = answer.strip()
    if mode == "answer":
        return f"Answer:\n{answer}" if "\n" in answer else f"Answer: {answer}"
    if mode == "boxed":
        return f"\\boxed{{{answer}}}"
    if mode == "tag":
        return f"<answer>{answer}</answer>"
    return answer


def build_prompt(question: str, mode: str, instruction: str | None) -> str:
    """The question followed by the format instruction of ``mode`` (``instruction`` overrides it, '' drops it)."""
    instruction = _INSTRUCTIONS[mode] if instruction is None else instruction
    question = question.strip()
    return f"{question}\n\n{instruction}" if instruction else question


# --------------------------------------------------------------------------
# Split and seed helpers
# --------------------------------------------------------------------------


def check_split(split: str) -> str:
    """``split`` if it is one of `SPLITS`, else ValueError."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    return split


def check_fraction(eval_fraction: float) -> float:
    """``eval_fraction`` if it is in (0, 1), else ValueError."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    return eval_fraction


def split_of(text: str, eval_fraction: float) -> str:
    """The split a question belongs to, from a hash of its text (stable across runs)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction else "train"


def derive_seed(*parts: object) -> int:
    """A 32-bit seed from arbitrary parts; far-apart seeds keep reasoning-gym's
    ``Random(seed + i)`` streams from overlapping."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big")


def check_count(n: int) -> int:
    """``n`` if it is a valid number of problems (>= 0), else ValueError."""
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
            logger.log(level, "grading failed for %s problem %d; scored 0.0", problem.task, problem.index,
                       exc_info=True)
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

