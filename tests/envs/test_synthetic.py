"""Synthetic tasks: determinism, disjoint splits, correct expert plans, small vocabulary."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections import Counter

import pytest

from copes.envs.tasks.synthetic import (
    CITY_SUFFIXES,
    COUNTRY_SUFFIXES,
    MATH_TEMPLATES,
    QA_TEMPLATES,
    SYLLABLES,
    split_of,
    synthetic_corpus_text,
    synthetic_math_tasks,
    synthetic_qa_tasks,
)

SPLITS = ("train", "validation", "test")


def run_code(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue()


# --------------------------------------------------------------------------- both kinds


@pytest.mark.parametrize("make", [synthetic_math_tasks, synthetic_qa_tasks])
def test_same_arguments_same_tasks_and_seeds_differ(make):
    a, b = make("train", 50, seed=3), make("train", 50, seed=3)
    assert a == b
    assert [t.metadata for t in a] == [t.metadata for t in b]  # metadata is compare=False
    other = make("train", 50, seed=4)
    assert not {t.question for t in a} & {t.question for t in other}


@pytest.mark.parametrize("make", [synthetic_math_tasks, synthetic_qa_tasks])
def test_prefix_stable_and_ids(make):
    short, long = make("validation", 5), make("validation", 30)
    assert short == long[:5]
    kind = "math" if make is synthetic_math_tasks else "qa"
    assert long[12].id == f"synthetic-{kind}-validation-00012"
    assert {t.source for t in long} == {f"synthetic-{kind}"}
    assert {t.kind for t in long} == {kind}


def test_identical_in_a_fresh_process():
    """No salted hash() or global random state: another interpreter gets the same tasks."""
    code = (
        "from copes.envs.tasks.synthetic import synthetic_math_tasks as m, "
        "synthetic_qa_tasks as q\n"
        "print(repr([(t.question, t.answers) for t in m('test', 5, 7)]))\n"
        "print(repr([(t.question, t.answers, t.passages) for t in q('test', 5, 7)]))\n"
    )
    here = "\n".join(
        [
            repr([(t.question, t.answers) for t in synthetic_math_tasks("test", 5, 7)]),
            repr([(t.question, t.answers, t.passages) for t in synthetic_qa_tasks("test", 5, 7)]),
        ]
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == here


@pytest.mark.parametrize("make", [synthetic_math_tasks, synthetic_qa_tasks])
def test_splits_are_disjoint(make):
    by_split = {s: make(s, 2000) for s in SPLITS}
    questions = {s: {t.question for t in tasks} for s, tasks in by_split.items()}
    for s, tasks in by_split.items():
        assert len(questions[s]) == 2000  # unique inside a split
        assert all(split_of(t.question) == s for t in tasks)
        assert len({t.id for t in tasks}) == 2000
    assert not questions["train"] & questions["validation"]
    assert not questions["train"] & questions["test"]
    assert not questions["validation"] & questions["test"]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="split must be one of"):
        synthetic_math_tasks("dev", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="difficulty"):
        synthetic_math_tasks("train", 3, difficulty=4)
    with pytest.raises(ValueError, match="num_passages"):
        synthetic_qa_tasks("train", 3, num_passages=1)
    with pytest.raises(ValueError, match="n must be"):
        synthetic_qa_tasks("train", -1)
    assert synthetic_math_tasks("test", 0) == []


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_solution_code_prints_exactly_the_gold_answer(difficulty):
    tasks = synthetic_math_tasks("train", 350, seed=1, difficulty=difficulty)
    assert {t.metadata["template"] for t in tasks} == set(MATH_TEMPLATES)
    for t in tasks:
        assert t.metadata["difficulty"] == difficulty
        assert run_code(t.metadata["solution_code"]) == t.answers[0] + "\n", t.question
        assert len(t.answers) == 1 and "," not in t.answers[0]


def test_math_answers_need_the_calculator():
    tasks = synthetic_math_tasks("test", 500)
    assert Counter(t.metadata["difficulty"] for t in tasks).keys() == {1, 2, 3}
    hard = [t for t in tasks if "/" in t.answers[0] or len(t.answers[0].lstrip("-")) >= 4]
    assert len(hard) >= 0.8 * len(tasks)
    fractions = [t for t in tasks if "/" in t.answers[0]]
    assert len(fractions) >= 0.1 * len(tasks)
    for t in fractions:  # reduced, proper "p/q" strings as Fraction prints them
        p, q = map(int, t.answers[0].split("/"))
        assert q > 1 and p > 0
    assert all(not t.answers[0].startswith("-") for t in tasks)


def test_difficulty_grows_the_work():
    """Harder levels mean more numbers to copy into the code and bigger answers."""
    digits = {}
    for d in (1, 2, 3):
        tasks = synthetic_math_tasks("train", 300, difficulty=d)
        digits[d] = sum(len(re.findall(r"\d", t.metadata["solution_code"])) for t in tasks)
    assert digits[1] < digits[2] < digits[3]


# --------------------------------------------------------------------------- qa


def passage_by_title(task):
    titles = [p.title for p in task.passages]
    assert len(titles) == len(set(titles)), "titles must be unique inside a pool"
    return {p.title: p for p in task.passages}


@pytest.mark.parametrize("num_passages", [2, 8, 20])
def test_qa_two_hops_chain_through_the_pool(num_passages):
    tasks = synthetic_qa_tasks("train", 300, seed=2, num_passages=num_passages)
    assert {t.metadata["template"] for t in tasks} == set(QA_TEMPLATES)
    for t in tasks:
        pool = passage_by_title(t)
        hop1, hop2 = t.metadata["hops"]
        assert len(t.passages) == num_passages
        assert t.metadata["supporting_titles"] == [hop1["query"], hop2["query"]]
        assert hop1["query"] in t.question and hop2["query"] == hop1["answer"]
        assert hop1["answer"] in pool[hop1["query"]].text
        assert hop2["answer"] == t.answers[0]
        assert t.answers[0] in pool[hop2["query"]].text
        assert all(a.lower() not in t.question.lower() for a in t.answers)
        # no shortcut: a passage that names the question's entity never states the answer
        for p in t.passages:
            if hop1["query"] in p.text:
                assert t.answers[0] not in p.text, (t.question, p)


def test_qa_distractors_look_alike_and_aliases():
    tasks = synthetic_qa_tasks("validation", 200)
    near_misses = 0
    for t in tasks:
        first = t.metadata["hops"][0]["query"]
        stems = {w[:4] for w in re.findall(r"\w+", first)}  # a shared word or name stem
        others = [p.title for p in t.passages if p.title != first]
        near_misses += any(stems & {w[:4] for w in re.findall(r"\w+", o)} for o in others)
        if t.metadata["template"].endswith("country"):
            assert t.answers == (t.answers[0], f"Republic of {t.answers[0]}")
    assert near_misses >= 0.9 * len(tasks)


def test_qa_worlds_do_not_repeat_facts():
    """Facts live in a world per question, so memorizing train passages cannot answer test."""
    train = synthetic_qa_tasks("train", 300)
    test = synthetic_qa_tasks("test", 100)
    train_facts = {p.text for t in train for p in t.passages}
    test_facts = {p.text for t in test for p in t.passages}
    assert len(train_facts & test_facts) <= 0.02 * len(test_facts)


# --------------------------------------------------------------------------- corpus


def test_corpus_vocabulary_is_small():
    docs = list(synthetic_corpus_text(n=500))
    assert len(docs) == 1000
    words = Counter(w for doc in docs for w in re.findall(r"[A-Za-z]+", doc))
    syll = "|".join(SYLLABLES)
    suffix = "|".join(CITY_SUFFIXES + COUNTRY_SUFFIXES)
    name = re.compile(rf"(?:{syll})+(?:{suffix})?")
    invented = {w for w in words if w[0].isupper() and name.fullmatch(w.lower())}
    fixed = set(words) - invented
    report = (
        f"vocabulary: {len(words)} word types = {len(fixed)} template/code words "
        f"+ {len(invented)} invented names over {len(SYLLABLES)} syllables"
    )
    print(report)
    assert len(fixed) < 250, sorted(fixed)
    assert set("".join(re.findall(r"[^A-Za-z\s]", "".join(docs)))) <= set("0123456789.,?/*+-%()=_")
