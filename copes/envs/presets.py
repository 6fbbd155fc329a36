"""The two ready-made environments: ToolMath (Python calculator) and ToolQA (BM25 search).

Each is a `ToolEnv` with a task source, a default tool and a grader. Users pick a benchmark
and split, pass their own tasks, replace the tools, or add one with ``extra_tools=[...]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from copes.envs.core import ToolEnv
from copes.envs.rewards.graders import FunctionGrader, Grader, MathGrader, QAGrader, as_grader
from copes.envs.tasks.base import Task
from copes.envs.tools.base import Tool

MATH_SYSTEM_PROMPT = None  # the tiny agent and base models do best with the task alone


def load_tasks(
    benchmark: str,
    split: str | None,
    *,
    source: str | Path | None = None,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    task_seed: int = 0,
) -> list[Task]:
    """Tasks of a registered benchmark (`copes.registry`, `Benchmark.load_tasks`)."""
    from copes.registry import get_benchmark

    return get_benchmark(benchmark).load_tasks(
        split=split, limit=limit, data_dir=data_dir, source=source, seed=task_seed
    )


def _resolve_tasks(
    tasks: Any,
    kind: str,
    env_name: str,
    benchmark: str,
    split: str | None,
    source: str | Path | None,
    data_dir: str | Path | None,
    limit: int | None,
    task_seed: int,
    columns: Mapping[str, str] | None,
) -> Sequence[Task]:
    """The user's tasks (Tasks, dicts, a file or a Dataset), or the benchmark's; all of them
    must be of the env's kind."""
    if tasks is None:
        tasks = load_tasks(
            benchmark, "train" if split is None and benchmark.startswith("synthetic") else split,
            source=source, data_dir=data_dir, limit=limit, task_seed=task_seed,
        )  # fmt: skip
    else:
        from copes.envs.tasks.records import as_tasks

        tasks = as_tasks(tasks, kind=kind, columns=columns, split=split or "train")  # type: ignore[arg-type]
    wrong = [t.id for t in tasks if t.kind != kind]
    if wrong:
        raise ValueError(
            f"{env_name} grades {kind} tasks, but {len(wrong)} task(s) are not "
            f"(first: {wrong[0]!r}); use the other environment or fix the task kind"
        )
    return tasks


def _benchmark_grader(tasks: Sequence[Task]) -> Grader | None:
    """The scorer the tasks' benchmark brings (reasoning-gym's `score_answer` for
    ``rg:<dataset>``, a plugged-in benchmark's own), found by their `source`, so that
    ``gym.make("copes:ToolMath-v0", benchmark="rg:products")`` grades by the official rule as
    copes-train and copes-eval do; None where they bring none. Tasks of benchmarks with
    different scorers in one env are an error."""
    from copes.registry import REASONING_GYM_PREFIX, benchmark_names, get_benchmark

    known = set(benchmark_names())
    sources = {
        t.source for t in tasks if t.source in known or t.source.startswith(REASONING_GYM_PREFIX)
    }
    scorers = {source: get_benchmark(source).grader for source in sorted(sources)}
    own = {source: scorer for source, scorer in scorers.items() if scorer is not None}
    if not own:
        return None
    if len(scorers) > 1:
        raise ValueError(
            f"ToolMath: tasks of {', '.join(scorers)} in one env, and {', '.join(own)} grade "
            "with their own scorer: make one env per benchmark, or pass grader="
        )
    return FunctionGrader(next(iter(own.values())))


def _qa_rule_of(tasks: Sequence[Task]) -> str:
    """The one official QA rule of the tasks' benchmarks; tasks of benchmarks with different
    rules in one env are an error (their scores would not be comparable)."""
    from copes.envs.rewards.qa import DEFAULT_QA_RULE, benchmark_qa_rule

    rules = {benchmark_qa_rule(t.source): t.source for t in tasks}
    if len(rules) > 1:
        found = ", ".join(f"{src or '(no source)'}: {rule}" for rule, src in sorted(rules.items()))
        raise ValueError(
            f"ToolQA: the tasks come from benchmarks with different official QA rules ({found}); "
            "pass qa_rule=<one of them> or build one env per benchmark"
        )
    return next(iter(rules), DEFAULT_QA_RULE)


@dataclass(frozen=True)
class TaskChoice:
    """Where an env's tasks come from (the arguments both presets share, as `gym.make` passes
    them): `tasks` (Tasks, dicts, a .jsonl/.json/.parquet path or a `datasets.Dataset`, read
    through `columns`; `copes.envs.tasks.records`) overrides `benchmark` (a registered one,
    `copes.registry`: its `split`, `source`, `data_dir`, first `limit` tasks, `task_seed`)."""

    benchmark: str
    split: str | None = None
    tasks: Any = None
    columns: Mapping[str, str] | None = None
    source: str | Path | None = None
    data_dir: str | Path | None = None
    limit: int | None = None
    task_seed: int = 0

    def resolve(self, kind: str, env_name: str) -> Sequence[Task]:
        return _resolve_tasks(
            self.tasks, kind, env_name, self.benchmark, self.split, self.source, self.data_dir,
            self.limit, self.task_seed, self.columns,
        )  # fmt: skip


_TASK_CHOICE = {f.name for f in fields(TaskChoice)}


def _preset_env(
    kind: Literal["math", "qa"],
    env_name: str,
    benchmark: str,
    split: str | None,
    options: dict[str, Any],
    default_tools: Callable[[Sequence[Task]], list[Tool]],
    default_grader: Callable[[Sequence[Task], Any], Grader],
    tool_options: dict[str, Any],
) -> ToolEnv:
    """The one way a preset is built: its tasks, its tools (the default ones unless `tools`
    replaces them; `extra_tools` adds to them), its grader, `demonstrations` (0-2 worked
    examples, `copes.envs.demonstrations`), and every other option to `ToolEnv`
    (`max_turns`, `call_format`, `instructions`, ...)."""
    choice = TaskChoice(
        benchmark, split, **{k: options.pop(k) for k in _TASK_CHOICE & set(options)}
    )
    tasks = choice.resolve(kind, env_name)
    tools = options.pop("tools", None)
    tools = default_tools(tasks) if tools is None else list(tools)
    tools = [*tools, *options.pop("extra_tools", ())]
    grader = default_grader(tasks, options.pop("grader", None))
    call_format = options.setdefault("call_format", "tags")
    _add_demonstrations(
        options, kind, options.pop("demonstrations", 0), call_format, tools, tool_options
    )
    return ToolEnv(tasks, tools, grader, **options)


def tool_math_env(
    benchmark: str = "synthetic-math",
    split: str | None = None,
    *,
    python_timeout: float = 10.0,
    grader_timeout: float = 5.0,
    **options: Any,
) -> ToolEnv:
    """ToolMath-v0: math problems, a sandboxed Python (sympy) tool, a symbolic-equality grader.

    `options`: the task choice (`TaskChoice`: tasks, columns, source, data_dir, limit,
    task_seed), `tools` (replaces the Python tool), `extra_tools` (adds to it), `grader`
    (``fn(answer, task)`` -> Grade, bool or reward; replaces the benchmark's scorer or
    symbolic equality), `demonstrations` (0-2 worked examples of calling Python before each
    task), and any `ToolEnv` argument (max_turns, call_format, ...).
    """
    from copes.envs.tools.python import PythonTool

    options.setdefault("accept_boxed", True)
    return _preset_env(
        "math", "ToolMath", benchmark, split, options,
        lambda tasks: [PythonTool(timeout=python_timeout)],
        lambda tasks, grader: as_grader(
            grader, _benchmark_grader(tasks) or MathGrader(timeout=grader_timeout)
        ),
        {"timeout": python_timeout},
    )  # fmt: skip


def _add_demonstrations(
    env_kwargs: dict[str, Any],
    kind: str,
    count: int,
    call_format: str,
    tools: Sequence[Any],
    tool_options: dict[str, Any],
) -> None:
    """Put the transcript of `count` worked examples into the env's kwargs."""
    from copes.envs.demonstrations import DEMONSTRATIONS, check_count, play

    check_count(kind, count)  # type: ignore[arg-type]
    if not count:
        return
    if "demonstration_messages" in env_kwargs:
        raise ValueError("pass demonstrations=N or demonstration_messages=[...], not both")
    examples = DEMONSTRATIONS[kind][:count]  # type: ignore[index]
    needed = {call.tool for example in examples for call in example.calls}
    missing = sorted(needed - {getattr(t, "name", None) for t in tools})
    if missing:
        raise ValueError(
            f"demonstrations call the {', '.join(missing)} tool, which this env does not "
            "have (tools= replaced it); drop demonstrations or keep the tool"
        )
    env_kwargs["demonstration_messages"] = play(
        kind, count, call_format=call_format,  # type: ignore[arg-type]
        instructions=env_kwargs.get("instructions"),
        max_tool_output_chars=env_kwargs.get("max_tool_output_chars", 4000),
        tool_options=tool_options,
    )  # fmt: skip


@functools.cache
def _shared_http_retriever(url: str, **options: Any) -> Any:
    """One client per server and settings in a process, shared by every env (thread-safe)."""
    from copes.envs.retrieval import HTTPRetriever

    return HTTPRetriever(url, **options)


def tool_qa_env(
    benchmark: str = "synthetic-qa",
    split: str | None = None,
    *,
    top_k: int = 3,
    corpus_index: str | Path | None = None,
    retriever_url: str | None = None,
    retriever_timeout_s: float | None = None,
    retriever_retries: int | None = None,
    reward_metric: Literal["f1", "em"] = "f1",
    qa_rule: str | None = None,
    **options: Any,
) -> ToolEnv:
    """ToolQA-v0: multi-hop questions, a BM25 search tool, an EM/F1 grader.

    Search runs over each question's own passage pool (the distractor setting) unless
    `corpus_index` names an on-disk open-corpus index or `retriever_url` a Search-R1 style
    retrieval server's endpoint (`HTTPRetriever`, with `retriever_timeout_s` per attempt and
    `retriever_retries`; see docs/retrieval.md). EM/F1 follow
    `qa_rule` (`copes.envs.rewards.qa.QA_RULES`); None: the official rule of the tasks'
    benchmark (their `source`), SQuAD v1.1 for benchmarks without one of their own.
    `options` as for `tool_math_env`; `demonstrations` (0-2) plays worked examples of
    searching (their searches run over the examples' own passages).
    """
    if corpus_index is not None and retriever_url is not None:
        raise ValueError(
            "ToolQA: pass corpus_index= (a local index) or retriever_url= (a retrieval "
            "server), not both"
        )
    if options.get("grader") is not None and qa_rule is not None:
        raise ValueError("ToolQA: pass grader= or qa_rule= (the default grader's rule), not both")
    http_options: dict[str, Any] = {
        name: value
        for name, value in (("timeout_s", retriever_timeout_s), ("retries", retriever_retries))
        if value is not None
    }
    if http_options and retriever_url is None:
        raise ValueError(
            "ToolQA: retriever_timeout_s and retriever_retries only apply with retriever_url="
        )

    def grader_of(tasks: Sequence[Task], grader: Any) -> Grader:
        if grader is not None:
            return as_grader(grader, QAGrader(metric=reward_metric))
        return QAGrader(
            metric=reward_metric, rule=_qa_rule_of(tasks) if qa_rule is None else qa_rule
        )

    def search_tools(tasks: Sequence[Task]) -> list[Tool]:
        from copes.envs.tools.search import SearchTool

        retriever = None
        if corpus_index is not None:
            from copes.envs.retrieval import open_index

            retriever = open_index(corpus_index)  # one shared copy per process
        elif retriever_url is not None:
            retriever = _shared_http_retriever(retriever_url, **http_options)
        else:
            pool_less = [t.id for t in tasks if not t.passages]
            if pool_less:
                raise ValueError(
                    f"{len(pool_less)} task(s) have no passages to search (first: "
                    f"{pool_less[0]!r}): open-domain questions need a corpus to search, "
                    "corpus_index=<index dir> or retriever_url=<retrieval server endpoint> "
                    '(copes-eval/copes-train: --env-kwargs \'{"corpus_index": '
                    '"indexes/wiki18"}\'; docs/retrieval.md)'
                )
        return [SearchTool(retriever=retriever, top_k=top_k)]

    return _preset_env(
        "qa", "ToolQA", benchmark, split, options, search_tools, grader_of, {"top_k": top_k}
    )
