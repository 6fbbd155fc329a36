"""Aggregation of learning curves over seeds, on hand-made curves whose answers are known."""

import math

import pytest

from copes.evaluation.curves import (
    Curve,
    best_checkpoint_budget,
    bootstrap_interval,
    budget_to_target,
    fraction_of_gain,
    gain_recovered,
    mean_curve,
    t_interval,
    t_quantile,
)


def curve(budgets, accuracies):
    return Curve(tuple(budgets), tuple(accuracies))


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 1, 12.7062047), (0.975, 2, 4.3026527), (0.975, 10, 2.2281389),
     (0.95, 4, 2.1318468), (0.995, 30, 2.7499957), (0.025, 2, -4.3026527)],
)  # fmt: skip
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-6)


def test_t_interval_by_hand_and_degenerate_cases():
    got = t_interval([1.0, 2.0, 3.0])  # mean 2, sample sd 1
    half = 4.3026527 / math.sqrt(3)
    assert got.mean == 2.0 and got.n == 3
    assert (got.low, got.high) == (pytest.approx(2 - half), pytest.approx(2 + half))
    single = t_interval([0.4])
    assert (single.mean, single.low, single.high) == (0.4, None, None)
    same = t_interval([0.5, 0.5])
    assert same.low == same.high == 0.5
    with pytest.raises(ValueError, match="at least one"):
        t_interval([])


def test_curve_is_a_step_function_of_the_latest_validation():
    c = curve([0, 10, 20], [0.1, 0.5, 0.3])
    assert [c.at(b) for b in (0, 5, 10, 19.9, 20, 99)] == [0.1, 0.1, 0.5, 0.5, 0.3, 0.3]
    assert c.best_until(9) == 0.1 and c.best_until(25) == 0.5 and c.base == 0.1
    assert c.first_reaching(0.3) == 10 and c.first_reaching(0.6) is None
    with pytest.raises(ValueError, match="ascending"):
        curve([0, 20, 10], [0, 0, 0])
    with pytest.raises(ValueError, match="one accuracy per budget"):
        curve([0, 10], [0.1])
    with pytest.raises(ValueError, match="precedes"):
        c.at(-1)


def test_mean_curve_bounds_contain_the_mean():
    seeds = [curve([0, 10], [0.1, 0.4]), curve([0, 12], [0.2, 0.6]), curve([0, 8], [0.0, 0.5])]
    points = mean_curve(seeds, [0, 9, 11, 20])
    assert [p.mean for p in points] == pytest.approx([0.1, 0.8 / 3, 1.1 / 3, 0.5])
    for p in points:
        assert p.low <= p.mean <= p.high


# GRPO: two seeds peaking at budget 20 (mean 0.5 from a base of 0.1: gain 0.4), then falling.
GRPO = [curve([0, 10, 20, 30], [0.1, 0.3, 0.5, 0.4]), curve([0, 10, 20, 30], [0.1, 0.3, 0.5, 0.2])]


def test_reference_best_budget_is_the_earliest_peak_of_its_mean_curve():
    assert best_checkpoint_budget(GRPO) == 20
    flat = [curve([0, 10, 20], [0.2, 0.4, 0.4])]
    assert best_checkpoint_budget(flat) == 10


def test_fraction_of_gain_on_known_curves():
    # best accuracy up to B* = 20 is 0.3 (base 0.1): gain 0.2 of GRPO's 0.4 -> 0.5; the
    # 0.9 at budget 25 comes after B* and does not count.
    method = [curve([0, 15, 25], [0.1, 0.3, 0.9]), curve([0, 15, 25], [0.1, 0.3, 0.9])]
    assert fraction_of_gain(method, GRPO) == pytest.approx(0.5)
    assert fraction_of_gain(GRPO, GRPO) == pytest.approx(1.0)
    # per-seed bases: a seed that starts higher must gain from its own base
    shifted = [curve([0, 15], [0.2, 0.4]), curve([0, 15], [0.0, 0.2])]
    assert fraction_of_gain(shifted, GRPO) == pytest.approx(0.5)
    no_gain = [curve([0, 10], [0.3, 0.2])]
    assert fraction_of_gain(method, no_gain) is None


def test_gain_recovered_interval_brackets_the_estimate():
    method = [curve([0, 15], [0.1, a]) for a in (0.2, 0.3, 0.35, 0.4)]
    result = gain_recovered(method, GRPO, resamples=500)
    assert result.budget == 20 and result.reference_gain == pytest.approx(0.4)
    assert result.fraction == pytest.approx((0.1 + 0.2 + 0.25 + 0.3) / 4 / 0.4)
    assert result.low <= result.fraction <= result.high
    one_seed = gain_recovered(method[:1], GRPO)
    assert one_seed.fraction == pytest.approx(0.25) and one_seed.low is None


def test_bootstrap_drops_undefined_resamples():
    always_none = bootstrap_interval([GRPO], lambda g: None, resamples=50)
    assert always_none == (None, None, 0)


def test_budget_to_target_per_seed_and_on_the_mean_curve():
    seeds = [curve([0, 10, 20], [0.0, 0.5, 0.6]), curve([0, 10, 20], [0.0, 0.1, 0.2])]
    got = budget_to_target(seeds, 0.4)
    assert got["per_seed"] == [10, None] and got["reached"] == 1
    assert got["mean_of_reached"] == 10 and got["mean_curve_first"] == 20  # mean 0.4 at 20
    assert got["target_kind"] == "accuracy"
    # 0.1 + 0.2 is 0.30000000000000004: a run at 3/10 still reaches it
    assert curve([0, 5], [0.0, 3 / 10]).first_reaching(0.1 + 0.2) == 5


def test_budget_to_a_gain_counts_from_each_seeds_own_base():
    # Seed 2 starts at 0.5: it already "reaches" an absolute 0.4 at budget 0, but it needs
    # 0.7 for a gain of 0.2; seed 1 needs 0.2 (its base is 0).
    seeds = [curve([0, 10, 20], [0.0, 0.1, 0.2]), curve([0, 10, 20], [0.5, 0.6, 0.7])]
    assert budget_to_target(seeds, 0.4)["per_seed"] == [None, 0]
    got = budget_to_target(seeds, 0.2, gain=True)
    assert got["per_seed"] == [20, 20] and got["mean_of_reached"] == 20
    assert got["mean_curve_first"] == 20  # mean 0.45 = mean base 0.25 + 0.2 first at 20
    assert got["target_kind"].startswith("gain")
