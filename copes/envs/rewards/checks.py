"""Answer checks: per-task conditions on the *form* of an answer, on top of its value.

A grader decides whether an answer has the right value; some tasks also ask for a form
("simplify to lowest terms", "give an integer"). A task names its checks in `Task.checks`
(a JSONL column `checks`, or a benchmark's default); `with_checks` wraps any grader so that
a correct answer failing one of its task's checks scores 0, with the failed check named in
the grade's details. Other packages add checks with `register_answer_check`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace

from copes.envs.rewards.graders import Grade, Grader
from copes.envs.tasks.base import Task

AnswerCheck = Callable[[str, Task], bool]  # (answer, task) -> does the answer have the form

_FRACTION = re.compile(r"^([+-]?)\s*(\d+)\s*/\s*([+-]?\d+)$")


def _plain(answer: str) -> str:
    """The answer as the math grader reads it (boxes, `$`, `\\frac` written as a/b)."""
    from copes.envs.rewards.math import normalize_math_answer

    text = normalize_math_answer(answer)
    if m := re.fullmatch(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}", text):
        text = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    return text


def lowest_terms(answer: str, task: Task) -> bool:
    """An integer, or a fraction p/q with q > 1 and gcd(p, q) = 1 (``92/524`` fails)."""
    text = _plain(answer)
    if re.fullmatch(r"[+-]?\d+", text):
        return True
    m = _FRACTION.match(text)
    if m is None:
        return False
    numerator, denominator = int(m.group(2)), int(m.group(3))
    return denominator > 1 and math.gcd(numerator, denominator) == 1


def integer(answer: str, task: Task) -> bool:
    """Written as an integer (``12``, not ``12.0`` or ``24/2``)."""
    return re.fullmatch(r"[+-]?\d+", _plain(answer)) is not None


def same_form(answer: str, task: Task) -> bool:
    """Written as a gold answer is, after normalization (for "expand", "factor", "simplify")."""
    from copes.envs.rewards.math import normalize_math_answer

    return normalize_math_answer(answer) in {normalize_math_answer(g) for g in task.answers}


ANSWER_CHECKS: dict[str, AnswerCheck] = {
    "lowest-terms": lowest_terms,
    "integer": integer,
    "same-form": same_form,
}


def register_answer_check(name: str, check: AnswerCheck, *, replace: bool = False) -> None:
    """Make `name` usable in `Task.checks`; an existing name needs ``replace=True``."""
    if not callable(check):
        raise TypeError(f"answer check {name!r} must be callable as check(answer, task)")
    if name in ANSWER_CHECKS and not replace:
        raise ValueError(f"answer check {name!r} is already registered; pass replace=True")
    ANSWER_CHECKS[name] = check


def unknown_checks(names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name not in ANSWER_CHECKS]


class CheckedGrader:
    """`grader`, then the task's answer checks: a correct answer failing one scores 0."""

    def __init__(self, grader: Grader) -> None:
        self.grader = grader

    def __call__(self, answer: str, task: Task) -> Grade:
        grade = self.grader(answer, task)
        if not task.checks or not grade.correct:
            return grade
        failed = [name for name in task.checks if not ANSWER_CHECKS[name](answer, task)]
        if not failed:
            return grade
        details = {**grade.details, "failed_checks": failed, "correct": False}
        return replace(grade, reward=0.0, correct=False, details=details)


def with_checks(grader: Grader) -> Grader:
    """`grader` enforcing each task's `checks` (idempotent)."""
    return grader if isinstance(grader, CheckedGrader) else CheckedGrader(grader)
