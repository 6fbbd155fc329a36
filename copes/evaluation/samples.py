"""samples.jsonl: one JSON line per (benchmark, task, sample), and whether a stored one still fits.

A record carries `task_digest` (`copes.envs.tasks.base.task_digest`), the digest of the task it
was generated for. Resume and rescore key samples by (benchmark, task id, sample) only, and an
index-based id (`gsm8k-test-0`) survives a data file replaced by one with other questions; the
digest is what tells a stored sample of another problem from one of the current problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from copes.envs.tasks.base import Task, task_digest
from copes.registry import Benchmark, resolve_benchmarks
from copes.run_log import read_jsonl

SAMPLES_FILE = "samples.jsonl"
SampleKey = tuple[str, str, int]
# Why the stored samples of a task no longer fit it.
Mismatch = Literal["changed", "gold", "no-digest"]
_WHY = {
    "changed": "question or passages changed",
    "gold": "only gold answers or checks changed",
    "no-digest": "no task_digest (written before copes stored one), so unverifiable",
}


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The sample records of a samples.jsonl; a torn (unterminated) last line is ignored."""
    return read_jsonl(
        Path(path),
        hint="Delete the damaged lines (they are re-generated on resume) or start again with "
        "resume=False / --no-resume",
    )


def append_samples(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append `records` and fsync: a finished batch survives a kill."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(lines)
        handle.flush()
        os.fsync(handle.fileno())


def sample_key(record: Mapping[str, Any]) -> SampleKey:
    return record["benchmark"], record["task_id"], int(record["sample"])


def sample_record(
    benchmark: str, task: Task, sample: int, trajectory: Any, save_messages: bool
) -> dict[str, Any]:
    """The stored form of one episode: verdict, gold, the task's digest, counters."""
    grade = dict(trajectory.grade)
    prediction = grade.pop("prediction", None)
    grade.pop("gold", None)
    grade.pop("correct", None)
    record = {
        "benchmark": benchmark,
        "task_id": task.id,
        "sample": sample,
        "task_digest": task_digest(task),
        "prediction": prediction,
        "gold": list(task.answers),
        "checks": list(task.checks),
        "correct": bool(trajectory.correct),
        "reward": float(trajectory.reward),
        "grade": grade,
        "tool_calls": trajectory.tool_calls,
        "turns": trajectory.turns,
        "end_reason": trajectory.end_reason,
        "generated_tokens": trajectory.num_generated_tokens,
    }
    if save_messages:
        record["messages"] = trajectory.messages
    return record


def mismatch(record: Mapping[str, Any], task: Task, digest: str | None = None) -> Mismatch | None:
    """None if `record` was generated for `task` as it is now; else what differs.

    "gold": the agent saw the same problem (the current task with the record's own gold and
    checks has the record's digest), so re-grading its prediction is sound; "changed": it
    answered another question or read other passages, so only re-generating is. `digest`:
    `task_digest(task)` if the caller has it.
    """
    stored = record.get("task_digest")
    if stored is None:
        return "no-digest"
    if stored == (digest or task_digest(task)):
        return None
    seen = dataclasses.replace(
        task, answers=tuple(record["gold"]), checks=tuple(record.get("checks", ()))
    )
    return "gold" if stored == task_digest(seen) else "changed"


def stale_tasks(
    done: Mapping[SampleKey, Mapping[str, Any]], benchmark: str, tasks: Sequence[Task], n: int
) -> dict[str, Mismatch]:
    """task id -> why, for each task whose stored samples 0..n-1 do not all fit it: the worst
    reason over its samples ("changed" over "no-digest" over "gold"), so one sample that only
    saw a gold change never hides another that answered a different question."""
    severity = {"gold": 0, "no-digest": 1, "changed": 2}
    stale: dict[str, Mismatch] = {}
    for task in tasks:
        digest = task_digest(task)
        for s in range(n):
            record = done.get((benchmark, task.id, s))
            why = None if record is None else mismatch(record, task, digest)
            if why is not None and severity[why] > severity.get(stale.get(task.id, ""), -1):
                stale[task.id] = why
    return stale


def describe(stale: Mapping[str, Mismatch], show: int = 4) -> str:
    """'question or passages changed for a, b; ...' (ids shortened past `show`)."""
    parts = []
    for why in _WHY:
        ids = [task_id for task_id, w in stale.items() if w == why]
        if ids:
            named = ", ".join(ids[:show]) + (
                f" and {len(ids) - show} more" if len(ids) > show else ""
            )
            parts.append(f"{_WHY[why]} for {len(ids)} task(s): {named}")
    return "; ".join(parts)


def stale_samples(
    path: Path,
    done: dict[Any, dict[str, Any]],
    loaded: Sequence[tuple[Benchmark, list[Task]]],
    n: int,
    regenerate_changed: bool,
) -> dict[str, dict[str, Mismatch]]:
    """benchmark -> {task id: why} of stored samples that do not fit the current tasks; an
    error naming them and the remedies unless they are to be re-generated."""
    stale = {b.name: stale_tasks(done, b.name, tasks, n) for b, tasks in loaded}
    if any(stale.values()) and not regenerate_changed:
        name = next(b for b, s in stale.items() if s)
        only_gold = set(stale[name].values()) == {"gold"}
        raise ValueError(
            f"{path} holds {name} samples that do not fit the current tasks: "
            f"{describe(stale[name])}. Re-generate them with --regenerate-changed "
            "(regenerate_changed=True), or start over with --no-resume (resume=False)"
            + ("; or re-grade them against the new gold with --rescore" if only_gold else "")
        )
    return stale


def check_stored_samples(
    out_dir: str | Path,
    benchmarks: str | Sequence[str | Benchmark],
    *,
    n: int,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    regenerate_changed: bool = False,
    split: str | None = None,
) -> None:
    """What `evaluate` (resuming) checks of the samples in `out_dir`, without a policy: so
    the CLI refuses stale samples before it loads a model. No samples.jsonl: nothing to do."""
    path = Path(out_dir) / SAMPLES_FILE
    if not path.exists():
        return
    loaded = [
        (b, b.load_tasks(split=split, data_dir=data_dir, limit=limit))
        for b in resolve_benchmarks(benchmarks)
    ]
    done = {sample_key(r): r for r in read_samples(path)}
    stale_samples(path, done, loaded, n, regenerate_changed)


def current_tasks(benchmark: Benchmark, task_ids: list[str], config: dict[str, Any]) -> list[Task]:
    """The tasks `task_ids` of `benchmark` as the stored evaluation loaded them now (its
    split, data_dir and limit): what its samples are checked and re-graded against."""
    loaded = benchmark.load_tasks(
        split=config.get("split"), data_dir=config.get("data_dir"), limit=config.get("limit")
    )
    by_id = {t.id: t for t in loaded}
    missing = [task_id for task_id in task_ids if task_id not in by_id]
    if missing:
        raise ValueError(
            f"the current {benchmark.name} data has no task {', '.join(missing[:4])}"
            f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} of the stored "
            "evaluation: it changed since; evaluate the current data instead (copes-eval "
            "--model MODEL with the same --out resumes what still fits, or --no-resume)"
        )
    return [by_id[task_id] for task_id in task_ids]
