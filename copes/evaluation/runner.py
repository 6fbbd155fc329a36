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
current task's (`copes.evaluation.samples`).

One concern a module: the resume store and the plan of batches (`copes.evaluation.resume`),
the rollouts (here), the numbers (`copes.evaluation.summary`); `copes.evaluation.rescore`
re-grades stored predictions without generating anything.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from copes.agents.policy import Policy, SamplingConfig
from copes.agents.rollout import rollout
from copes.envs.core import EpisodeRules
from copes.envs.tasks.base import Task
from copes.evaluation.report import Report
from copes.evaluation.resume import open_samples
from copes.evaluation.samples import SAMPLES_FILE, append_samples, sample_key, sample_record
from copes.evaluation.summary import check_ks, summarize
from copes.registry import Benchmark, resolve_benchmarks
from copes.seeding import derive_seed

logger = logging.getLogger(__name__)


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
    done, plan, resumed = open_samples(
        out, config, loaded, n=n, batch_episodes=batch_episodes, resume=resume,
        regenerate_changed=regenerate_changed,
    )  # fmt: skip
    total_todo = sum(len(batch) for _, _, todo in plan for _, batch in todo)
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
