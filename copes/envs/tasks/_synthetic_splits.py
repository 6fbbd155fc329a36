"""Seeding and split assignment shared by the synthetic math and QA generators.

A task's split is a stable hash of its question text (80/10/10), so no question can appear in
two splits for any `n` or seed; seeds go through the same stable hash, never through `hash()`
or global random state, so every process draws the same tasks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Literal, Protocol, TypeVar

Split = Literal["train", "validation", "test"]
SPLITS: tuple[str, ...] = ("train", "validation", "test")


class _Draw(Protocol):
    @property
    def question(self) -> str: ...


_D = TypeVar("_D", bound=_Draw)


def stable_int(*parts: object) -> int:
    """A 64-bit integer from `parts` that is identical in every process (unlike hash())."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def split_of(question: str) -> str:
    """The split a question belongs to: a stable hash bucket, 80/10/10 train/val/test."""
    bucket = stable_int("split", question) % 10
    return "train" if bucket < 8 else ("validation" if bucket == 8 else "test")


def check_split(split: str, n: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def collect(
    split: str, n: int, seed: int, kind: str, draw: Callable[[random.Random], _D]
) -> list[_D]:
    """Draw candidates from the (seed, split) stream, keep the unique ones of `split`.

    The stream is filtered, not partitioned, so the result is prefix-stable: the first k
    tasks are the same whatever `n` is.
    """
    rng = random.Random(stable_int(seed, split, kind))
    kept, seen = [], set()
    max_draws = 100 * n + 1000
    for _ in range(max_draws):
        if len(kept) == n:
            return kept
        cand = draw(rng)
        if cand.question in seen or split_of(cand.question) != split:
            continue
        seen.add(cand.question)
        kept.append(cand)
    if len(kept) == n:
        return kept
    raise RuntimeError(
        f"only {len(kept)} unique synthetic {kind} questions for split {split!r} after "
        f"{max_draws} draws (asked for {n}); ask for fewer tasks"
    )
