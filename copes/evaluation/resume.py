"""Resuming an evaluation from its folder: `eval_config.json` (the settings that make a
sample what it is, checked on resume), the samples already stored, and the batches still to
roll out (a batch is always rolled out whole, so its samples come out as in an uninterrupted
run; stored samples of a task whose data changed are refused, or regenerated on request)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from copes.envs.tasks.base import Task
from copes.evaluation.samples import (
    SAMPLES_FILE,
    describe,
    read_samples,
    sample_key,
    stale_samples,
)
from copes.registry import Benchmark
from copes.run_log import drop_torn_tail

logger = logging.getLogger(__name__)

CONFIG_FILE = "eval_config.json"
# Settings that change what a sample is; resuming with different values would mix two
# evaluations in one file.
_SAMPLE_SETTINGS = (
    "model", "sampling", "max_turns", "batch_episodes", "call_format", "chat_template_kwargs",
    "env_kwargs", "split", "demonstrations", "dtype",
)  # fmt: skip


def read_eval_config(out_dir: str | Path) -> dict[str, Any] | None:
    """The eval_config.json of an earlier evaluation in `out_dir` (None if there is none);
    a file that is not one is an error naming it."""
    path = Path(out_dir) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not an evaluation config ({exc}); use another --out") from None
    if not isinstance(old, dict):
        raise ValueError(
            f"{path} is not an evaluation config (a JSON object); use another --out, or "
            "--no-resume to discard what is there"
        )
    return old


def check_resumable(out_dir: Path, config: dict[str, Any]) -> None:
    old = read_eval_config(out_dir)
    if old is None:
        return
    for name in _SAMPLE_SETTINGS:
        if name in ("model", "dtype") and (old.get(name) is None or config.get(name) is None):
            continue
        if old.get(name) != config.get(name):
            raise ValueError(
                f"{out_dir} holds samples of a different evaluation: {name} was "
                f"{old.get(name)!r}, now {config.get(name)!r}. Use another out_dir (--out), or "
                f"resume=False (--no-resume) to discard the stored samples"
            )


Batch = list[tuple[Task, int]]  # (task, sample index) pairs rolled out together
Stored = dict[tuple[str, str, int], dict[str, Any]]  # (benchmark, task id, sample) -> record
Plan = list[tuple[Benchmark, list[Task], list[tuple[int, Batch]]]]  # batches still to run


def open_samples(
    out: Path,
    config: dict[str, Any],
    loaded: list[tuple[Benchmark, list[Task]]],
    *,
    n: int,
    batch_episodes: int,
    resume: bool,
    regenerate_changed: bool,
) -> tuple[
    dict[tuple[str, str, int], dict[str, Any]],
    list[tuple[Benchmark, list[Task], list[tuple[int, Batch]]]],
    int,
]:
    """Accept the evaluation in `out` (its config written only once it is checked) and plan
    it: (the samples kept, keyed by (benchmark, task, sample); each benchmark's batches
    still to roll out, by index; how many samples were resumed)."""
    samples_path = out / SAMPLES_FILE
    if resume:
        check_resumable(out, config)
    config["task_ids"] = {b.name: [t.id for t in tasks] for b, tasks in loaded}
    done = {sample_key(r): r for r in read_samples(samples_path)} if resume else {}
    # Stored samples of tasks whose data changed: refused (before anything is written), or
    # with `regenerate_changed` their whole batches are dropped below and rolled out again.
    stale = stale_samples(samples_path, done, loaded, n, regenerate_changed)
    if resume:
        drop_torn_tail(samples_path)
    elif samples_path.exists():
        samples_path.unlink()
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    # Plan: every benchmark's (task, sample) pairs in fixed batches; keep those with gaps.
    plan = []
    for benchmark, tasks in loaded:
        items = [(task, s) for task in tasks for s in range(n)]
        batches = [items[i : i + batch_episodes] for i in range(0, len(items), batch_episodes)]
        if stale[benchmark.name]:
            dropped = [b for b in batches if any(t.id in stale[benchmark.name] for t, _ in b)]
            for batch in dropped:
                for task, s in batch:
                    done.pop((benchmark.name, task.id, s), None)
            logger.warning(
                "%s: re-generating %d batch(es) of %s whose stored samples do not fit the "
                "current tasks: %s", samples_path, len(dropped), benchmark.name,
                describe(stale[benchmark.name]),
            )  # fmt: skip
        todo = [
            (index, batch)
            for index, batch in enumerate(batches)
            if any((benchmark.name, t.id, s) not in done for t, s in batch)
        ]
        plan.append((benchmark, tasks, todo))
    resumed = sum(
        (b.name, t.id, s) in done for b, tasks, _ in plan for t in tasks for s in range(n)
    )
    if resumed:
        logger.info("resuming: %d samples already in %s", resumed, samples_path)
    return done, plan, resumed
