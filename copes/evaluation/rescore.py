"""`rescore(out_dir)`: an evaluation's stored predictions re-graded with the current graders,
nothing generated."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copes.envs.tasks.base import Task, task_digest
from copes.evaluation.report import Report
from copes.evaluation.resume import CONFIG_FILE
from copes.evaluation.samples import (
    SAMPLES_FILE,
    current_tasks,
    describe,
    read_samples,
    sample_key,
    stale_tasks,
)
from copes.evaluation.summary import check_ks, summarize
from copes.registry import get_benchmark

logger = logging.getLogger(__name__)


def rescore(out_dir: str | Path, *, ks: Sequence[int] | None = None) -> Report:
    """Re-grade the stored predictions of an evaluation with the current graders.

    Rewrites samples.jsonl with the new verdicts (atomically) and returns the report over the
    benchmarks, problems and n of the last `evaluate` into `out_dir`. The report's samples are
    graded against the current tasks (loaded as that evaluation did), so their digests are
    checked first: a sample whose task only changed its gold answers or checks is re-graded
    against the new ones; one whose question or passages changed is refused. Samples that
    gave no final answer keep their reward and stay incorrect. Nothing is generated.
    """
    out = Path(out_dir)
    config_path = out / CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(
            f"{config_path} does not exist; rescore needs the folder an evaluation wrote "
            f"(its --out), with {CONFIG_FILE} and {SAMPLES_FILE}"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        n = int(config["n"])
        task_ids = {name: list(config["task_ids"][name]) for name in config["benchmarks"]}
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{config_path} is not an evaluation config ({exc!r})") from None
    ks = check_ks(config["ks"] if ks is None else ks, n)
    benchmarks = [get_benchmark(name) for name in config["benchmarks"]]
    # One record per (benchmark, task, sample), the last one written, as `evaluate` keeps.
    done = {sample_key(r): r for r in read_samples(out / SAMPLES_FILE)}
    current = {b.name: current_tasks(b, task_ids[b.name], config) for b in benchmarks}
    for benchmark in benchmarks:
        stale = stale_tasks(done, benchmark.name, current[benchmark.name], n)
        refused = {task_id: why for task_id, why in stale.items() if why != "gold"}
        if refused:
            raise ValueError(
                f"{out / SAMPLES_FILE} holds {benchmark.name} samples that cannot be re-graded "
                f"against the current tasks: {describe(refused)}. Re-generate them with "
                f"copes-eval --model MODEL --out {out} --regenerate-changed (same settings), "
                "or start over with --no-resume"
            )
        if stale:
            logger.warning(
                "%s: re-grading against new gold answers or checks: %s",
                benchmark.name, describe(stale),
            )  # fmt: skip
    tasks = {(name, t.id): t for name, ts in current.items() for t in ts}
    graders = {b.name: b.make_grader(current[b.name]) for b in benchmarks}
    kinds = {b.name: b.kind for b in benchmarks}
    for record in done.values():
        name = record["benchmark"]
        if name not in graders:
            graders[name] = get_benchmark(name).make_grader()
            kinds[name] = get_benchmark(name).kind
        task = tasks.get((name, record["task_id"])) if int(record["sample"]) < n else None
        if task is not None:  # checked above: generated for this very problem
            record["gold"], record["checks"] = list(task.answers), list(task.checks)
            record["task_digest"] = task_digest(task)
        else:  # outside the report: its own gold (its digest is checked when it is resumed)
            checks = tuple(record.get("checks", ()))
            task = Task(record["task_id"], "", tuple(record["gold"]), kinds[name], checks=checks)
        if record["prediction"] is None:
            record["correct"] = False
            continue
        grade = graders[name](record["prediction"], task)
        record["correct"] = bool(grade.correct)
        record["reward"] = float(grade.reward)
        record["grade"] = {
            k: v for k, v in grade.details.items() if k not in ("prediction", "gold", "correct")
        }
    records = list(done.values())
    tmp = out / (SAMPLES_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, out / SAMPLES_FILE)

    results = {}
    for benchmark in benchmarks:
        by_task: dict[str, list[dict[str, Any]]] = {
            task_id: [] for task_id in task_ids[benchmark.name]
        }
        for record in records:
            if (
                record["benchmark"] == benchmark.name
                and record["task_id"] in by_task
                and int(record["sample"]) < n
            ):
                by_task[record["task_id"]].append(record)
        results[benchmark.name] = summarize(benchmark, by_task, ks)
    return Report(n=n, ks=ks, benchmarks=results, model=config.get("model"))
