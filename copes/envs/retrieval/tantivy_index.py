"""`TantivyRetriever`: BM25 over a Wikipedia-scale corpus, built by streaming, searched from disk.

Why tantivy (docs/design.md): bm25s holds every document's token ids and its score matrix in
RAM while building (10.3 GB at 1M passages here), so the 21M-passage Wikipedia of DPR and
Search-R1 does not fit a 24 GB machine, and its query time grows with the corpus. tantivy
is a Lucene-class inverted index in a Rust wheel (no Java, no server): it indexes a stream
of documents with a fixed memory budget, writes immutable segments, memory-maps them at
search time (every process on a machine shares one copy through the page cache) and
answers a top-k union query by skipping through posting lists instead of scoring every
passage.

Same tokens, same scoring rule, one constant differs:
- copes tokenizes (`Tokenizer`) in Python and hands tantivy the tokens joined by spaces,
  indexed with a whitespace tokenizer, so the index holds exactly the terms bm25s would;
  queries are tokenized the same way and become a union of term queries (no query syntax,
  so an agent's `"` or `:` cannot break a search).
- tantivy scores BM25 with the Lucene IDF and b = 0.75 like the other backends, but its k1
  is fixed at 1.2 (not configurable in tantivy), and it stores each passage's length in one
  byte (Lucene's lossy field norm), so lengths above ~40 tokens are rounded. The top-10
  agreement with exact BM25 is measured in benchmarks/retrieval_scale.py.

Shards, because tantivy-py cannot prune. Every tantivy-py search runs through a
MultiCollector, which scores every passage that holds a query word (tantivy's block-max
WAND only runs under a bare top-k collector): a query of common words costs time in
proportion to the corpus (measured: top-1, top-64 and a full count cost the same). The
corpus is therefore split into shards of `shard_size` consecutive passages, each its own
tantivy index, searched side by side on threads (tantivy releases the GIL). Scores stay
corpus-wide where tantivy allows: each word's IDF is the whole corpus's (a boost rescales
the shard's own IDF), while the length normalisation uses the shard's average length (not
settable from Python; it orders passages that exact BM25 ties by shard, see docs/retrieval.md).
A corpus of one shard scores exactly as one tantivy index. Hits are ordered by score, then
corpus position: each shard returns its best TIE_CANDIDATES, which costs what its best 10
cost, and a passage's position comes from a per-shard table (address -> position) written
when the shard is built.

Building (streamed, resumable) is `copes.envs.retrieval.tantivy_build`; the on-disk layout
both read is `copes.envs.retrieval.tantivy_format`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from copes.envs.retrieval.base import (
    SearchHit,
    Tokenizer,
    check_k,
)
from copes.envs.retrieval.passage_store import PassageStore, StoredPassages
from copes.envs.retrieval.tantivy_format import (
    FIELD,
    FORMAT_VERSION,
    SHARDS_DIR,
    open_tantivy,
    positions_path,
    read_meta,
    segments_path,
    shard_name,
    tantivy_module,
)
from copes.envs.tasks.base import Passage

# Hits each shard returns, so that a tie at the top-k cut-off is ordered by corpus position.
# tantivy-py scores every matching passage whatever the limit, so 64 costs what 11 does; a
# larger tie (a one-word query of a common word) keeps tantivy's own order past 64.
TIE_CANDIDATES = 64
# Scores this close (relative) are one tie: float32 carries ~7 digits and each shard's IDF
# boost rounds on its own, so an exact tie across shards can differ in its last bit or two.
TIE_TOLERANCE = 1e-6
_CLAUSE_CACHE_SIZE = 1 << 16  # words whose per-shard clauses are kept


def _idf(doc_freq: int, num_docs: int) -> float:
    """tantivy's (Lucene's) BM25 IDF."""
    return math.log(1.0 + (num_docs - doc_freq + 0.5) / (doc_freq + 0.5))


class _Shard:
    """One shard's tantivy searcher and its address -> corpus position table."""

    def __init__(self, path: Path) -> None:
        self.index = open_tantivy(path)
        self.searcher = self.index.searcher()
        self.num_docs = self.searcher.num_docs
        self.segment_starts = [int(x) for x in np.load(segments_path(path))]
        self.positions = np.load(positions_path(path), mmap_mode="r")  # shared pages
        segments = self.searcher.num_segments
        if len(self.positions) != self.num_docs or len(self.segment_starts) != segments:
            raise ValueError(
                f"{path}: its position table does not match its segments (a copy of another "
                "build?); rebuild the index"
            )

    def position(self, address: Any) -> int:
        return int(self.positions[self.segment_starts[address.segment_ord] + address.doc])


class TantivyRetriever(StoredPassages):
    """Sharded tantivy indexes plus a passage store; `build` once, then `load` anywhere."""

    def __init__(
        self,
        shards: list[_Shard],
        store: PassageStore,
        meta: dict[str, Any],
        index_dir: Path,
        search_threads: int | None = None,
    ):
        """Use `build` or `load`; this wires already-opened parts together."""
        self._tantivy = tantivy_module()
        self._shards = shards
        self._schema = shards[0].index.schema
        self._num_docs = sum(shard.num_docs for shard in shards)
        self._store = store
        self.meta = meta
        self.tokenizer = Tokenizer(**meta["tokenizer"])
        self.index_dir = index_dir
        threads = min(len(shards), os.cpu_count() or 1)
        if search_threads is not None:
            threads = search_threads
        if threads < 1:
            raise ValueError(f"search_threads must be at least 1, got {threads}")
        self.search_threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._clause_cache: dict[str, tuple[Any, ...]] = {}
        # Searches whose top-k cut-off fell in a tie, and those whose tie outgrew a shard's
        # candidates (their order past TIE_CANDIDATES is tantivy's; benchmarks report it).
        self.ties_at_cut_off = 0
        self.ties_beyond_candidates = 0

    # --- building ---------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        corpus: str | os.PathLike[str] | Iterable[Passage],
        index_dir: str | os.PathLike[str],
        **options: Any,
    ) -> TantivyRetriever:
        """Index `corpus` into `index_dir` (`copes.envs.retrieval.tantivy_build.build_index`:
        streamed, resumable, bounded memory), then `load` it."""
        from copes.envs.retrieval.tantivy_build import build_index

        return cls.load(build_index(corpus, index_dir, **options))

    # --- loading and searching ----------------------------------------------------------

    @classmethod
    def load(
        cls, index_dir: str | os.PathLike[str], *, search_threads: int | None = None
    ) -> TantivyRetriever:
        """Open a built index; its segments and passages are memory-mapped, not read.

        `search_threads` searches that many shards at once (default: one a core, up to
        the number of shards); 1 searches them one after the other.
        """
        index_dir = Path(index_dir)
        meta = read_meta(index_dir)
        if meta.get("backend") != "tantivy":
            raise ValueError(
                f"{index_dir} holds a {meta.get('backend', 'bm25s')} index, not a tantivy one; "
                "open it with copes.envs.retrieval.open_index"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{index_dir} has tantivy index format {meta.get('format_version')!r}, this "
                f"copes reads format {FORMAT_VERSION}; rebuild it with copes-index build"
            )
        shards = [
            _Shard(index_dir / SHARDS_DIR / shard_name(number))
            for number in range(len(meta["shard_starts"]))
        ]
        store = PassageStore(index_dir)
        retriever = cls(shards, store, meta, index_dir, search_threads)
        counts = [shard.num_docs for shard in shards]
        expected = [*np.diff([*meta["shard_starts"], meta["num_passages"]]).tolist()]
        if len(store) != meta["num_passages"] or counts != expected:
            raise ValueError(
                f"{index_dir}: the shards hold {counts} passages, the passage file {len(store)} "
                f"and the metadata {expected}; the index does not match its files, rebuild it"
            )
        return retriever

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Top-`k` passages for `query` (best first, ties by corpus position)."""
        check_k(k)
        tokens = self.tokenizer(query)
        if not tokens:
            return []
        limit = max(k + 1, TIE_CANDIDATES)
        work = self._shard_queries(tokens)
        found = self._search_shards(work, limit)
        scores = sorted((score for hits in found for score, _ in hits), reverse=True)
        if not scores:
            return []
        # Tie groups: each shard's IDF boost rounds in float32 on its own, so a tie between
        # shards can differ in its last bits; scores within TIE_TOLERANCE of the next higher
        # one are a tie, ordered by corpus position and reported with the group's top score.
        top_of: dict[float, float] = {}
        top = previous = scores[0]
        for number, score in enumerate(scores):
            if score < previous - TIE_TOLERANCE * abs(previous):
                if number >= k:
                    break
                top = score
            top_of.setdefault(score, top)
            previous = score
        floor = previous  # the lowest score of the k-th hit's group
        # Positions only for what can make the top k: the hits down to the k-th hit's group.
        ranked = []
        for (shard, _), hits in zip(work, found, strict=True):
            for score, address in hits:
                if score < floor:
                    break  # a shard's hits come best first
                ranked.append((-top_of[score], shard.position(address)))
        ranked.sort()
        if len(ranked) > k and ranked[k][0] == ranked[k - 1][0]:
            self.ties_at_cut_off += 1
            if any(len(hits) == limit and hits[-1][0] >= floor for hits in found):
                self.ties_beyond_candidates += 1
        return [SearchHit(self._store.passage(p), -s) for s, p in ranked[:k]]

    def _shard_queries(self, tokens: list[str]) -> list[tuple[_Shard, Any]]:
        """Each shard's union of term queries, from the per-word clauses (`_clauses`)."""
        per_word = [self._clauses(token) for token in tokens]
        tantivy = self._tantivy
        work = []
        for number, shard in enumerate(self._shards):
            clauses = [clauses[number] for clauses in per_word if clauses[number] is not None]
            if clauses:
                work.append((shard, tantivy.Query.boolean_query(clauses)))
        return work

    def _clauses(self, token: str) -> tuple[Any, ...]:
        """A word's clause in each shard's union (None where the shard lacks it), cached:
        agents repeat words. With several shards the clause carries the corpus's IDF: it
        is boosted by corpus IDF / shard IDF (document frequencies summed over shards)."""
        clauses = self._clause_cache.get(token)
        if clauses is not None:
            return clauses
        tantivy = self._tantivy
        term = tantivy.Query.term_query(self._schema, FIELD, token, index_option="freq")
        should = tantivy.Occur.Should
        if len(self._shards) == 1:
            clauses = ((should, term),)
        else:
            freqs = [shard.searcher.doc_freq(FIELD, token) for shard in self._shards]
            idf = _idf(sum(freqs), self._num_docs)
            clauses = tuple(
                (should, tantivy.Query.boost_query(term, idf / _idf(freq, shard.num_docs)))
                if freq
                else None
                for freq, shard in zip(freqs, self._shards, strict=True)
            )
        if len(self._clause_cache) >= _CLAUSE_CACHE_SIZE:
            self._clause_cache.clear()
        self._clause_cache[token] = clauses
        return clauses

    def _search_shards(self, work: list[tuple[_Shard, Any]], limit: int) -> list[list[Any]]:
        """Each shard's best `limit` (score, address). The calling thread and up to
        `search_threads - 1` pool threads take shards, largest first, until none is left
        (so a pool busy with another search never stalls this one)."""
        if len(work) <= 1 or self.search_threads == 1:
            return [shard.searcher.search(q, limit, count=False).hits for shard, q in work]
        results: list[list[Any]] = [[] for _ in work]
        queue = iter(sorted(range(len(work)), key=lambda i: -work[i][0].num_docs))
        lock = threading.Lock()

        def take_shards() -> None:
            while True:
                with lock:
                    number = next(queue, None)
                if number is None:
                    return
                shard, query = work[number]
                results[number] = shard.searcher.search(query, limit, count=False).hits

        pool = self._thread_pool()
        helpers = [pool.submit(take_shards) for _ in range(min(self.search_threads, len(work)) - 1)]
        take_shards()
        for helper in helpers:
            helper.result()
        return results

    def _thread_pool(self) -> ThreadPoolExecutor:
        """The search threads, made in the process that searches (a forked child gets its
        own: threads do not survive a fork)."""
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(
                    self.search_threads - 1, thread_name_prefix="copes-search"
                )
                self._pool_pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Stop the search threads and unmap the passage file."""
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None
        super().close()
