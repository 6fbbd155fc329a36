"""An answer is a value (issue 48): no reward for arithmetic left undone.

Every case is graded through ToolMath-v0's grader (`MathGrader`), the one that turns a final
answer into a reward, and every refused case is checked to have the gold's value
(`is_equivalent`, Math-Verify's semantics), so each row shows the form rule and nothing else.
"""

from __future__ import annotations

import random
import time

import pytest

from copes.envs.rewards._math_undone import undone_operations
from copes.envs.rewards.graders import MathGrader
from copes.envs.rewards.math import NOT_A_NUMBER, UNDONE_ARITHMETIC, is_equivalent
from copes.envs.tasks.base import Task

GRADER = MathGrader()


def grade(pred: str, gold: str):
    return GRADER(pred, Task(id="form", question="q", answers=(gold,), kind="math"))


# A plain-number gold: only a plain number earns it (signs, decimals, thousands separators,
# a unit or a box around it, scientific notation).
PLAIN_FORMS = [
    ("6794", "6794"), ("6,794", "6794"), ("+6794", "6794"), ("6794.0", "6794"),
    (r"\boxed{6794}", "6794"), (r"$6794$", "6794"), (r"6794\text{ apples}", "6794"),
    (r"\$18", "18"), (r"5\text{ cm}^2", "5"), (r"125\textnormal{ miles}", "125"),
    ("(18)", "18"), ("-3", "-3"), ("0.5", r"50\%"), (r"50\%", "0.5"), ("x = 18", "18"),
    ("1.8e3", "1800"), (r"1.8\times 10^{3}", "1800"), (r"1.8 \cdot 10^3", "1800"),
    ("10^{6}", "1000000"), ("1000000", "10^{6}"), (r"0.\overline{3}", r"0.\overline{3}"),
    ("2.67", r"\approx 2.67"), (r"3\text{ thousand}", "3000"),
]  # fmt: skip
UNDONE_FOR_A_PLAIN_GOLD = [
    ("79 * 86", "6794"), ("79*86", "6794"), (r"79 \times 86", "6794"), (r"79\cdot86", "6794"),
    ("6793+1", "6794"), ("6795 - 1", "6794"), ("13588/2", "6794"), (r"13588 \div 2", "6794"),
    ("2^{10}", "1024"), (r"\left(79\right)\cdot 86", "6794"),
    (r"\frac{13588}{2}", "6794"), (r"\frac{1}{2}", "0.5"), ("1/2", "0.5"), (r"\sqrt{16}", "4"),
    ("5!", "120"), (r"\binom{5}{2}", "10"), ("x = 2+3", "5"), (r"\boxed{9*2}", "18"),
    (r"\frac{8}{3}", r"\approx 2.67"), (r"e^{i\pi}", "-1"), (r"\sum_{i=1}^{3} i", "6"),
]  # fmt: skip
# A gold that is a form: equivalence, but no more operations between numbers than it has.
FORMS = [
    (r"\frac{3}{4}", r"\frac{3}{4}", True), ("3/4", r"\frac{3}{4}", True),
    ("0.75", r"\frac{3}{4}", True), (r"-\frac{3}{4}", r"\frac{-3}{4}", True),
    (r"\frac{1}{2}\sqrt{3}", r"\frac{\sqrt{3}}{2}", True), (r"\sqrt{8}", r"2\sqrt{2}", True),
    ("2x+2", "2(x+1)", True), (r"\frac{\pi}{2}", r"\frac{1}{2}\pi", True),
    ("243", "3^5", True), ("3^5", "3^5", True), ("(2, 3)", "(2,3)", True),
    (r"\frac{6}{8}", r"\frac{3}{4}", False), (r"\frac{1}{2}+\frac{1}{4}", r"\frac{3}{4}", False),
    (r"1\frac{1}{2}", r"\frac{3}{2}", False), ("(2+3)x", "5x", False),
    (r"\frac{2}{2 \cdot 100!}", r"\frac{1}{100!}", False), ("(1+1, 3)", "(2, 3)", False),
    (r"\sqrt{4}\sqrt{2}", r"2\sqrt{2}", False), ("3^4 \\cdot 3", "3^5", False),
    ("x+2+3", "x+5", False),
]  # fmt: skip


@pytest.mark.parametrize(("pred", "gold"), PLAIN_FORMS)
def test_a_plain_number_earns_a_plain_gold(pred, gold):
    verdict = grade(pred, gold)
    assert verdict.correct and verdict.reward == 1.0
    assert verdict.details["refused"] is None and not verdict.details["undone_arithmetic"]


@pytest.mark.parametrize(("pred", "gold"), UNDONE_FOR_A_PLAIN_GOLD)
def test_arithmetic_left_undone_earns_nothing_and_says_so(pred, gold):
    assert is_equivalent(pred, gold), "the case must have the gold's value"
    verdict = grade(pred, gold)
    assert not verdict.correct and verdict.reward == 0.0
    assert verdict.details["refused"] == UNDONE_ARITHMETIC and verdict.details["undone_arithmetic"]


@pytest.mark.parametrize(("pred", "gold", "correct"), FORMS)
def test_a_form_gold_takes_no_more_undone_arithmetic_than_it_has(pred, gold, correct):
    assert is_equivalent(pred, gold), "the case must have the gold's value"
    verdict = grade(pred, gold)
    assert verdict.correct is correct
    assert verdict.details["undone_arithmetic"] is (not correct)


def test_prose_around_a_plain_value_is_refused_but_not_counted_as_arithmetic():
    pred, gold = "the number is not 10 which is 1,000.99€", "1000.99"
    assert is_equivalent(pred, gold)  # Math-Verify's extraction reads the last number
    verdict = grade(pred, gold)
    assert not verdict.correct and verdict.details["refused"] == NOT_A_NUMBER
    assert not verdict.details["undone_arithmetic"]


def test_wrong_values_are_wrong_and_never_counted_as_undone():
    for pred, gold in (("79 * 85", "6794"), ("6795", "6794"), (r"\frac{5}{8}", r"\frac{3}{4}")):
        verdict = grade(pred, gold)
        assert not verdict.correct and verdict.details["refused"] is None


def test_any_gold_counts_and_a_refusal_is_reported_only_when_none_credits():
    task = Task(id="two", question="q", answers=("6794", "79 * 86"), kind="math")
    assert GRADER("79 * 86", task).correct  # the second gold has that arithmetic itself
    task = Task(id="two", question="q", answers=("6794", "6,794"), kind="math")
    grade_ = GRADER("79 * 86", task)
    assert not grade_.correct and grade_.details["undone_arithmetic"]


@pytest.mark.parametrize(
    ("answer", "operations"),
    [("2**10", 1), ("(79)(86)", 1), ("79(86)", 1), ("-(3)", 0), (r"\frac{-3}{4}", 0),
     (r"\frac{3}{-4}", 1), (r"\frac{0.5}{2}", 1), (r"\frac{4}{1}", 1), ("4^{1/2}", 2),
     (r"\sqrt[3]{27}", 1), (r"\sqrt[3]{26}", 0), ("2^{1/2}", 0), ("1/0", 1),
     ("2^{100000}", 1), (r"\log_2 8", 0), (r"x \in [1+1, 3]", 1), ("f(x)=3x+2", 0)],
)  # fmt: skip
def test_operations_between_numbers_are_counted_where_the_grader_cannot_read_them(
    answer, operations
):
    """The count alone, on spellings the value check does not read (`2**10`, juxtaposed
    brackets) and on the edges of what is a number written once."""
    assert undone_operations(answer) == operations


def test_the_parser_takes_hostile_input_in_linear_time():
    assert undone_operations("(" * 5000 + "1" + ")" * 5000) is None  # too deep: no claim
    assert undone_operations("-" * 5000 + "5") == 0  # signs are read in a loop
    rng = random.Random(0)
    alphabet = [*"0123456789+-*/^!(){}[]_,.= x", r"\frac", r"\sqrt", r"\cdot", r"\pi"]
    for _ in range(2000):  # never raises, whatever it is given
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert undone_operations(text) is None or undone_operations(text) >= 0
    long = "+".join(["12"] * 5000)  # 15,000 characters
    start = time.process_time()
    assert undone_operations(long) == 4999
    assert time.process_time() - start < 5.0
