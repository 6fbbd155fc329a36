"""Tasks on the wire: what a harness is told of its session's task (JSON)."""

from __future__ import annotations

from typing import Any

from copes.envs.tasks.base import Passage, Task


def task_to_dict(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "question": task.question,
        "answers": list(task.answers),
        "kind": task.kind,
        "passages": [{"title": p.title, "text": p.text, "id": p.id} for p in task.passages],
        "source": task.source,
        "checks": list(task.checks),
        "metadata": dict(task.metadata),
    }


def task_from_dict(data: dict[str, Any]) -> Task:
    return Task(
        id=data["id"],
        question=data["question"],
        answers=tuple(data["answers"]),
        kind=data["kind"],
        passages=tuple(Passage(**p) for p in data.get("passages", ())),
        source=data.get("source", ""),
        checks=tuple(data.get("checks", ())),
        metadata=dict(data.get("metadata", {})),
    )
