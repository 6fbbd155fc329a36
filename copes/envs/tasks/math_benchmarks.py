"""Math benchmarks as `Task`s: GSM8K, MATH-500, MATH (hendrycks), AIME 2024 and AIME 2025.

Each loader reads the public schema (DATASETS.md) from a hub id or a local file and keeps
one gold answer per task, in the form the math grader compares symbolically. Ids are the
dataset's own where it has one, else `<benchmark>-<split>-<index>` in file order.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from copes.envs.parsing import last_boxed
from copes.envs.tasks.base import Task
from copes.envs.tasks.io import SchemaError, load_records, looks_like_path, other_fields, required

logger = logging.getLogger(__name__)

GSM8K_SOURCE = "openai/gsm8k"
MATH500_SOURCE = "HuggingFaceH4/MATH-500"
MATH_SOURCE = "EleutherAI/hendrycks_math"
AIME24_SOURCE = "HuggingFaceH4/aime_2024"
AIME25_SOURCE = "math-ai/aime25"
AIME25_OPENCOMPASS_SOURCE = "opencompass/AIME2025"

# EleutherAI/hendrycks_math has one config per subject and no "all" config.
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
_AIME25_OPENCOMPASS_CONFIGS = ("AIME2025-I", "AIME2025-II")


def load_gsm8k(
    source: str | os.PathLike = GSM8K_SOURCE, split: str = "test", limit: int | None = None
) -> list[Task]:
    """GSM8K: the gold answer is the text after the final `####`, commas removed."""
    tasks = []
    for index, record in enumerate(load_records(source, split=split, config="main", limit=limit)):
        solution = str(required(record, "answer", benchmark="gsm8k", index=index))
        _, marker, tail = solution.rpartition("####")
        gold = tail.strip().replace(",", "")
        if not marker or not gold:
            raise SchemaError(
                f"gsm8k: record {index} has no final '#### <number>' line in its 'answer' "
                f"(ends with {solution[-60:]!r}); GSM8K answers end with '#### <number>'"
            )
        tasks.append(
            Task(
                id=f"gsm8k-{split}-{index}",
                question=str(required(record, "question", benchmark="gsm8k", index=index)),
                answers=(gold,),
                kind="math",
                source="gsm8k",
                metadata={"solution": solution, **other_fields(record, "question", "answer")},
            )
        )
    return tasks


def load_math500(
    source: str | os.PathLike = MATH500_SOURCE, split: str = "test", limit: int | None = None
) -> list[Task]:
    """MATH-500: gold is the `answer` field; subject, level and solution go to metadata."""
    tasks = []
    for index, record in enumerate(load_records(source, split=split, limit=limit)):
        tasks.append(
            Task(
                id=str(record.get("unique_id") or f"math500-{split}-{index}"),
                question=str(required(record, "problem", benchmark="math500", index=index)),
                answers=(_answer(record, "math500", index),),
                kind="math",
                source="math500",
                metadata=other_fields(record, "unique_id", "problem", "answer"),
            )
        )
    return tasks


def load_math(
    source: str | os.PathLike = MATH_SOURCE,
    split: str = "test",
    limit: int | None = None,
    subjects: Sequence[str] | None = None,
) -> list[Task]:
    """MATH (hendrycks): gold is the last `\\boxed{}` of `solution`.

    From the hub every subject config is loaded in turn (or only `subjects`); a local path
    is one file (one subject or all of them). Ids are `math-<split>-<type>-<n>`, with `n`
    counting inside the type, so a per-subject file and the hub agree. The rare solution
    without a box is skipped with a warning rather than graded against a wrong answer.
    """
    if looks_like_path(source):
        if subjects is not None:
            raise ValueError(
                "load_math: `subjects` selects hub configs; a local file is loaded whole. "
                "Pass subjects=None, or one file per subject"
            )
        records = load_records(source, split=split)
    else:
        chosen = MATH_SUBJECTS if subjects is None else tuple(subjects)
        unknown = sorted(set(chosen) - set(MATH_SUBJECTS))
        if unknown:
            raise ValueError(f"load_math: unknown subjects {unknown}; known: {list(MATH_SUBJECTS)}")
        records = []
        for subject in chosen:
            if limit is not None and len(records) >= limit:
                break
            records += load_records(source, split=split, config=subject)

    tasks: list[Task] = []
    per_type: Counter[str] = Counter()
    skipped = 0
    for index, record in enumerate(records):
        if limit is not None and len(tasks) >= limit:
            break
        subject = str(required(record, "type", benchmark="math", index=index))
        slug = _slug(subject)
        number = per_type[slug]
        per_type[slug] += 1
        solution = str(required(record, "solution", benchmark="math", index=index))
        gold = last_boxed(solution)
        if gold is None or not gold.strip():
            skipped += 1
            continue
        tasks.append(
            Task(
                id=f"math-{split}-{slug}-{number}",
                question=str(required(record, "problem", benchmark="math", index=index)),
                answers=(gold.strip(),),
                kind="math",
                source="math",
                metadata={"subject": subject, **other_fields(record, "problem")},
            )
        )
    if skipped:
        logger.warning("math: skipped %d records whose solution has no \\boxed{} answer", skipped)
    return tasks


def load_aime24(
    source: str | os.PathLike = AIME24_SOURCE, split: str = "test", limit: int | None = None
) -> list[Task]:
    """AIME 2024 (integer answers 0-999); year, url and solution go to metadata.

    The 30 problems are one evaluation set: Qwen2.5-Math's copy (and copes' --data-dir
    layout) calls it `test`, the hub's `HuggingFaceH4/aime_2024` holds it as its only split,
    `train`, which `test` reads there.
    """
    if not looks_like_path(source) and str(source) == AIME24_SOURCE and split == "test":
        split = "train"  # the hub copy's name for the same 30 problems
    return _load_aime(source, split, limit, benchmark="aime24", config=None)


def load_aime25(
    source: str | os.PathLike = AIME25_SOURCE, split: str = "test", limit: int | None = None
) -> list[Task]:
    """AIME 2025, from `math-ai/aime25` (`problem`) or `opencompass/AIME2025` (`question`).

    The opencompass hub id is split into two configs (parts I and II); both are loaded.
    """
    if not looks_like_path(source) and str(source) == AIME25_OPENCOMPASS_SOURCE:
        tasks = []
        for config in _AIME25_OPENCOMPASS_CONFIGS:
            remaining = None if limit is None else limit - len(tasks)
            if remaining == 0:
                break
            tasks += _load_aime(source, split, remaining, benchmark="aime25", config=config)
        return tasks
    return _load_aime(source, split, limit, benchmark="aime25", config=None)


def _load_aime(
    source: str | os.PathLike, split: str, limit: int | None, *, benchmark: str, config: str | None
) -> list[Task]:
    tasks = []
    for index, record in enumerate(load_records(source, split=split, config=config, limit=limit)):
        question_key = "problem" if "problem" in record else "question"
        if record.get("id") is not None:
            task_id = str(record["id"])
        else:
            task_id = f"{config or f'{benchmark}-{split}'}-{index}"
        tasks.append(
            Task(
                id=task_id,
                question=str(required(record, question_key, benchmark=benchmark, index=index)),
                answers=(_answer(record, benchmark, index),),
                kind="math",
                source=benchmark,
                metadata=other_fields(record, "id", question_key, "answer"),
            )
        )
    return tasks


def _answer(record: dict[str, Any], benchmark: str, index: int) -> str:
    answer = str(required(record, "answer", benchmark=benchmark, index=index)).strip()
    if not answer:
        raise SchemaError(f"{benchmark}: record {index} has an empty 'answer'; a gold is needed")
    return answer


def _slug(subject: str) -> str:
    """ "Counting & Probability" -> "counting_and_probability" (the hub config name)."""
    return re.sub(r"[^a-z0-9]+", "_", subject.lower().replace("&", "and")).strip("_")
