"""Math answer grading: extract the final answer, normalize it, decide equivalence.

Cheap checks (normalized strings, exact numbers, element-wise structure, plain words) run in
the caller. Only what they cannot decide goes to math-verify/sympy, in the persistent worker
process of `copes.envs.rewards._math_worker`, which enforces a hard per-pair timeout.

What earns the reward (issue 48) is a value, not a calculation: `grade_answer` credits an
answer that `is_equivalent` to the gold and leaves no more arithmetic undone than the gold does
(`_math_undone`): against a plain-number gold only a plain number (`79 * 86`, `9*2`, `\\frac{12}{2}`
never earn 6794, 18, 6), against a form (a fraction, a radical, an expression) no operation
between numbers the gold has not done (`\\frac{6}{8}` is not `\\frac{3}{4}`).

Exactness (issue 25): exact values compare exactly, and a decimal is the rational it writes,
however many digits it has (`0.5` = `\\frac12`, `2.50` = `2.5`, `1234567.1` != `1234567.9`,
`2.6667` != `\\frac83`, `0.0833333333333333` != `\\frac{1}{12}`, `4.123105625617661` !=
`\\sqrt{17}`). A tolerance applies only where the gold is itself an approximation, marked
`\\approx` (`\\approx 2.67`), and it is the gold's own stated precision: half a unit of its
last digit. A hedged or bounded prediction (`\\approx 5`, "about 5", `\\le 5`, `\\sim 5`) never
matches an unhedged gold, and an equation (`2x = 6`) never matches a plain value unless it
assigns a single variable (`x = 3` reads as `3`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction

from copes.envs.parsing import last_boxed
from copes.envs.rewards._math_normalize import (
    finish,
    has_percent,
    has_relation,
    leading_relation,
    loose_digits,
    prepare,
    relations,
    split_assignment,
)
from copes.envs.rewards._math_numbers import INTEGER, atom, canonical_int, to_number
from copes.envs.rewards._math_size import size_verdict
from copes.envs.rewards._math_undone import is_plain_number, undone_operations
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


# A leading `~5` in the raw answer is "about 5" (prepare drops `~` as TeX's tie space).
_TILDE_HEDGE = re.compile(r"^\s*(?:\$\s*)?~")
# The relations a leading one may be, by meaning (`\leq 5` is `\le 5`, `!= 5` is `\ne 5`).
_SAME_RELATION = {
    "\\leq": "\\le",
    "≤": "\\le",
    "\\leqslant": "\\le",
    "\\geq": "\\ge",
    "≥": "\\ge",
    "\\geqslant": "\\ge",
    "\\neq": "\\ne",
    "≠": "\\ne",
    "!=": "\\ne",
    "<": "\\lt",
    ">": "\\gt",
}

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
    kind, inner = "list", s
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif len(s) > 1 and s[0] in "([" and s[-1] in ")]":
        kind, inner = s[0] + s[-1], s[1:-1]
    elif "," not in s:
        return None
    items = _split_top_level(inner)
    if items is None and kind != "list":  # `(5,2),(7,2)`: a list of tuples, not one tuple
        kind, items = "list", _split_top_level(s)
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
    if {p_kind, g_kind} & _ORDERED and "set" in (p_kind, g_kind):
        return False  # a tuple or interval `(1, 2)` is not the set `\{1, 2\}`
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


def _drop_assignments(p: str, g: str) -> tuple[str, str]:
    """`x = 3` reads as `3` against a plain value, and both as values when both assign the
    same variable; against any other equation it stays an equation (`y = -x/2 + 3/4` is the
    line `2x + 4y - 3 = 0`, which the worker compares as equations)."""
    p_assign, g_assign = split_assignment(p), split_assignment(g)
    if p_assign and g_assign:
        return (p_assign[1], g_assign[1]) if p_assign[0] == g_assign[0] else (p, g)
    if p_assign and not has_relation(g):
        return p_assign[1], g
    if g_assign and not has_relation(p):
        return p, g_assign[1]
    return p, g


def _compare(p: str, g: str, depth: int = 0) -> bool | None:
    """Decide two prepared answers from strings, exact numbers and element-wise structure;
    None when only the symbolic check can."""
    p, g = _drop_assignments(p, g)
    return _decide(finish(p, keep_spaces=False), finish(g, keep_spaces=False), depth)


def _plain_number(s: str):
    """The value of a plain number, also in one pair of parentheses (`(1234.5)`); else None."""
    if len(s) > 2 and s[0] == "(" and s[-1] == ")":
        s = s[1:-1]
    return atom(s)


def _decide(p: str, g: str, depth: int) -> bool | None:
    """`_compare` on answers whose assignments are dropped and that are finished."""
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
        return p_atom == g_atom  # exact values, no tolerance (issue 25)
    if depth >= 3:
        return None
    p_struct, g_struct = _structure(p), _structure(g)
    if p_struct is not None and g_struct is not None:
        return _compare_structures(p_struct, g_struct, depth)
    # Several plain numbers against one (`1, 2` vs `2`, `(1,234.5)` vs `(1234.5)`: inside
    # brackets a comma separates elements) never match.
    for struct, other in ((p_struct, g), (g_struct, p)):
        if (
            struct is not None
            and _plain_number(other) is not None
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
    never `5000`; gold `50` never takes `0.5\\%`. A `%` on one side only of anything but plain
    numbers is False; None when both sides carry it alike (the answers then compare as written)."""
    p_pct, g_pct = has_percent(pred), has_percent(gold)
    if p_pct == g_pct:
        return None
    p_num, g_num = to_number(p), to_number(g)
    if p_num is None or g_num is None:  # `\sqrt{2}\%`, `5\% x`: the `%` may not vanish
        return False
    return p_num == g_num or (p_num / 100 if p_pct else g_num / 100) == (g_num if p_pct else p_num)


_INEQUALITIES = {"<", ">", "≤", "≥", "\\le", "\\ge", "\\leq", "\\geq", "\\lt", "\\gt"}
_INEQUALITIES |= {"\\leqslant", "\\geqslant"}


def _inequalities_vs_interval(relation: str, other: str) -> bool:
    """Whether `relation` is only inequalities and `other` (finished) an interval or a union."""
    struct = _structure(other)
    is_interval = "\\cup" in other or (struct is not None and struct[0] in _ORDERED)
    return is_interval and set(relations(relation)) <= _INEQUALITIES


def _cheap_verdict(pred: str, gold: str) -> tuple[bool | None, str, str]:
    """(verdict, pred, gold): True/False when strings, numbers or words decide, None when symbolic
    work is needed; with the two answers as the symbolic check gets them (prepared, spaced,
    assignments dropped)."""
    p_prep, g_prep = prepare(pred), prepare(gold)
    p_lead, g_lead = leading_relation(p_prep), leading_relation(g_prep)
    if p_lead or g_lead:  # `\le 5`, `\sim 5`, `!= 5` is a claim about a value, not the value
        if p_lead is None or g_lead is None:
            return False, p_prep, g_prep
        if _SAME_RELATION.get(p_lead, p_lead) != _SAME_RELATION.get(g_lead, g_lead):
            return False, p_prep, g_prep
        p_prep, g_prep = p_prep[len(p_lead) :].strip(), g_prep[len(g_lead) :].strip()
    p_drop, g_drop = _drop_assignments(p_prep, g_prep)
    spaced = finish(p_drop, keep_spaces=True), finish(g_drop, keep_spaces=True)
    p, g = finish(p_drop, keep_spaces=False), finish(g_drop, keep_spaces=False)
    if loose_digits(p_prep) or loose_digits(g_prep):  # `1 2` is neither `12` nor `12 3`
        return finish(p_prep, True) == finish(g_prep, True), *spaced
    percent = _percent_verdict(pred, gold, p, g)
    if percent is not None:
        return percent, *spaced
    if p and p == g:
        return True, *spaced
    # An equation is not a value (`2x = 6` vs `6`, `a + b = 10` vs `10`); a single-variable
    # assignment was dropped above. Lists compare element by element instead, and an inequality
    # chain may describe an interval (`0 < x < 1` vs `(0, 1)`): the symbolic check decides.
    p_rel, g_rel = has_relation(p_drop), has_relation(g_drop)
    if p_rel != g_rel and None in (_structure(p), _structure(g)):
        rel, other = (p_drop, g) if p_rel else (g_drop, p)
        if not _inequalities_vs_interval(rel, other):
            return False, *spaced
    verdict = _decide(p, g, 0)
    if verdict is not None:
        return verdict, *spaced
    p_words, g_words = finish(p_prep, True), finish(g_prep, True)
    # Plain words (`east`, `\text{Monday}`) compare case-insensitively; sympy would read them
    # as products of symbols (`east` == `seat`). Single letters stay symbolic: `x` is a variable.
    if _WORDS.match(p_words) and _WORDS.match(g_words) and max(len(p), len(g)) > 1:
        return p_words.casefold().split() == g_words.casefold().split(), *spaced
    if not (_braces_balanced(p) and _braces_balanced(g)):
        return False, *spaced
    return None, *spaced


def _approx_verdict(pred: str, gold: str, timeout: float) -> bool:
    """Gold marked approximate (`\\approx 2.67`): within half a unit of its last digit."""
    pred, gold = _APPROX.sub(" ", pred), _APPROX.sub(" ", gold)
    g = normalize_math_answer(gold)
    if not (INTEGER.match(g) or re.fullmatch(r"[+-]?\d*\.\d+", g)):  # `\approx 2\pi`: exact
        return _exact_verdict(pred, gold, timeout)
    half_unit = Fraction(1, 2 * 10 ** len(g.split(".")[1]) if "." in g else 2)
    p_prep = prepare(pred)
    assignment = split_assignment(p_prep)
    if assignment is None and has_relation(p_prep):  # `\le 2.67`, `\sim 2.67`: not a value
        return False
    p_value = assignment[1] if assignment else p_prep
    p = finish(p_value, keep_spaces=False)
    value = to_number(p)
    if value is not None:
        return abs(value - Fraction(g)) <= half_unit
    if not _braces_balanced(p) or len(pred) > _MAX_SYMBOLIC_CHARS:
        return False
    spaced = finish(p_value, keep_spaces=True)
    if size_verdict(spaced, Fraction(g)) is not None:  # power towers: no worker call
        return False
    return _symbolic_verdict(spaced, _tolerance_request(g, half_unit), timeout)


def _exact_verdict(pred: str, gold: str, timeout: float) -> bool:
    verdict, p, g = _cheap_verdict(pred, gold)
    if verdict is not None:
        return verdict
    size = size_verdict(p, to_number(g.replace(" ", "")))  # power towers: no worker call
    if size is not None:
        return size
    if max(len(pred), len(gold)) > _MAX_SYMBOLIC_CHARS:
        logger.debug("math grader: answer over %d chars, not equivalent", _MAX_SYMBOLIC_CHARS)
        return False
    return _symbolic_verdict(p, g, timeout)


def is_equivalent(pred: str, gold: str, timeout: float = 5.0) -> bool:
    """Whether `pred` equals `gold` mathematically; malformed input is False, never an error.

    `timeout` is CPU seconds of the grader worker for the symbolic check of this pair (waiting
    for the shared worker, or for a loaded machine, does not count). A pair that runs out of
    time counts as not equivalent. Raises RuntimeError only when the worker cannot start at
    all (sympy/math-verify missing): a broken install must not silently grade every answer as
    wrong.
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
        if _APPROX.search(pred) or _TILDE_HEDGE.match(pred):  # "\approx 5", "~5" is not 5
            return False
        return _exact_verdict(pred, gold, timeout)
    except RecursionError:
        logger.debug("math grader: answer nested too deeply, not equivalent")
        return False
    except Exception:  # a normalization bug must not crash a rollout
        logger.exception("math grader: normalization failed on pred=%.200r gold=%.200r", pred, gold)
        return False


# ---------------------------------------------------------------------------------------------
# What earns the reward: a value, with no arithmetic left undone (issue 48)


UNDONE_ARITHMETIC = "undone arithmetic"
NOT_A_NUMBER = "not a plain number"
FORM_CHECK_FAILED = "form check failed"  # a bug, logged; not counted as undone arithmetic
# An operation on numbers still written out: what tells `79 * 86` from prose around a number.
_OPERATION = re.compile(
    r"[\d)}\]]\s*[-+*/^!:]|[-+*/^]\s*[\d({\[]|\^|\\(?:times|cdot|div|frac|sqrt|sum|prod"
    r"|binom|choose|log|ln|lg|exp|sin|cos|tan|cot|sec|csc|int)(?![A-Za-z])"
)


@dataclass(frozen=True)
class MathVerdict:
    """The verdict on one answer against one gold.

    correct: what earns the reward: equivalent, and no more arithmetic left undone than the
        gold has. refused: why an answer of the gold's value was refused for its form:
        `UNDONE_ARITHMETIC` (`79 * 86` for 6794: what a policy drifting toward the
        grader-as-calculator hack produces, counted in every report) or `NOT_A_NUMBER` (prose
        around a plain-number gold's value, `\\pi` for `\\approx 3.14`); None otherwise.
    """

    correct: bool
    refused: str | None = None

    @property
    def undone_arithmetic(self) -> bool:
        return self.refused == UNDONE_ARITHMETIC


def _written_forms(answer: str, other: str) -> tuple[str, str]:
    """(compact, spaced) finished spelling of `answer` as the grader compares it with `other`:
    hedges and a leading relation dropped, an assignment read as its value where `other`
    would read it so."""
    answer, other = _APPROX.sub(" ", answer), _APPROX.sub(" ", other)
    a_prep, o_prep = prepare(answer), prepare(other)
    lead = leading_relation(a_prep)
    if lead:
        a_prep = a_prep[len(lead) :].strip()
    o_lead = leading_relation(o_prep)
    if o_lead:
        o_prep = o_prep[len(o_lead) :].strip()
    a_drop, _ = _drop_assignments(a_prep, o_prep)
    return finish(a_drop, keep_spaces=False), finish(a_drop, keep_spaces=True)


def form_refusal(pred: str, gold: str) -> str | None:
    """Why `pred`'s form cannot earn `gold` (None: it can). Against a plain-number gold only a
    plain number (`_math_undone.is_plain_number`) earns it; against any other gold, no more
    operations between rational constants than the gold has
    (`_math_undone.undone_operations`). Checked on answers of the gold's value."""
    if pred.strip() == gold.strip():
        return None
    g_compact, g_spaced = _written_forms(gold, pred)
    p_compact, p_spaced = _written_forms(pred, gold)
    if is_plain_number(g_compact):
        if is_plain_number(p_compact):
            return None
        return UNDONE_ARITHMETIC if _OPERATION.search(p_compact.lstrip("+-")) else NOT_A_NUMBER
    p_ops, g_ops = undone_operations(p_spaced), undone_operations(g_spaced)
    return UNDONE_ARITHMETIC if p_ops is not None and p_ops > (g_ops or 0) else None


def grade_answer(pred: str, gold: str, timeout: float = 5.0) -> MathVerdict:
    """What copes credits: `pred` equivalent to `gold` (`is_equivalent`) with no arithmetic
    left undone beyond the gold's (`form_refusal`). Malformed input is wrong, never an
    error."""
    if not is_equivalent(pred, gold, timeout=timeout):
        return MathVerdict(correct=False)
    try:
        refused = form_refusal(pred, gold)
    except Exception:  # a bug must not crash a rollout, nor credit what the check missed
        logger.exception("math grader: form check failed on pred=%.200r gold=%.200r", pred, gold)
        return MathVerdict(correct=False, refused=FORM_CHECK_FAILED)
    return MathVerdict(correct=refused is None, refused=refused)


def is_correct(pred: str, gold: str, timeout: float = 5.0) -> bool:
    """`grade_answer(pred, gold).correct`: the reward's verdict (ToolMath-v0's grader)."""
    return grade_answer(pred, gold, timeout=timeout).correct
