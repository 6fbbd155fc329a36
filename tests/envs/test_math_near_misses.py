"""Near misses for every rule of the math grader (issue 25): each wrong answer next to a right
one it resembles, graded the way ToolMath-v0 grades a final answer."""

from __future__ import annotations

import pytest

from copes.envs.rewards.graders import MathGrader
from copes.envs.tasks.base import Task

GRADER = MathGrader()


def graded_correct(pred: str, gold: str) -> bool:
    return GRADER(pred, Task(id="near-miss", question="q", answers=(gold,), kind="math")).correct


# (category, pred, gold, correct)
NEAR_MISSES = [
    # a `%` means /100 on the side that carries it, and only there
    ("percent", "5000", r"50\%", False),
    ("percent", r"0.5\%", "50", False),
    ("percent", "50", r"50\%", True),
    ("percent", r"50\%", "50", True),
    ("percent", "0.5", r"50\%", True),
    ("percent", r"50\%", "0.5", True),
    ("percent", r"0.5\%", r"50\%", False),  # both carry it: the numbers compare as written
    ("percent", r"\frac{1}{8}", r"12.5\%", True),
    ("percent", "28 percent", r"28\%", True),
    ("percent", "0.0028", r"28\%", False),
    # a comma groups thousands only between digits, without a space
    ("separators", "32, 349", "32349", False),
    ("separators", "1, 234", "1234", False),
    ("separators", "1,234", "1234", True),
    ("separators", "1{,}234", "1234", True),
    ("separators", r"1,\!234", "1234", True),
    ("separators", r"1\,234", "1234", True),  # SI thin space between thousands groups
    ("separators", "1 234 567", "1234567", True),
    ("separators", "1 2", "12", False),
    ("separators", "12 3", "1 23", False),
    ("separators", "1,23", "123", False),
    ("separators", "1,2345", "12345", False),
    ("separators", "1,000,000", "10^{6}", True),
    ("separators", "1,000.5", "1000.5", True),
    # magnitude words are factors, not units
    ("magnitude", "2", r"2\text{ million}", False),
    ("magnitude", "2000000", r"2\text{ million}", True),
    ("magnitude", "3000", r"3\text{ thousand}", True),
    ("magnitude", "3", r"3\text{ thousand}", False),
    ("magnitude", r"1.5\text{ billion}", "1500000000", True),
    ("magnitude", r"\$2 million", "2000000", True),
    ("magnitude", r"3\text{ thousand dollars}", "3000", True),
    ("magnitude", r"2 \times 10^{6}", r"2\text{ million}", True),
    ("magnitude", "5", r"5\text{ hundred}", False),
    # units are dropped, their numbers are not
    ("units", r"5\text{ cm}", "5", True),
    ("units", r"6\text{ cm}", "5", False),
    ("units", r"5\mbox{ inches}^2", "5", True),
    ("units", r"10\text{ units}", "100", False),
    # degree signs only: `\circ` between functions is composition
    ("degrees", r"30^\circ", "30", True),
    ("degrees", "30°", "30", True),
    ("degrees", r"30^{\circ}", "31", False),
    ("degrees", "fg", r"f \circ g", False),
    ("degrees", r"g \circ f", r"f \circ g", False),
    ("degrees", r"f\circ g", r"f \circ g", True),
    # tiny and huge constants compare exactly, never as rounded floats
    ("constants", r"\frac{1}{2^{98}}", r"\frac{1}{2^{99}}", False),
    ("constants", r"\frac{1}{2^{99}}", r"\frac{1}{2^{99}}", True),
    ("constants", "1/99!", "1/100!", False),
    ("constants", r"\frac{2}{2 \cdot 100!}", r"\frac{1}{100!}", True),
    ("constants", "0.0000002", "0.0000001", False),
    ("constants", "10^{-21}", "10^{-20}", False),
    ("constants", "1000000000000000000000000000001", "10^{30}", False),
    ("constants", "2^{100}+1", "2^{100}", False),
    ("constants", r"e^{i\pi}", "-1", True),
    ("constants", r"e^{i\pi}", "1", False),
    ("constants", "i^2", "-1", True),
    # no tolerance on integers and exact rationals
    ("exact", "1234567.9", "1234567.1", False),
    ("exact", "1000001", "1000000", False),
    ("exact", "12.0", "12", True),
    ("exact", "2.50", "2.5", True),
    ("exact", "0.3333333", r"\frac{1}{3}", False),
    ("exact", "0.333", r"\frac{1}{3}", False),
    ("exact", r"0.\overline{3}", r"\frac{1}{3}", True),
    ("exact", r"0.1\overline{6}", r"\frac{1}{6}", True),
    ("exact", r"0.\overline{3}", r"\frac{1}{4}", False),
    ("exact", r"\frac{100}{3}", "33.3", False),
    ("exact", "(0.6,2.6667]", r"(\frac{3}{5},\frac{8}{3}]", False),
    ("exact", "(1,4.5)", r"(1,\frac{9}{2})", True),
    # a float printout (15+ significant digits) meets the value it rounds, to its last digit
    ("float printout", "0.0833333333333333", r"\frac{1}{12}", True),
    ("float printout", "0.08333333333333333", r"\frac{1}{12}", True),
    ("float printout", "0.6666666666666666", r"\frac{2}{3}", True),
    ("float printout", "0.0833333333333343", r"\frac{1}{12}", False),
    ("float printout", "0.0833333333333333", r"\frac{1}{13}", False),
    ("float printout", "1.4142135623730951", r"\sqrt{2}", True),
    ("float printout", "1.4142135623730951", r"\sqrt{3}", False),
    ("float printout", "1.414213562", r"\sqrt{2}", False),
    ("float printout", r"\sqrt{17}", "4.123105625617661", True),
    ("float printout", "3.141592653589793", r"\pi", True),
    ("float printout", "3.14", r"\pi", False),
    # a gold marked approximate takes its own stated precision, half a unit of its last digit
    ("approximation", r"\frac{8}{3}", r"\approx 2.67", True),
    ("approximation", "2.6667", r"\approx 2.67", True),
    ("approximation", "2.68", r"\approx 2.67", False),
    ("approximation", r"\sqrt{2}", r"\approx 1.41", True),
    ("approximation", r"\sqrt{3}", r"\approx 1.41", False),
    ("approximation", "1204", r"\approx 1200", False),
    ("approximation", r"\text{at least } 2.67", r"\approx 2.67", False),
    ("approximation", r"\approx 2.668", r"\approx 2.67", True),
    # equations are compared as equations, expressions as expressions
    ("equations", r"y=-\frac12x+\frac34", "2x+4y-3=0", True),
    ("equations", r"y=-\frac12x+\frac14", "2x+4y-3=0", False),
    ("equations", "2x+4y-3", "2x+4y-3=0", False),
    ("equations", "2x - y + 1 = 0", "y = 2x + 1", True),
    ("equations", "x = 5", "5", True),
    ("equations", "y = 5", "x = 5", False),
    ("equations", "x^2 = 25", "x = 5", False),
    ("equations", "b=2, a=1", "a=1, b=2", True),
    ("equations", "a=2, b=1", "a=1, b=2", False),
    # a hedged answer is not the answer
    ("hedges", r"\approx 5", "5", False),
    ("hedges", r"x \approx 5", "5", False),
    ("hedges", "about 5", "5", False),
    ("hedges", r"\text{approximately } 5", "5", False),
    ("hedges", r"\text{at least } 5", "5", False),
    ("hedges", "5 or 6", "5", False),
    ("hedges", "5", "5", True),
    # a bare list keeps its order (MATH's is_equiv); a gold set does not
    ("lists", "4, 10, -2", "10, 4, -2", False),
    ("lists", "10, 4, -2", "10, 4, -2", True),
    ("lists", "4, 10, -2", r"\{10, 4, -2\}", True),
    ("lists", r"\{4, 10, -2\}", "10, 4, -2", False),
    ("lists", "1, 2", "1, 2, 3", False),
]


@pytest.mark.parametrize(
    ("pred", "gold", "correct"),
    [pytest.param(p, g, c, id=f"{cat}: {p!r} vs gold {g!r}") for cat, p, g, c in NEAR_MISSES],
)
def test_near_miss(pred: str, gold: str, correct: bool) -> None:
    assert graded_correct(pred, gold) is correct


def test_every_category_has_a_wrong_and_a_right_answer() -> None:
    verdicts: dict[str, set[bool]] = {}
    for category, _, _, correct in NEAR_MISSES:
        verdicts.setdefault(category, set()).add(correct)
    assert {c for c, seen in verdicts.items() if seen != {True, False}} == set()


def test_an_answer_identical_to_a_gold_over_the_size_cap_is_correct() -> None:
    gold = "x+" * 6_000 + "1"  # 12,001 characters, past the 10,000-character cap
    assert graded_correct(gold, gold)
    assert not graded_correct(gold[:-1] + "2", gold)
