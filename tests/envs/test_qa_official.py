"""Each QA rule reproduces its official script, and each QA benchmark's env grades by its rule.

The official scores (`tests/fixtures/peer_graders/qa_cases.json`, sources in SOURCES.md there)
were computed by the SQuAD v1.1, HotpotQA, 2WikiMultihopQA and MuSiQue scripts themselves.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from copes.envs.presets import tool_qa_env
from copes.envs.rewards.qa import QA_RULES, exact_match, f1_score, normalize_answer
from copes.envs.tasks.base import Passage, Task
from copes.registry import Benchmark, get_benchmark

CASES = json.loads(
    (Path(__file__).parents[1] / "fixtures/peer_graders/qa_cases.json").read_text("utf-8")
)
FIXTURES = "tests/fixtures/benchmarks"
# our rule name -> the key of that script's scores in qa_cases.json
# (FlashRAG's F1_Score, read in flashrag/evaluator/metrics.py, is HotpotQA's rule; no FlashRAG
# scores were extracted, so it is checked against HotpotQA's.)
OFFICIAL_KEYS = {
    "squad": "squad", "hotpotqa": "hotpot", "2wiki": "2wiki", "musique": "musique",
    "flashrag": "hotpot",
}  # fmt: skip


def test_every_rule_is_checked_and_the_cases_tell_the_rules_apart():
    assert set(OFFICIAL_KEYS) == set(QA_RULES)
    differ = {
        (a, b): sum(
            c["official"][OFFICIAL_KEYS[a]] != c["official"][OFFICIAL_KEYS[b]] for c in CASES
        )
        for a in ("squad", "hotpotqa", "musique")
        for b in ("squad", "hotpotqa", "musique")
        if a < b
    }
    assert len(CASES) == 471 and all(n > 0 for n in differ.values()), differ


@pytest.mark.parametrize("rule", list(OFFICIAL_KEYS))
def test_em_and_f1_equal_the_official_script_on_every_case(rule):
    wrong = []
    for case in CASES:
        official = case["official"][OFFICIAL_KEYS[rule]]
        em = exact_match(case["pred"], case["golds"])
        f1 = f1_score(case["pred"], case["golds"], rule=rule)
        if abs(em - official["em"]) > 1e-9 or abs(f1 - official["f1"]) > 1e-9:
            wrong.append((case["id"], case["pred"], case["golds"], (em, f1), official))
    assert not wrong, f"{len(wrong)} of {len(CASES)} differ, first: {wrong[:3]}"


def test_normalization_equals_the_official_one():
    assert all(normalize_answer(c["pred"]) == c["official"]["normalized_pred"] for c in CASES)


def test_an_unknown_rule_is_a_one_line_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown QA rule 'hotpot'; known: squad, hotpotqa"):
        f1_score("yes", "yes", rule="hotpot")
    task = Task("t", "?", ("yes",), "qa", passages=(Passage("p", "text"),))
    with pytest.raises(ValueError, match="unknown QA rule 'SQuAD'"):
        tool_qa_env(tasks=[task], qa_rule="SQuAD")
    with pytest.raises(ValueError, match="grader= or qa_rule="):
        tool_qa_env(tasks=[task], qa_rule="squad", grader=lambda answer, task: 1.0)


# ------------------------------------------------------------------ the benchmarks' envs
# Two answers the rules disagree on: "yes it is" against gold "yes" (HotpotQA / 2Wiki: no
# partial credit for yes/no; SQuAD / MuSiQue: P = 1/3, R = 1, F1 = 0.5), and "a" against gold
# "the" (both empty after normalization: MuSiQue F1 = 1, the others 0).
PARTIAL_YES = {"squad": 0.5, "hotpotqa": 0.0, "2wiki": 0.0, "musique": 0.5, "flashrag": 0.0}
BOTH_EMPTY = {"squad": 0.0, "hotpotqa": 0.0, "2wiki": 0.0, "musique": 1.0, "flashrag": 0.0}


def _graded_as(grader, task=None):
    """The F1 rewards `grader` gives the two telling answers, as (partial yes, both empty)."""
    task = task or Task("t", "?", ("yes",), "qa")
    yes = grader("yes it is", dataclasses.replace(task, answers=("yes",)))
    empty = grader("a", dataclasses.replace(task, answers=("the",)))
    assert not yes.correct and empty.correct  # EM is the same under every rule
    return yes.reward, empty.reward


def _expected(rule):
    return pytest.approx((PARTIAL_YES[rule], BOTH_EMPTY[rule]))


def _user_benchmark(**fields):
    records = [{"question": "Is it?", "answer": "yes", "passages": [{"title": "p", "text": "t"}]}]
    return Benchmark("my-qa", records, kind="qa", split="test", **fields)


BENCHMARKS = {
    "hotpotqa": lambda: (get_benchmark("hotpotqa"), f"{FIXTURES}/hotpot_dev_distractor_v1.json"),
    "2wiki": lambda: (get_benchmark("2wiki"), f"{FIXTURES}/2wiki_dev.json"),
    "musique": lambda: (get_benchmark("musique"), f"{FIXTURES}/musique_ans_v1.0_dev.jsonl"),
    "synthetic-qa": lambda: (get_benchmark("synthetic-qa"), None),
    "my-qa": lambda: (_user_benchmark(), None),
    "my-qa with qa_rule": lambda: (_user_benchmark(env_kwargs={"qa_rule": "musique"}), None),
}
EXPECTED_RULE = {
    "hotpotqa": "hotpotqa",
    "2wiki": "2wiki",
    "musique": "musique",
    "synthetic-qa": "squad",
    "my-qa": "squad",
    "my-qa with qa_rule": "musique",
}


def _reward(benchmark, task, answer):
    env = benchmark.make_env([task])  # as copes-eval builds it
    try:
        env.reset(options={"task": task})
        _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
        assert terminated
        return reward, info
    finally:
        env.close()


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_env_grades_with_its_official_rule(name):
    benchmark, source = BENCHMARKS[name]()
    task = benchmark.load_tasks(split=benchmark.split, limit=1, source=source)[0]
    rule = EXPECTED_RULE[name]
    reward, info = _reward(benchmark, dataclasses.replace(task, answers=("yes",)), "yes it is")
    assert reward == pytest.approx(PARTIAL_YES[rule]) and not info["correct"]
    reward, info = _reward(benchmark, dataclasses.replace(task, answers=("the",)), "a")
    assert reward == BOTH_EMPTY[rule] and info["correct"]  # EM is 1 under every rule
    # rescore re-grades stored samples with make_grader(), on tasks without a source
    assert _graded_as(benchmark.make_grader()) == _expected(rule)


def test_gym_ids_and_flashrag_versions_use_the_datasets_rule():
    import gymnasium as gym

    import copes  # noqa: F401

    env = gym.make("copes:ToolQA-2wiki-v0", source=f"{FIXTURES}/2wiki_dev.json")
    assert _graded_as(env.unwrapped.grader) == _expected("2wiki")
    env.close()
    # FlashRAG's versions are scored as FlashRAG scores them, not as MuSiQue's own script
    assert _graded_as(get_benchmark("flashrag-musique").make_grader()) == _expected("flashrag")


def test_tasks_of_benchmarks_with_different_rules_need_an_explicit_rule():
    pool = (Passage("p", "text"),)
    tasks = [
        Task("a", "?", ("yes",), "qa", passages=pool, source="hotpotqa"),
        Task("b", "?", ("yes",), "qa", passages=pool, source="musique"),
    ]
    with pytest.raises(ValueError, match=r"different official QA rules .*pass qa_rule="):
        tool_qa_env(tasks=tasks)
    assert _graded_as(tool_qa_env(tasks=tasks, qa_rule="squad").unwrapped.grader) == _expected(
        "squad"
    )
    same_rule = [dataclasses.replace(t, source="hotpotqa") for t in tasks]
    assert _graded_as(tool_qa_env(tasks=same_rule).unwrapped.grader) == _expected("hotpotqa")
