"""Seeded synthetic QA tasks: two-hop questions over a small invented world per question.

A fresh world per question means facts cannot be memorized across questions, so the search
tool is needed; each task carries the expert's search plan in `metadata["hops"]`. Invented
names are built from `SYLLABLES`, so a tokenizer with a few thousand entries covers them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from copes.envs.tasks._synthetic_splits import Split, check_split, collect, stable_int
from copes.envs.tasks.base import Passage, Task

SYLLABLES = (
    "ka", "lo", "mi", "ra", "ven", "to", "sa", "del", "ru", "fen",
    "ba", "no", "li", "tor", "gu", "pe", "zan", "mo", "ri", "val",
)  # fmt: skip
CITY_SUFFIXES = ("ford", "holm", "mere", "wick", "gard")
COUNTRY_SUFFIXES = ("ia", "land", "stan")
COMPANY_WORDS = ("Works", "Labs", "Foods", "Motors", "Textiles")
BAND_WORDS = ("Crows", "Wolves", "Lanterns", "Echoes", "Sparrows")
JOBS = ("painter", "farmer", "teacher", "doctor", "sailor", "baker", "writer", "builder")


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
    rng = random.Random(stable_int(seed, "qa-world", d.question))
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
    check_split(split, n)
    if num_passages < 2:
        raise ValueError(f"num_passages must be >= 2 (two supporting passages), got {num_passages}")
    names = sorted(QA_TEMPLATES)

    def draw(rng: random.Random) -> _QADraw:
        template = rng.choice(names)
        kind = _RELATIONS[QA_TEMPLATES[template][0]][0]
        first = _Namer(rng).name(kind)
        return _QADraw(QA_TEMPLATES[template][2].format(e=first), template, first)

    tasks = []
    for i, d in enumerate(collect(split, n, seed, "qa", draw)):
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
