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


class FunctionGrader:
    """A user's grading function as a `Grader`: ``fn(answer, task)`` may return a `Grade`, a
    bool (correct: reward 1, else 0) or a number (the reward; correct when it is 1)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, answer: str, task: Task) -> Grade:
        verdict = self.fn(answer, task)
        if isinstance(verdict, Grade):
            return verdict
        if isinstance(verdict, bool):
            return Grade(float(verdict), verdict, {"prediction": answer})
        if isinstance(verdict, (int, float)):
            return Grade(float(verdict), float(verdict) == 1.0, {"prediction": answer})
        raise TypeError(
            f"grader {getattr(self.fn, '__name__', self.fn)!r} returned "
            f"{type(verdict).__name__}; return a Grade, a bool or a number"
        )


def as_grader(candidate: Any, default: Grader) -> Grader:
    """`default` for None; a `Grade`-returning grader or a plain function otherwise."""
    if candidate is None:
        return default
    if not callable(candidate):
        raise TypeError(f"grader must be callable as grader(answer, task), got {candidate!r}")
    return FunctionGrader(candidate)


class MathGrader:
    """Reward 1 when the answer equals a gold answer in value and leaves no arithmetic
    undone (`copes.envs.rewards.math.grade_answer`), else 0. The details say when an answer
    of the right value was refused for its undone arithmetic (`undone_arithmetic`)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout

    def __call__(self, answer: str, task: Task) -> Grade:
        from copes.envs.rewards.math import UNDONE_ARITHMETIC, grade_answer

        correct, refused = False, None
        for gold in task.answers:
            verdict = grade_answer(answer, gold, timeout=self.timeout)
            correct, refused = verdict.correct, refused or verdict.refused
            if correct:
                break
        refused = None if correct else refused
        return Grade(
            reward=float(correct),
            correct=correct,
            details={
                "prediction": answer,
                "gold": list(task.answers),
                "correct": correct,
                "refused": refused,
                "undone_arithmetic": refused == UNDONE_ARITHMETIC,
            },
        )


class QAGrader:
    """Reward = token F1 (default, a denser signal for training) or exact match, by `rule`,
    the official QA script reproduced (`copes.envs.rewards.qa.QA_RULES`; default SQuAD v1.1).

    Both metrics are always reported in the details; `correct` means exact match.
    """

    def __init__(self, metric: Literal["f1", "em"] = "f1", rule: str = "squad") -> None:
        from copes.envs.rewards.qa import get_qa_rule

        if metric not in ("f1", "em"):
            raise ValueError(f"QA reward metric must be 'f1' or 'em', got {metric!r}")
        self.metric = metric
        self.rule = get_qa_rule(rule).name

    def __call__(self, answer: str, task: Task) -> Grade:
        from copes.envs.rewards.qa import exact_match, f1_score

        em = exact_match(answer, task.answers)
        f1 = f1_score(answer, task.answers, rule=self.rule)
        return Grade(
            reward=f1 if self.metric == "f1" else em,
            correct=em == 1.0,
            details={"prediction": answer, "gold": list(task.answers), "em": em, "f1": f1},
        )
