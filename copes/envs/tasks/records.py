"""Tasks in any common shape: `Task`s, dicts, a JSONL/JSON/Parquet file, a `datasets.Dataset`.

`as_tasks` is what ``tool_math_env(tasks=...)``, ``gym.make(..., tasks=...)`` and
`copes.registry.register_benchmark` accept. A record's fields are read through a column
mapping (``columns={"question": "problem", "answers": "solution"}``); without one the
names are Task's own (`id`, `question`, `answers` or `answer`, `passages`, `checks`), and
every other column goes into `Task.metadata`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from copes.envs.tasks.base import Passage, Task, TaskKind

TASK_FIELDS = ("id", "question", "answers", "passages", "checks", "kind", "source")
# Names tried when no mapping is given for a field, in order (`answer` is GSM8K/MATH style).
_DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "id": ("id",),
    "question": ("question",),
    "answers": ("answers", "answer"),
    "passages": ("passages",),
    "checks": ("checks",),
    "kind": ("kind",),
    "source": ("source",),
}


def as_tasks(
    items: Any,
    *,
    kind: TaskKind,
    columns: Mapping[str, str] | None = None,
    source: str = "",
    split: str = "train",
    checks: tuple[str, ...] = (),
) -> list[Task]:
    """`items` as a list of `Task`s of `kind`.

    `items` is a sequence of `Task`s or dicts, a `datasets.Dataset`, or the path of a
    .jsonl/.json/.parquet file. Records without an id get ``<source>-<split>-<index>``;
    `checks` are added to every task's own (`copes.envs.rewards.checks`).
    """
    columns = dict(columns or {})
    wrong = sorted(set(columns) - set(TASK_FIELDS))
    if wrong:
        raise ValueError(
            f"columns maps unknown task fields {wrong}; map any of {list(TASK_FIELDS)} to "
            "your column names, e.g. columns={'question': 'problem'}"
        )
    if isinstance(items, (str, os.PathLike)):
        from copes.envs.tasks.io import load_records

        source = source or Path(items).stem
        items = load_records(items, split=split)
    if isinstance(items, Mapping):
        raise TypeError(
            "tasks must be a list of tasks or records, a datasets.Dataset or a file path, "
            "got one dict; wrap it in a list (a DatasetDict: pick a split, dataset['train'])"
        )
    if not isinstance(items, Iterable):
        raise TypeError(f"tasks must be iterable, got {type(items).__name__}")
    tasks = []
    for index, item in enumerate(items):
        if isinstance(item, Task):
            task = item
        elif isinstance(item, Mapping):
            task = _record_task(item, index, kind, columns, source, split)
        else:
            raise TypeError(
                f"task {index} is a {type(item).__name__}; give Task objects or dicts with "
                "a question and its answers"
            )
        if checks:
            task = _with_checks(task, checks)
        tasks.append(task)
    return tasks


def _with_checks(task: Task, checks: tuple[str, ...]) -> Task:
    from dataclasses import replace

    merged = (*task.checks, *(c for c in checks if c not in task.checks))
    return replace(task, checks=merged)


def _column(record: Mapping[str, Any], name: str, columns: Mapping[str, str]) -> str | None:
    if name in columns:
        return columns[name]
    return next((c for c in _DEFAULT_COLUMNS[name] if c in record), None)


def _record_task(
    record: Mapping[str, Any],
    index: int,
    kind: TaskKind,
    columns: Mapping[str, str],
    source: str,
    split: str,
) -> Task:
    used: dict[str, str] = {}
    for name in TASK_FIELDS:
        column = _column(record, name, columns)
        if column is not None:
            if column not in record:
                raise KeyError(
                    f"record {index} has no column {column!r} (mapped to {name}); its "
                    f"columns are {sorted(record)[:12]}"
                )
            used[name] = column
    for name in ("question", "answers"):
        if name not in used:
            raise KeyError(
                f"record {index} has no {name} (columns: {sorted(record)[:12]}); map yours "
                f"with columns={{{name!r}: '<your column>'}}"
            )
    answers = record[used["answers"]]
    if isinstance(answers, (str, int, float)):
        answers = (answers,)
    record_kind = record[used["kind"]] if "kind" in used else kind
    if record_kind != kind:
        raise ValueError(f"record {index} is a {record_kind!r} task where {kind!r} is expected")
    task_source = str(record[used["source"]]) if "source" in used else source
    task_id = record[used["id"]] if "id" in used else f"{task_source or 'task'}-{split}-{index}"
    return Task(
        id=str(task_id),
        question=str(record[used["question"]]),
        answers=tuple(str(a) for a in answers),
        kind=kind,
        passages=tuple(_passage(p) for p in record.get(used.get("passages", ""), None) or ()),
        source=task_source,
        metadata={k: v for k, v in record.items() if k not in used.values()},
        checks=tuple(record[used["checks"]] or ()) if "checks" in used else (),
    )


def _passage(item: Any) -> Passage:
    if isinstance(item, Passage):
        return item
    if isinstance(item, str):
        return Passage(title="", text=item)
    if isinstance(item, Mapping) and "text" in item:
        return Passage(str(item.get("title", "")), str(item["text"]), str(item.get("id", "")))
    raise TypeError(f"a passage is a string or a dict with 'text' (and 'title'), got {item!r:.60}")
