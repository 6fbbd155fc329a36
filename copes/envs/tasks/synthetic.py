"""Seeded synthetic tasks: the offline default data for the embedded tiny agent.

Two generators, both pure functions of their arguments:

- math (`synthetic_math`): multi-step arithmetic word problems (large products, powers,
  modular arithmetic, fractions) whose answers are impractical without the Python tool;
  each carries the expert's `solution_code`, which prints exactly the gold answer.
- qa (`synthetic_qa`): two-hop questions over a small invented world built per question (so
  facts cannot be memorized across questions and the search tool is needed); each carries
  the expert's search plan in `metadata["hops"]`.

Vocabularies are deliberately small: a fixed template wording, numbers written in digits,
and invented names built from `SYLLABLES`, so a tokenizer with a few thousand entries covers
everything. Splits are disjoint by construction: a task's split is a stable hash of its
question text (80/10/10), so no question can appear in two splits for any `n` or seed.

This module gathers both generators' public names and the tokenizer corpus built from them.
"""

from __future__ import annotations

from collections.abc import Iterator

from copes.envs.tasks._synthetic_splits import SPLITS, Split, split_of
from copes.envs.tasks.synthetic_math import (
    DIFFICULTIES,
    GOODS,
    MATH_TEMPLATES,
    synthetic_math_tasks,
)
from copes.envs.tasks.synthetic_qa import (
    BAND_WORDS,
    CITY_SUFFIXES,
    COMPANY_WORDS,
    COUNTRY_SUFFIXES,
    JOBS,
    QA_TEMPLATES,
    SYLLABLES,
    synthetic_qa_tasks,
)

__all__ = [
    "BAND_WORDS",
    "CITY_SUFFIXES",
    "COMPANY_WORDS",
    "COUNTRY_SUFFIXES",
    "DIFFICULTIES",
    "GOODS",
    "JOBS",
    "MATH_TEMPLATES",
    "QA_TEMPLATES",
    "SPLITS",
    "SYLLABLES",
    "Split",
    "split_of",
    "synthetic_corpus_text",
    "synthetic_math_tasks",
    "synthetic_qa_tasks",
]


def synthetic_corpus_text(n: int = 2000, seed: int = 0) -> Iterator[str]:
    """Text for training the tiny tokenizer: n math and n QA train tasks, interleaved.

    Each document is one task's question, then its solution code (math) or passages and
    search queries (qa), then its answers: everything the agent reads or writes.
    """
    math = synthetic_math_tasks("train", n, seed)
    qa = synthetic_qa_tasks("train", n, seed)
    for m, q in zip(math, qa, strict=True):
        yield "\n".join([m.question, m.metadata["solution_code"], *m.answers])
        hops = [h["query"] for h in q.metadata["hops"]]
        yield "\n".join([q.question, *(p.text for p in q.passages), *hops, *q.answers])
