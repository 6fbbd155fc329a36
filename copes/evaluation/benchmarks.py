"""The evaluation registry: a benchmark name -> its tasks, its environment and its grader.

`EVAL_BENCHMARKS["gsm8k"]` says everything an evaluation needs: which task loader of
`copes.envs.tasks.registry` reads it (and its default split), which environment preset runs
it (ToolMath-v0 with the Python tool, or ToolQA-v0 with BM25 search over each question's
passages) and how final answers are graded and grouped for majority voting.

Every file-backed benchmark reads a local data directory instead of the hub when given one
(`data_dir/<name>.jsonl`, or `data_dir/<name>/<split>.jsonl`; see docs/evaluation.md).
Synthetic benchmarks are generated from a fixed seed and need no files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from copes.envs.rewards.graders import Grader, MathGrader, QAGrader
from copes.envs.tasks.base import Task

GraderKind = Literal["math", "qa"]


@dataclass(frozen=True)
class EvalBenchmark:
    """One evaluation benchmark.

    Attributes:
        name: the name users type (`--benchmarks gsm8k,hotpotqa`).
        loader: its entry in `copes.envs.tasks.registry.BENCHMARKS`.
        split: the split evaluated by default.
        grader: "math" (answer extraction + symbolic equivalence; correct = equal) or "qa"
            (SQuAD normalization; correct = exact match, reward = token F1).
        env: the environment preset it runs in, "ToolMath-v0" or "ToolQA-v0".
    """

    name: str
    loader: str
    split: str
    grader: GraderKind

    @property
    def env(self) -> str:
        return "ToolMath-v0" if self.grader == "math" else "ToolQA-v0"

    @property
    def source(self) -> str | None:
        """The default hub id (None for generated benchmarks)."""
        from copes.envs.tasks.registry import BENCHMARKS

        return BENCHMARKS[self.loader].source

    def load_tasks(
        self,
        *,
        data_dir: str | Path | None = None,
        limit: int | None = None,
        split: str | None = None,
    ) -> list[Task]:
        """The first `limit` tasks of `split` (default: the benchmark's), from `data_dir` or
        the hub; generated benchmarks ignore `data_dir`. Task ids must be unique."""
        from copes.envs.tasks.registry import load_benchmark

        data_dir = None if self.source is None else data_dir
        tasks = load_benchmark(
            self.loader, split=split or self.split, limit=limit, data_dir=data_dir
        )
        seen: set[str] = set()
        for task in tasks:
            if task.id in seen:
                raise ValueError(
                    f"benchmark {self.name!r} has two tasks with id {task.id!r}; evaluation "
                    f"keys samples by task id, so ids must be unique within a split"
                )
            seen.add(task.id)
        return tasks

    def make_env(self, tasks: Sequence[Task], *, max_turns: int = 4, **env_kwargs: Any) -> Any:
        """A fresh environment (the math or QA preset) over `tasks`; pick one per episode
        with ``reset(options={"task": task})``."""
        from copes.envs.presets import tool_math_env, tool_qa_env

        make = tool_math_env if self.grader == "math" else tool_qa_env
        return make(tasks=tasks, max_turns=max_turns, **env_kwargs)

    def make_grader(self) -> Grader:
        """The grader the environment uses, for re-grading stored predictions."""
        return MathGrader() if self.grader == "math" else QAGrader()

    @property
    def normalize(self) -> Callable[[str], str]:
        """The canonical form of an answer, by which majority voting groups samples."""
        if self.grader == "math":
            from copes.envs.rewards.math import normalize_math_answer

            return _never_raises(normalize_math_answer)
        from copes.envs.rewards.qa import normalize_answer

        return normalize_answer


def _never_raises(normalize: Callable[[str], str]) -> Callable[[str], str]:
    """`normalize`, falling back to the stripped answer on input it cannot parse: a model's
    malformed answer must not stop a report (it is graded wrong anyway)."""

    def safe(answer: str) -> str:
        try:
            return normalize(answer)
        except Exception:
            return answer.strip()

    return safe


EVAL_BENCHMARKS: dict[str, EvalBenchmark] = {
    b.name: b
    for b in (
        EvalBenchmark("aime24", "aime24", "train", "math"),
        EvalBenchmark("aime25", "aime25", "test", "math"),
        EvalBenchmark("gsm8k", "gsm8k", "test", "math"),
        EvalBenchmark("math500", "math500", "test", "math"),
        EvalBenchmark("hotpotqa", "hotpotqa", "validation", "qa"),
        EvalBenchmark("2wiki", "2wiki", "validation", "qa"),
        EvalBenchmark("musique", "musique", "validation", "qa"),
        EvalBenchmark("synthetic-math", "synthetic-math", "test", "math"),
        EvalBenchmark("synthetic-qa", "synthetic-qa", "test", "qa"),
    )
}


def get_benchmark(name: str) -> EvalBenchmark:
    """The registry entry of `name`; ValueError listing the known names if there is none."""
    try:
        return EVAL_BENCHMARKS[name]
    except KeyError:
        raise ValueError(
            f"unknown benchmark {name!r}; known benchmarks: {', '.join(EVAL_BENCHMARKS)}"
        ) from None


def resolve_benchmarks(names: str | Iterable[str | EvalBenchmark]) -> list[EvalBenchmark]:
    """Entries for a comma-separated string or a list of names/entries (order kept, no
    duplicates). Unknown names raise before anything is loaded."""
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    resolved: list[EvalBenchmark] = []
    for item in names:
        benchmark = item if isinstance(item, EvalBenchmark) else get_benchmark(item)
        if benchmark.name in (b.name for b in resolved):
            raise ValueError(f"benchmark {benchmark.name!r} is listed twice")
        resolved.append(benchmark)
    if not resolved:
        raise ValueError(f"no benchmarks given; choose from: {', '.join(EVAL_BENCHMARKS)}")
    return resolved
