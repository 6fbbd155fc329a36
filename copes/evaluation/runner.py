"""`evaluate(policy, benchmarks, n=, ks=)`: n tool-using samples per problem -> pass@k and more.

Samples are produced by the same batched multi-turn `rollout` as training (tools, graders and
turn limits included). The (problem, sample) pairs of a benchmark are cut into fixed batches
of `batch_episodes` episodes, and each batch samples with a seed derived from (sampling seed,
benchmark, batch index), so a rerun reproduces every sample on the same machine.

Every finished batch is appended to ``out_dir/samples.jsonl`` (one JSON line per sample), so
an interrupted evaluation resumes where it stopped: samples already on disk are kept, a torn
last line is dropped, and only batches with missing samples are rolled out again (a batch is
always rolled out whole, so its samples come out exactly as in an uninterrupted run, and only
the missing ones are written). A stored sample is kept only if its `task_digest` is the
current task's (`copes.evaluation.samples`). `rescore(out_dir)` re-grades the stored
predictions with the current graders without generating anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from copes.agents.policy import Policy, SamplingConfig
from copes.agents.rollout import mean_of_said, rollout
from copes.envs.core import EpisodeRules
from copes.envs.tasks.base import Task, task_digest
from copes.evaluation.passk import majority_at_n, mean_at_n, pass_at_k
from copes.evaluation.report import BenchmarkResult, Report
from copes.evaluation.samples import (
    SAMPLES_FILE,
    append_samples,
    current_tasks,
    describe,
    read_samples,
    sample_key,
    sample_record,
    stale_samples,
    stale_tasks,
)
from copes.registry import Benchmark, get_benchmark, resolve_benchmarks
from copes.run_log import drop_torn_tail
from copes.seeding import derive_seed

logger = logging.getLogger(__name__)

CONFIG_FILE = "eval_config.json"
# Settings that change what a sample is; resuming with different values would mix two
# evaluations in one file.
_SAMPLE_SETTINGS = (
    "model", "sampling", "max_turns", "batch_episodes", "call_format", "chat_template_kwargs",
    "env_kwargs", "split", "demonstrations", "dtype",
)  # fmt: skip


def check_ks(ks: Iterable[int], n: int) -> list[int]:
    """`ks` sorted and deduplicated; ValueError unless every k is in [1, n]."""
    if n < 1:
        raise ValueError(f"n (samples per problem) must be >= 1, got {n}")
    ks = sorted(set(int(k) for k in ks))
    if not ks:
        raise ValueError("no k given for pass@k; pass e.g. ks=[1, 4, 16]")
    if ks[0] < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={ks[0]}")
    if ks[-1] > n:
        too_big = [k for k in ks if k > n]
        raise ValueError(
            f"pass@k needs k <= n samples per problem: k={too_big} with n={n}; "
            f"raise n to at least {too_big[-1]} or drop those k"
        )
    return ks


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


def _check_resumable(out_dir: Path, config: dict[str, Any]) -> None:
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


# ---------------------------------------------------------------------- metrics
def summarize(
    benchmark: Benchmark,
    samples_by_task: dict[str, list[dict[str, Any]]],
    ks: Sequence[int],
) -> BenchmarkResult:
    """Per-problem pass@k, mean@n and maj@n averaged over problems (in the given order)."""
    if not samples_by_task:
        raise ValueError(f"benchmark {benchmark.name!r} has no samples to summarize")
    pass_sums = dict.fromkeys(ks, 0.0)
    mean_sum = maj_sum = 0.0
    all_samples: list[dict[str, Any]] = []
    for task_id, samples in samples_by_task.items():
        samples = sorted(samples, key=lambda r: int(r["sample"]))
        n, c = len(samples), sum(bool(r["correct"]) for r in samples)
        if n < max(ks):
            raise ValueError(
                f"{benchmark.name} problem {task_id!r} has {n} samples, fewer than k={max(ks)}; "
                f"finish the evaluation (resume it) before computing pass@{max(ks)}"
            )
        for k in ks:
            pass_sums[k] += pass_at_k(n, c, k)
        mean_sum += mean_at_n([r["reward"] for r in samples])
        maj_sum += majority_at_n(
            [r["prediction"] for r in samples],
            [bool(r["correct"]) for r in samples],
            benchmark.normalize,
        )
        all_samples.extend(samples)
    problems = len(samples_by_task)
    per_problem = {len(s) for s in samples_by_task.values()}
    total = len(all_samples)
    return BenchmarkResult(
        benchmark=benchmark.name,
        num_problems=problems,
        n=per_problem.pop() if len(per_problem) == 1 else min(per_problem),
        pass_at_k={k: pass_sums[k] / problems for k in ks},
        mean_at_n=mean_sum / problems,
        maj_at_n=maj_sum / problems,
        mean_tool_calls=sum(r["tool_calls"] for r in all_samples) / total,
        mean_turns=sum(r["turns"] for r in all_samples) / total,
        mean_generated_tokens=sum(r["generated_tokens"] for r in all_samples) / total,
        end_reasons=dict(sorted(Counter(r["end_reason"] for r in all_samples).items())),
        protocol_use_rate=sum(
            r["tool_calls"] > 0 or r["end_reason"] == "answer" for r in all_samples
        )
        / total,
        tool_use_rate=sum(r["tool_calls"] > 0 for r in all_samples) / total,
        invalid_rate=sum(r["end_reason"] == "invalid" for r in all_samples) / total,
        undone_arithmetic_rate=_undone_arithmetic_rate(all_samples),
    )


def _undone_arithmetic_rate(samples: list[dict[str, Any]]) -> float | None:
    """The share of samples refused for arithmetic left undone (issue 48); None unless every
    answered sample's grade says (QA graders never do; samples graded before issue 48 did
    not). A sample without an answer was refused nothing."""
    return mean_of_said(
        r.get("grade", {}).get("undone_arithmetic") if r.get("prediction") is not None else False
        for r in samples
    )


# ---------------------------------------------------------------------- evaluate
def evaluate(
    policy: Policy,
    benchmarks: str | Sequence[str | Benchmark],
    *,
    n: int,
    ks: Sequence[int],
    sampling: SamplingConfig,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path,
    resume: bool = True,
    batch_episodes: int = 64,
    progress: bool = True,
    max_turns: int = 4,
    save_messages: bool = False,
    model_name: str | None = None,
    call_format: str = "tags",
    regenerate_changed: bool = False,
    env_kwargs: Mapping[str, Any] | None = None,
    split: str | None = None,
    demonstrations: int = 0,
) -> Report:
    """Sample `n` tool-using episodes per problem of each benchmark and report pass@k etc.

    Args:
        policy: the model backend (any `Policy`).
        benchmarks: registered names (`copes.registry`; "gsm8k,hotpotqa" or a list).
        n: samples per problem; ks: the k of pass@k (each 1 <= k <= n, checked first).
        sampling: per-turn sampling; its `seed` (default 0) seeds every batch.
        limit: evaluate only the first `limit` problems of each benchmark.
        data_dir: local benchmark files instead of the hub (docs/evaluation.md).
        out_dir: where samples.jsonl and eval_config.json go.
        resume: keep the samples already in out_dir (False: start over).
        batch_episodes: episodes rolled out together (the unit of seeding and of writing).
        progress: show a progress bar with an ETA.
        max_turns: agent turns per episode (tool calls + answer).
        save_messages: also store each episode's full conversation.
        model_name: recorded in the report and checked on resume.
        call_format: how the agent calls tools: tags, native (the model's own, from its chat
            template) or one of copes.envs.parsing.CALL_FORMATS.
        regenerate_changed: on resume, roll out again the batches holding stored samples of a
            task whose data changed since (`task_digest`); without it they are refused.
        env_kwargs: extra arguments for every benchmark's env factory (e.g. `corpus_index`
            for open-domain QA over a corpus index); recorded, and checked on resume.
        split: the split of every benchmark (None: each benchmark's own evaluation split).
        demonstrations: worked examples of the call protocol played before every task
            (`copes.envs.demonstrations`); their transcript's digest is recorded.
    """

    ks = check_ks(ks, n)
    if batch_episodes < 1:
        raise ValueError(f"batch_episodes must be >= 1, got {batch_episodes}")
    resolved = resolve_benchmarks(benchmarks)
    from copes.agents.chat import resolve_call_format

    chat = None if policy is None else policy.chat  # "native" reads the chat template
    call_format = resolve_call_format(call_format, chat)
    if sampling.greedy and n > 1:
        logger.warning("temperature 0 (greedy): the %d samples of a problem will be identical", n)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples_path = out / SAMPLES_FILE
    config = {
        "model": model_name,
        "benchmarks": [b.name for b in resolved],
        "n": n,
        "ks": ks,
        "limit": limit,
        "data_dir": None if data_dir is None else str(data_dir),
        "sampling": dataclasses.asdict(sampling),
        "max_turns": max_turns,
        "batch_episodes": batch_episodes,
        "call_format": call_format,
        "chat_template_kwargs": {} if chat is None else dict(chat.template_kwargs),
    }
    env_kwargs = dict(env_kwargs or {})
    # Absent when unset, so the evaluations stored before these options still resume.
    if env_kwargs:
        config["env_kwargs"] = dict(env_kwargs)
    if split is not None:
        config["split"] = split
    # Checked on resume when both evaluations recorded it (older ones did not).
    config["dtype"] = None if policy is None else str(policy.dtype).removeprefix("torch.")
    if demonstrations:
        env_kwargs["demonstrations"] = demonstrations
    config["sampling"]["stop"] = list(sampling.stop)
    start = time.perf_counter()

    # Load every benchmark before touching out_dir, so a missing file fails early.
    loaded = []
    for benchmark in resolved:
        tasks = benchmark.load_tasks(split=split, data_dir=data_dir, limit=limit)
        if not tasks:
            raise ValueError(f"benchmark {benchmark.name!r} has no tasks (limit={limit})")
        loaded.append((benchmark, tasks))
    if demonstrations:  # the examples as each benchmark's env plays them
        config["demonstrations"] = {
            "count": demonstrations,
            "sha256": {
                b.name: _demonstration_digest(b, tasks, max_turns, call_format, env_kwargs)
                for b, tasks in loaded
            },
        }
    if resume:
        _check_resumable(out, config)
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
    total_todo = sum(len(batch) for _, _, todo in plan for _, batch in todo)
    resumed = sum(
        (b.name, t.id, s) in done for b, tasks, _ in plan for t in tasks for s in range(n)
    )
    if resumed:
        logger.info("resuming: %d samples already in %s", resumed, samples_path)

    from tqdm.auto import tqdm

    base_seed = 0 if sampling.seed is None else sampling.seed
    generated = written = 0
    with tqdm(total=total_todo, unit="episode", disable=not progress, desc="evaluate") as bar:
        for benchmark, tasks, todo in plan:
            if not todo:
                continue
            bar.set_postfix_str(benchmark.name)
            size = max(len(batch) for _, batch in todo)
            rules = EpisodeRules(max_turns=max_turns)
            envs = [
                benchmark.make_env(tasks, rules=rules, call_format=call_format, **env_kwargs)
                for _ in range(size)
            ]
            try:
                for index, batch in todo:
                    seed = derive_seed("eval", base_seed, benchmark.name, index)
                    trajectories = rollout(
                        policy,
                        envs[: len(batch)],
                        dataclasses.replace(sampling, seed=seed),
                        options=[{"task": task} for task, _ in batch],
                    )
                    records = [
                        sample_record(benchmark.name, task, s, traj, save_messages)
                        for (task, s), traj in zip(batch, trajectories, strict=True)
                        if (benchmark.name, task.id, s) not in done
                    ]
                    append_samples(samples_path, records)
                    done.update((sample_key(r), r) for r in records)
                    generated += len(batch)
                    written += len(records)
                    bar.update(len(batch))
            finally:
                for env in envs:
                    env.close()

    results = {}
    for benchmark, tasks, _ in plan:
        by_task = {t.id: [done[(benchmark.name, t.id, s)] for s in range(n)] for t in tasks}
        results[benchmark.name] = summarize(benchmark, by_task, ks)
    return Report(
        n=n,
        ks=ks,
        benchmarks=results,
        model=model_name,
        generated_episodes=generated,
        new_samples=written,
        resumed_samples=resumed,
        seconds=time.perf_counter() - start,
    )


# ---------------------------------------------------------------------- rescore
def _demonstration_digest(
    benchmark: Benchmark,
    tasks: Sequence[Task],
    max_turns: int,
    call_format: str,
    env_kwargs: Mapping[str, Any],
) -> str:
    """The digest of the worked examples `benchmark`'s env plays before every task."""
    from copes.envs.demonstrations import transcript_digest

    rules = EpisodeRules(max_turns=max_turns)
    env = benchmark.make_env(tasks[:1], rules=rules, call_format=call_format, **env_kwargs)
    try:
        return transcript_digest(env.unwrapped.demonstration_messages)
    finally:
        env.close()


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
