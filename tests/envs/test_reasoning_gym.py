"""rg:<dataset> tasks: split hygiene, and every dataset graded by its own `score_answer`
(issue 48): copes extracts the answer, reasoning-gym scores it."""

from fractions import Fraction

import gymnasium as gym
import pytest

pytest.importorskip("reasoning_gym")

from copes.registry import get_benchmark

N = 40
# The arithmetic datasets copes' own math grader used to score, and one that is not math.
DATASETS = (
    "basic_arithmetic", "chain_sum", "decimal_arithmetic", "fraction_simplification", "gcd",
    "gsm_symbolic", "lcm", "leg_counting", "products", "word_sorting",
)  # fmt: skip


def _scorer(name):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0)


def _wrong(answer: str) -> str:
    """A different value in the same form (last integer in the answer + 1)."""
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if not digits:
        return answer + " no"
    end = digits[-1] + 1
    start = end
    while start > 0 and answer[start - 1].isdigit():
        start -= 1
    return answer[:start] + str(int(answer[start:end]) + 1) + answer[end:]


@pytest.mark.parametrize("name", DATASETS)
def test_every_dataset_is_graded_by_its_own_score_answer(name):
    bench = get_benchmark(f"rg:{name}")
    tasks = bench.load_tasks(split="test", limit=N)
    assert len(tasks) == N
    grader, scorer = bench.make_grader(), _scorer(name)
    for task in tasks:
        entry = task.metadata["reasoning_gym"]
        for answer in (task.answers[0], _wrong(task.answers[0])):
            grade, score = grader(answer, task), float(scorer.score_answer(answer, entry))
            assert (grade.reward, grade.correct) == (score, score == 1.0), (task.id, answer)
        assert grader(task.answers[0], task).correct, task.id


def test_products_copied_from_the_question_earn_nothing_and_are_counted():
    """The hack of issue 48, through the public env: the question's own product, 64 of 64
    credited before; reasoning-gym's rule never gives it a full score (only its substring
    credit: `7 * 1` holds the gold 7, 0.2), and the grade says why."""
    env = gym.make("copes:ToolMath-v0", benchmark="rg:products", split="test", limit=64)
    scorer = _scorer("products")
    for index in range(64):
        _, info = env.reset(options={"task_index": index})
        task = env.unwrapped.task
        expression = task.metadata["reasoning_gym"]["metadata"]["expression"]
        assert expression in task.question and "*" in expression
        _, reward, terminated, _, info = env.step(f"<answer>{expression}</answer>")
        assert terminated and reward < 1.0 and not info["correct"], task.id
        assert reward == scorer.score_answer(expression, task.metadata["reasoning_gym"])
        assert info["grade"]["undone_arithmetic"], task.id
        env.reset(options={"task_index": index})
        _, reward, _, _, info = env.step(f"<answer>{task.answers[0]}</answer>")
        assert reward == 1.0 and info["correct"] and not info["grade"]["undone_arithmetic"]
    env.close()


def test_partial_credit_is_the_reward_and_never_a_correct_answer():
    bench = get_benchmark("rg:products")
    grader, scorer = bench.make_grader(), _scorer("products")
    task = bench.load_tasks(split="test", limit=1)[0]
    entry, gold = task.metadata["reasoning_gym"], task.answers[0]
    for partial in (f"The answer is {gold}", f"{gold} 12"):
        grade = grader(partial, task)
        assert 0.0 < grade.reward < 1.0 and not grade.correct, partial
        assert grade.reward == scorer.score_answer(partial, entry)
        assert not grade.details["undone_arithmetic"]


def test_fraction_simplification_asks_for_lowest_terms():
    bench = get_benchmark("rg:fraction_simplification")
    grader, scorer = bench.make_grader(), _scorer("fraction_simplification")
    for task in bench.load_tasks(split="test", limit=N):
        meta = task.metadata["reasoning_gym"]["metadata"]
        value = Fraction(meta["numerator"], meta["denominator"])
        unreduced = f"{value.numerator * 4}/{value.denominator * 4}"  # equal, not reduced
        assert not grader(unreduced, task).correct
        assert scorer.score_answer(unreduced, task.metadata["reasoning_gym"]) < 1.0


def test_splits_are_disjoint_and_unknown_datasets_are_refused():
    bench = get_benchmark("rg:basic_arithmetic")
    questions = {
        split: {t.question for t in bench.load_tasks(split=split, limit=50)}
        for split in ("train", "validation", "test")
    }
    assert not questions["train"] & questions["test"]
    assert not questions["train"] & questions["validation"]
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'nope'"):
        get_benchmark("rg:nope")


def test_one_env_never_mixes_a_benchmarks_own_scorer_with_another_rule():
    from copes.envs.presets import tool_math_env

    products = get_benchmark("rg:products").load_tasks(split="test", limit=2)
    gcd = get_benchmark("rg:gcd").load_tasks(split="test", limit=2)
    with pytest.raises(ValueError, match="one env per benchmark"):
        tool_math_env(tasks=[*products, *gcd])
