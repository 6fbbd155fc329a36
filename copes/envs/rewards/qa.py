"""Answer grading for open-domain and multi-hop QA: SQuAD normalization, exact match, F1.

The rules follow the official evaluation scripts so that our numbers are comparable with
published HotpotQA / 2Wiki / MuSiQue results:

- `normalize_answer` is the SQuAD v1.1 `normalize_answer` (lowercase, drop ASCII
  punctuation, drop the articles a/an/the, collapse whitespace), which the HotpotQA,
  2WikiMultihopQA and MuSiQue scripts reuse unchanged. Like the original, it keeps
  non-ASCII punctuation and accents ("Beyoncé" does not match "Beyonce").
- `f1_score` is the HotpotQA `f1_score`: token-overlap F1, and 0 when either side
  normalizes to yes/no/noanswer and the two differ (so "no" never earns partial credit
  against "yes, it is").
- Empty answers follow the SQuAD v2.0 script: if either side has no tokens after
  normalization, F1 is 1.0 when both are empty and 0.0 otherwise (consistent with EM).
- Several gold aliases: the score is the maximum over aliases.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})


def normalize_answer(s: str) -> str:
    """Normalize an answer the SQuAD way, so surface differences do not count as errors."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


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
    """1.0 if the normalized prediction equals any normalized gold alias, else 0.0."""
    normalized_pred = normalize_answer(pred)
    return float(any(normalized_pred == normalize_answer(g) for g in _as_golds(golds)))


def _f1_single(normalized_pred: str, normalized_gold: str) -> float:
    if normalized_pred != normalized_gold and (
        normalized_pred in _SPECIAL_ANSWERS or normalized_gold in _SPECIAL_ANSWERS
    ):
        return 0.0
    pred_tokens = normalized_pred.split()
    gold_tokens = normalized_gold.split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str, golds: Sequence[str] | str) -> float:
    """Token-overlap F1 of the prediction, maximised over gold aliases (HotpotQA rules)."""
    normalized_pred = normalize_answer(pred)
    return max(_f1_single(normalized_pred, normalize_answer(g)) for g in _as_golds(golds))
