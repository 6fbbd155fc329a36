"""A size bound on numeric answers: power towers are refused in microseconds, not after the
symbolic check's whole CPU budget.

A small model writes junk like ``3 * 3 * 32 ** 32 ** 32 ** 32 *``. sympy evaluates an integer
power when it builds it, before any comparison, so such an answer costs the grader worker its
whole budget (5 CPU seconds) and then counts as not equivalent. Two rules decide these answers
before the worker is asked, each with the verdict the worker gives:

- **Too large to build.** An answer made only of numbers and arithmetic that holds an integer
  power whose value needs more than `MAX_BITS` bits: the worker cannot even hold that number
  (its address space is capped at 2 GiB), so on every machine it fails or runs out of time,
  which is "not equivalent".
- **Far too large to be the gold.** An answer that is a *monotone* expression of positive
  numbers (``+``, ``*``, powers: no ``-`` or ``/`` that could cancel) has a magnitude that
  floats bound reliably; against a gold that is a plain number, a magnitude with more than
  twice the gold's bits (and 4,096 more) cannot be equal to it: "not equivalent", exactly.

Anything else (letters, a ``-`` or ``/`` in an exponent, an unbalanced group) is left to the
worker unchanged.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_BITS = 2.0**33  # a 1 GiB integer: beyond what the worker (2 GiB address space) can build
_SLACK_BITS = 4096.0

# Numbers, arithmetic, brackets and the LaTeX that writes them; nothing else.
_TOKEN = re.compile(
    r"\s+|(\d+(?:\.\d*)?|\.\d+)|(\*\*|\\cdot|\\times|[+\-*/^(){}\[\]])|\\left|\\right"
)


def _tokens(text: str) -> list[tuple[str, str]] | None:
    """(kind, text) tokens of a numbers-and-arithmetic answer; None if it holds anything
    else (a letter, a word, a command other than \\cdot, \\times, \\left, \\right)."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            return None
        number, operator = match.group(1), match.group(2)
        if number is not None:
            tokens.append(("num", number))
        elif operator is not None:
            op = {"\\cdot": "*", "\\times": "*", "**": "^"}.get(operator, operator)
            op = {"{": "(", "[": "(", "}": ")", "]": ")"}.get(op, op)
            tokens.append(("op", op))
        pos = match.end()
    return tokens


class _Parser:
    """Precedence climbing over the tokens; each value is (log2 of the magnitude, monotone),
    monotone meaning built from positive numbers with + * ^ only (so floats bound it).
    Trailing junk (a dangling operator) ends the parse where it starts."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.largest_power_bits = 0.0  # the largest power met, in bits (any context)

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def expression(self) -> tuple[float, bool] | None:
        left = self.term()
        while left is not None and self.peek() in ("+", "-"):
            op = self.tokens[self.pos][1]
            self.pos += 1
            right = self.term()
            if right is None:
                return left if self.pos >= len(self.tokens) else None
            left = (_log2_sum(left[0], right[0]), left[1] and right[1] and op == "+")
        return left

    def term(self) -> tuple[float, bool] | None:
        left = self.power()
        while left is not None and self.peek() in ("*", "/"):
            op = self.tokens[self.pos][1]
            self.pos += 1
            right = self.power()
            if right is None:
                return left if self.pos >= len(self.tokens) else None
            if op == "*":
                left = (left[0] + right[0], left[1] and right[1])
            else:
                left = (left[0] - right[0], False)
        return left

    def power(self) -> tuple[float, bool] | None:
        base = self.atom()
        if base is None or self.peek() != "^":
            return base
        self.pos += 1
        exponent = self.power()  # right-associative: 2^3^4 = 2^(3^4)
        if exponent is None:
            return base if self.pos >= len(self.tokens) else None
        monotone = base[1] and exponent[1] and base[0] > 0.0
        exponent_value = 2.0 ** exponent[0] if exponent[0] < 1024 else math.inf
        bits = exponent_value * base[0] if base[0] > 0.0 else 0.0
        if monotone:
            self.largest_power_bits = max(self.largest_power_bits, bits)
        return (bits if base[0] > 0.0 else 0.0, monotone)

    def atom(self) -> tuple[float, bool] | None:
        kind, text = self.tokens[self.pos] if self.pos < len(self.tokens) else ("", "")
        if kind == "num":
            self.pos += 1
            value = Fraction(text)
            return (math.log2(value) if value > 0 else -math.inf, value >= 1)
        if text == "(":
            self.pos += 1
            inner = self.expression()
            if inner is None or self.peek() != ")":
                return None
            self.pos += 1
            return inner
        return None


def _log2_sum(a: float, b: float) -> float:
    """log2(2^a + 2^b) (an upper bound for a difference too)."""
    high, low = max(a, b), min(a, b)
    return high if high - low > 60 else high + math.log2(1.0 + 2.0 ** (low - high))


def size_verdict(pred: str, gold: Fraction | None) -> bool | None:
    """False when `pred` is refused by a size bound (see the module docstring), else None.

    `gold` is the gold's exact value when it is a plain number (None otherwise)."""
    if len(pred) > 2000 or ("^" not in pred and "**" not in pred):
        return None
    tokens = _tokens(pred)
    if not tokens:
        return None
    parser = _Parser(tokens)
    try:
        value = parser.expression()
    except (OverflowError, ValueError, ZeroDivisionError):
        return None
    if parser.largest_power_bits > MAX_BITS:
        return False  # the worker cannot build this number on any machine
    if value is None or parser.pos != len(tokens) or not value[1] or gold is None:
        return None
    gold_bits = math.log2(abs(gold)) if gold != 0 else 0.0
    if value[0] > 2.0 * max(gold_bits, 0.0) + _SLACK_BITS:
        return False  # a monotone value with far more bits than the gold cannot equal it
    return None
