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

A build streams the corpus once: it commits every `commit_every` passages and at the end of
every shard, and records, just before each commit, how many passages are in and where the
corpus file resumes. A killed build restarts from its last commit (the index holds exactly
the committed passages; the passage file is cut back to match), and the finished index is
renamed into place only when complete, so no reader ever sees a half-built index.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from copes.envs.retrieval.base import (
    BM25_B,
    SearchHit,
    Tokenizer,
    check_k,
    passage_index_text,
)
from copes.envs.retrieval.corpus_files import (
    CorpusFormat,
    count_bytes,
    only_passages,
    read_corpus,
    resolve_format,
)
from copes.envs.retrieval.passage_store import PassageStore, PassageStoreWriter, StoredPassages
from copes.envs.tasks.base import Passage

logger = logging.getLogger(__name__)

TANTIVY_K1 = 1.2  # tantivy's Bm25Weight constant (tantivy/src/query/bm25.rs)
# Hits each shard returns, so that a tie at the top-k cut-off is ordered by corpus position.
# tantivy-py scores every matching passage whatever the limit, so 64 costs what 11 does; a
# larger tie (a one-word query of a common word) keeps tantivy's own order past 64.
TIE_CANDIDATES = 64
# Scores this close (relative) are one tie: float32 carries ~7 digits and each shard's IDF
# boost rounds on its own, so an exact tie across shards can differ in its last bit or two.
TIE_TOLERANCE = 1e-6
SHARD_SIZE = 2_000_000  # passages a shard: 11 for wiki-18's 21M, which 2 threads split evenly
FORMAT_VERSION = 2
META = "copes_index.json"
_STATE = "build_state.json"
SHARDS_DIR = "shards"
_CLAUSE_CACHE_SIZE = 1 << 16  # words whose per-shard clauses are kept
_FIELD = "body"
_POSITION = "pos"
_ANALYZER = "copes_pretokenized"


def _tantivy() -> Any:
    try:
        import tantivy
    except ImportError as err:  # pragma: no cover - tantivy is a dependency
        raise ImportError(
            "the tantivy backend needs the tantivy package: pip install tantivy"
        ) from err
    return tantivy


def _schema(tantivy: Any) -> Any:
    builder = tantivy.SchemaBuilder()
    # 'freq': doc ids and term frequencies, no positions (BM25 needs no phrases).
    builder.add_text_field(_FIELD, stored=False, tokenizer_name=_ANALYZER, index_option="freq")
    builder.add_unsigned_field(_POSITION, stored=False, indexed=False, fast=True)
    return builder.build()


def _open_tantivy(path: Path, schema: Any | None = None) -> Any:
    tantivy = _tantivy()
    if schema is None:
        index = tantivy.Index.open(str(path))
    else:
        index = tantivy.Index(schema, path=str(path), reuse=False)
    # Our tokens never hold whitespace ([^\W_]+ runs), so splitting on it gives them back.
    index.register_tokenizer(
        _ANALYZER, tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build()
    )
    return index


def default_threads() -> int:
    """Indexing threads: the cores left after the Python thread that tokenizes (1 to 4)."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def _idf(doc_freq: int, num_docs: int) -> float:
    """tantivy's (Lucene's) BM25 IDF."""
    return math.log(1.0 + (num_docs - doc_freq + 0.5) / (doc_freq + 0.5))


class _Shard:
    """One shard's tantivy searcher and its address -> corpus position table."""

    def __init__(self, path: Path) -> None:
        self.index = _open_tantivy(path)
        self.searcher = self.index.searcher()
        self.num_docs = self.searcher.num_docs
        self.segment_starts = [int(x) for x in np.load(_segments_path(path))]
        self.positions = np.load(_positions_path(path), mmap_mode="r")  # shared pages
        segments = self.searcher.num_segments
        if len(self.positions) != self.num_docs or len(self.segment_starts) != segments:
            raise ValueError(
                f"{path}: its position table does not match its segments (a copy of another "
                "build?); rebuild the index"
            )

    def position(self, address: Any) -> int:
        return int(self.positions[self.segment_starts[address.segment_ord] + address.doc])


def _positions_path(shard_dir: Path) -> Path:
    return shard_dir.with_name(shard_dir.name + ".positions.npy")


def _segments_path(shard_dir: Path) -> Path:
    return shard_dir.with_name(shard_dir.name + ".segments.npy")


def _write_positions(shard_dir: Path, start: int) -> None:
    """Write a finished shard's address -> position table.

    Asked of the searcher itself (every passage, ordered by its position field), so the
    table holds whatever segment order and sizes tantivy's merges left.
    """
    tantivy = _tantivy()
    searcher = _open_tantivy(shard_dir).searcher()
    total = searcher.num_docs
    segments = np.empty(total, dtype=np.int64)
    docs = np.empty(total, dtype=np.int64)
    chunk = 1 << 20
    everything = tantivy.Query.all_query()
    for offset in range(0, total, chunk):
        hits = searcher.search(
            everything,
            chunk,
            count=False,
            order_by_field=_POSITION,
            order=tantivy.Order.Asc,
            offset=offset,
        ).hits
        got = np.fromiter((p for p, _ in hits), np.int64, len(hits))
        if not np.array_equal(got, np.arange(start + offset, start + offset + len(hits))):
            raise ValueError(f"{shard_dir}: the shard does not hold passages {start}.. in order")
        segments[offset : offset + len(hits)] = [a.segment_ord for _, a in hits]
        docs[offset : offset + len(hits)] = [a.doc for _, a in hits]
    sizes = np.bincount(segments, minlength=searcher.num_segments)
    segment_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    positions = np.empty(total, dtype=np.uint32 if start + total < 2**32 else np.uint64)
    positions[segment_starts[segments] + docs] = np.arange(start, start + total)
    np.save(_segments_path(shard_dir), segment_starts)
    tmp = shard_dir.with_name(shard_dir.name + ".positions.tmp.npy")
    np.save(tmp, positions)
    os.replace(tmp, _positions_path(shard_dir))  # last: the mark of a finished shard


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
        self._tantivy = _tantivy()
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
        *,
        corpus_format: CorpusFormat = "auto",
        tokenizer: Tokenizer | None = None,
        heap_mb: int = 1024,
        threads: int | None = None,
        commit_every: int = 1_000_000,
        shard_size: int = SHARD_SIZE,
        restart: bool = False,
        overwrite: bool = False,
        show_progress: bool = True,
    ) -> TantivyRetriever:
        """Index `corpus` (a corpus file, see `corpus_files`, or Passages) into `index_dir`.

        Memory stays bounded by `heap_mb` (tantivy's indexing budget) plus tantivy's
        merges, whatever the corpus size. The build happens in `index_dir.building/`; if a
        build of the same corpus file was killed there, it resumes from its last commit
        (`restart=True` starts over). An existing `index_dir` is refused unless
        `overwrite=True`.
        """
        index_dir = Path(index_dir)
        if heap_mb < 16:
            raise ValueError(f"heap_mb must be at least 16 (MiB of indexing memory), got {heap_mb}")
        if commit_every < 1:
            raise ValueError(f"commit_every must be at least 1 passage, got {commit_every}")
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1 passage, got {shard_size}")
        threads = default_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if index_dir.exists() and any(index_dir.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{index_dir} already exists and is not empty; load it, or pass overwrite=True "
                "(--overwrite) to rebuild it"
            )
        tokenizer = tokenizer or Tokenizer()
        staging = index_dir.with_name(index_dir.name + ".building")
        source = _Source.of(corpus, corpus_format, tokenizer, shard_size)
        state = _resumable_state(staging, source, restart)
        if state is None:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / SHARDS_DIR).mkdir(parents=True)
            state = {"source": source.fingerprint, "checkpoints": []}
        build = _Build(staging, source, tokenizer, state, heap_mb, threads, commit_every)
        build.run(shard_size, show_progress)
        if index_dir.exists():
            shutil.rmtree(index_dir)
        staging.rename(index_dir)
        return cls.load(index_dir)

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
            _Shard(index_dir / SHARDS_DIR / _shard_name(number))
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
        term = tantivy.Query.term_query(self._schema, _FIELD, token, index_option="freq")
        should = tantivy.Occur.Should
        if len(self._shards) == 1:
            clauses = ((should, term),)
        else:
            freqs = [shard.searcher.doc_freq(_FIELD, token) for shard in self._shards]
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


def _shard_name(number: int) -> str:
    return f"{number:04d}"


def read_meta(index_dir: Path) -> dict[str, Any]:
    """The `copes_index.json` of a disk index, with one-line errors for a wrong folder."""
    meta_path = index_dir / META
    if not meta_path.is_file():
        hint = (
            f"; a build was interrupted in {index_dir}.building: run the same build again "
            "to resume it"
            if (index_dir.with_name(index_dir.name + ".building") / _STATE).is_file()
            else "; build one with copes-index build CORPUS OUT"
        )
        raise FileNotFoundError(f"{index_dir} is not a copes corpus index (no {META}){hint}")
    return json.loads(meta_path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class _Source:
    """The corpus being indexed and the fingerprint that says a resume is of the same one."""

    path: Path | None
    passages: Iterable[Passage] | None
    format: str
    fingerprint: dict[str, Any]

    @classmethod
    def of(
        cls, corpus: Any, corpus_format: CorpusFormat, tokenizer: Tokenizer, shard_size: int
    ) -> _Source:
        settings = {"remove_stopwords": tokenizer.remove_stopwords}
        if isinstance(corpus, (str, os.PathLike)):
            path = Path(corpus).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"corpus file {path} does not exist")
            fmt = resolve_format(path, corpus_format)
            stat = path.stat()
            fingerprint = {
                "path": str(path),
                "bytes": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "format": fmt,
                "tokenizer": settings,
                "shard_size": shard_size,
            }
            return cls(path, None, fmt, fingerprint)
        # An iterable cannot be re-read from a position: such builds restart, never resume.
        fingerprint = {"path": None, "tokenizer": settings, "shard_size": shard_size}
        return cls(None, corpus, "passages", fingerprint)

    def read(self, start_byte: int) -> Iterator[tuple[Passage, int]]:
        if self.path is not None:
            yield from read_corpus(self.path, self.format, start_byte)  # type: ignore[arg-type]
            return
        for passage in only_passages(self.passages or ()):
            yield passage, 0


def _resumable_state(staging: Path, source: _Source, restart: bool) -> dict[str, Any] | None:
    """The state of an interrupted build of this same corpus in `staging`, if any."""
    state_path = staging / _STATE
    if restart or source.path is None or not state_path.is_file():
        return None
    state = json.loads(state_path.read_text(encoding="utf-8"))
    if state.get("source") != source.fingerprint:
        raise ValueError(
            f"{staging} holds an interrupted build of another corpus or with other settings "
            f"({state.get('source')}); pass restart=True (--restart) to discard it"
        )
    return state


class _Build:
    """One pass over the corpus into `staging` (fresh or resumed), shard after shard."""

    def __init__(
        self,
        staging: Path,
        source: _Source,
        tokenizer: Tokenizer,
        state: dict[str, Any],
        heap_mb: int,
        threads: int,
        commit_every: int,
    ) -> None:
        self.staging, self.source, self.tokenizer, self.state = staging, source, tokenizer, state
        self.heap_mb, self.threads, self.commit_every = heap_mb, threads, commit_every
        self.shards = staging / SHARDS_DIR

    def run(self, shard_size: int, show_progress: bool) -> None:
        if not self.state["checkpoints"]:
            _write_json_atomic(self.staging / _STATE, self.state)
        committed = self._committed(shard_size)
        start_byte = self._resume_point(committed)
        store = PassageStoreWriter(self.staging)
        try:
            store.truncate(committed)
            if committed:
                logger.info("resuming the interrupted build at passage %d", committed)
            self._index_all(store, committed, start_byte, shard_size, show_progress)
            store.finish()
        except BaseException:
            store.close()
            raise
        if store.count == 0:
            raise ValueError("the corpus has no passages; nothing to index")
        starts = list(range(0, store.count, shard_size))
        for number, start in enumerate(starts):  # a resumed build's last shard, if killed
            path = self.shards / _shard_name(number)  # between its commit and its table
            if not _positions_path(path).is_file():
                _write_positions(path, start)
        meta = {
            "format_version": FORMAT_VERSION,
            "backend": "tantivy",
            "num_passages": store.count,
            "shard_size": shard_size,
            "shard_starts": starts,
            "tokenizer": {"remove_stopwords": self.tokenizer.remove_stopwords},
            "k1": TANTIVY_K1,
            "b": BM25_B,
            "tantivy_version": _tantivy_version(),
            "corpus": self.source.fingerprint,
        }
        (self.staging / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (self.staging / _STATE).unlink(missing_ok=True)

    def _committed(self, shard_size: int) -> int:
        """Passages tantivy has committed, shard by shard (shards are filled in order)."""
        total = 0
        for number in range(sum(1 for path in self.shards.iterdir() if path.is_dir()) + 1):
            path = self.shards / _shard_name(number)
            if not (path / "meta.json").is_file():
                shutil.rmtree(path, ignore_errors=True)  # made, never committed to
                break
            try:
                docs = _open_tantivy(path).searcher().num_docs
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"{self.staging}: the interrupted build cannot be opened ({err}); pass "
                    "restart=True (--restart) to build it over"
                ) from err
            total += docs
            if docs < shard_size:
                break
        return total

    def _resume_point(self, committed: int) -> int:
        """The corpus byte to read from, given how many passages tantivy has committed."""
        if committed == 0:
            self.state["checkpoints"] = []
            return 0
        for checkpoint in self.state["checkpoints"]:
            if checkpoint["passages"] == committed:
                return int(checkpoint["corpus_byte"])
        raise ValueError(
            f"{self.staging}: the index committed {committed} passages but no checkpoint says "
            "where the corpus resumes; pass restart=True (--restart) to build it over"
        )

    def _open_shard(self, number: int) -> Any:
        """A writer on shard `number`: the one a killed build left, or a new one."""
        path = self.shards / _shard_name(number)
        if (path / "meta.json").is_file():
            index = _open_tantivy(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
            index = _open_tantivy(path, _schema(_tantivy()))
        return index.writer(heap_size=self.heap_mb * 2**20, num_threads=self.threads)

    def _index_all(
        self,
        store: PassageStoreWriter,
        position: int,
        start_byte: int,
        shard_size: int,
        show: bool,
    ) -> None:
        tantivy = _tantivy()
        total_bytes = count_bytes(self.source.path) if self.source.path else None
        bar = tqdm(
            total=total_bytes,
            initial=start_byte if total_bytes else 0,
            unit="B",
            unit_scale=True,
            desc="Indexing",
            disable=not show,
            mininterval=2.0,
        )
        last_byte, started, done_at_start = start_byte, time.monotonic(), position
        tokenizer, commit_every = self.tokenizer, self.commit_every
        writer = None
        with bar:
            for passage, end_byte in self.source.read(start_byte):
                if writer is None:
                    writer = self._open_shard(position // shard_size)
                document = tantivy.Document()
                document.add_text(_FIELD, " ".join(tokenizer(passage_index_text(passage))))
                document.add_unsigned(_POSITION, position)
                writer.add_document(document)
                store.append(passage)
                position += 1
                if total_bytes:
                    bar.update(end_byte - last_byte)
                else:
                    bar.update(1)
                last_byte = end_byte
                if position % shard_size == 0 or position % commit_every == 0:
                    self._commit(writer, store, position, end_byte)
                    rate = (position - done_at_start) / max(1e-9, time.monotonic() - started)
                    bar.set_postfix(passages=f"{position:,}", per_s=f"{rate:,.0f}")
                if position % shard_size == 0:
                    self._finish_shard(writer, position // shard_size - 1, shard_size)
                    writer = None
            if writer is not None:
                self._commit(writer, store, position, last_byte)
                self._finish_shard(writer, (position - 1) // shard_size, shard_size)

    def _commit(self, writer: Any, store: PassageStoreWriter, passages: int, byte: int) -> None:
        """Passages on disk first, then the checkpoint, then tantivy's commit (see module)."""
        store.flush()
        self.state["checkpoints"].append({"passages": passages, "corpus_byte": byte})
        _write_json_atomic(self.staging / _STATE, self.state)
        writer.commit()

    def _finish_shard(self, writer: Any, number: int, shard_size: int) -> None:
        """Let tantivy's merges end (they move passages between segments), then write the
        shard's address -> position table."""
        writer.wait_merging_threads()
        _write_positions(self.shards / _shard_name(number), number * shard_size)


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tantivy_version() -> str:
    from importlib.metadata import version

    return version("tantivy")
