"""Normalization of math answers, in two stages around the assignment decision.

Rules follow the MATH reference `is_equiv`/`_strip_string` (Hendrycks et al. 2021, "Measuring
Mathematical Problem Solving With the MATH Dataset"), written afresh, plus a few extras:
thousands separators, scale words as factors (`5\\text{ dozen}` = 60), `\\text{...}`
unwrapping. `prepare` removes notation (delimiters, spacing, units, degree signs, `%`); the
grader then decides whether `x = 3` reads as `3` (it depends on the other answer), and
`finish` canonicalizes what is left.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

from copes.envs.parsing import last_boxed

_SPACING = re.compile(r"(?<!\\)\\[,;:! ]|\\q?quad(?![a-zA-Z])|~")  # not the `\\` of a row end
_SEPARATOR_SPACE = re.compile(r"(?<=\d),\s*\\!\s*(?=\d)")  # `1,\!000`: MATH's thousands comma
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
# Degree signs only: a `\circ` that is not a superscript (`f \circ g`) is composition.
_DEGREES = re.compile(
    r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])|°|(?<=\d)\s*\\circ\s*$"
)
_MATH_DELIMITERS = re.compile(r"\\\$|\$|\\[()\[\]]")
_TEXT_CMD = r"\\(?:text|textrm|textbf|textit|mbox|mathrm)\s*"
# Words that scale the number before them: factors, never units (`5\text{ dozen}` is 60,
# `5\text{ hundredths}` is 0.05). Only words with one reading; `k` only inside `\text{}`,
# since a bare `3k` is 3 times the variable k.
_SCALES = {
    "hundred": Fraction(10**2),
    "thousand": Fraction(10**3),
    "million": Fraction(10**6),
    "billion": Fraction(10**9),
    "trillion": Fraction(10**12),
    "dozen": Fraction(12),
    "half": Fraction(1, 2),
    "halve": Fraction(1, 2),  # `halves`
    "third": Fraction(1, 3),
    "quarter": Fraction(1, 4),
    "fourth": Fraction(1, 4),
    "fifth": Fraction(1, 5),
    "tenth": Fraction(1, 10),
    "hundredth": Fraction(1, 10**2),
    "thousandth": Fraction(1, 10**3),
    "millionth": Fraction(1, 10**6),
    "billionth": Fraction(1, 10**9),
}
_SCALE_WORD = (
    r"(?<![A-Za-z])(" + "|".join(sorted(_SCALES, key=len, reverse=True)) + r")s?(?![A-Za-z])"
)
# `2\text{ million}`, `1.5 billion dollars`, `3\text{k}`: a number times its scale (short
# scale), whatever unit follows.
_MAGNITUDE = re.compile(
    r"^([+-]?\d+(?:,\d{3})*(?:\.\d+)?)\s*(?:(?:"
    + _TEXT_CMD
    + r"\{\s*)?"
    + _SCALE_WORD
    + r"|"
    + _TEXT_CMD
    + r"\{\s*(k|K)\s*\})(?:[\sA-Za-z.{}]|"
    + _TEXT_CMD
    + r")*$",
    re.IGNORECASE,
)
# A trailing unit: `5 \text{ cm}`, `5\mbox{ inches}^2`; letters, spaces and dots only, and
# never a scale word (`\text{ million}`, `\text{ dozen}`, `\text{k}` scale the number).
_TRAILING_UNIT = re.compile(
    _TEXT_CMD
    + r"\{(?![^{}]*"
    + _SCALE_WORD
    + r")(?!\s*[kK]\s*\})\s*[A-Za-z][A-Za-z .]*\}\s*(?:\^\s*\{?\d\}?)?\s*$",
    re.IGNORECASE,
)
_TEXT_WRAP = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_VARIABLE = r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*"
# What an assignment assigns: one variable (`x`, `a_1`, `\alpha`) or a tuple of them (`(p, q)`).
_ASSIGN_LHS = re.compile(rf"^(?:{_VARIABLE}|\s*\({_VARIABLE}(?:,{_VARIABLE})+\)\s*)$")
# Every relation and relation-like hedge (`\sim 5`, `\gg 5` are claims about a value, not the
# value). The one spelling both the assignment rule and the grader use.
RELATION = re.compile(
    r"!=|=|<|>|≤|≥|≠|≈|∼|≪|≫|∝|≡|≅"
    r"|\\(?:le|ge|leq|geq|neq|ne|lt|gt|leqq|geqq|leqslant|geqslant|nless|ngtr|nleq|ngeq"
    r"|sim|simeq|approx|thickapprox|thicksim|cong|equiv|propto|ll|gg|lll|ggg"
    r"|lesssim|gtrsim|lessapprox|gtrapprox|prec|succ|preceq|succeq"
    r"|in|notin|ni|subset|subseteq|supset|supseteq)(?![A-Za-z])|∈|∉|⊂|⊆"
)
_FRAC_SQRT = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_BARE_DECIMAL = re.compile(r"(?<![\d.])\.(\d)")
_ANY_DIGIT = re.compile(r"\d")  # Unicode decimal digits of every script
_INT_SLASH = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
# A comma groups thousands only between digits and without a space: `32,349` is one number,
# `32, 349` a list of two.
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DIGIT_RUN = re.compile(r"\d+(?:\s+\d+)+")
_SPACED_THOUSANDS = re.compile(r"\d{1,3}(?:\s+\d{3})+")  # `1 234 567`, `3\,000` (SI style)
_CHOICE = re.compile(r"^\(([A-Za-z])\)$")
_PERCENT_WORD = re.compile(
    r"(?<=\d)\s*(?:\\text\s*\{\s*)?(?:percent(?:age)?|per\s+cent|pct)(?![A-Za-z])\s*\}?",
    re.IGNORECASE,
)


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """One TeX argument at `s[i:]`: a balanced `{...}`, a `\\command`, or one character."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1 : j], j + 1
        return None
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+|\\.", s[i:])
        return (m.group(0), i + m.end()) if m else None
    return s[i], i + 1


def _brace_frac_sqrt(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`; malformed tails are kept as is."""
    out: list[str] = []
    i = 0
    while i < len(s):
        m = _FRAC_SQRT.match(s, i)
        if m is None:
            out.append(s[i])
            i += 1
            continue
        j, head = m.end(), m.group(0)
        if m.group(1) == "sqrt" and s[j : j + 1] == "[" and "]" in s[j:]:
            close = s.index("]", j)
            head, j = head + s[j : close + 1], close + 1
        args = []
        for _ in range(2 if m.group(1) == "frac" else 1):
            got = _read_arg(s, j)
            if got is None:
                break
            args.append(got[0])
            j = got[1]
        else:
            out.append(head + "".join("{" + _brace_frac_sqrt(a) + "}" for a in args))
            i = j
            continue
        out.append(s[i:])  # unbalanced or missing argument: leave the rest untouched
        break
    return "".join(out)


def _strip_outer_braces(s: str) -> str:
    """`{{ x }}` -> `x`: every brace pair that wraps the whole string, in one pass (a loop
    of `_read_arg` calls was quadratic in the nesting depth)."""
    match: dict[int, int] = {}
    opened: list[int] = []
    for i, ch in enumerate(s):
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            match[opened.pop()] = i
    start, end = 0, len(s)
    while start < end and match.get(start) == end - 1:
        start, end = start + 1, end - 1
        while start < end and s[start].isspace():
            start += 1
        while end > start and s[end - 1].isspace():
            end -= 1
    return s[start:end]


def _ascii_digits(s: str) -> str:
    """Any script's decimal digits (Arabic-Indic `٤٢`, full-width `４２`) as ASCII `42`."""
    if s.isascii():
        return s
    return _ANY_DIGIT.sub(lambda m: str(unicodedata.digit(m.group(0))), s)


def _apply_magnitude(s: str) -> str:
    """`3\\text{ thousand}` -> `3000`, `5\\text{ dozen}` -> `60`, exactly (`1.5 million` ->
    `1500000`, `2\\text{ thirds}` -> `\\frac{2}{3}`)."""
    m = _MAGNITUDE.match(s)
    if m is None:
        return s
    word = (m.group(2) or "thousand").lower()  # group 3 is `\text{k}`
    value = Fraction(m.group(1).replace(",", "")) * _SCALES[word]
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:  # not a terminating decimal
        return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    places = max(twos, fives)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def has_percent(s: str) -> bool:
    """A `%` sign or a percent word after a number (`28 percent`, `28 pct`)."""
    return "%" in s or _PERCENT_WORD.search(s) is not None


def loose_digits(s: str) -> bool:
    """Digits separated by spaces that are not thousands groups (`1 2`): not one number."""
    return any(not _SPACED_THOUSANDS.fullmatch(run) for run in _DIGIT_RUN.findall(s))


def prepare(s: str) -> str:
    """Drop notation that carries no value: boxes, spacing, `\\left`, degree signs, math
    delimiters, units, `%` (the grader reads the `%` on the raw answer), `\\text` wrappers."""
    if not isinstance(s, str):
        return ""
    s = _ascii_digits(s.strip())
    if s.startswith(("\\boxed", "\\fbox")):
        s = last_boxed(s) or s
    s = s.replace("\n", " ").replace("\\displaystyle", "")
    s = _SEPARATOR_SPACE.sub(",", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _DEGREES.sub("", s)
    s = _MATH_DELIMITERS.sub("", s).strip()
    s = _apply_magnitude(s)
    if not _TEXT_WRAP.fullmatch(s.strip()):  # a lone `\text{east}` is the answer, not a unit
        s = _TRAILING_UNIT.sub("", s)
    s = _PERCENT_WORD.sub("", s.replace("\\%", "").replace("%", ""))
    s = _TEXT_WRAP.sub(lambda m: m.group(1), s)
    return s.replace("{,}", ",").strip().rstrip(".").strip()


def _outside_braces(s: str) -> str:
    """`s` with every `{...}` group's content blanked (same length), so that a search sees only
    the top level: the `=` of `\\sum_{i=1}` or `\\lim_{x=0}` is not a relation of the answer.
    Escaped set braces `\\{ \\}` are not groups."""
    out, depth = list(s), 0
    for i, ch in enumerate(s):
        if i and s[i - 1] == "\\":
            continue
        if ch == "{":
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                continue
        if depth:
            out[i] = " "
    return "".join(out)


def relations(s: str) -> list[str]:
    """The relations at the top level of an answer (`2x = 6`: `=`; `0 < x \\le 1`: `<`, `\\le`)."""
    return RELATION.findall(_outside_braces(s))


def has_relation(s: str) -> bool:
    """Whether the answer is (or contains, at its top level) a relation: `2x = 6`, `\\le 5`."""
    return RELATION.search(_outside_braces(s)) is not None


def leading_relation(s: str) -> str | None:
    """The relation an answer starts with (`\\le 5`, `!= 5`, `< 5`), else None."""
    m = RELATION.match(s.strip())
    return m.group(0) if m else None


def split_assignment(s: str) -> tuple[str, str] | None:
    """(variable, value) of an assignment, the answer's one top-level relation: `x = 3`,
    `(p, q) = (3, 2)`, or a membership `x \\in [1, 2]` (its variable is then `x\\in`, so that
    it never reads as the same claim as `x = ...`); None for anything else."""
    found = list(RELATION.finditer(_outside_braces(s)))
    if len(found) != 1 or found[0].group(0) not in ("=", "\\in", "∈"):
        return None
    lhs, rhs = s[: found[0].start()], s[found[0].end() :]
    if not _ASSIGN_LHS.match(lhs) or not rhs.strip():
        return None
    variable = re.sub(r"\s+", "", lhs) + ("\\in" if found[0].group(0) != "=" else "")
    return variable, rhs.strip()


def finish(s: str, keep_spaces: bool) -> str:
    """Canonical spelling of a prepared answer: braced `\\frac`/`\\sqrt`, `.5` -> `0.5`, `1/2`
    -> `\\frac{1}{2}`, thousands separators removed; idempotent."""
    s = _brace_frac_sqrt(s.strip())
    s = _BARE_DECIMAL.sub(r"0.\1", s)
    if m := _INT_SLASH.match(s):
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = _strip_outer_braces(s)
    if m := _CHOICE.match(s):
        s = m.group(1)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.lstrip("+") if re.match(r"^\+\s*\d", s) else s
    return re.sub(r"\s+", " " if keep_spaces else "", s).strip()
