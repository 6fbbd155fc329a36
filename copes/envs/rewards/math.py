"""Math answer grading: extract the final answer, normalize it, decide equivalence.

Cheap checks (normalized strings, exact numbers, element-wise structure, plain words) run in
the caller. Only what they cannot decide goes to math-verify/sympy, in the persistent worker
process of `copes.envs.rewards._math_worker`, which enforces a hard per-pair timeout.

Exactness (issue 25): exact values compare exactly, and a decimal is the rational it writes
(`0.5` = `\\frac12`, `2.50` = `2.5`, `1234567.1` != `1234567.9`, `2.6667` != `\\frac83`). A
tolerance applies only where one side is itself an approximation, and it is that side's own
stated precision:
- a gold marked approximate (`\\approx 2.67`): within half a unit of its last digit;
- a float printout, a decimal of 15 or more significant digits (float64 holds 15.95; the
  Python tool prints 15 to 17): within one unit of its last digit, so `0.0833333333333333`
  meets `\\frac{1}{12}` and `4.123105625617661` meets `\\sqrt{17}`. A shorter decimal was
  rounded by its writer, not by the machine, and stays exact: `0.3333` != `\\frac13`.
A hedged prediction (`\\approx 5`, "about 5", "at least 5") never matches an unhedged gold.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from copes.envs.parsing import last_boxed
from copes.envs.rewards._math_normalize import (
    finish,
    has_percent,
    loose_digits,
    prepare,
    split_assignment,
)
from copes.envs.rewards._math_numbers import INTEGER, atom, canonical_int, float_unit, to_number
from copes.envs.rewards._math_worker import GRADER as _GRADER  # noqa: F401 (tests use it)
from copes.envs.rewards._math_worker import SymbolicGrader as _SymbolicGrader  # noqa: F401
from copes.envs.rewards._math_worker import symbolic_verdict as _symbolic_verdict

logger = logging.getLogger(__name__)

_MAX_SYMBOLIC_CHARS = 1000  # longer "answers" are garbage; the LaTeX parser crawls on them
# Longer answers are not equivalent to anything but an identical string, before any work:
# with the linear-time normalization this bounds the whole grading path together with the
# symbolic check's timeout. Above the longest exact number compared (`_math_numbers._MAX_DIGITS`).
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


def normalize_math_answer(s: str) -> str:
    """MATH-style canonical string of an answer, for cheap exact comparison (spaces removed).

    A single-variable assignment reads as its value (`x = 3` -> `3`), as MATH's reference does;
    the grader itself keeps an assignment when the other answer is an equation.
    """
    prepared = prepare(s)
    assignment = split_assignment(prepared)
    return finish(assignment[1] if assignment else prepared, keep_spaces=False)


# ---------------------------------------------------------------------------------------------
# Hedges: an approximate or bounded claim is not the value

_APPROX = re.compile(
    r"\\(?:approx|thickapprox)(?![A-Za-z])|≈"
    r"|(?<![A-Za-z])(?:approximately|approx|about|around|roughly|nearly|almost|circa)(?![A-Za-z])",
    re.IGNORECASE,
)
_BOUND = re.compile(
    r"(?<![A-Za-z])(?:at\s+least|at\s+most|more\s+than|less\s+than|fewer\s+than|greater\s+than"
    r"|up\s+to|or\s+more|or\s+less|or\s+fewer|or\s+so)(?![A-Za-z])",
    re.IGNORECASE,
)


_WORDS = re.compile(r"^[A-Za-z]+(?:[ '\-][A-Za-z]+)*$")


def _tolerance_request(value: str, tolerance: Fraction) -> str:
    """The worker's spelling of "within `tolerance` of `value`" (see `_math_worker`)."""
    return f"\\approx {value} \\pm {tolerance.numerator}/{tolerance.denominator}"


# ---------------------------------------------------------------------------------------------
# Structure: tuples, intervals, sets, lists

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
    return kind, [finish(item, keep_spaces=False) for item in items]


def _named(items: list[str]) -> dict[str, str] | None:
    """`a=4, b=5` as {a: 4, b: 5} when every element assigns a distinct variable."""
    pairs = [split_assignment(item) for item in items]
    if not all(pairs) or len({p[0] for p in pairs if p}) != len(pairs):
        return None
    return {p[0]: p[1] for p in pairs if p}


def _in_order(p_items: list[str], g_items: list[str], depth: int) -> bool | None:
    if len(p_items) != len(g_items):
        return False if all(atom(x) is not None for x in p_items + g_items) else None
    verdicts = [_compare(a, b, depth + 1) for a, b in zip(p_items, g_items, strict=True)]
    if False in verdicts:
        return False
    return True if all(verdicts) else None


def _compare_structures(
    p: tuple[str, list[str]], g: tuple[str, list[str]], depth: int
) -> bool | None:
    """Tuples and intervals compare in order. A bare list compares in order too, as MATH's
    reference `is_equiv` does (`10, 4, -2` != `4, 10, -2`), unless every element names its
    variable (`a=1, b=2` = `b=2, a=1`). A gold set `\\{...\\}` compares as a set."""
    (p_kind, p_items), (g_kind, g_items) = p, g
    if p_kind in _ORDERED and g_kind in _ORDERED:
        if p_kind != g_kind:
            return False if all(atom(x) is not None for x in p_items + g_items) else None
        return _in_order(p_items, g_items, depth)
    if g_kind == "list" and p_kind in ("list", "set"):
        p_named, g_named = _named(p_items), _named(g_items)
        if p_named is not None and g_named is not None:
            if p_named.keys() != g_named.keys():
                return False
            return _in_order(
                [p_named[k] for k in sorted(g_named)], [g_named[k] for k in sorted(g_named)], depth
            )
        return _in_order(p_items, g_items, depth)
    if g_kind == "set" and p_kind in ("list", "set"):  # unordered: set equality
        matrix = [[_compare(a, b, depth + 1) for b in g_items] for a in p_items]
        if any(v is None for row in matrix for v in row):
            return None
        return all(any(row) for row in matrix) and all(
            any(col) for col in zip(*matrix, strict=True)
        )
    return None


# ---------------------------------------------------------------------------------------------
# Pairwise comparison

_RELATION = re.compile(
    r"=|<|>|≤|≥|≠|\\(?:le|ge|leq|geq|neq|ne|lt|gt|leqslant|geqslant)(?![A-Za-z])"
)


def _drop_assignments(p: str, g: str) -> tuple[str, str]:
    """`x = 3` reads as `3` against a plain value, and both as values when both assign the
    same variable; against any other equation it stays an equation (`y = -x/2 + 3/4` is the
    line `2x + 4y - 3 = 0`, which the worker compares as equations)."""
    p_assign, g_assign = split_assignment(p), split_assignment(g)
    if p_assign and g_assign:
        return (p_assign[1], g_assign[1]) if p_assign[0] == g_assign[0] else (p, g)
    if p_assign and not _RELATION.search(g):
        return p_assign[1], g
    if g_assign and not _RELATION.search(p):
        return p, g_assign[1]
    return p, g


def _compare(p: str, g: str, depth: int = 0) -> bool | None:
    """Decide two normalized answers from strings, exact numbers and element-wise structure;
    None when only the symbolic check can."""
    p, g = _drop_assignments(p, g)
    p, g = finish(p, keep_spaces=False), finish(g, keep_spaces=False)
    if not p or not g:
        return False
    if p == g:
        return True
    if "\\circ" in p or "\\circ" in g:  # composition `f \circ g`: sympy has no such operator
        return False
    if INTEGER.match(p) and INTEGER.match(g):  # any size, no int() conversion limit
        return canonical_int(p) == canonical_int(g)
    p_atom, g_atom = atom(p), atom(g)
    if p_atom is not None and g_atom is not None:
        if p_atom == g_atom:
            return True
        units = [u for u in (float_unit(p), float_unit(g)) if u is not None]
        if not units or isinstance(p_atom, str) or isinstance(g_atom, str):
            return False
        return abs(p_atom - g_atom) <= max(units)
    if depth >= 3:
        return None
    p_struct, g_struct = _structure(p), _structure(g)
    if p_struct is not None and g_struct is not None:
        return _compare_structures(p_struct, g_struct, depth)
    # Several plain numbers against one (`1, 2` vs `2`) never match.
    for struct, single in ((p_struct, g_atom), (g_struct, p_atom)):
        if (
            struct is not None
            and single is not None
            and all(atom(x) is not None for x in struct[1])
        ):
            return False
    return None


def _braces_balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _percent_verdict(pred: str, gold: str, p: str, g: str) -> bool | None:
    """A `%` means /100 on the side that carries it only: gold `50\\%` takes `50` or `0.5`,
    never `5000`; gold `50` never takes `0.5\\%`. None unless both sides are plain numbers."""
    p_pct, g_pct = has_percent(pred), has_percent(gold)
    p_num, g_num = to_number(p), to_number(g)
    if p_pct == g_pct or p_num is None or g_num is None:
        return None
    return p_num == g_num or (p_num / 100 if p_pct else g_num / 100) == (g_num if p_pct else p_num)


def _cheap_verdict(pred: str, gold: str) -> bool | None:
    """True/False when strings, numbers or words decide; None when symbolic work is needed."""
    p_prep, g_prep = prepare(pred), prepare(gold)
    p, g = (finish(s, keep_spaces=False) for s in _drop_assignments(p_prep, g_prep))
    if loose_digits(p_prep) or loose_digits(g_prep):  # `1 2` is neither `12` nor `12 3`
        return finish(p_prep, keep_spaces=True) == finish(g_prep, keep_spaces=True)
    if p and p == g:
        return True
    percent = _percent_verdict(pred, gold, p, g)
    if percent is not None:
        return percent
    verdict = _compare(p_prep, g_prep)
    if verdict is not None:
        return verdict
    p_words, g_words = finish(p_prep, True), finish(g_prep, True)
    # Plain words (`east`, `\text{Monday}`) compare case-insensitively; sympy would read them
    # as products of symbols (`east` == `seat`). Single letters stay symbolic: `x` is a variable.
    if _WORDS.match(p_words) and _WORDS.match(g_words) and max(len(p), len(g)) > 1:
        return p_words.casefold().split() == g_words.casefold().split()
    if not (_braces_balanced(p) and _braces_balanced(g)):
        return False
    return None


def _approx_verdict(pred: str, gold: str, timeout: float) -> bool:
    """Gold marked approximate (`\\approx 2.67`): within half a unit of its last digit."""
    pred, gold = _APPROX.sub(" ", pred), _APPROX.sub(" ", gold)
    g = normalize_math_answer(gold)
    if not (INTEGER.match(g) or re.fullmatch(r"[+-]?\d*\.\d+", g)):  # `\approx 2\pi`: exact
        return _exact_verdict(pred, gold, timeout)
    half_unit = Fraction(1, 2 * 10 ** len(g.split(".")[1]) if "." in g else 2)
    p = normalize_math_answer(pred)
    value = to_number(p)
    if value is not None:
        return abs(value - Fraction(g)) <= half_unit
    if not _braces_balanced(p) or len(pred) > _MAX_SYMBOLIC_CHARS:
        return False
    spaced = finish(prepare(pred), keep_spaces=True)
    return _symbolic_verdict(spaced, _tolerance_request(g, half_unit), timeout)


def _exact_verdict(pred: str, gold: str, timeout: float) -> bool:
    try:
        verdict = _cheap_verdict(pred, gold)
    except RecursionError:  # deeply nested \frac: malformed, and its traceback is noise
        logger.debug("math grader: answer nested too deeply, not equivalent")
        return False
    if verdict is not None:
        return verdict
    if max(len(pred), len(gold)) > _MAX_SYMBOLIC_CHARS:
        logger.debug("math grader: answer over %d chars, not equivalent", _MAX_SYMBOLIC_CHARS)
        return False
    p, g = _drop_assignments(prepare(pred), prepare(gold))
    p, g = finish(p, keep_spaces=True), finish(g, keep_spaces=True)
    # A float printout against a closed form (`1.4142135623730951` vs `\sqrt{2}`).
    for printout, other in ((p, g), (g, p)):
        unit = float_unit(printout)
        if unit is not None and atom(other.replace(" ", "")) is None:
            return _symbolic_verdict(other, _tolerance_request(printout, unit), timeout)
    return _symbolic_verdict(p, g, timeout)


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
    if pred.strip() and pred.strip() == gold.strip():  # identical, even past the size cap
        return True
    if max(len(pred), len(gold)) > _MAX_ANSWER_CHARS:
        logger.debug("math grader: answer over %d chars, not equivalent", _MAX_ANSWER_CHARS)
        return False
    try:
        if _BOUND.search(pred) and not _BOUND.search(gold):  # "at least 5" is not 5
            return False
        if _APPROX.search(gold):
            return _approx_verdict(pred, gold, timeout)
        if _APPROX.search(pred):  # "\approx 5", "about 5" is not 5
            return False
        return _exact_verdict(pred, gold, timeout)
    except RecursionError:
        logger.debug("math grader: answer nested too deeply, not equivalent")
        return False
    except Exception:  # a normalization bug must not crash a rollout
        logger.exception("math grader: normalization failed on pred=%.200r gold=%.200r", pred, gold)
        return False
