"""Near misses for every rule of the math grader (issue 25): each wrong answer next to a right
one it resembles, graded the way ToolMath-v0 grades a final answer.

`REFUSED` marks an answer of the gold's value that earns nothing for its form (issue 48): a
plain-number gold takes only a plain number (`\\frac{6}{4}` is not 1.5, `e^{i\\pi}` is not -1),
a form no more arithmetic than it has. Its value is still checked (`is_equivalent`), so the
value rules of issue 25 stay tested on it."""

from __future__ import annotations

import pytest

from copes.envs.rewards.graders import MathGrader
from copes.envs.rewards.math import is_equivalent
from copes.envs.tasks.base import Task

GRADER = MathGrader()
REFUSED = "refused"


def grade(pred: str, gold: str):
    return GRADER(pred, Task(id="near-miss", question="q", answers=(gold,), kind="math"))


def graded_correct(pred: str, gold: str) -> bool:
    return grade(pred, gold).correct


# (category, pred, gold, correct: True, False or REFUSED)
NEAR_MISSES = [
    # a `%` means /100 on the side that carries it, and only there
    ("percent", "5000", r"50\%", False),
    ("percent", r"0.5\%", "50", False),
    ("percent", "50", r"50\%", True),
    ("percent", r"50\%", "50", True),
    ("percent", "0.5", r"50\%", True),
    ("percent", r"50\%", "0.5", True),
    ("percent", r"0.5\%", r"50\%", False),  # both carry it: the numbers compare as written
    ("percent", r"\frac{1}{8}", r"12.5\%", REFUSED),
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
    ("constants", r"\frac{2}{2 \cdot 100!}", r"\frac{1}{100!}", REFUSED),
    ("constants", "0.0000002", "0.0000001", False),
    ("constants", "10^{-21}", "10^{-20}", False),
    ("constants", "1000000000000000000000000000001", "10^{30}", False),
    ("constants", "2^{100}+1", "2^{100}", False),
    ("constants", r"e^{i\pi}", "-1", REFUSED),
    ("constants", r"e^{i\pi}", "1", False),
    ("constants", "i^2", "-1", REFUSED),
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
    # a long decimal is the exact rational it writes: no float-printout tolerance (issue 25)
    ("long decimals", "0.0833333333333333", r"\frac{1}{12}", False),
    ("long decimals", "0.08333333333333333", r"\frac{1}{12}", False),
    ("long decimals", "0.6666666666666666", r"\frac{2}{3}", False),
    ("long decimals", "1.4142135623730951", r"\sqrt{2}", False),
    ("long decimals", r"\sqrt{17}", "4.123105625617661", False),
    ("long decimals", "4.123105625617661", r"\sqrt{17}", False),
    ("long decimals", "3.141592653589793", r"\pi", False),
    ("long decimals", "1.000000000000001", "1", False),
    ("long decimals", "0.0833333333333333", "0.0833333333333333", True),
    ("long decimals", "0.08333333333333330", "0.0833333333333333", True),
    ("long decimals", r"0.08\overline{3}", r"\frac{1}{12}", True),
    # a gold marked approximate takes its own stated precision, half a unit of its last digit
    ("approximation", r"\frac{8}{3}", r"\approx 2.67", REFUSED),
    ("approximation", "2.6667", r"\approx 2.67", True),
    ("approximation", "2.68", r"\approx 2.67", False),
    ("approximation", r"\sqrt{2}", r"\approx 1.41", REFUSED),
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
    # review findings and further near misses, per category
    ("percent", r"\sqrt{2}\%", r"\sqrt{2}", False),
    ("percent", r"5\%x", "5x", False),
    ("percent", r"\sqrt{2}\%", r"\sqrt{2}\%", True),
    ("percent", r"50\%", r"\frac{1}{2}", True),
    ("percent", r"\frac{1}{2}\%", "0.5", REFUSED),
    ("percent", r"25\text{ percent}", "0.25", True),
    ("percent", "25 pct", "25", True),
    ("percent", r"2.5\%", "0.025", True),
    ("percent", r"2.5\%", "0.25", False),
    ("percent", r"50\%", r"50\%", True),
    ("percent", r"x\%", "x", False),
    ("percent", r"100\%", "1", True),
    ("percent", r"-5\%", "-0.05", True),
    ("percent", r"5\%", "-0.05", False),
    ("separators", "(1,234.5)", "(1234.5)", False),
    ("separators", "(1, 234.5)", "(1,234.5)", True),
    ("separators", "1,234.5", "1234.5", True),
    ("separators", "1,234.5", "1, 234.5", False),
    ("separators", "(1,234)", "1234", False),
    ("separators", r"\{1,234\}", "1234", False),
    ("separators", "12,34", "1234", False),
    ("separators", "1,234,56", "123456", False),
    ("separators", "1.234", "1234", False),
    ("separators", "1 234.5", "1234.5", True),
    ("separators", "-1,234", "-1234", True),
    ("separators", "1,234", "1,235", False),
    ("magnitude", r"5\text{ thousandths}", "5", False),
    ("magnitude", r"5\text{ thousandths}", "0.005", True),
    ("magnitude", r"5\text{ hundredths}", "5", False),
    ("magnitude", r"5\text{ hundredths}", "0.05", True),
    ("magnitude", r"5\text{ dozen}", "5", False),
    ("magnitude", r"5\text{ dozen}", "60", True),
    ("magnitude", r"3\text{k}", "3", False),
    ("magnitude", r"3\text{k}", "3000", True),
    ("magnitude", r"3\text{ quarters}", "3", False),
    ("magnitude", r"3\text{ quarters}", r"\frac{3}{4}", True),
    ("magnitude", r"2\text{ thirds}", r"\frac{2}{3}", True),
    ("magnitude", r"2\text{ thirds}", "2", False),
    ("magnitude", "2 million", "2", False),
    ("magnitude", "3k", "3000", False),
    ("magnitude", r"5\text{ tenths}", "0.5", True),
    ("magnitude", r"x\text{ dozen}", "x", False),
    ("magnitude", r"1.2\text{ million people}", "1200000", True),
    ("magnitude", r"7\text{ halves}", "3.5", True),
    ("units", r"5\text{ m}", "5", True),
    ("units", r"5\text{ km}", "5000", False),
    ("units", r"5\text{ km}", "5", True),
    ("units", r"5\text{ dollars}", "5", True),
    ("units", r"5\text{ cm}^2", "5", True),
    ("units", r"5\text{ cm}^2", "25", False),
    ("units", r"\text{5 cm}", "5", True),
    ("units", r"5\text{ ml}", "0.005", False),
    ("units", r"12\text{ inches}", "1", False),
    ("units", r"3\text{ hours}", "180", False),
    ("units", r"5\ \text{cm}", "5", True),
    ("degrees", r"90^\circ", r"\frac{\pi}{2}", False),
    ("degrees", r"45^{\circ}", "45", True),
    ("degrees", r"45^{\circ}", "46", False),
    ("degrees", r"45\degree", "45", True),
    ("degrees", r"45 \circ", "45", True),
    ("degrees", r"f \circ f", "f^2", False),
    ("degrees", r"(f \circ g)(x)", "f(g(x))", False),
    ("degrees", r"-10^\circ", "-10", True),
    ("degrees", r"360^\circ", "0", False),
    ("constants", "10^{-100}", "0", False),
    ("constants", "10^{100}+1", "10^{100}", False),
    ("constants", "2^{-60}", "2^{-61}", False),
    ("constants", r"\frac{1}{10^{20}}", "10^{-20}", REFUSED),
    ("constants", "1e-20", "0", False),
    ("constants", "1e-20", "10^{-20}", True),
    ("constants", "10^{20}", "100000000000000000000", True),
    ("constants", "10^{20}", "100000000000000000001", False),
    ("constants", r"\pi + 10^{-30}", r"\pi", False),
    ("constants", "e^{-50}", "0", False),
    ("constants", "1 - 10^{-20}", "1", False),
    ("exact", "0.9999999999999999", "1", False),
    ("exact", r"\frac{1}{3}", "0.3333333333333333", False),
    ("exact", "100.0", "100", True),
    ("exact", "1.50", r"\frac{3}{2}", True),
    ("exact", "7", "7.000001", False),
    ("exact", r"\frac{6}{4}", "1.5", REFUSED),
    ("exact", r"\frac{22}{7}", r"\pi", False),
    ("exact", "1e2", "100", True),
    ("approximation", "3.14", r"\approx 3.14", True),
    ("approximation", r"\pi", r"\approx 3.14", REFUSED),
    ("approximation", "3.15", r"\approx 3.14", False),
    ("approximation", r"\frac{1}{12}", r"\approx 0.0833", REFUSED),
    ("approximation", "0.08", r"\approx 0.0833", False),
    ("approximation", r"\le 3.14", r"\approx 3.14", False),
    ("approximation", r"\approx 3.14", r"\approx 3.14", True),
    ("approximation", "3.1416", r"\approx 3.14", True),
    ("approximation", r"\sim 3.14", r"\approx 3.14", False),
    ("approximation", "x = 3.14", r"\approx 3.14", True),
    ("equations", "2x=6", "6", False),
    ("equations", "x^2=9", "9", False),
    ("equations", "a+b=10", "10", False),
    ("equations", "x+y=3", "3", False),
    ("equations", "10", "a+b=10", False),
    ("equations", "x = 3", "3", True),
    ("equations", "(p,q)=(3,2)", "(3,2)", True),
    ("equations", "(p,q)=(3,2)", "(2,3)", False),
    ("equations", r"\sum_{i=1}^{3} i", "6", REFUSED),
    ("equations", r"\prod_{k=1}^{3} k", "6", REFUSED),
    ("equations", r"\sum_{i=1}^{3} i", "7", False),
    ("equations", r"x \in [1, 2]", "[1,2]", True),
    ("equations", r"x \in [1, 2]", "[1,3]", False),
    ("equations", "0 < x < 1", "[0,1]", False),
    ("equations", "x = 2y", "2y", True),
    ("equations", "f(x) = 2x", "2x", False),
    ("equations", "y = 2x + 1", "2x + 1", True),
    ("equations", "x=3", "x=4", False),
    ("equations", "x_{1} = 3", "3", True),
    ("equations", "x = 3 = y", "3", False),
    ("hedges", r"\neq 5", "5", False),
    ("hedges", r"\ne 5", "5", False),
    ("hedges", "!=5", "5", False),
    ("hedges", r"\le 5", "5", False),
    ("hedges", r"\ge 5", "5", False),
    ("hedges", "< 5", "5", False),
    ("hedges", r"\sim 5", "5", False),
    ("hedges", r"\gg 5", "5", False),
    ("hedges", r"\lesssim 5", "5", False),
    ("hedges", r"\propto 5", "5", False),
    ("hedges", "~5", "5", False),
    ("hedges", r"\le 5", r"\leq 5", True),
    ("hedges", r"\le 5", r"\ge 5", False),
    ("hedges", r"x \sim 5", "5", False),
    ("hedges", "roughly 5", "5", False),
    ("hedges", "5?", "5", False),
    ("hedges", "5 or so", "5", False),
    ("hedges", r"\text{about } 5", "5", False),
    ("hedges", r"\approx 5", r"\approx 5", True),
    ("hedges", "≈5", "5", False),
    ("hedges", r"\simeq 5", "5", False),
    ("hedges", r"\in \{5\}", "5", False),
    ("hedges", "5+", "5", False),
    ("hedges", "5^{+}", "5", False),
    ("lists", "(1,2)", r"\{1,2\}", False),
    ("lists", r"\{1,2\}", "(1,2)", False),
    ("lists", "[1,2]", r"\{1,2\}", False),
    ("lists", r"\{2,1\}", r"\{1,2\}", True),
    ("lists", "(5,2),(7,2)", "(5,2),(7,2)", True),
    ("lists", "(5,2),(7,2)", "(7,2),(5,2)", False),
]


@pytest.mark.parametrize(
    ("pred", "gold", "correct"),
    [pytest.param(p, g, c, id=f"{cat}: {p!r} vs gold {g!r}") for cat, p, g, c in NEAR_MISSES],
)
def test_near_miss(pred: str, gold: str, correct: bool | str) -> None:
    verdict = grade(pred, gold)
    if correct == REFUSED:
        assert is_equivalent(pred, gold), "a refused answer must have the gold's value"
        assert not verdict.correct and verdict.reward == 0.0
        assert verdict.details["refused"] is not None
    else:
        assert verdict.correct is correct
        assert verdict.details["refused"] is None


def test_every_category_has_a_wrong_and_a_right_answer() -> None:
    verdicts: dict[str, set[bool | str]] = {}
    for category, _, _, correct in NEAR_MISSES:
        verdicts.setdefault(category, set()).add(correct)
    assert {c for c, seen in verdicts.items() if not {True, False} <= seen} == set()


def test_an_answer_identical_to_a_gold_over_the_size_cap_is_correct() -> None:
    gold = "x+" * 6_000 + "1"  # 12,001 characters, past the 10,000-character cap
    assert graded_correct(gold, gold)
    assert not graded_correct(gold[:-1] + "2", gold)
