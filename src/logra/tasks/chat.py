"""`ChatTemplateTask`: a task whose prompts are user turns of a tokenizer's chat template."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Problem, Task


class ChatTemplateTask(Task):
    """``task`` with every prompt given as a user turn of ``tokenizer``'s chat template.

    Instruct models answer their own chat format: SmolLM2-135M-Instruct returns nothing
    for the bare text "What is 7 + 5?" and "7 + 5 = 12." for the same words in a user turn.
    Problems keep their grading data and the name of the task that grades them, so
    scoring, mixtures and reference responses are ``task``'s own.

    Args:
        task: the task to wrap.
        tokenizer: a transformers tokenizer with a ``chat_template``.

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, task: Task, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.task = task
        self.name = task.name
        self.extract = task.extract
        self._tokenizer = tokenizer
        # the trainer tokenizes prompt text with special tokens; where the tokenizer adds
        # its BOS itself, the template's own BOS would otherwise appear twice
        bos = tokenizer.bos_token
        ids = tokenizer("x")["input_ids"]
        self._drop = bos if bos and ids and ids[0] == tokenizer.bos_token_id else ""

    def format(self, prompt: str) -> str:
        """``prompt`` as a user turn followed by the assistant's generation prompt."""
        text = self._tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        return text.removeprefix(self._drop) if self._drop else text

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """``task``'s problems with their prompts in the chat template."""
        return [dataclasses.replace(p, prompt=self.format(p.prompt)) for p in self.task.problems(split, n, seed)]

    def _grade(self, problem: Problem, response: str) -> float:
        return self.task._grade(problem, response)

    def reference_response(self, problem: Problem) -> str:
        """``task``'s full-credit response."""
        return self.task.reference_response(problem)
