"""Arithmetic left undone in a math answer (issue 48: an answer is a value).

A grader that evaluates expressions is a calculator: `<answer>79 * 86</answer>` equals 6794,
and a policy that searches against such a reward learns to copy the question's arithmetic
instead of doing it (ES did, in two steps, on reasoning-gym `products`). copes therefore
credits an answer only when it holds no more arithmetic than the gold does:

- `is_plain_number`: the form every plain-number gold asks for (a sign, digits, a decimal
  point, scientific notation, a unit after it; boxes, `$`, `%` and thousands separators are
  removed before, by `_math_normalize.prepare`/`finish`).
- `undone_operations`: how many operations between rational constants an answer still has
  to do: `79*86` 1, `\\frac{1}{2}+\\frac{1}{4}` 3, `\\frac{6}{8}` 1 (a fraction not in lowest
  terms: MATH's reference `is_equiv` never equates it with `\\frac{3}{4}`), `2^{10}` 1,
  `\\sqrt{16}` 1, while `\\frac{3}{4}`, `-0.75`, `\\frac{\\sqrt{3}}{2}`, `\\frac{1}{2}\\sqrt{3}`,
  `2x + 3` and `\\sqrt{8}` have none (a radical left unsimplified is a form, not arithmetic;
  equivalence decides it, with Math-Verify's semantics).

The parser below is a small precedence parser over the answer's tokens, written for this
count only: it never evaluates anything but exact rationals of bounded size, and whatever it
does not know (a command, a letter, a relation) is an opaque symbol or a separator, so no
input can make it fail or loop; its work is linear in the answer's length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

_MAX_DIGITS = 4000  # exact values above this size are not computed (a tower is still constant)
_MAX_DEPTH = 50  # deeper nesting: not analysed (no undone arithmetic is claimed)

# ---------------------------------------------------------------------------------------------
# Plain numbers

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
# `1.8e3`, `1.8\times10^{3}`, `1.8\cdot 10^3`, `10^{-3}`: scientific notation is a written
# number, not a power to work out.
_SCIENTIFIC = rf"{_NUMBER}(?:[eE][+-]?\d+|(?:\\times|\\cdot|\*)10\^(?:\{{[+-]?\d+\}}|[+-]?\d))"
_POWER_OF_TEN = r"[+-]?10\^(?:\{[+-]?\d+\}|[+-]?\d)"
_REPEATING = rf"{_NUMBER}\\(?:overline|bar)\{{\d+\}}"  # 0.1\overline{6}
# A currency sign before it, a unit after it (`18\text{ dollars}` is unwrapped to `18dollars`
# by then; `5m^2`, `3.5kg`, `18€`).
_CURRENCY = r"(?:[$€£¥]|\\\$|USD|EUR|Rs\.?)?"
_UNIT = r"(?:[A-Za-z€£¥$.'²³\s]|\\[A-Za-z]+\{[A-Za-z .]*\}|\^\{?[23]\}?)*"
_PLAIN = re.compile(
    rf"^{_CURRENCY}(?:\((?:{_SCIENTIFIC}|{_POWER_OF_TEN}|{_REPEATING}|{_NUMBER})\)"
    rf"|{_SCIENTIFIC}|{_POWER_OF_TEN}|{_REPEATING}|{_NUMBER}){_UNIT}$"
)


def is_plain_number(finished: str) -> bool:
    """Whether a finished answer (`_math_normalize.finish`) is one written number: nothing in
    it is left to compute."""
    return _PLAIN.match(finished.strip()) is not None


# ---------------------------------------------------------------------------------------------
# Tokens

_TOKEN = re.compile(
    r"(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+(?![A-Za-z]))?|\.\d+)"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<open>\\\{|[({\[])"
    r"|(?P<close>\\\}|[)}\]])"
    r"|(?P<op>\*\*|[+\-*/^!_])"
    r"|(?P<letter>[A-Za-z])"
    r"|(?P<space>\s+)"
    r"|(?P<sep>.)",
    re.DOTALL,
)
_OPERATOR_COMMANDS = {"\\times": "*", "\\cdot": "*", "\\ast": "*", "\\div": "/"}


def _tokens(s: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(s):
        kind, text = m.lastgroup or "sep", m.group(0)
        if kind == "space":
            continue
        if kind == "cmd" and text in _OPERATOR_COMMANDS:
            kind, text = "op", _OPERATOR_COMMANDS[text]
        elif kind == "op" and text == "**":
            text = "^"
        out.append((kind, text))
    return out


# ---------------------------------------------------------------------------------------------
# Nodes: what the count needs to know of a subexpression


class _Big:
    """A rational constant whose value was not computed (too large): still arithmetic."""


BIG = _Big()


@dataclass(frozen=True)
class _Node:
    """value: the exact value when the node is a rational constant (`BIG` when too large),
    None otherwise. ops: operations inside a rational constant. canonical: a rational written
    as a single number (a literal, a signed one, a fraction of integers in lowest terms).
    undone: undone operations in the parts of a non-constant node."""

    value: Fraction | _Big | None = None
    ops: int = 0
    canonical: bool = False
    undone: int = 0
    integer_literal: bool = False

    @property
    def rational(self) -> bool:
        return self.value is not None


_SYMBOL = _Node()


def _left_undone(node: _Node) -> int:
    """Operations left undone in a node, counting a rational constant as a whole."""
    if node.rational:
        return 0 if node.canonical else max(node.ops, 1)
    return node.undone


def _exact(compute) -> Fraction | _Big:
    try:
        value = compute()
    except (ZeroDivisionError, OverflowError, ValueError):
        return BIG
    return value


def _size_ok(*values: Fraction) -> bool:
    return all(len(str(abs(v.numerator))) + len(str(v.denominator)) < _MAX_DIGITS for v in values)


def _chain(children: list[_Node], combine) -> _Node:
    """A sum or a product: rational when every part is; else the undone work of each run of
    adjacent rational parts (`x + 2 + 3` has one: 2 + 3)."""
    if all(c.rational for c in children):
        values = [c.value for c in children]
        big = any(isinstance(v, _Big) for v in values)
        value = BIG if big else _exact(lambda: combine(values))
        ops = len(children) - 1 + sum(c.ops for c in children)
        return _Node(value=value, ops=ops)
    undone, run = 0, []
    for child in [*children, _SYMBOL]:
        if child.rational:
            run.append(child)
            continue
        if len(run) == 1:
            undone += _left_undone(run[0])
        elif run:
            undone += len(run) - 1 + sum(c.ops for c in run)
        run = []
        undone += child.undone
    return _Node(undone=undone)


def _sum(children: list[_Node]) -> _Node:
    return _chain(children, sum)


def _product(children: list[_Node], inverted: list[bool]) -> _Node:
    if len(children) == 2 and inverted == [False, True]:  # `3/4`: a fraction, as \frac{3}{4}
        return _fraction(children[0], children[1])

    def multiply(values):
        out = Fraction(1)
        for divide, v in zip(inverted, values, strict=True):
            out = out / v if divide else out * v
            if not _size_ok(out):
                raise OverflowError
        return out

    return _chain(children, multiply)


def _fraction(num: _Node, den: _Node) -> _Node:
    if not (num.rational and den.rational):
        return _Node(undone=_left_undone(num) + _left_undone(den))
    if isinstance(num.value, _Big) or isinstance(den.value, _Big) or den.value == 0:
        return _Node(value=BIG, ops=1 + num.ops + den.ops)
    assert isinstance(num.value, Fraction) and isinstance(den.value, Fraction)
    value = num.value / den.value
    canonical = (
        num.integer_literal
        and den.integer_literal
        and den.value > 1
        and math.gcd(num.value.numerator, den.value.numerator) == 1
    )
    return _Node(value=value, ops=1 + num.ops + den.ops, canonical=canonical)


def _root(value: Fraction, degree: int) -> Fraction | None:
    """The exact `degree`-th root of a rational, None when irrational (or not real)."""
    if value < 0 and degree % 2 == 0:
        return None
    sign = -1 if value < 0 else 1
    parts = []
    for n in (abs(value.numerator), value.denominator):
        r = round(n ** (1.0 / degree)) if n.bit_length() < 1000 else None
        if r is None:
            return None
        found = next((c for c in (r - 1, r, r + 1) if c >= 0 and c**degree == n), None)
        if found is None:
            return None
        parts.append(found)
    return sign * Fraction(parts[0], parts[1])


def _power(base: _Node, exponent: _Node) -> _Node:
    if not (base.rational and exponent.rational):
        return _Node(undone=_left_undone(base) + _left_undone(exponent))
    ops = 1 + base.ops + exponent.ops
    b, e = base.value, exponent.value
    if isinstance(b, _Big) or isinstance(e, _Big):
        return _Node(value=BIG, ops=ops)
    assert isinstance(b, Fraction) and isinstance(e, Fraction)
    if e.denominator != 1:  # 4^{1/2} is 2, 2^{1/2} is not rational
        if e.denominator > 12 or b == 0:
            return _Node(undone=_left_undone(base) + _left_undone(exponent))
        root = _root(b, e.denominator)
        if root is None:
            return _Node(undone=_left_undone(base) + _left_undone(exponent))
        b, e = root, Fraction(e.numerator)
    digits = abs(int(e)) * max(len(str(abs(b.numerator))), len(str(b.denominator)))
    if digits > _MAX_DIGITS or (b == 0 and e < 0):
        return _Node(value=BIG, ops=ops)
    return _Node(value=b ** int(e), ops=ops)


def _radical(radicand: _Node, degree: int) -> _Node:
    if not radicand.rational or isinstance(radicand.value, _Big):
        return _Node(undone=_left_undone(radicand))
    assert isinstance(radicand.value, Fraction)
    root = _root(radicand.value, degree)
    if root is None:  # `\sqrt{8}`: irrational, a form; its radicand's own work still counts
        return _Node(undone=_left_undone(radicand))
    return _Node(value=root, ops=1 + radicand.ops)


def _factorial(node: _Node) -> _Node:
    if not node.rational:
        return _Node(undone=_left_undone(node))
    v = node.value
    if isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= 1000:
        return _Node(value=Fraction(math.factorial(int(v))), ops=node.ops + 1)
    return _Node(value=BIG, ops=node.ops + 1)


def _literal(text: str) -> _Node:
    if len(text) > _MAX_DIGITS:
        return _Node(value=BIG, canonical=True)
    integer = text.isdigit()
    return _Node(value=Fraction(text), canonical=True, integer_literal=integer)


def _negate(node: _Node) -> _Node:
    if not node.rational:
        return node
    value = BIG if isinstance(node.value, _Big) else -node.value  # type: ignore[operator]
    return _Node(value, node.ops, node.canonical, 0, node.integer_literal)


# ---------------------------------------------------------------------------------------------
# The parser


class _TooDeep(Exception):
    pass


class _Parser:
    """Precedence parser: list of expressions (any separator), sum, product (explicit or
    juxtaposed), unary sign, power, factorial, primary. Unknown tokens are separators."""

    _STARTS = ("num", "cmd", "letter", "open")

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.i, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.i += 1
        return token

    def elements(self, closing: bool) -> list[_Node]:
        """Expressions up to the end (or a closing bracket, when `closing`), split at any
        separator."""
        items = []
        while True:
            kind, _ = self.peek()
            if kind == "end" or (kind == "close" and closing):
                return items
            if kind in ("sep", "close"):
                self.take()
                continue
            before = self.i
            items.append(self.sum())
            if self.i == before:  # a token no rule takes (`!` alone): skip it
                self.take()

    def at_sign(self) -> bool:
        return self.peek() in (("op", "+"), ("op", "-"))

    def operand_follows(self) -> bool:
        return self.peek()[0] in self._STARTS or self.at_sign()

    def sum(self) -> _Node:
        terms = [self.signed(self.product)]
        while self.at_sign():
            sign = self.take()[1]
            term = self.signed(self.product)
            terms.append(_negate(term) if sign == "-" else term)
        return terms[0] if len(terms) == 1 else _sum(terms)

    def signed(self, rule) -> _Node:
        """Leading signs, then `rule` (a product in a sum, a power after `*`, `/`, `^`)."""
        negative = False
        while self.at_sign():
            negative ^= self.take()[1] == "-"
        node = rule()
        return _negate(node) if negative else node

    def product(self) -> _Node:
        factors, inverted = [self.power()], [False]
        while True:
            kind, text = self.peek()
            if kind == "op" and text in "*/":
                self.take()
                if not self.operand_follows():
                    break
                factors.append(self.signed(self.power))
                inverted.append(text == "/")
            elif kind in self._STARTS:
                factors.append(self.power())
                inverted.append(False)
            else:
                break
        return factors[0] if len(factors) == 1 else _product(factors, inverted)

    def power(self) -> _Node:
        base = self.postfix()
        kind, text = self.peek()
        if kind == "op" and text in "^_":
            self.take()
            if not self.operand_follows():
                return base
            exponent = self.signed(self.power)
            if text == "_":  # a subscript names, it does not compute: `x_1`, `\log_2`
                return _Node(undone=base.undone + _left_undone(exponent))
            return _power(base, exponent)
        return base

    def postfix(self) -> _Node:
        node = self.primary()
        while self.peek() == ("op", "!"):
            self.take()
            node = _factorial(node)
        return node

    def group(self) -> _Node:
        """A bracketed group: its one expression, or a tuple (its elements' undone work)."""
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _TooDeep
        items = self.elements(closing=True)
        if self.peek()[0] == "close":
            self.take()
        self.depth -= 1
        if len(items) == 1:
            return items[0]
        return _Node(undone=sum(_left_undone(item) for item in items))

    def argument(self) -> _Node:
        """A command's argument: a group, or a single token (`\\frac12` was braced before)."""
        if self.peek()[0] == "open":
            self.take()
            return self.group()
        return self.primary()

    def primary(self) -> _Node:
        kind, text = self.peek()
        if kind == "num":
            self.take()
            return _literal(text)
        if kind == "open":
            self.take()
            return self.group()
        if kind == "cmd":
            self.take()
            if text in ("\\frac", "\\dfrac", "\\tfrac", "\\cfrac"):
                return _fraction(self.argument(), self.argument())
            if text == "\\sqrt":
                degree = 2
                if self.peek() == ("open", "["):
                    self.take()
                    index = self.group()
                    if not (
                        isinstance(index.value, Fraction)
                        and index.value.denominator == 1
                        and 2 <= index.value <= 12
                    ):
                        return _Node(undone=_left_undone(index) + _left_undone(self.argument()))
                    degree = int(index.value)
                return _radical(self.argument(), degree)
            return _SYMBOL  # \pi, \infty, \sin, \log, \alpha: not a rational constant
        if kind == "letter":
            self.take()
            return _SYMBOL
        return _SYMBOL  # nothing to read here (a stray operator): the caller moves on


def undone_operations(answer: str) -> int | None:
    """Operations between rational constants left to do in a prepared answer; None when it
    is nested too deeply to analyse."""
    try:
        parser = _Parser(_tokens(answer))
        return sum(_left_undone(item) for item in parser.elements(closing=False))
    except (_TooDeep, RecursionError):
        return None
