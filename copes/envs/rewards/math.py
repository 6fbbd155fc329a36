"""Math answer grading: extract the final answer, normalize it, decide equivalence.

Cheap checks (normalized string equality, exact/toleranced numbers, plain words) run in the
caller. Only what they cannot decide goes to math-verify/sympy, in the persistent worker
process of `copes.envs.rewards._math_worker`, which enforces a hard per-pair timeout.
"""

from __future__ import annotations

import logging
import math
import re
import unicodedata
from fractions import Fraction

from copes.envs.parsing import last_boxed
from copes.envs.rewards._math_worker import GRADER as _GRADER  # noqa: F401 (tests use it)
from copes.envs.rewards._math_worker import SymbolicGrader as _SymbolicGrader  # noqa: F401
from copes.envs.rewards._math_worker import symbolic_verdict as _symbolic_verdict

logger = logging.getLogger(__name__)

REL_TOL = 1e-6  # relative tolerance when either number is written as a decimal
_MAX_SYMBOLIC_CHARS = 1000  # longer "answers" are garbage; the LaTeX parser crawls on them
# Longer answers are not equivalent to anything, before any work: with the linear-time
# normalization this bounds the whole grading path (normalization included) together with
# the symbolic check's timeout. Above the longest exact number compared (_MAX_DIGITS).
_MAX_ANSWER_CHARS = 10_000

# ---------------------------------------------------------------------------------------------
# Answer extraction


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last `<answer>` tag (its box if boxed), else last box.

    An `<answer>` opened after the last closed one and never closed counts too: generation
    often stops on the `</answer>` stop string, which the engine strips from the output.
    """
    if not isinstance(text, str) or not text:
        return None
    content = None
    closed = list(_ANSWER_TAG.finditer(text))
    tail_from = closed[-1].end() if closed else 0
    open_at = text.rfind("<answer>", tail_from)
    if open_at >= 0:
        content = text[open_at + len("<answer>") :]
    elif closed:
        content = closed[-1].group(1)
    if content is not None:
        boxed = last_boxed(content)
        answer = (boxed if boxed is not None else content).strip()
        return answer or None
    boxed = last_boxed(text)
    return boxed.strip() if boxed is not None and boxed.strip() else None


# ---------------------------------------------------------------------------------------------
# Normalization. Rules follow the MATH reference `is_equiv`/`_strip_string` (Hendrycks et al.
# 2021, "Measuring Mathematical Problem Solving With the MATH Dataset"), written afresh, plus
# a few extras: thousands separators, single-variable assignments, `\text{...}` unwrapping.

_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|°")
_TEXT_CMD = r"\\(?:text|textrm|textbf|textit|mbox|mathrm)\s*"
# A trailing unit: `5 \text{ cm}`, `5\mbox{ inches}^2`; letters, spaces and dots only.
_TRAILING_UNIT = re.compile(_TEXT_CMD + r"\{\s*[A-Za-z][A-Za-z .]*\}\s*(?:\^\s*\{?\d\}?)?\s*$")
_TEXT_WRAP = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_ASSIGN_LHS = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*$")
_FRAC_SQRT = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_BARE_DECIMAL = re.compile(r"(?<![\d.])\.(\d)")
_ANY_DIGIT = re.compile(r"\d")  # Unicode decimal digits of every script
_INT_POWER = re.compile(r"^([+-]?)(\d+)\^\{?(\d{1,4})\}?$")  # 10^3, 2^{10}, -2^2 = -4
_INT_SLASH = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_CHOICE = re.compile(r"^\(([A-Za-z])\)$")


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


def _normalize(s: str, keep_spaces: bool) -> str:
    if not isinstance(s, str):
        return ""
    s = _ascii_digits(s.strip())
    if s.startswith(("\\boxed", "\\fbox")):
        s = last_boxed(s) or s
    s = s.replace("\n", " ").replace("\\displaystyle", "")
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    if not _TEXT_WRAP.fullmatch(s.strip()):  # a lone `\text{east}` is the answer, not a unit
        s = _TRAILING_UNIT.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _TEXT_WRAP.sub(lambda m: m.group(1), s)
    s = s.replace("{,}", ",").strip().rstrip(".").strip()
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _ASSIGN_LHS.match(lhs) and rhs.strip():
            s = rhs.strip()
    s = _brace_frac_sqrt(s)
    s = _BARE_DECIMAL.sub(r"0.\1", s)
    if m := _INT_SLASH.match(s):
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = _strip_outer_braces(s)
    if m := _CHOICE.match(s):
        s = m.group(1)
    if _THOUSANDS.match(s.replace(" ", "")):
        s = s.replace(",", "")
    s = s.lstrip("+") if re.match(r"^\+\s*\d", s) else s
    return re.sub(r"\s+", " " if keep_spaces else "", s).strip()


def normalize_math_answer(s: str) -> str:
    """MATH-style canonical string of an answer, for cheap exact comparison (spaces removed)."""
    return _normalize(s, keep_spaces=False)


# ---------------------------------------------------------------------------------------------
# Cheap checks

_INT = re.compile(r"^[+-]?\d+$")
_DECIMAL = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d{1,3})$")
_FRAC_NUM = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")
_WORDS = re.compile(r"^[A-Za-z]+(?:[ '\-][A-Za-z]+)*$")
_MAX_DIGITS = 4000  # below CPython's int/str conversion limit (4300)


def _canonical_int(s: str) -> str:
    sign = "-" if s.startswith("-") else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def _to_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, exact) for plain integers, decimals and integer fractions; None otherwise."""
    if len(s) > _MAX_DIGITS:
        return None
    if _INT.match(s):
        return Fraction(int(s)), True
    if m := _INT_POWER.match(s):  # an integer power, so `10^3` meets `1e3` and `1000`
        base, exponent = int(m.group(2)), int(m.group(3))
        if base > 1 and exponent * math.log10(base) > _MAX_DIGITS:
            return None
        value = Fraction(base**exponent)
        return (-value if m.group(1) == "-" else value), True
    if _DECIMAL.match(s):
        return Fraction(s), False
    if m := _FRAC_NUM.match(s):
        den = int(m.group(3))
        if den == 0:
            return None
        value = Fraction(int(m.group(2)), den)
        return (-value if m.group(1) == "-" else value), True
    return None


def _numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    (x, x_exact), (y, y_exact) = a, b
    if x == y:
        return True
    if x_exact and y_exact:
        return False
    return abs(x - y) <= Fraction(str(REL_TOL)) * max(abs(x), abs(y))


_INFINITY = {"\\infty": "+", "+\\infty": "+", "-\\infty": "-", "\\inf": "+", "-\\inf": "-"}
_Atom = tuple[Fraction, bool] | str


def _atom(s: str) -> _Atom | None:
    """A plain number as (value, exact), an infinity as its sign, else None."""
    return _INFINITY.get(s) or _to_number(s)


def _atoms_equal(a: _Atom, b: _Atom) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return _numbers_equal(a, b)


_ORDERED = {"()", "[]", "(]", "[)"}  # tuples and intervals: order and brackets matter
_MAX_ELEMENTS = 64


def _split_top_level(s: str) -> list[str] | None:
    """Split on commas outside brackets; None when a bracket closes that never opened."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    items.append(s[start:])
    return items if depth == 0 else None


def _structure(s: str) -> tuple[str, list[str]] | None:
    """(kind, elements) of a tuple, interval, set or bare comma list; None otherwise."""
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif len(s) > 1 and s[0] in "([" and s[-1] in ")]":
        kind, inner = s[0] + s[-1], s[1:-1]
    elif "," in s:
        kind, inner = "list", s
    else:
        return None
    items = _split_top_level(inner)
    if items is None or not 2 <= len(items) <= _MAX_ELEMENTS:
        return None
    return kind, [normalize_math_answer(item) for item in items]


def _compare_structures(
    p: tuple[str, list[str]], g: tuple[str, list[str]], depth: int
) -> bool | None:
    (p_kind, p_items), (g_kind, g_items) = p, g
    if p_kind in _ORDERED and g_kind in _ORDERED:
        if p_kind != g_kind or len(p_items) != len(g_items):
            all_atoms = all(_atom(x) is not None for x in p_items + g_items)
            return False if all_atoms else None  # `[1,2)` vs `[1,2]`
        verdicts = [
            _compare_normalized(a, b, depth + 1) for a, b in zip(p_items, g_items, strict=True)
        ]
        if False in verdicts:
            return False
        return True if all(verdicts) else None
    if p_kind == g_kind or {p_kind, g_kind} == {"set", "list"}:  # unordered: set equality
        matrix = [[_compare_normalized(a, b, depth + 1) for b in g_items] for a in p_items]
        if any(v is None for row in matrix for v in row):
            return None
        return all(any(row) for row in matrix) and all(
            any(col) for col in zip(*matrix, strict=True)
        )
    return None


def _compare_normalized(p: str, g: str, depth: int = 0) -> bool | None:
    """Decide two normalized answers from strings, numbers and element-wise structure."""
    if not p or not g:
        return False
    if p == g:
        return True
    if _INT.match(p) and _INT.match(g):  # any size, no int() conversion limit
        return _canonical_int(p) == _canonical_int(g)
    p_atom, g_atom = _atom(p), _atom(g)
    if p_atom is not None and g_atom is not None:
        return _atoms_equal(p_atom, g_atom)
    if depth >= 3:
        return None
    p_struct, g_struct = _structure(p), _structure(g)
    if p_struct is not None and g_struct is not None:
        return _compare_structures(p_struct, g_struct, depth)
    # Several plain numbers against one (`1, 2` vs `2`) never match.
    for struct, atom in ((p_struct, g_atom), (g_struct, p_atom)):
        if struct is not None and atom is not None and all(_atom(x) for x in struct[1]):
            return False
    return None


def _braces_balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _cheap_verdict(pred: str, gold: str) -> bool | None:
    """True/False when strings, numbers or words decide; None when symbolic work is needed."""
    p, g = normalize_math_answer(pred), normalize_math_answer(gold)
    verdict = _compare_normalized(p, g)
    if verdict is False and ("%" in pred or "%" in gold):  # `50\%` also matches `0.5`
        p_num, g_num = _to_number(p), _to_number(g)
        if p_num is not None and g_num is not None:
            p_scaled, g_scaled = (p_num[0] / 100, p_num[1]), (g_num[0] / 100, g_num[1])
            return _numbers_equal(p_scaled, g_num) or _numbers_equal(p_num, g_scaled)
    if verdict is not None:
        return verdict
    p_words, g_words = _normalize(pred, True), _normalize(gold, True)
    # Plain words (`east`, `\text{Monday}`) compare case-insensitively; sympy would read them
    # as products of symbols (`east` == `seat`). Single letters stay symbolic: `x` is a variable.
    if _WORDS.match(p_words) and _WORDS.match(g_words) and max(len(p), len(g)) > 1:
        return p_words.casefold().split() == g_words.casefold().split()
    if not (_braces_balanced(p) and _braces_balanced(g)):
        return False
    return None


def is_equivalent(pred: str, gold: str, timeout: float = 5.0) -> bool:
    """Whether `pred` equals `gold` mathematically; malformed input is False, never an error.

    `timeout` bounds the symbolic check of this pair (waiting for the shared worker does not
    count). A pair that runs out of time counts as not equivalent. Raises RuntimeError only
    when the worker cannot start at all (sympy/math-verify missing): a broken install must
    not silently grade every answer as wrong.
    """
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    if max(len(pred), len(gold)) > _MAX_ANSWER_CHARS:
        logger.debug("math grader: answer over %d chars, not equivalent", _MAX_ANSWER_CHARS)
        return False
    try:
        verdict = _cheap_verdict(pred, gold)
    except RecursionError:  # deeply nested \frac: malformed, and its traceback is noise
        logger.debug("math grader: answer nested too deeply, not equivalent")
        return False
    except Exception:  # a normalization bug must not crash a rollout
        logger.exception("math grader: normalization failed on pred=%.200r gold=%.200r", pred, gold)
        return False
    if verdict is not None:
        return verdict
    if max(len(pred), len(gold)) > _MAX_SYMBOLIC_CHARS:
        logger.debug("math grader: answer over %d chars, not equivalent", _MAX_SYMBOLIC_CHARS)
        return False
    return _symbolic_verdict(_normalize(pred, True), _normalize(gold, True), timeout)
