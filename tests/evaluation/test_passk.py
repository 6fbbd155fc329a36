"""pass@k, mean@n and maj@n against hand-computed values and brute-force enumeration."""

import itertools
import math

import pytest

from copes.envs.rewards.math import normalize_math_answer
from copes.envs.rewards.qa import normalize_answer
from copes.evaluation.passk import majority_at_n, majority_vote, mean_at_n, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c correct) that hold a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (10, 3, 1, 0.3),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (16, 4, 4, 1 - 495 / 1820),  # 1 - C(12,4)/C(16,4)
        (8, 0, 8, 0.0),
        (8, 1, 8, 1.0),
    ],
)
def test_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_matches_enumeration_of_all_k_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(
                    brute_force_pass_at_k(n, c, k), abs=1e-12
                ), (n, c, k)


def test_one_when_every_k_subset_holds_a_correct_sample():
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k
    assert pass_at_k(10, 10, 1) == 1.0


def test_large_n_is_stable_and_matches_exact_binomials():
    # C(1000, 500) has ~300 digits: a float ratio of binomials would overflow.
    n, c, k = 1000, 7, 500
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints: exact, then one division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert 0.99 < pass_at_k(n, c, k) < 1.0


def test_monotone_in_k_and_c():
    n = 16
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)
    for k in (1, 4, 16):
        values = [pass_at_k(n, c, k) for c in range(n + 1)]
        assert values == sorted(values)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 1, 5, "at least 5 samples"),
        (4, 5, 1, "cannot exceed n"),
        (-1, 0, 1, "n must be >= 0"),
        (4, -1, 1, "c must be >= 0"),
        (4, 1, -2, "k must be >= 0"),
        (4, 1, 0, "k >= 1"),
    ],
)
def test_invalid_arguments_raise_clear_errors(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_non_integers_are_rejected():
    with pytest.raises(TypeError, match="integer"):
        pass_at_k(4.0, 1, 1)


def test_mean_at_n():
    assert mean_at_n([1, 0, 0, 1]) == 0.5
    assert mean_at_n([0.2, 0.4]) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no samples"):
        mean_at_n([])


def test_majority_vote_groups_normalized_answers():
    answers = ["\\frac{1}{2}", "7", "\\dfrac12", "7.0", " \\frac{1}{2} "]
    # normalize_math_answer maps \dfrac12 and \frac{1}{2} to one form: 3 votes vs 2.
    assert majority_at_n(answers, [True, False, True, False, True], normalize_math_answer) == 1.0
    assert majority_vote(answers, normalize_math_answer) == 0


def test_majority_uses_the_winners_correctness():
    answers = ["Paris", "paris.", "The Paris", "London"]
    assert majority_at_n(answers, [False, False, False, True], normalize_answer) == 0.0
    assert majority_at_n(answers, [True, True, True, False], normalize_answer) == 1.0


def test_majority_ties_go_to_the_first_answer():
    assert majority_vote(["b", "a", "a", "b"]) == 0
    assert majority_at_n(["b", "a", "a", "b"], [False, True, True, False]) == 0.0
    assert majority_at_n(["a", "b", "b", "a"], [True, False, False, True]) == 1.0


def test_majority_ignores_missing_answers():
    assert majority_vote([None, "", None, "4"]) == 3
    assert majority_at_n([None, None, "4"], [False, False, True]) == 1.0
    assert majority_at_n([None, None], [False, False]) == 0.0


def test_majority_with_a_grading_function():
    answers = ["12", "12", "13"]
    assert majority_at_n(answers, lambda a: a == "12") == 1.0
    assert majority_at_n(answers, lambda a: a == "13") == 0.0


def test_majority_needs_one_verdict_per_answer():
    with pytest.raises(ValueError, match="one correctness value per answer"):
        majority_at_n(["1", "2"], [True])
