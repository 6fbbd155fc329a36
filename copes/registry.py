"""The one registry of benchmarks: a name -> its tasks, the environment it runs in, its grader.

`copes-train --benchmark NAME`, `copes-eval --benchmarks NAME`, `load_tasks` and the
environment presets all resolve names here. Three ways a name gets here:

- the built-ins (GSM8K, MATH-500, AIME, HotpotQA, ..., synthetic-math/qa), at import;
- another package: an entry point in the group ``copes.benchmarks`` whose object is a
  `Benchmark`, a list of them, or a function that calls `register_benchmark`; loaded the first
  time a name is looked up. ``module:name`` (as in ``gym.make("module:Env-v0")``) imports
  `module` first, for code that registers without an entry point;
- ``rg:<dataset>``: a reasoning-gym generator (optional dependency), made on first use.

A benchmark runs in a Gymnasium env (`env`, any registered id whose factory takes
``tasks=``; default ToolMath-v0 or ToolQA-v0 by kind), graded by that env's grader unless
the benchmark brings its own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copes.envs.core import EpisodeRules
from copes.envs.tasks.base import Task, TaskKind

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "copes.benchmarks"
DEFAULT_ENVS: dict[str, str] = {"math": "ToolMath-v0", "qa": "ToolQA-v0"}
REASONING_GYM_PREFIX = "rg:"
# Env arguments a run sets with its own flags (copes-train and copes-eval alike), never
# through --env-kwargs: the flag that sets each.
RUN_ENV_KWARGS = {
    "tasks": "--benchmark(s) and --split", "max_turns": "--max-turns",
    "invalid_penalty": "--invalid-penalty", "call_format": "--call-format",
    "demonstrations": "--demonstrations",
}  # fmt: skip
# How an env grades: copes-eval grades with each benchmark's registered grader, so that
# --rescore re-grades the same way.
GRADING_KWARGS = ("grader", "grader_timeout", "qa_rule", "reward_metric")


def parse_env_kwargs(text: str | None, *, grading: bool = True) -> dict[str, Any]:
    """`--env-kwargs`: a JSON object of env arguments (e.g. ``{"corpus_index": ...}``) for
    every env a run builds. Arguments the run sets with its own flags are refused naming the
    flag; with `grading` False (copes-eval) so are the grading arguments."""
    from copes.errors import json_object_flag

    kwargs = json_object_flag("--env-kwargs", text, '{"corpus_index": "indexes/wiki18"}')
    taken = sorted(set(kwargs) & set(RUN_ENV_KWARGS))
    if taken:
        flags = ", ".join(f"{name}: {RUN_ENV_KWARGS[name]}" for name in taken)
        raise ValueError(
            f"--env-kwargs sets {', '.join(taken)}, which the run sets with its own flags "
            f"({flags}); use those"
        )
    graders = sorted(set(kwargs) & set(GRADING_KWARGS))
    if graders and not grading:
        raise ValueError(
            f"--env-kwargs sets {', '.join(graders)}: copes-eval grades with each benchmark's "
            "registered grader, so that --rescore re-grades the same way; register a benchmark "
            "with that grader instead (docs/evaluation.md)"
        )
    return kwargs


@dataclass(frozen=True)
class Benchmark:
    """One benchmark.

    Attributes:
        name: what users type (``--benchmarks gsm8k``).
        tasks: where the tasks come from: a function ``fn(split, limit)`` (it may also take
            `data_dir`, `source` and `seed` keywords) returning Tasks or dicts; a folder
            holding one .jsonl/.json/.parquet file per split; one such file, a list, or a
            `datasets.Dataset` (these hold only `split`); or a `datasets.DatasetDict`.
        kind: "math" or "qa": the tasks' kind and the default env and vote normalization.
        split: the split evaluated by default.
        env: the Gymnasium id the benchmark runs in (default by kind).
        env_kwargs: passed to the env's factory with the tasks.
        grader: ``fn(answer, task)`` -> Grade, bool or reward; None: the env's own.
        columns: record column names for Task fields (`copes.envs.tasks.records.as_tasks`).
        checks: answer checks every task carries (`copes.envs.rewards.checks`).
        source: the default hub id, shown in listings; None for generated or local tasks.
        generated: the tasks are generated (no files; `data_dir` does not apply).
        train_split: the split `copes-train` trains on by default.
        eval_split: the held-out split `copes-train` validates on by default.
    """

    name: str
    tasks: Any
    kind: TaskKind = "math"
    split: str = "test"
    env: str | None = None
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    grader: Callable[..., Any] | None = None
    columns: Mapping[str, str] | None = None
    checks: tuple[str, ...] = ()
    source: str | None = None
    generated: bool = False
    train_split: str = "train"
    eval_split: str = "validation"

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() or c == "," for c in self.name):
            raise ValueError(f"benchmark name {self.name!r} must be non-empty, without , or spaces")
        if self.kind not in DEFAULT_ENVS:
            raise ValueError(f"benchmark {self.name!r}: kind must be 'math' or 'qa'")
        if self.grader is not None and not callable(self.grader):
            raise TypeError(f"benchmark {self.name!r}: grader must be callable(answer, task)")

    @property
    def env_id(self) -> str:
        return self.env or DEFAULT_ENVS[self.kind]

    def load_tasks(
        self,
        *,
        split: str | None = None,
        limit: int | None = None,
        data_dir: str | Path | None = None,
        source: str | Path | None = None,
        seed: int | None = None,
    ) -> list[Task]:
        """The first `limit` tasks of `split` (default `self.split`), with unique ids."""
        from copes.envs.tasks.records import as_tasks

        split = self.split if split is None else split
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be None or >= 0, got {limit}")
        if self.generated:  # nothing to read: a data folder does not apply, the seed does
            data_dir = None
        else:
            seed = None
        items = self._items(split, limit, data_dir, source, seed)
        tasks = as_tasks(
            items, kind=self.kind, columns=self.columns, source=self.name, split=split,
            checks=self.checks,
        )  # fmt: skip
        tasks = tasks if limit is None else tasks[:limit]
        seen: set[str] = set()
        for task in tasks:
            if task.id in seen:
                raise ValueError(
                    f"benchmark {self.name!r} has two tasks with id {task.id!r}; runs key "
                    "samples by task id, so ids must be unique within a split"
                )
            seen.add(task.id)
        return tasks

    def _items(
        self,
        split: str,
        limit: int | None,
        data_dir: str | Path | None,
        source: str | Path | None,
        seed: int | None,
    ) -> Any:
        tasks = self.tasks
        if callable(tasks) and not _is_dataset(tasks):
            offered = {"data_dir": data_dir, "source": source, "seed": seed}
            params = inspect.signature(tasks).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
            kwargs = {
                k: v for k, v in offered.items() if v is not None and (takes_all or k in params)
            }
            ignored = [k for k, v in offered.items() if v is not None and k not in kwargs]
            if ignored and ignored != ["data_dir"]:  # data_dir is where built-ins look
                raise ValueError(f"benchmark {self.name!r} does not take {', '.join(ignored)}")
            return tasks(split=split, limit=limit, **kwargs)
        if isinstance(tasks, (str, Path)) and Path(tasks).expanduser().is_dir():
            return _split_file(tasks, split)
        if _is_dataset_dict(tasks):
            if split not in tasks:
                raise ValueError(
                    f"benchmark {self.name!r} has splits {sorted(tasks)}, not {split!r}"
                )
            return tasks[split]
        if split != self.split:  # one file, list or Dataset: a single split, never reused
            raise ValueError(
                f"benchmark {self.name!r} holds one split ({self.split!r}), not {split!r}; "
                "register a folder with one file per split, a DatasetDict or a function to "
                f"have more, or ask for split {self.split!r}"
            )
        return tasks

    def make_env(
        self,
        tasks: Iterable[Task],
        *,
        env_id: str | None = None,
        rules: EpisodeRules | None = None,
        **kwargs: Any,
    ) -> Any:
        """A fresh env over `tasks` (``gym.make(env_id, tasks=...)``, by default the
        benchmark's env); `kwargs` override the benchmark's `env_kwargs`. The one place every
        run (copes-train, copes-eval, copes-serve, the integrations) builds its envs.

        `rules` (turn limit, invalid penalty, tool-output cut) are set on the env after it
        is built, so any `ToolEnv` honours them whatever its factory takes; an env that is
        not a `ToolEnv` cannot and is refused. Pick a task per episode with
        ``reset(options={"task": task})``."""
        import gymnasium as gym

        import copes  # noqa: F401  (registers the copes env ids)
        from copes.envs.core import ToolEnv

        env_id = env_id or self.env_id
        options = {**self.env_kwargs, **kwargs}
        if self.grader is not None:
            options.setdefault("grader", self.grader)
        try:
            env = gym.make(env_id, tasks=list(tasks), disable_env_checker=True, **options)
        except gym.error.Error as exc:
            raise ValueError(f"benchmark {self.name!r}: env {env_id!r}: {exc}") from None
        if rules is not None:
            if not isinstance(env.unwrapped, ToolEnv):
                env.close()
                raise ValueError(
                    f"env {env_id} makes a {type(env.unwrapped).__name__}, not a copes ToolEnv, "
                    "so it cannot take a run's episode rules (turn limit, invalid penalty) or "
                    "its text turns: build it with copes.envs.ToolEnv or a preset "
                    "(tool_math_env(extra_tools=[...]))"
                )
            env.unwrapped.set_rules(rules)
        return env

    def make_grader(self, tasks: Sequence[Task] = ()) -> Any:
        """The grader the benchmark's env grades `tasks` with (answer checks included, the QA
        rule of the tasks' source, as evaluation builds it), for re-grading stored predictions.
        Without tasks, a placeholder task of this benchmark stands in. Open-domain tasks get
        a placeholder passage: grading needs no corpus."""
        import dataclasses

        from copes.envs.tasks.base import Passage

        passage = (Passage("placeholder", "a passage, for envs that search each task's pool"),)
        placeholder = Task(  # its source picks the benchmark's QA rule (`tool_qa_env`)
            "placeholder", "?", ("0",), self.kind, passages=passage, source=self.name
        )
        pooled = [
            t if t.passages or t.kind != "qa" else dataclasses.replace(t, passages=passage)
            for t in tasks
        ]
        env = self.make_env(pooled or [placeholder])
        try:
            return env.unwrapped.grader
        finally:
            env.close()

    @property
    def normalize(self) -> Callable[[str], str]:
        """The canonical form of an answer, by which majority voting groups samples."""
        if self.kind == "math":
            from copes.envs.rewards.math import normalize_math_answer

            return _never_raises(normalize_math_answer)
        from copes.envs.rewards.qa import normalize_answer

        return normalize_answer


def _is_dataset(obj: Any) -> bool:
    return type(obj).__name__ == "Dataset" and hasattr(obj, "column_names")


def _is_dataset_dict(obj: Any) -> bool:
    return type(obj).__name__ in ("DatasetDict", "IterableDatasetDict") or (
        isinstance(obj, Mapping) and obj and all(_is_dataset(v) for v in obj.values())
    )


def _split_file(folder: str | Path, split: str) -> Path:
    from copes.envs.tasks.io import _file_for_split

    return _file_for_split(Path(folder).expanduser(), split)


def _never_raises(normalize: Callable[[str], str]) -> Callable[[str], str]:
    """`normalize`, falling back to the stripped answer on input it cannot parse: a model's
    malformed answer must not stop a report (it is graded wrong anyway)."""

    def safe(answer: str) -> str:
        try:
            return normalize(answer)
        except Exception:
            return answer.strip()

    return safe


# ---------------------------------------------------------------------- the registry
_REGISTRY: dict[str, Benchmark] = {}


def register_benchmark(
    name_or_benchmark: str | Benchmark, tasks: Any = None, *, replace: bool = False, **fields: Any
) -> Benchmark:
    """Add a benchmark: ``register_benchmark("units", "data/units/", kind="math")`` or
    ``register_benchmark(Benchmark(...))``. A taken name needs ``replace=True``."""
    if isinstance(name_or_benchmark, Benchmark):
        if tasks is not None or fields:
            raise TypeError("pass either a Benchmark or a name with its fields, not both")
        benchmark = name_or_benchmark
    else:
        if tasks is None:
            raise TypeError(f"register_benchmark({name_or_benchmark!r}) needs its tasks")
        benchmark = Benchmark(name_or_benchmark, tasks, **fields)
    if benchmark.name in _REGISTRY and not replace and _REGISTRY[benchmark.name] != benchmark:
        raise ValueError(f"benchmark {benchmark.name!r} is already registered; pass replace=True")
    _REGISTRY[benchmark.name] = benchmark
    return benchmark


@functools.lru_cache(maxsize=1)
def _load_entry_points() -> None:
    """Run every installed package's ``copes.benchmarks`` entry point, once per process."""
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
        except Exception as exc:  # one broken plugin must not hide every other benchmark
            logger.warning("benchmark entry point %s failed to load: %r", point.value, exc)
            continue
        if isinstance(loaded, Benchmark):
            register_benchmark(loaded)
        elif isinstance(loaded, (list, tuple)):
            for item in loaded:
                register_benchmark(item)
        elif callable(loaded):
            loaded()
        else:
            logger.warning("benchmark entry point %s is not a Benchmark or a function", point)


def benchmark_names() -> list[str]:
    """Every registered name (entry points loaded); ``rg:<dataset>`` names are made on use."""
    _load_entry_points()
    return list(_REGISTRY)


def _reasoning_gym_benchmark(name: str) -> Benchmark:
    """The `Benchmark` ``rg:<name>``, made on first lookup (`get_benchmark`)."""
    from copes.envs.tasks import reasoning_gym as rg

    rg.check_dataset(name)  # an unknown name or a missing install fails here, at lookup

    def load(split: str, limit: int | None, seed: int = 0) -> list[Task]:
        return rg.reasoning_gym_tasks(name, split, limit, seed)

    return Benchmark(
        f"rg:{name}", load, kind="math", split="test", grader=rg.ReasoningGymScorer(name),
        generated=True, source=None,
    )  # fmt: skip


def get_benchmark(name: str) -> Benchmark:
    """The benchmark called `name`; ValueError listing the known names if there is none."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.startswith(REASONING_GYM_PREFIX):
        return register_benchmark(_reasoning_gym_benchmark(name[len(REASONING_GYM_PREFIX) :]))
    if ":" in name:  # module:name, as gym.make does
        module, _, short = name.partition(":")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise ValueError(f"benchmark {name!r}: cannot import {module!r} ({exc})") from None
        if short in _REGISTRY:
            return _REGISTRY[short]
        raise ValueError(f"benchmark {name!r}: importing {module!r} registered no {short!r}")
    _load_entry_points()
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise ValueError(
        f"unknown benchmark {name!r}; known: {', '.join(_REGISTRY)}, or rg:<reasoning-gym "
        f"dataset>; register yours with copes.registry.register_benchmark or an entry point "
        f"in the {ENTRY_POINT_GROUP!r} group"
    )


def resolve_benchmarks(names: str | Iterable[str | Benchmark]) -> list[Benchmark]:
    """Entries for a comma-separated string or a list of names/entries (order kept, no
    duplicates). Unknown names raise before anything is loaded."""
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    resolved: list[Benchmark] = []
    for item in names:
        benchmark = item if isinstance(item, Benchmark) else get_benchmark(item)
        if benchmark.name in (b.name for b in resolved):
            raise ValueError(f"benchmark {benchmark.name!r} is listed twice")
        resolved.append(benchmark)
    if not resolved:
        raise ValueError(f"no benchmarks given; choose from: {', '.join(benchmark_names())}")
    return resolved


def iter_benchmarks() -> Iterator[Benchmark]:
    _load_entry_points()
    return iter(list(_REGISTRY.values()))


# ---------------------------------------------------------------------- built-ins
def _register_builtins() -> None:
    from copes.envs.tasks import builtin

    for spec in builtin.BENCHMARKS.values():
        generated = spec.source is None

        def load(split: str, limit: int | None, *, name: str = spec.name, **kwargs: Any) -> Any:
            return builtin.load_benchmark(name, split=split, limit=limit, **kwargs)

        # Training's splits: synthetic tasks have all three; the hub benchmarks' own.
        register_benchmark(
            spec.name, load, kind=spec.kind, split=spec.split, source=spec.source,
            generated=generated,
        )  # fmt: skip


_register_builtins()
