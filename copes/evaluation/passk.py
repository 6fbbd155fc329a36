"""Sample-based metrics of one problem: unbiased pass@k, mean@n and majority vote (maj@n).

With n samples of which c are correct, pass@k is the probability that at least one of k
samples drawn without replacement from the n is correct (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

an unbiased estimate of the chance that k fresh samples contain a correct one. It is computed
as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms a binomial coefficient
(C(1000, 500) has 300 digits) and is exact to float rounding.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence


def _count(name: str, value: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"{name} must be an integer, got {kind}: {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return number


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from `n` samples of which `c` are correct.

    Raises ValueError when an argument is negative, k < 1, k > n (k samples cannot be drawn
    from n: take more samples or a smaller k) or c > n.
    """
    n, c, k = _count("n", n), _count("c", c), _count("k", k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(
            f"pass@{k} needs at least {k} samples per problem, got n={n}; sample more (n >= k) "
            f"or drop k={k}"
        )
    if c > n:
        raise ValueError(f"c (correct samples) cannot exceed n (samples): c={c}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    failure = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def mean_at_n(rewards: Sequence[float]) -> float:
    """Mean reward over the n samples of one problem (mean@n; with 0/1 rewards, = pass@1)."""
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("mean@n of no samples is undefined; pass at least one reward")
    return sum(values) / len(values)


def majority_vote(
    answers: Sequence[str | None], normalize: Callable[[str], str] | None = None
) -> int | None:
    """Index of the first sample whose answer won the vote, or None when no sample answered.

    Answers are compared after `normalize` (default: surrounding whitespace stripped); None
    and empty answers do not vote. Ties go to the answer that appeared first.
    """
    normalize = normalize or str.strip
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        key = normalize(answer)
        if not key:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, index)
    if not counts:
        return None
    # max() returns the first maximum in iteration order, i.e. in order of first appearance.
    winner = max(counts, key=counts.__getitem__)
    return first[winner]


def majority_at_n(
    answers: Sequence[str | None],
    correct: Sequence[bool] | Callable[[str], bool],
    normalize: Callable[[str], str] | None = None,
) -> float:
    """maj@n of one problem: 1.0 if the majority-voted final answer is correct, else 0.0.

    Args:
        answers: the final answer of each sample (None where a sample gave none).
        correct: either the correctness of each sample (the winning sample's verdict is
            used; samples with the same normalized answer share it) or a function that
            grades an answer.
        normalize: the canonical form answers are grouped by (e.g. `normalize_math_answer`
            or the SQuAD `normalize_answer`); default: whitespace stripped.
    """
    if not callable(correct) and len(correct) != len(answers):
        raise ValueError(
            f"need one correctness value per answer: {len(answers)} answers, {len(correct)} values"
        )
    winner = majority_vote(answers, normalize)
    if winner is None:
        return 0.0
    if callable(correct):
        answer = answers[winner]
        assert answer is not None
        return float(bool(correct(answer)))
    return float(bool(correct[winner]))
