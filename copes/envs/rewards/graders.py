"""Graders: a final answer and a task in, a reward and its details out.

The environment calls one `Grader` when the agent answers. The math and QA graders wrap the
public checking functions of `copes.envs.rewards.math` and `copes.envs.rewards.qa`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from copes.envs.tasks.base import Task


@dataclass(frozen=True)
class Grade:
    """The verdict on one final answer."""

    reward: float
    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


class Grader(Protocol):
    def __call__(self, answer: str, task: Task) -> Grade: ...


class MathGrader:
    """Reward 1 when the answer is mathematically equal to a gold answer, else 0."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout

    def __call__(self, answer: str, task: Task) -> Grade:
        from copes.envs.rewards.math import is_equivalent

        correct = any(is_equivalent(answer, gold, timeout=self.timeout) for gold in task.answers)
        return Grade(
            reward=float(correct),
            correct=correct,
            details={"prediction": answer, "gold": list(task.answers), "correct": correct},
        )


class QAGrader:
    """Reward = token F1 (default, a denser signal for training) or exact match.

    Both metrics are always reported in the details; `correct` means exact match.
    """

    def __init__(self, metric: Literal["f1", "em"] = "f1") -> None:
        if metric not in ("f1", "em"):
            raise ValueError(f"QA reward metric must be 'f1' or 'em', got {metric!r}")
        self.metric = metric

    def __call__(self, answer: str, task: Task) -> Grade:
        from copes.envs.rewards.qa import exact_match, f1_score

        em = exact_match(answer, task.answers)
        f1 = f1_score(answer, task.answers)
        return Grade(
            reward=f1 if self.metric == "f1" else em,
            correct=em == 1.0,
            details={"prediction": answer, "gold": list(task.answers), "em": em, "f1": f1},
        )
