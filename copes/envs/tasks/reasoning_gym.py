"""reasoning-gym generators as a task source: ``--benchmark rg:fraction_simplification``.

reasoning-gym (optional: ``pip install reasoning-gym``) makes procedurally generated problems
with their own scorers. Here each dataset becomes a copes benchmark:

- splits as the synthetic tasks have them: one seeded stream of problems, each kept in the
  split its question hashes to (80/10/10), so train and evaluation never share a question;
- graded by the dataset's own `score_answer`, the official rule (as each QA benchmark is
  scored by its own script): copes only extracts the answer (the `<answer>` tag, its box).
  The reward is the score, partial credit included (measured on `products`, gold 8717446:
  0.7 for `8717446 12`, 0.333 for `The answer is 8717446`, and 0.2 for `7 * 1` whose gold is
  7); `correct`, and so accuracy and pass@k, is a full score of 1 only. Until issue 48 nine
  arithmetic datasets were graded by copes' math grader instead, which evaluated
  `1663 * 5242` for the agent.
"""

from __future__ import annotations

from typing import Any

from copes.envs.tasks._synthetic_splits import SPLITS, split_of
from copes.envs.tasks.base import Task

DEFAULT_SIZE = 500


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
            )
        )
    return tasks


class ReasoningGymScorer:
    """reasoning-gym's own `score_answer` as a grader (tasks keep their entry in metadata).

    reward = the score (partial credit included), correct = a score of 1. Where the gold is a
    plain number and the score is not 1, the details also say whether the answer had the
    gold's value with its arithmetic left undone (`1663 * 5242`): the count every report keeps
    (copes' math rule, `copes.envs.rewards.math.grade_answer`), which never raises a score.
    """

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
        details: dict[str, Any] = {"prediction": answer, "gold": list(task.answers)}
        details["score"] = score
        details["undone_arithmetic"] = score < 1.0 and _undone_arithmetic(answer, task)
        return Grade(score, score == 1.0, details)


def _undone_arithmetic(answer: str, task: Task) -> bool:
    """Whether `answer` has a plain-number gold's value with its arithmetic left undone."""
    from copes.envs.rewards._math_normalize import finish, prepare
    from copes.envs.rewards._math_undone import is_plain_number
    from copes.envs.rewards.math import grade_answer

    def plain(text: str) -> bool:
        return is_plain_number(finish(prepare(text), keep_spaces=False))

    if plain(answer):  # a written number leaves nothing undone: no grading needed (hot path)
        return False
    golds = [g for g in task.answers if plain(g)]
    return any(grade_answer(answer, gold).undone_arithmetic for gold in golds)
