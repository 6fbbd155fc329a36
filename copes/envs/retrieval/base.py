"""What every retrieval backend shares: the tokenizer, the scoring constants, a hit, the protocol.

All copes backends tokenize the same way (`Tokenizer`) and score with BM25 with the Lucene
IDF `log(1 + (N - n + 0.5) / (n + 0.5))`, b = 0.75; k1 is 1.5 except in the tantivy backend,
whose engine fixes it at 1.2 (docs/retrieval.md). Ties go to the earlier passage, so results
are deterministic.
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass
from itertools import filterfalse
from typing import Protocol, runtime_checkable

import numpy as np

from copes.envs.tasks.base import Passage

BM25_K1 = 1.5
BM25_B = 0.75

# Deliberately small: function words and question words only. Content words that appear in
# titles ("first", "after", "before") are kept, and so are "I" and "II" (World War I).
# fmt: off
ENGLISH_STOPWORDS: frozenset[str] = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "did", "do", "does", "for",
    "from", "had", "has", "have", "he", "her", "his", "how", "if", "in", "into", "is",
    "it", "its", "of", "on", "or", "she", "so", "than", "that", "the", "their", "them", "then",
    "there", "these", "they", "this", "to", "was", "we", "were", "what", "when", "where",
    "which", "while", "who", "whom", "whose", "why", "will", "with", "you", "your",
})
# fmt: on

_TOKEN = re.compile(r"[^\W_]+")
_ASCII_SEPARATORS = bytes(
    b if chr(b) in string.ascii_lowercase + string.digits else ord(" ") for b in range(256)
)


@dataclass(frozen=True)
class Tokenizer:
    """Lowercased alphanumeric tokens, accents folded, optional stopword removal.

    One instance is used for both indexing and querying; `CorpusRetriever` stores its
    settings next to the index so a loaded index tokenizes queries the way it was built.
    """

    remove_stopwords: bool = True

    def __call__(self, text: str) -> list[str]:
        text = text.lower()
        if not text.isascii():  # fold accents so "Beyonce" finds "Beyoncé"
            text = "".join(
                ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch)
            )
        if text.isascii():
            # The same runs as the regex, 10x faster: every ASCII byte that is not [a-z0-9]
            # becomes a space (the Wikipedia-scale build tokenizes 2 billion words).
            tokens = text.encode("ascii").translate(_ASCII_SEPARATORS).decode("ascii").split()
        else:
            tokens = _TOKEN.findall(text)
        if self.remove_stopwords:
            return list(filterfalse(ENGLISH_STOPWORDS.__contains__, tokens))
        return tokens


@dataclass(frozen=True)
class SearchHit:
    """One retrieved passage and its BM25 score (higher is better; > 0 for every hit)."""

    passage: Passage
    score: float


@runtime_checkable
class Retriever(Protocol):
    """What the search tool needs: the top-`k` passages for a free-text query."""

    def search(self, query: str, k: int) -> list[SearchHit]: ...


def passage_index_text(passage: Passage) -> str:
    """Text indexed for a passage: the title counts, since queries often name the entity."""
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


def check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer (number of hits), got {k!r}")


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` best positive scores, best first, ties by lower index.

    Deterministic even at the cut-off: among passages tied with the k-th score, the
    earliest ones are kept.
    """
    positive = np.flatnonzero(scores > 0)
    if len(positive) > k:
        kth = np.partition(scores[positive], len(positive) - k)[len(positive) - k]
        above = positive[scores[positive] > kth]
        tied = positive[scores[positive] == kth][: k - len(above)]
        positive = np.concatenate([above, tied])
    order = np.lexsort((positive, -scores[positive]))
    return positive[order]
