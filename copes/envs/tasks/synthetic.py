"""Seeded synthetic tasks: the offline default data for the embedded tiny agent.

Two generators, both pure functions of their arguments:

- math: multi-step arithmetic word problems (large products, powers, modular arithmetic,
  fractions) whose answers are impractical without the Python tool; each carries the
  expert's `solution_code`, which prints exactly the gold answer.
- qa: two-hop questions over a small invented world built per question (so facts cannot be
  memorized across questions and the search tool is needed); each carries the expert's
  search plan in `metadata["hops"]`.

Vocabularies are deliberately small: a fixed template wording, numbers written in digits,
and invented names built from `SYLLABLES`, so a tokenizer with a few thousand entries covers
everything. Splits are disjoint by construction: a task's split is a stable hash of its
question text (80/10/10), so no question can appear in two splits for any `n` or seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, TypeVar

from copes.envs.tasks.base import Passage, Task

Split = Literal["train", "validation", "test"]
SPLITS: tuple[str, ...] = ("train", "validation", "test")
DIFFICULTIES = (1, 2, 3)
SYLLABLES = (
    "ka", "lo", "mi", "ra", "ven", "to", "sa", "del", "ru", "fen",
    "ba", "no", "li", "tor", "gu", "pe", "zan", "mo", "ri", "val",
)  # fmt: skip
CITY_SUFFIXES = ("ford", "holm", "mere", "wick", "gard")
COUNTRY_SUFFIXES = ("ia", "land", "stan")
COMPANY_WORDS = ("Works", "Labs", "Foods", "Motors", "Textiles")
BAND_WORDS = ("Crows", "Wolves", "Lanterns", "Echoes", "Sparrows")
JOBS = ("painter", "farmer", "teacher", "doctor", "sailor", "baker", "writer", "builder")
GOODS = ("lamps", "chairs", "books", "ropes", "jars", "bags", "coats", "boots", "clocks")

# ---------------------------------------------------------------------------------------
# Seeding and split assignment


def _stable_int(*parts: object) -> int:
    """A 64-bit integer from `parts` that is identical in every process (unlike hash())."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def split_of(question: str) -> str:
    """The split a question belongs to: a stable hash bucket, 80/10/10 train/val/test."""
    bucket = _stable_int("split", question) % 10
    return "train" if bucket < 8 else ("validation" if bucket == 8 else "test")


_Draw = TypeVar("_Draw", "_MathDraw", "_QADraw")


def _check_split(split: str, n: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def _collect(
    split: str, n: int, seed: int, kind: str, draw: Callable[[random.Random], _Draw]
) -> list[_Draw]:
    """Draw candidates from the (seed, split) stream, keep the unique ones of `split`.

    The stream is filtered, not partitioned, so the result is prefix-stable: the first k
    tasks are the same whatever `n` is.
    """
    rng = random.Random(_stable_int(seed, split, kind))
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


# ---------------------------------------------------------------------------------------
# Math


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
    _check_split(split, n)
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
        for i, c in enumerate(_collect(split, n, seed, "math", draw))
    ]


# ---------------------------------------------------------------------------------------
# Multi-hop QA over invented worlds


@dataclass
class _Entity:
    kind: str  # person | city | country | company | band
    name: str
    links: dict[str, int] = field(default_factory=dict)  # relation -> entity index
    job: str = ""


# relation -> (kind of the subject, kind of the object); each fact is stated only in the
# subject's passage, so the first search never shows the answer (no one-hop shortcut).
_RELATIONS = {
    "born_in": ("person", "city"),
    "country": ("city", "country"),
    "mayor": ("city", "person"),
    "capital": ("country", "city"),
    "founder": ("company", "person"),
    "based_in": ("company", "city"),
    "singer": ("band", "person"),
    "formed_in": ("band", "city"),
}

# template -> (relation of hop 1, relation of hop 2, question with {e} for the first entity)
QA_TEMPLATES: dict[str, tuple[str, str, str]] = {
    "founder_birth_city": ("founder", "born_in", "In which city was the founder of {e} born?"),
    "singer_birth_city": ("singer", "born_in", "In which city was the lead singer of {e} born?"),
    "mayor_birth_city": ("mayor", "born_in", "In which city was the mayor of {e} born?"),
    "birth_country": ("born_in", "country", "In which country was {e} born?"),
    "company_country": ("based_in", "country", "In which country is {e} based?"),
    "band_country": ("formed_in", "country", "In which country was {e} formed?"),
    "capital_of_country_of_city": (
        "country",
        "capital",
        "What is the capital of the country where {e} is located?",
    ),
    "mayor_of_company_city": (
        "based_in", "mayor", "Who is the mayor of the city where {e} is based?"
    ),
    "mayor_of_band_city": (
        "formed_in", "mayor", "Who is the mayor of the city where {e} was formed?"
    ),
}  # fmt: skip


class _Namer:
    """Invented names from `SYLLABLES`; stems are unique within one world unless shared on
    purpose (confusers), so no name contains another entity's name by accident."""

    def __init__(self, rng: random.Random, reserved: tuple[str, ...] = ()) -> None:
        self.rng, self.used = rng, set(reserved)

    def stem(self, syllables: int | None = None) -> str:
        while True:
            k = syllables or self.rng.choice((2, 3))
            s = "".join(self.rng.choice(SYLLABLES) for _ in range(k)).capitalize()
            if s not in self.used:
                self.used.add(s)
                return s

    def name(self, kind: str, stem: str | None = None, other: str | None = None) -> str:
        """A fresh name of `kind`; `stem` reuses a word of an existing name (a confuser)."""
        r = self.rng
        if kind == "person":
            return f"{stem or self.stem(2)} {other or self.stem()}"
        words = {"company": COMPANY_WORDS, "band": BAND_WORDS}
        stem = stem or self.stem()
        if kind in words:
            return f"{stem} {r.choice([w for w in words[kind] if w != other])}"
        suffixes = CITY_SUFFIXES if kind == "city" else COUNTRY_SUFFIXES
        return stem + r.choice([s for s in suffixes if s != other])


def _stems(kind: str, name: str) -> tuple[str, ...]:
    if kind in ("person", "company", "band"):
        return tuple(name.split())
    suffixes = CITY_SUFFIXES if kind == "city" else COUNTRY_SUFFIXES
    return tuple(name[: -len(s)] for s in suffixes if name.endswith(s))


class _World:
    """A small consistent set of entities and facts; every entity has all its relations."""

    def __init__(self, rng: random.Random, namer: _Namer, scale: int) -> None:
        self.rng, self.namer, self.ents = rng, namer, []
        for _ in range(2 * scale):
            country = self._new("country")
            cities = [self._new("city", country=country) for _ in range(2)]
            self.ents[country].links["capital"] = cities[0]
        for city in self.of_kind("city"):  # mayors once every city exists to be born in
            self.ents[city].links["mayor"] = self.add_person(avoid_city=city)
        for _ in range(2 * scale):
            self.add_company()
            self.add_band()

    def _new(self, kind: str, name: str | None = None, **links: int) -> int:
        self.ents.append(_Entity(kind, name or self.namer.name(kind), dict(links)))
        return len(self.ents) - 1

    def of_kind(self, kind: str) -> list[int]:
        return [i for i, e in enumerate(self.ents) if e.kind == kind]

    def add_person(self, name: str | None = None, avoid_city: int = -1) -> int:
        cities = [c for c in self.of_kind("city") if c != avoid_city]
        i = self._new("person", name, born_in=self.rng.choice(cities))
        self.ents[i].job = self.rng.choice(JOBS)
        return i

    def add_city(self, name: str | None = None) -> int:
        i = self._new("city", name, country=self.rng.choice(self.of_kind("country")))
        self.ents[i].links["mayor"] = self.add_person(avoid_city=i)
        return i

    def add_company(self, name: str | None = None) -> int:
        city = self.rng.choice(self.of_kind("city"))
        return self._new("company", name, founder=self.add_person(), based_in=city)

    def add_band(self, name: str | None = None) -> int:
        city = self.rng.choice(self.of_kind("city"))
        return self._new("band", name, singer=self.add_person(), formed_in=city)

    def add_confuser(self, i: int) -> int:
        """An entity of the same kind sharing a word with entity `i` (a hard distractor)."""
        e = self.ents[i]
        stems = _stems(e.kind, e.name)
        if e.kind == "person":
            first, last = e.name.split()
            name = (
                self.namer.name("person", stem=first)
                if self.rng.random() < 0.5
                else self.namer.name("person", other=last)
            )
        elif e.kind in ("company", "band"):
            name = self.namer.name(e.kind, stem=stems[0], other=e.name.split()[1])
        else:
            name = self.namer.name(e.kind, stem=stems[0], other=e.name[len(stems[0]) :])
        add = {"person": self.add_person, "city": self.add_city, "company": self.add_company}
        if e.kind == "country":  # a country needs a capital: give it a fresh one
            j = self._new("country", name)
            self.ents[j].links["capital"] = self.add_city()
            self.ents[self.ents[j].links["capital"]].links["country"] = j
            return j
        return add.get(e.kind, self.add_band)(name=name)

    def passage(self, i: int) -> Passage:
        """The entity's passage: its own outgoing facts only, in a fixed wording."""
        e = self.ents[i]
        x = {rel: self.ents[j].name for rel, j in e.links.items()}
        if e.kind == "person":
            text = f"{e.name} was born in {x['born_in']}. {e.name} works as a {e.job}."
        elif e.kind == "city":
            text = f"{e.name} is a city in {x['country']}. The mayor of {e.name} is {x['mayor']}."
        elif e.kind == "country":
            text = (
                f"{e.name}, officially the Republic of {e.name}, is a country. "
                f"Its capital is {x['capital']}."
            )
        elif e.kind == "company":
            text = (
                f"{e.name} is a company based in {x['based_in']}. It was founded by {x['founder']}."
            )
        else:
            text = (
                f"{e.name} is a band formed in {x['formed_in']}. Its lead singer is {x['singer']}."
            )
        return Passage(title=e.name, text=text)

    def aliases(self, i: int) -> tuple[str, ...]:
        e = self.ents[i]
        return (e.name, f"Republic of {e.name}") if e.kind == "country" else (e.name,)


@dataclass(frozen=True)
class _QADraw:
    question: str
    template: str
    first_name: str


def _pick_first(world: _World, rng: random.Random, kind: str, rel1: str, rel2: str) -> int | None:
    """An entity to ask about whose question has no one-search shortcut.

    Rejected: a question city that is itself the answer (a capital), and an entity whose
    own passage, or a passage naming it, also contains the answer (a company based in its
    founder's birth city; the mayor of a city in the answer country), since the first
    search would then show the answer and a guess from it would often be right.
    """
    choices = world.of_kind(kind)
    rng.shuffle(choices)
    for c in choices:
        answer = world.ents[world.ents[c].links[rel1]].links[rel2]
        if answer == c:
            continue
        answer_name = world.ents[answer].name
        mentions = [j for j, e in enumerate(world.ents) if j == c or c in e.links.values()]
        if all(answer_name not in world.passage(j).text for j in mentions):
            return c
    return None


def _build_qa(
    d: _QADraw, seed: int, num_passages: int
) -> tuple[tuple[str, ...], tuple[Passage, ...], dict]:
    """Answers, pool and metadata for a drawn question; the world depends on (seed, question)."""
    rel1, rel2, _ = QA_TEMPLATES[d.template]
    kind = _RELATIONS[rel1][0]
    rng = random.Random(_stable_int(seed, "qa-world", d.question))
    scale = max(1, -(-num_passages // 14))  # a base world has ~22 entities
    while True:  # retried only if the answer ends up inside the question (rare)
        world = _World(rng, _Namer(rng, _stems(kind, d.first_name)), scale)
        first = _pick_first(world, rng, kind, rel1, rel2)
        if first is None:
            continue
        world.ents[first].name = d.first_name
        bridge = world.ents[first].links[rel1]
        answer = world.ents[bridge].links[rel2]
        answers = world.aliases(answer)
        if not any(a.lower() in d.question.lower() for a in answers):
            break
    hard = [world.add_confuser(first), world.add_confuser(bridge)]
    mentions = [i for i, e in enumerate(world.ents) if {first, bridge} & set(e.links.values())]
    same = world.of_kind(kind) + world.of_kind(world.ents[bridge].kind)
    rest = list(range(len(world.ents)))
    for group in (mentions, same, rest):
        rng.shuffle(group)
    pool: list[int] = [first, bridge]
    for i in hard + mentions + same + rest:
        if len(pool) == num_passages:
            break
        if i not in pool:
            pool.append(i)
    rng.shuffle(pool)
    names = [world.ents[i].name for i in (first, bridge, answer)]
    metadata = {
        "template": d.template,
        "hops": [{"query": names[0], "answer": names[1]}, {"query": names[1], "answer": names[2]}],
        "supporting_titles": names[:2],
    }
    return answers, tuple(world.passage(i) for i in pool), metadata


def synthetic_qa_tasks(split: Split, n: int, seed: int = 0, num_passages: int = 8) -> list[Task]:
    """`n` two-hop questions, each over its own invented world, all from `split`.

    A fresh world per question means facts cannot be memorized from other questions, so
    the search tool is needed. The pool holds the two supporting passages plus distractors
    from the same world (first a same-kind entity sharing a word with each supporting one)
    up to `num_passages`.
    """
    _check_split(split, n)
    if num_passages < 2:
        raise ValueError(f"num_passages must be >= 2 (two supporting passages), got {num_passages}")
    names = sorted(QA_TEMPLATES)

    def draw(rng: random.Random) -> _QADraw:
        template = rng.choice(names)
        kind = _RELATIONS[QA_TEMPLATES[template][0]][0]
        first = _Namer(rng).name(kind)
        return _QADraw(QA_TEMPLATES[template][2].format(e=first), template, first)

    tasks = []
    for i, d in enumerate(_collect(split, n, seed, "qa", draw)):
        answers, passages, metadata = _build_qa(d, seed, num_passages)
        tasks.append(
            Task(
                id=f"synthetic-qa-{split}-{i:05d}",
                question=d.question,
                answers=answers,
                kind="qa",
                passages=passages,
                source="synthetic-qa",
                metadata=metadata,
            )
        )
    return tasks


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
