"""`PoolRetriever`: BM25 over the 10-20 passages of one question (the distractor setting)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rank_bm25 import BM25Okapi

from copes.envs.retrieval.base import (
    BM25_B,
    BM25_K1,
    SearchHit,
    Tokenizer,
    check_k,
    passage_index_text,
    top_k_indices,
)
from copes.envs.tasks.base import Passage


class _LuceneIdfBM25(BM25Okapi):
    """BM25Okapi with the Lucene IDF, which is positive for every term.

    BM25Okapi's IDF `log((N - n + 0.5) / (n + 0.5))` is <= 0 for a term in half the
    passages or more and is then floored to `epsilon * mean_idf`. In a 10-passage
    distractor pool the question's key terms are often in most passages, so they all get
    the same tiny weight (or exactly 0) and the supporting passage cannot win.
    """

    def _calc_idf(self, nd: dict[str, int]) -> None:
        n_docs = self.corpus_size
        for word, df in nd.items():
            self.idf[word] = math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))
        self.average_idf = sum(self.idf.values()) / len(self.idf) if self.idf else 0.0


class PoolRetriever:
    """rank-bm25 over one question's candidate passages (the distractor setting)."""

    def __init__(
        self,
        passages: Sequence[Passage],
        tokenizer: Tokenizer | None = None,
        k1: float = BM25_K1,
        b: float = BM25_B,
    ) -> None:
        self.passages: tuple[Passage, ...] = tuple(passages)
        if not self.passages:
            raise ValueError("PoolRetriever needs at least one passage; got an empty pool")
        self.tokenizer = tokenizer or Tokenizer()
        corpus = [self.tokenizer(passage_index_text(p)) for p in self.passages]
        self._has_tokens = any(corpus)
        # rank-bm25 divides by the mean length; an all-empty pool can never match anyway.
        self._bm25 = _LuceneIdfBM25(corpus if self._has_tokens else [["\0"]], k1=k1, b=b)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Top-`k` passages of the pool for `query`; passages sharing no term are left out."""
        check_k(k)
        tokens = self.tokenizer(query)
        if not tokens or not self._has_tokens:
            return []
        scores = np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)
        return [SearchHit(self.passages[i], float(scores[i])) for i in top_k_indices(scores, k)]
