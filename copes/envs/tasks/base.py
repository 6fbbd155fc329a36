"""The `Task` every environment, loader and generator agrees on.

A task is one problem with its gold answers (aliases for QA) and, for multi-hop QA in the
distractor setting, the pool of candidate passages the search tool may retrieve from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

TaskKind = Literal["math", "qa"]


@dataclass(frozen=True)
class Passage:
    """One retrievable passage: a title and its text (`id` is optional, for open corpora)."""

    title: str
    text: str
    id: str = ""


@dataclass(frozen=True)
class Task:
    """One problem with verifiable answers.

    Attributes:
        id: stable identifier, unique inside its benchmark split.
        question: the problem text shown to the agent.
        answers: gold answers; math has one, QA may list aliases (any alias counts).
        kind: "math" (graded by symbolic equivalence) or "qa" (graded by EM/F1).
        passages: the per-question pool for QA in the distractor setting; empty otherwise.
        source: benchmark name, e.g. "gsm8k", "hotpotqa", "synthetic-math".
        metadata: anything else worth keeping (level, subject, type, supporting titles).
        checks: names of answer checks a correct answer must also pass, e.g. "lowest-terms"
            (`copes.envs.rewards.checks`): how a task asks for a form, not only a value.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    kind: TaskKind
    passages: tuple[Passage, ...] = ()
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.answers:
            raise ValueError(f"task {self.id!r} has no gold answer; every task needs at least one")
        if self.kind not in ("math", "qa"):
            raise ValueError(f"task {self.id!r}: kind must be 'math' or 'qa', got {self.kind!r}")
        if isinstance(self.checks, str) or not all(isinstance(c, str) for c in self.checks):
            raise TypeError(
                f"task {self.id!r}: checks must be a tuple of names, got {self.checks!r}"
            )


def task_digest(task: Task) -> str:
    """sha256 (hex) of what defines `task`: the question and passages the agent sees, and
    what decides its verdict: gold answers, answer checks, kind and `source` (it picks the QA
    rule).

    A stored sample keeps the digest of the task it was generated for, so a data file replaced
    under the same task ids is detected (`copes.evaluation.samples`). `id` and `metadata` are
    left out: metadata holds descriptions (a GSM8K solution changes with every gold fix, which
    must stay a gold-only change); a reasoning-gym task, graded from its metadata entry, has
    its question generated from that entry.
    """
    canonical = {
        "question": task.question,
        "passages": [[p.title, p.text, p.id] for p in task.passages],
        "answers": list(task.answers),
        "checks": list(task.checks),
        "kind": task.kind,
        "source": task.source,
    }
    text = json.dumps(canonical, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def task_to_dict(task: Task) -> dict[str, Any]:
    """A task as JSON-able data: what a served harness or a verifiers taskset is given."""
    return asdict(task)


def task_from_dict(data: dict[str, Any]) -> Task:
    """The task `task_to_dict` wrote."""
    return Task(
        id=data["id"],
        question=data["question"],
        answers=tuple(data["answers"]),
        kind=data["kind"],
        passages=tuple(Passage(**p) for p in data.get("passages", ())),
        source=data.get("source", ""),
        metadata=dict(data.get("metadata", {})),
        checks=tuple(data.get("checks", ())),
    )
