"""reasoning-gym generators as a task source: ``--benchmark rg:fraction_simplification``.

reasoning-gym (optional: ``pip install reasoning-gym``) makes procedurally generated problems
with their own scorers. Here each dataset becomes a copes benchmark:

- splits as the synthetic tasks have them: one seeded stream of problems, each kept in the
  split its question hashes to (80/10/10), so train and evaluation never share a question;
- graded by copes' math grader where that was checked against reasoning-gym's scorer on
  gold answers (`MATH_GRADED`; tests/envs/test_reasoning_gym.py), with the answer checks the
  task's wording asks for ("lowest terms"); every other dataset by reasoning-gym's own
  `score_answer` (reward = its score, correct = score 1).
"""

from __future__ import annotations

from typing import Any

from copes.envs.tasks._synthetic_splits import SPLITS, split_of
from copes.envs.tasks.base import Task

DEFAULT_SIZE = 500
# Datasets whose answers are numbers or fractions copes' grader verifies, with the answer
# checks their questions ask for.
MATH_GRADED: dict[str, tuple[str, ...]] = {
    "basic_arithmetic": (),
    "chain_sum": (),
    "decimal_arithmetic": (),
    "fraction_simplification": ("lowest-terms",),
    "gcd": (),
    "gsm_symbolic": (),
    "lcm": (),
    "leg_counting": (),
    "products": (),
}


def _dataset(name: str, size: int, seed: int) -> Any:
    try:
        import reasoning_gym
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"benchmark 'rg:{name}' needs reasoning-gym: pip install reasoning-gym"
        ) from None
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(
            f"reasoning-gym has no dataset {name!r}; it has e.g. {', '.join(sorted(DATASETS)[:12])}"
        )
    return reasoning_gym.create_dataset(name, size=size, seed=seed)


def check_dataset(name: str) -> None:
    """Fail now on an unknown dataset name or a missing reasoning-gym install."""
    _dataset(name, 1, 0)


def reasoning_gym_tasks(
    name: str, split: str, limit: int | None = None, seed: int = 0
) -> list[Task]:
    """The first `limit` (default 500) problems of `split` from the dataset's seeded stream."""
    if split not in SPLITS:
        raise ValueError(f"rg:{name} has splits {SPLITS}, not {split!r}")
    n = DEFAULT_SIZE if limit is None else limit
    draws = 100 * n + 1000
    dataset = _dataset(name, draws, seed)
    checks = MATH_GRADED.get(name, ())
    tasks, seen = [], set()
    for index in range(draws):
        if len(tasks) == n:
            break
        entry = dataset[index]
        question = str(entry["question"])
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        tasks.append(
            Task(
                id=f"rg-{name}-{seed}-{index}",
                question=question,
                answers=(str(entry["answer"]),),
                kind="math",
                source=f"rg:{name}",
                metadata={"reasoning_gym": entry, "reasoning_gym_dataset": name},
                checks=checks,
            )
        )
    return tasks


class ReasoningGymScorer:
    """reasoning-gym's own `score_answer` as a grader (tasks keep their entry in metadata)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._scorer = _dataset(name, 1, 0)

    def __call__(self, answer: str, task: Task) -> Any:
        from copes.envs.rewards.graders import Grade

        entry = task.metadata.get("reasoning_gym")
        if entry is None:
            raise ValueError(
                f"task {task.id!r} carries no reasoning-gym entry; rg:{self.name} grades "
                "with reasoning-gym's scorer, which needs the task as generated"
            )
        score = float(self._scorer.score_answer(answer, entry))
        return Grade(score, score == 1.0, {"prediction": answer, "gold": list(task.answers)})
