"""Verifiable reasoning tasks: problem generation and reward functions.

This is the reward side of the RL loop. A :class:`Task` produces
:class:`Problem` objects (the prompt the policy sees plus whatever the grader
needs), the loop samples responses, and :meth:`Task.score` turns each response
into a reward in ``[0, 1]``.

Three kinds of task are provided (and :class:`ChatTemplateTask`, which gives any of
them to an instruct model as chat turns):

* :class:`ReasoningGymTask` wraps one procedural dataset of ``reasoning_gym``;
* :class:`MathJsonlTask` reads MATH-style problems from a JSONL file and grades
  them with ``math_verify``;
* :class:`MixtureTask` samples from several tasks by weight.

:func:`make_task` builds any of them from a short spec string.

Modules: `base` (`Problem`, `Task`, answer extraction, the split), `gym`
(reasoning-gym tasks, ``rg-hard``), `math_jsonl` (MATH JSONL + math-verify), `mixture`,
`chat` (`ChatTemplateTask`), `spec` (`make_task`) and `passk` (`is_correct`, pass@k).

Train/eval separation: both the reasoning-gym and the JSONL tasks assign every
problem to a split by a hash of its question text (a fixed fraction,
``eval_fraction``, goes to eval). The split is therefore a property of the
problem's content, not of the seed, so no seed of ``'train'`` can ever produce
an ``'eval'`` problem. Seeds alone would not guarantee this: reasoning-gym
builds item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``, so the
datasets for seeds ``s`` and ``s + 1`` are shifted copies of each other, and
small problem spaces repeat questions under any seed.
"""

from .base import EXTRACT_MODES, Problem, Task, extract_answer, format_answer
from .chat import ChatTemplateTask
from .gym import REASONING_GYM_HARD, ReasoningGymTask, list_tasks
from .math_jsonl import MathJsonlTask
from .mixture import MixtureTask
from .passk import is_correct, pass_at_k, pass_at_k_mean
from .spec import make_task

__all__ = [
    "EXTRACT_MODES",
    "ChatTemplateTask",
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
