"""Exact values of plain numbers in math answers (issue 25: exact answers compare exactly).

A decimal is the rational it writes, however many digits it has (`0.0833333333333333` is not
1/12); a repeating decimal (`0.1\\overline{6}`) is its exact fraction.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

INTEGER = re.compile(r"^[+-]?\d+$")
_DECIMAL = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d{1,3})$")
_REPEATING = re.compile(r"^([+-]?)(\d*)\.(\d*)\\(?:overline|bar)\{(\d+)\}$")  # 0.1\overline{6}
_INT_POWER = re.compile(r"^([+-]?)(\d+)\^\{?(-?\d{1,4})\}?$")  # 10^3, 2^{10}, -2^2, 10^{-3}
_FRAC_NUM = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")
_MAX_DIGITS = 4000  # below CPython's int/str conversion limit (4300)


def canonical_int(s: str) -> str:
    sign = "-" if s.startswith("-") else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def to_number(s: str) -> Fraction | None:
    """The exact value of a plain integer, decimal, repeating decimal, integer power or integer
    fraction; None for anything else."""
    if len(s) > _MAX_DIGITS:
        return None
    if INTEGER.match(s):
        return Fraction(int(s))
    if m := _INT_POWER.match(s):  # an integer power, so `10^3` meets `1e3` and `1000`
        base, exponent = int(m.group(2)), int(m.group(3))
        if base > 1 and abs(exponent) * math.log10(base) > _MAX_DIGITS:
            return None
        if base == 0 and exponent < 0:  # 0^{-1}: undefined
            return None
        value = Fraction(base) ** exponent
        return -value if m.group(1) == "-" else value
    if _DECIMAL.match(s):
        return Fraction(s)
    if m := _REPEATING.match(s):  # a.b(c) = a.b + c / (10^|b| (10^|c| - 1))
        sign, whole, fixed, cycle = m.groups()
        value = Fraction(int(whole or "0")) + Fraction(int(fixed or "0"), 10 ** len(fixed))
        value += Fraction(int(cycle), 10 ** len(fixed) * (10 ** len(cycle) - 1))
        return -value if sign == "-" else value
    if m := _FRAC_NUM.match(s):
        den = int(m.group(3))
        if den == 0:
            return None
        value = Fraction(int(m.group(2)), den)
        return -value if m.group(1) == "-" else value
    return None


_INFINITY = {"\\infty": "+", "+\\infty": "+", "-\\infty": "-", "\\inf": "+", "-\\inf": "-"}
Atom = Fraction | str


def atom(s: str) -> Atom | None:
    """A plain number as its exact value, an infinity as its sign, else None."""
    return _INFINITY.get(s) or to_number(s)
