"""A scripted expert that acts in the synthetic environments, for warm-start transcripts.

It plays by the rules of the real environment (real tool calls, real tool outputs): for a
math task it sends the task's `solution_code` to the Python tool and answers with what the
tool printed; for a QA task it searches each hop and answers with the last entity found.
With probability `mistake_rate` per episode it errs the way a weak agent does (a wrong
number in the code, a guess without the tool, a wrong search, the intermediate entity as
the answer), so a model trained on its transcripts is competent but far from perfect.
"""

from __future__ import annotations

import random
import re
from typing import Any

from copes.envs.parsing import CallFormat, format_call
from copes.envs.tasks.base import Task


def _last_tool_output(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message["role"] == "tool":
            return str(message["content"]).strip()
    return ""


class ScriptedExpert:
    """Chooses the next turn from the task's plan (`solution_code` or `hops` metadata)."""

    def __init__(
        self, mistake_rate: float = 0.2, seed: int = 0, call_format: CallFormat = "tags"
    ) -> None:
        if not 0 <= mistake_rate <= 1:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate}")
        self.mistake_rate = mistake_rate
        self.call_format = call_format
        self._rng = random.Random(seed)
        self._mistake: dict[str, str | None] = {}

    def begin(self, task: Task) -> None:
        """Decide, once per episode, whether and how this episode goes wrong."""
        kinds = ("code", "guess") if task.kind == "math" else ("search", "early")
        wrong = self._rng.random() < self.mistake_rate
        self._mistake[task.id] = self._rng.choice(kinds) if wrong else None

    def act(self, task: Task, messages: list[dict[str, Any]]) -> str:
        """The next assistant turn, given the conversation so far."""
        if task.id not in self._mistake:
            self.begin(task)
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if task.kind == "math":
            return self._math(task, turn, messages)
        return self._qa(task, turn, messages)

    def _math(self, task: Task, turn: int, messages: list[dict[str, Any]]) -> str:
        mistake = self._mistake[task.id]
        if mistake == "guess":
            return f"<answer>{self._perturb_number(task.answers[0])}</answer>"
        if turn == 0:
            code = task.metadata["solution_code"]
            if mistake == "code":
                code = self._perturb_number(code)
            return format_call(self.call_format, "python", {"code": code})
        output = _last_tool_output(messages).splitlines()
        return f"<answer>{output[-1].strip() if output else '0'}</answer>"

    def _qa(self, task: Task, turn: int, messages: list[dict[str, Any]]) -> str:
        hops = task.metadata["hops"]
        mistake = self._mistake[task.id]
        if turn < len(hops):
            query = hops[turn]["query"]
            if mistake == "search" and turn == len(hops) - 1:
                others = [p.title for p in task.passages if p.title not in query]
                query = self._rng.choice(others) if others else query
            return format_call(self.call_format, "search", {"query": query})
        answer = hops[-1]["answer"] if mistake != "early" else hops[0]["answer"]
        if mistake == "search":
            # Answer with the first entity named in the wrong passage it found.
            found = re.findall(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)?\b", _last_tool_output(messages))
            answer = found[-1] if found else answer
        return f"<answer>{answer}</answer>"

    def _perturb_number(self, text: str) -> str:
        """Change one multi-digit number in `text` by a small amount."""
        numbers = list(re.finditer(r"\d{2,}", text))
        if not numbers:
            return text + "1"
        match = self._rng.choice(numbers)
        value = int(match.group()) + self._rng.choice((-2, -1, 1, 2, 10))
        return text[: match.start()] + str(max(value, 0)) + text[match.end() :]
