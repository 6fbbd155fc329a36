"""Answer grading for open-domain and multi-hop QA: each benchmark's official EM and F1.

Published HotpotQA / 2Wiki / MuSiQue numbers come from each dataset's own script, and the
scripts disagree on edge cases, so a benchmark is graded by its own named rule (`QA_RULES`):

- `squad`: SQuAD v1.1's script (Rajpurkar et al. 2016). Token-overlap F1; an answer and a
  gold that are both empty after normalization share no token, so F1 = 0 (EM = 1).
- `hotpotqa`: hotpot_evaluate_v1.py (Yang et al. 2018). SQuAD v1.1's F1, plus: when either
  side normalizes to yes / no / noanswer and the two differ, F1 = 0 (no partial credit for
  "yes it is" against "yes").
- `2wiki`: 2wikimultihop_evaluate_v1.1.py (Ho et al. 2020): HotpotQA's rule.
- `musique`: MuSiQue's metrics/answer.py (Trivedi et al. 2022), SQuAD v2.0's F1: no yes/no
  rule, and when either side has no tokens F1 = 1 if both are empty, else 0.

What they share: SQuAD v1.1's `normalize_answer` (lowercase, drop ASCII punctuation, drop the
articles a/an/the, collapse whitespace; non-ASCII punctuation and accents are kept, so
"Beyoncé" does not match "Beyonce"), EM = the normalized strings are equal, and the maximum
over gold aliases (HotpotQA's script scores one gold; with aliases we take the maximum as the
others do). Since normalization is shared, maj@n votes with `normalize_answer` for every rule.

`BENCHMARK_QA_RULES` names each built-in benchmark's rule; any other benchmark (synthetic-qa,
user benchmarks) gets `DEFAULT_QA_RULE`, SQuAD v1.1. `tests/envs/test_qa_official.py` checks
every rule against the official scripts' scores on 471 cases.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})


def normalize_answer(s: str) -> str:
    """Normalize an answer the SQuAD way, so surface differences do not count as errors."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# ------------------------------------------------------------------ F1 on normalized strings
def _f1_squad_v1(pred: str, gold: str) -> float:
    """SQuAD v1.1: F1 of the token multisets; no common token (both empty included) is 0."""
    pred_tokens, gold_tokens = pred.split(), gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _f1_hotpotqa(pred: str, gold: str) -> float:
    """HotpotQA: a yes/no/noanswer on either side earns nothing unless the two are equal."""
    if pred != gold and (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS):
        return 0.0
    return _f1_squad_v1(pred, gold)


def _f1_squad_v2(pred: str, gold: str) -> float:
    """SQuAD v2.0 (MuSiQue): with an empty side, 1 if both are empty, else 0."""
    if not pred.split() or not gold.split():
        return float(pred.split() == gold.split())
    return _f1_squad_v1(pred, gold)


@dataclass(frozen=True)
class QARule:
    """One official scoring rule: `f1` scores a normalized prediction against one
    normalized gold; `script` names the official evaluation script it reproduces."""

    name: str
    f1: Callable[[str, str], float]
    script: str


QA_RULES: dict[str, QARule] = {
    rule.name: rule
    for rule in (
        QARule("squad", _f1_squad_v1, "SQuAD v1.1 evaluate-v1.1.py"),
        QARule("hotpotqa", _f1_hotpotqa, "HotpotQA hotpot_evaluate_v1.py"),
        QARule("2wiki", _f1_hotpotqa, "2WikiMultihopQA 2wikimultihop_evaluate_v1.1.py"),
        QARule("musique", _f1_squad_v2, "MuSiQue metrics/answer.py"),
        # FlashRAG's F1_Score applies HotpotQA's yes/no/noanswer rule to every dataset (and
        # scores two empty answers 0): its published numbers follow this rule.
        QARule("flashrag", _f1_hotpotqa, "FlashRAG flashrag/evaluator/metrics.py F1_Score"),
    )
}
DEFAULT_QA_RULE = "squad"
# FlashRAG's open-corpus versions are scored as FlashRAG scores them, to compare with its
# published numbers (for MuSiQue that differs from MuSiQue's own script).
BENCHMARK_QA_RULES: dict[str, str] = {
    "hotpotqa": "hotpotqa",
    "flashrag-hotpotqa": "flashrag",
    "2wiki": "2wiki",
    "flashrag-2wikimultihopqa": "flashrag",
    "musique": "musique",
    "flashrag-musique": "flashrag",
}


def get_qa_rule(name: str) -> QARule:
    """The rule called `name`; ValueError naming the known rules otherwise."""
    if name not in QA_RULES:
        raise ValueError(f"unknown QA rule {name!r}; known: {', '.join(QA_RULES)}")
    return QA_RULES[name]


def benchmark_qa_rule(benchmark: str) -> str:
    """The official rule of `benchmark` (a task's `source`); SQuAD v1.1 for any other."""
    return BENCHMARK_QA_RULES.get(benchmark, DEFAULT_QA_RULE)


def _as_golds(golds: Sequence[str] | str) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    golds = list(golds)
    if not golds:
        raise ValueError("no gold answers given; pass a string or a non-empty sequence of aliases")
    for gold in golds:
        if not isinstance(gold, str):
            raise TypeError(f"gold answers must be strings, got {type(gold).__name__}: {gold!r}")
    return golds


def exact_match(pred: str, golds: Sequence[str] | str) -> float:
    """1.0 if the normalized prediction equals any normalized gold alias, else 0.0 (the same
    in every rule)."""
    normalized_pred = normalize_answer(pred)
    return float(any(normalized_pred == normalize_answer(g) for g in _as_golds(golds)))


def f1_score(pred: str, golds: Sequence[str] | str, rule: str = DEFAULT_QA_RULE) -> float:
    """Token-overlap F1 of the prediction under `rule` (`QA_RULES`), maximised over aliases."""
    f1 = get_qa_rule(rule).f1
    normalized_pred = normalize_answer(pred)
    return max(f1(normalized_pred, normalize_answer(g)) for g in _as_golds(golds))
