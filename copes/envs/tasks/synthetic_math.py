"""Seeded synthetic math tasks: multi-step arithmetic word problems for the Python tool.

Large products, powers, modular arithmetic and fractions whose answers are impractical
without the calculator; each task carries the expert's `solution_code`, which prints exactly
the gold answer. Numbers are written in digits and the wording is a fixed template per kind,
so a tokenizer with a few thousand entries covers everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from copes.envs.tasks._synthetic_splits import Split, check_split, collect
from copes.envs.tasks.base import Task

DIFFICULTIES = (1, 2, 3)
GOODS = ("lamps", "chairs", "books", "ropes", "jars", "bags", "coats", "boots", "clocks")


@dataclass(frozen=True)
class _MathDraw:
    question: str
    answer: str
    code: str
    template: str
    difficulty: int


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _warehouse(r: random.Random, d: int) -> tuple[str, int, str]:
    if d == 1:
        a, b = r.randint(12, 99), r.randint(120, 999)
        q = f"A warehouse has {a} shelves with {b} boxes on each shelf. How many boxes are there?"
        return q, a * b, f"print({a} * {b})"
    a, b, c = r.randint(4, 40), r.randint(100, 2500), r.randint(12, 96)
    q = f"A warehouse has {a} shelves with {b} boxes on each shelf. Each box holds {c} items."
    if d == 2:
        return q + " How many items are there?", a * b * c, f"print({a} * {b} * {c})"
    k = r.randint(100, 9999)
    q += f" Of these, {k} items are broken. How many items are not broken?"
    return q, a * b * c - k, f"print({a} * {b} * {c} - {k})"


def _shop(r: random.Random, d: int) -> tuple[str, int, str]:
    goods = r.sample(GOODS, d)
    prices = [r.randint(100, 999) if d == 1 else r.randint(15, 999) for _ in goods]
    counts = [r.randint(12, 99) for _ in goods]
    sells = _join([f"{g} for {p} coins each" for g, p in zip(goods, prices, strict=True)])
    buys = _join([f"{c} {g}" for g, c in zip(goods, counts, strict=True)])
    total = sum(p * c for p, c in zip(prices, counts, strict=True))
    expr = " + ".join(f"{c} * {p}" for p, c in zip(prices, counts, strict=True))
    q = f"A shop sells {sells}. A customer buys {buys}."
    if d < 3:
        return q + " How many coins does the customer pay?", total, f"print({expr})"
    paid = (total // 1000 + 1 + r.randint(0, 4)) * 1000
    q += f" The customer pays with {paid} coins. How many coins of change are given back?"
    return q, paid - total, f"print({paid} - ({expr}))"


def _area(r: random.Random, d: int) -> tuple[str, int, str]:
    if d == 1:
        a, b = r.randint(120, 999), r.randint(45, 999)
        q = f"A field is {a} meters long and {b} meters wide. What is its area in square meters?"
        return q, a * b, f"print({a} * {b})"
    a, b, c = r.randint(100, 999), r.randint(50, 500), r.randint(12, 99)
    q = f"A field is {a} meters long and {b} meters wide."
    cost = f" Seed for one square meter costs {c} coins. How many coins does it cost to sow"
    if d == 2:
        return q + cost + " the whole field?", a * b * c, f"print({a} * {b} * {c})"
    p, w = r.randint(10, 49), r.randint(10, 49)
    q += f" A pond {p} meters long and {w} meters wide lies in it." + cost + " the rest?"
    return q, (a * b - p * w) * c, f"print(({a} * {b} - {p} * {w}) * {c})"


def _growth(r: random.Random, d: int) -> tuple[str, int, str]:
    if d == 1:
        p, h = r.randint(3, 99), r.randint(8, 16)
        q = (
            f"A colony starts with {p} bacteria and doubles every hour. "
            f"How many bacteria are there after {h} hours?"
        )
        return q, p * 2**h, f"print({p} * 2 ** {h})"
    if d == 2:
        p, k, n = r.randint(100, 999), r.randint(2, 5), r.randint(3, 7)
        m = r.randint(100, p * k**n // 2)
        q = (
            f"A town has {p} people. Its population is multiplied by {k} every year. "
            f"After {n} years, {m} people move away. How many people live there then?"
        )
        return q, p * k**n - m, f"print({p} * {k} ** {n} - {m})"
    rate, n = r.randint(2, 9), r.randint(2, 5)
    p = r.randint(2, 99) * rate**n  # so the population stays a whole number every year
    q = (
        f"A town has {p} people. Every year its population grows by 1/{rate} of its size. "
        f"How many people live there after {n} years?"
    )
    code = f"from fractions import Fraction\nprint({p} * (1 + Fraction(1, {rate})) ** {n})"
    return q, p * (rate + 1) ** n // rate**n, code


def _remainder(r: random.Random, d: int) -> tuple[str, int, str]:
    if d == 1:
        a, m = r.randint(10000, 99999), r.randint(13, 97)
        q = f"{a} marbles are packed into bags of {m}. How many marbles are left over?"
        return q, a % m, f"print({a} % {m})"
    if d == 2:
        a, b, m = r.randint(100, 999), r.randint(100, 999), r.randint(101, 999)
        q = (
            f"There are {a} crates with {b} marbles in each crate. The marbles are packed "
            f"into bags of {m}. How many marbles are left over?"
        )
        return q, a * b % m, f"print({a} * {b} % {m})"
    a, n, m = r.randint(3, 99), r.randint(20, 200), r.randint(1001, 9999)
    q = (
        f"A counter starts at 1. Each step it is multiplied by {a}, and only the remainder "
        f"after dividing by {m} is kept. What is the counter after {n} steps?"
    )
    return q, pow(a, n, m), f"print(pow({a}, {n}, {m}))"


def _split_bill(r: random.Random, d: int) -> tuple[str, Fraction, str]:
    imp = "from fractions import Fraction\n"
    k = r.randint(3, 12)
    if d == 1:
        b = r.randint(1000, 9999)
        q = f"A bill of {b} coins is shared equally by {k} friends."
        value, code = Fraction(b, k), f"{imp}print(Fraction({b}, {k}))"
    elif d == 2:
        b1, b2 = r.randint(1000, 9999), r.randint(100, 999)
        q = (
            f"Food costs {b1} coins and drinks cost {b2} coins. {k} friends share the total "
            "equally."
        )
        value, code = Fraction(b1 + b2, k), f"{imp}print(Fraction({b1} + {b2}, {k}))"
    else:
        b1, b2, j = r.randint(1000, 9999), r.randint(100, 999), r.randint(2, k - 1)
        q = (
            f"{k} friends share a meal. The food costs {b1} coins and is shared by all {k} "
            f"friends. The drinks cost {b2} coins and are shared by the {j} friends who drank."
        )
        value = Fraction(b1, k) + Fraction(b2, j)
        code = f"{imp}print(Fraction({b1}, {k}) + Fraction({b2}, {j}))"
    who = "each friend" if d < 3 else "a friend who drank"
    return q + f" How many coins does {who} pay? Give the exact answer.", value, code


def _tank(r: random.Random, d: int) -> tuple[str, Fraction, str]:
    lo, hi = ((3, 16), (5, 20), (7, 30))[d - 1]
    while True:
        fills = [(r.randint(1, 4), r.randint(lo, hi)) for _ in range(2 if d == 1 else 3)]
        leak = (r.randint(1, 2), r.randint(lo, hi)) if d == 3 else None
        value = sum((Fraction(a, b) for a, b in fills), Fraction(0))
        value -= Fraction(*leak) if leak else 0
        given = {f"{a}/{b}" for a, b in [*fills, *([leak] if leak else [])]}
        if 0 < value < 1 and value.denominator > 2 and str(value) not in given:
            break
    pipes = [f"pipe {x} fills {a}/{b} of it" for x, (a, b) in zip("ABC", fills, strict=False)]
    q = f"A tank starts empty. Then {_join(pipes)}"
    expr = " + ".join(f"Fraction({a}, {b})" for a, b in fills)
    if leak:
        q += f", and a leak drains {leak[0]}/{leak[1]} of it"
        expr += f" - Fraction({leak[0]}, {leak[1]})"
    q += ". What fraction of the tank is full?"
    return q, value, f"from fractions import Fraction\nprint({expr})"


MATH_TEMPLATES: dict[str, Callable[[random.Random, int], tuple[str, int | Fraction, str]]] = {
    "warehouse": _warehouse,
    "shop": _shop,
    "area": _area,
    "growth": _growth,
    "remainder": _remainder,
    "split_bill": _split_bill,
    "tank": _tank,
}


def synthetic_math_tasks(
    split: Split, n: int, seed: int = 0, difficulty: int | None = None
) -> list[Task]:
    """`n` arithmetic word problems that need the calculator, all from `split`.

    `difficulty` (1-3) fixes the number of steps and sizes of numbers; None mixes all three
    uniformly. Gold answers are integers or reduced fractions ("7/12"), written exactly as
    `print` shows them, so `metadata["solution_code"]` prints the gold string.
    """
    check_split(split, n)
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None, got {difficulty!r}")
    names = sorted(MATH_TEMPLATES)

    def draw(rng: random.Random) -> _MathDraw:
        template = rng.choice(names)
        d = difficulty if difficulty is not None else rng.choice(DIFFICULTIES)
        question, value, code = MATH_TEMPLATES[template](rng, d)
        return _MathDraw(question, str(value), code, template, d)

    return [
        Task(
            id=f"synthetic-math-{split}-{i:05d}",
            question=c.question,
            answers=(c.answer,),
            kind="math",
            source="synthetic-math",
            metadata={"solution_code": c.code, "difficulty": c.difficulty, "template": c.template},
        )
        for i, c in enumerate(collect(split, n, seed, "math", draw))
    ]
