"""The built-in benchmarks' loaders: `load_benchmark("gsm8k")` without remembering hub ids.

`BENCHMARKS` maps each built-in name to its loader, hub id and default split. It is not the
registry users meet: `copes.registry` holds every benchmark (these and other packages'),
with the environment and grader each runs with, and reads this table for the built-ins.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from copes.envs.tasks.base import Task, TaskKind
from copes.envs.tasks.io import SUPPORTED_SUFFIXES
from copes.envs.tasks.math_benchmarks import (
    AIME24_SOURCE,
    AIME25_SOURCE,
    GSM8K_SOURCE,
    MATH500_SOURCE,
    MATH_SOURCE,
    load_aime24,
    load_aime25,
    load_gsm8k,
    load_math,
    load_math500,
)
from copes.envs.tasks.qa_benchmarks import (
    FLASHRAG_SOURCE,
    HOTPOTQA_SOURCE,
    MUSIQUE_SOURCE,
    TWOWIKI_SOURCE,
    load_2wiki,
    load_flashrag,
    load_hotpotqa,
    load_musique,
)

logger = logging.getLogger(__name__)

# Generated benchmarks: size when no limit is given, and the default generator seed, so that
# "synthetic-math" names the same tasks on every machine (training passes its own seed).
SYNTHETIC_DEFAULT_SIZE = 500
SYNTHETIC_SEED = 0

Loader = Callable[..., list[Task]]  # (source, split=..., limit=...) -> tasks


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to load one benchmark: its loader and the defaults `load_benchmark` fills in.

    `source` is the default hub id, or None for generated benchmarks (nothing to read).
    """

    name: str
    loader: Loader
    source: str | None
    split: str
    kind: TaskKind


def _load_synthetic(
    kind: TaskKind, source: object, split: str, limit: int | None, seed: int = SYNTHETIC_SEED
) -> list[Task]:
    """Import the generators only when asked, so the registry works without them."""
    try:
        from copes.envs.tasks import synthetic
    except ModuleNotFoundError as exc:
        if exc.name != "copes.envs.tasks.synthetic":
            raise
        raise ModuleNotFoundError(
            f"benchmark 'synthetic-{kind}' needs copes/envs/tasks/synthetic.py, which this "
            f"installation lacks; reinstall copes from a complete checkout, or pick a "
            f"benchmark that loads from files"
        ) from exc
    generate = synthetic.synthetic_math_tasks if kind == "math" else synthetic.synthetic_qa_tasks
    n = SYNTHETIC_DEFAULT_SIZE if limit is None else limit
    return generate(split=split, n=n, seed=seed)


# Named after FlashRAG's configs, which is also the tasks' `source` ("flashrag-<config>").
_FLASHRAG_CONFIGS = ("hotpotqa", "2wikimultihopqa", "musique")

BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("gsm8k", load_gsm8k, GSM8K_SOURCE, "test", "math"),
        BenchmarkSpec("math500", load_math500, MATH500_SOURCE, "test", "math"),
        BenchmarkSpec("math", load_math, MATH_SOURCE, "test", "math"),
        BenchmarkSpec("aime24", load_aime24, AIME24_SOURCE, "test", "math"),
        BenchmarkSpec("aime25", load_aime25, AIME25_SOURCE, "test", "math"),
        BenchmarkSpec("hotpotqa", load_hotpotqa, HOTPOTQA_SOURCE, "validation", "qa"),
        BenchmarkSpec("2wiki", load_2wiki, TWOWIKI_SOURCE, "validation", "qa"),
        BenchmarkSpec("musique", load_musique, MUSIQUE_SOURCE, "validation", "qa"),
        *(
            BenchmarkSpec(
                f"flashrag-{config}",
                functools.partial(load_flashrag, dataset=config),
                FLASHRAG_SOURCE,
                "dev",
                "qa",
            )
            for config in _FLASHRAG_CONFIGS
        ),
        BenchmarkSpec(
            "synthetic-math", functools.partial(_load_synthetic, "math"), None, "test", "math"
        ),
        BenchmarkSpec("synthetic-qa", functools.partial(_load_synthetic, "qa"), None, "test", "qa"),
    )
}


def load_benchmark(
    name: str,
    source: str | os.PathLike | None = None,
    split: str | None = None,
    limit: int | None = None,
    data_dir: str | os.PathLike | None = None,
    seed: int = SYNTHETIC_SEED,
) -> list[Task]:
    """The tasks of benchmark `name` (see `BENCHMARKS`), from `source`, `data_dir` or the hub.

    Where the records come from, first match wins:
      1. `source`: a hub id or a local file/folder, passed to the benchmark's loader.
      2. `data_dir`: a folder of local files named after the benchmark, either
         `data_dir/<name>/` holding one file per split whose name contains the split
         (`data_dir/gsm8k/test.jsonl`; "dev" also serves "validation"), or a single file
         `data_dir/<name>.jsonl` (or `.json`, `.parquet`), taken as the requested split.
         If neither exists this is an error, never a silent trip to the hub.
      3. the benchmark's default hub id.
    `split` defaults to the benchmark's evaluation split. Generated benchmarks
    ("synthetic-*") ignore `data_dir`; `limit` is their size (default
    `SYNTHETIC_DEFAULT_SIZE`) and `seed` their generator's seed.
    """
    spec = BENCHMARKS.get(name)
    if spec is None:
        raise ValueError(f"unknown benchmark {name!r}; known benchmarks: {', '.join(BENCHMARKS)}")
    split = spec.split if split is None else split
    if spec.source is None:
        if source is not None:
            raise ValueError(
                f"benchmark {name!r} is generated, not read from files; drop source={source!r}"
            )
        return spec.loader(None, split=split, limit=limit, seed=seed)
    if source is None and data_dir is not None:
        source = _local_source(Path(data_dir).expanduser(), name)
    if source is None:
        source = spec.source
    logger.info("loading benchmark %s (split %s) from %s", name, split, source)
    return spec.loader(source, split=split, limit=limit)


def _local_source(data_dir: Path, name: str) -> Path:
    """`data_dir/<name>/` or `data_dir/<name>.<suffix>`, whichever exists (in that order)."""
    candidates = [data_dir / name, *(data_dir / f"{name}{suffix}" for suffix in SUPPORTED_SUFFIXES)]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    tried = ", ".join(str(candidate) for candidate in candidates)
    raise FileNotFoundError(
        f"no local files for benchmark {name!r} in data_dir {str(data_dir)!r} (tried {tried}); "
        f"put the split there as {name}/<split>.jsonl or {name}.jsonl, or drop data_dir to "
        f"load it from the hub"
    )
