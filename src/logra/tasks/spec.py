"""Spec strings: `make_task` builds any task from a short string (``'chain_sum'``,
``'rg-hard'``, ``'math:/path.jsonl'``, ``'a:0.7,b:0.3'``)."""

from __future__ import annotations

from typing import Any

from .base import Task
from .gym import ReasoningGymTask, rg_hard
from .math_jsonl import MathJsonlTask
from .mixture import MixtureTask


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
                return rg_hard(**kw)
            if spec.startswith("math:"):
                return MathJsonlTask(spec[len("math:") :], **kw)
            return ReasoningGymTask(spec, **kw)
    if any(not p for p in parts):
        raise ValueError(f"empty component in task spec {spec!r}")
    named = [_split_weight(p) for p in parts]
    return MixtureTask([make_task(n, **kw) for n, _ in named], [w for _, w in named])
