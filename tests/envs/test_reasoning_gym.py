"""rg:<dataset> tasks: split hygiene, and copes' grading agreeing with reasoning-gym's own."""

from fractions import Fraction

import pytest

pytest.importorskip("reasoning_gym")

from copes.envs.tasks.reasoning_gym import MATH_GRADED
from copes.registry import get_benchmark

N = 40


def _scorer(name):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0)


def _wrong(answer: str) -> str:
    """A different value in the same form (last integer in the answer + 1)."""
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    end = digits[-1] + 1
    start = end
    while start > 0 and answer[start - 1].isdigit():
        start -= 1
    return answer[:start] + str(int(answer[start:end]) + 1) + answer[end:]


@pytest.mark.parametrize("name", sorted(MATH_GRADED))
def test_copes_grades_gold_and_wrong_answers_as_reasoning_gym_scores_them(name):
    bench = get_benchmark(f"rg:{name}")
    tasks = bench.load_tasks(split="test", limit=N)
    assert len(tasks) == N
    grader, scorer = bench.make_grader(), _scorer(name)
    for task in tasks:
        entry = task.metadata["reasoning_gym"]
        gold = task.answers[0]
        assert grader(gold, task).correct and scorer.score_answer(gold, entry) == 1.0, task.id
        wrong = _wrong(gold)
        copes_says = grader(wrong, task).correct
        rg_says = scorer.score_answer(wrong, entry) == 1.0
        if name == "decimal_arithmetic":
            # reasoning-gym's decimal scorer is lenient (it takes 25.414 for 25.413); copes'
            # relative tolerance only forgives a slip in the 12th digit. copes never accepts
            # what reasoning-gym rejects.
            assert rg_says or not copes_says, (task.id, wrong)
        else:
            assert not copes_says and not rg_says, (task.id, wrong)


def test_fraction_simplification_asks_for_lowest_terms():
    bench = get_benchmark("rg:fraction_simplification")
    grader, scorer = bench.make_grader(), _scorer("fraction_simplification")
    for task in bench.load_tasks(split="test", limit=N):
        meta = task.metadata["reasoning_gym"]["metadata"]
        value = Fraction(meta["numerator"], meta["denominator"])
        unreduced = f"{value.numerator * 4}/{value.denominator * 4}"  # equal, not reduced
        assert not grader(unreduced, task).correct
        assert scorer.score_answer(unreduced, task.metadata["reasoning_gym"]) < 1.0


def test_splits_are_disjoint_and_other_datasets_use_reasoning_gyms_scorer():
    bench = get_benchmark("rg:basic_arithmetic")
    questions = {
        split: {t.question for t in bench.load_tasks(split=split, limit=50)}
        for split in ("train", "validation", "test")
    }
    assert not questions["train"] & questions["test"]
    assert not questions["train"] & questions["validation"]
    words = get_benchmark("rg:word_sorting")
    task = words.load_tasks(split="train", limit=1)[0]
    grader = words.make_grader()
    assert grader(task.answers[0], task).correct and not grader("no", task).correct
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'nope'"):
        get_benchmark("rg:nope")
