"""Learning curves over seeds: confidence intervals, GRPO's gain recovered, budget to a target.

The paper's three headline numbers are functions of validation curves (accuracy against a
budget of GPU-hours; here generated tokens or wall seconds), so they live here, tested on
synthetic curves whose answers are known, and `benchmarks/learning.py` only feeds them runs.

Definitions (one run = one `Curve`; a method has one curve per seed):

- A curve is a step function: at budget b the run's accuracy is that of its latest validation
  at or before b (the checkpoint you would hold if you stopped there).
- **Mean curve with a t-interval**: at each budget, the mean over seeds and a two-sided
  Student-t confidence interval (df = seeds - 1); with one seed there is no interval (None).
- **Gain recovered** (Wang et al. 2026): B* is the budget of the reference method's (GRPO's)
  best validation checkpoint, i.e. the earliest budget where its mean curve peaks. A method's
  gain is the mean over seeds of (best validation accuracy at budget <= B*) - (accuracy at the
  first validation, the base model); the fraction recovered is gain / reference gain, so the
  reference scores exactly 1. Its interval is a percentile bootstrap over seeds (each method's
  seeds and the reference's resampled independently, B* recomputed every time).
- **Budget to a target accuracy**: per seed, the first validation budget with accuracy >= the
  target (None if never); and the first budget where the mean curve reaches it. With
  `gain=True` the target is a gain: each seed must reach its own base + target (and the mean
  curve the mean base + target), the fair reading when each seed validates on its own tasks
  and so starts from its own base accuracy.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Accuracies are ratios such as 3/10, targets sums such as 0.1 + 0.2: compare with a tolerance
# so that a run that reaches 0.3 counts as reaching a target of 0.30000000000000004.
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Curve:
    """Validation accuracy of one run at ascending budgets (the first is the base model)."""

    budgets: tuple[float, ...]
    accuracies: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.budgets or len(self.budgets) != len(self.accuracies):
            raise ValueError(
                f"a curve needs one accuracy per budget and at least one point, got "
                f"{len(self.budgets)} budgets and {len(self.accuracies)} accuracies"
            )
        if any(b2 < b1 for b1, b2 in itertools.pairwise(self.budgets)):
            raise ValueError(f"budgets must be ascending, got {self.budgets}")

    @property
    def base(self) -> float:
        """Accuracy at the first validation (before any training step)."""
        return self.accuracies[0]

    def at(self, budget: float) -> float:
        """Accuracy of the latest validation at or before `budget`."""
        if budget < self.budgets[0]:
            raise ValueError(f"budget {budget} precedes the first validation ({self.budgets[0]})")
        value = self.accuracies[0]
        for b, a in zip(self.budgets, self.accuracies, strict=True):
            if b > budget:
                break
            value = a
        return value

    def best_until(self, budget: float) -> float:
        """Best validation accuracy among checkpoints at budget <= `budget`."""
        return max(a for b, a in zip(self.budgets, self.accuracies, strict=True) if b <= budget)

    def first_reaching(self, target: float) -> float | None:
        """The first budget whose validation accuracy is >= `target`, or None."""
        return next(
            (
                b
                for b, a in zip(self.budgets, self.accuracies, strict=True)
                if a >= target - TOLERANCE
            ),
            None,
        )


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its confidence interval (None when it is undefined)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}


# ---------------------------------------------------------------------- Student t
def _t_pdf(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf(x: float, df: int, intervals: int = 512) -> float:
    """P(T <= x) for x >= 0 by Simpson's rule on [0, x] (the density is smooth and bounded)."""
    h = x / intervals
    total = _t_pdf(0.0, df) + _t_pdf(x, df)
    for i in range(1, intervals):
        total += (4 if i % 2 else 2) * _t_pdf(i * h, df)
    return 0.5 + total * h / 3


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (no scipy needed).

    Bisection on the CDF; accurate to ~1e-7 for the 90-99% quantiles used for intervals.
    """
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(48):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of `values` and its two-sided Student-t interval (none for a single value)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("a confidence interval needs at least one value")
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, None, None, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    half = t_quantile(0.5 + confidence / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs))


def mean_curve(
    curves: Sequence[Curve], grid: Sequence[float], confidence: float = 0.95
) -> list[Interval]:
    """The mean over seeds (with its t-interval) of the step-function curves at each budget."""
    return [t_interval([c.at(b) for c in curves], confidence) for b in grid]


# ---------------------------------------------------------------------- bootstrap
def bootstrap_interval(
    groups: Sequence[Sequence[Curve]],
    statistic: Callable[..., float | None],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float | None, float | None, int]:
    """Percentile interval of `statistic(*groups)` with each group's seeds resampled.

    Resamples where the statistic is undefined (None) are dropped; returns (low, high,
    number kept). No interval when a group has a single seed or fewer than half are kept.
    """
    if any(len(g) < 2 for g in groups):
        return None, None, 0
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        draw = [[g[rng.randrange(len(g))] for _ in g] for g in groups]
        value = statistic(*draw)
        if value is not None and math.isfinite(value):
            values.append(value)
    if len(values) < resamples / 2:
        return None, None, len(values)
    values.sort()
    tail = (1 - confidence) / 2
    low = values[math.floor(tail * (len(values) - 1))]
    high = values[math.ceil((1 - tail) * (len(values) - 1))]
    return low, high, len(values)


# ---------------------------------------------------------------------- the paper's numbers
def best_checkpoint_budget(reference: Sequence[Curve]) -> float:
    """B*: the earliest budget where the reference's mean curve over seeds peaks."""
    grid = sorted({b for c in reference for b in c.budgets})
    grid = [b for b in grid if all(b >= c.budgets[0] for c in reference)]
    means = [sum(c.at(b) for c in reference) / len(reference) for b in grid]
    return grid[means.index(max(means))]


def mean_gain_until(curves: Sequence[Curve], budget: float) -> float:
    """Mean over seeds of (best accuracy at budget <= `budget`) - (base accuracy)."""
    return sum(c.best_until(budget) - c.base for c in curves) / len(curves)


def fraction_of_gain(curves: Sequence[Curve], reference: Sequence[Curve]) -> float | None:
    """Gain of `curves` at the reference's best-checkpoint budget / the reference's gain.

    None when the reference did not improve on its base model (there is no gain to recover).
    """
    budget = best_checkpoint_budget(reference)
    reference_gain = mean_gain_until(reference, budget)
    if reference_gain <= 0:
        return None
    return mean_gain_until(curves, budget) / reference_gain


@dataclass(frozen=True)
class GainRecovered:
    fraction: float | None
    low: float | None
    high: float | None
    budget: float  # B*
    gain: float
    reference_gain: float

    def as_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


def gain_recovered(
    curves: Sequence[Curve],
    reference: Sequence[Curve],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> GainRecovered:
    """`fraction_of_gain` with its bootstrap interval over seeds and the numbers behind it."""
    budget = best_checkpoint_budget(reference)
    low, high, _ = bootstrap_interval(
        [curves, reference], fraction_of_gain, confidence=confidence, resamples=resamples,
        seed=seed,
    )  # fmt: skip
    return GainRecovered(
        fraction=fraction_of_gain(curves, reference),
        low=low,
        high=high,
        budget=budget,
        gain=mean_gain_until(curves, budget),
        reference_gain=mean_gain_until(reference, budget),
    )


def budget_to_target(
    curves: Sequence[Curve], target: float, *, gain: bool = False
) -> dict[str, object]:
    """Per seed, the first budget reaching `target` (or base + target with `gain`); and where
    the mean curve reaches it (or its mean base + target)."""
    goals = [c.base + target if gain else target for c in curves]
    per_seed = [c.first_reaching(g) for c, g in zip(curves, goals, strict=True)]
    reached = [b for b in per_seed if b is not None]
    grid = sorted({b for c in curves for b in c.budgets if b >= max(x.budgets[0] for x in curves)})
    means = [(b, sum(c.at(b) for c in curves) / len(curves)) for b in grid]
    mean_goal = sum(goals) / len(goals)
    mean_first = next((b for b, m in means if m >= mean_goal - TOLERANCE), None)
    return {
        "target": target,
        "target_kind": "gain over each seed's base" if gain else "accuracy",
        "per_seed": per_seed,
        "reached": len(reached),
        "seeds": len(curves),
        "mean_of_reached": sum(reached) / len(reached) if reached else None,
        "mean_curve_first": mean_first,
    }
