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

A build streams the corpus once: it commits every `commit_every` passages and records, just
before each commit, how many passages are in and where the corpus file resumes. A killed
build restarts from its last commit (the index holds exactly the committed passages; the
passage file is cut back to match), and the finished index is renamed into place only when
complete, so no reader ever sees a half-built index.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
# Hits fetched once more when a tie crosses the top-k cut-off, to order it by corpus
# position. A larger tie (a one-word query of a common word) keeps tantivy's own order past
# this many hits: fetching all of it cost 6x the p95 latency at 100k passages.
TIE_CANDIDATES = 64
FORMAT_VERSION = 1
META = "copes_index.json"
_STATE = "build_state.json"
_TANTIVY_DIR = "tantivy"
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


class TantivyRetriever(StoredPassages):
    """A tantivy index plus its passage store; `build` once, then `load` in every process."""

    def __init__(self, index: Any, store: PassageStore, meta: dict[str, Any], index_dir: Path):
        """Use `build` or `load`; this wires already-opened parts together."""
        self._tantivy = _tantivy()
        self._index = index
        self._schema = index.schema
        self._searcher = index.searcher()
        self._store = store
        self.meta = meta
        self.tokenizer = Tokenizer(**meta["tokenizer"])
        self.index_dir = index_dir
        # Searches whose top-k cut-off fell in a tie, and those whose tie outgrew the
        # candidates (their order past TIE_CANDIDATES is tantivy's; benchmarks report it).
        self.tie_refetches = 0
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
        source = _Source.of(corpus, corpus_format, tokenizer)
        state = _resumable_state(staging, source, restart)
        if state is None:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / _TANTIVY_DIR).mkdir(parents=True)
            state = {"source": source.fingerprint, "checkpoints": []}
        _Build(staging, source, tokenizer, state, heap_mb, threads, commit_every).run(show_progress)
        if index_dir.exists():
            shutil.rmtree(index_dir)
        staging.rename(index_dir)
        return cls.load(index_dir)

    # --- loading and searching ----------------------------------------------------------

    @classmethod
    def load(cls, index_dir: str | os.PathLike[str]) -> TantivyRetriever:
        """Open a built index; its segments and passages are memory-mapped, not read."""
        index_dir = Path(index_dir)
        meta = read_meta(index_dir)
        if meta.get("backend") != "tantivy":
            raise ValueError(
                f"{index_dir} holds a {meta.get('backend', 'bm25s')} index, not a tantivy one; "
                "open it with copes.envs.retrieval.open_index"
            )
        index = _open_tantivy(index_dir / _TANTIVY_DIR)
        store = PassageStore(index_dir)
        retriever = cls(index, store, meta, index_dir)
        if len(store) != meta["num_passages"] or retriever._searcher.num_docs != len(store):
            raise ValueError(
                f"{index_dir}: the index holds {retriever._searcher.num_docs} passages, the "
                f"passage file {len(store)} and the metadata {meta['num_passages']}; rebuild it"
            )
        return retriever

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Top-`k` passages for `query` (best first, ties by corpus position)."""
        check_k(k)
        tokens = self.tokenizer(query)
        if not tokens:
            return []
        tantivy = self._tantivy
        clauses = [
            (tantivy.Occur.Should, tantivy.Query.term_query(self._schema, _FIELD, token))
            for token in tokens
        ]
        query = tantivy.Query.boolean_query(clauses)
        hits = self._searcher.search(query, k + 1, count=False).hits
        # tantivy orders equal scores by its own document order, which depends on how the
        # build split the corpus into segments (threads, commits, a resume). When a tie
        # crosses the cut-off, fetch up to TIE_CANDIDATES hits so the earliest passages of
        # the tie win, as in the other backends.
        if len(hits) > k and hits[k][0] == hits[k - 1][0] and k + 1 < TIE_CANDIDATES:
            self.tie_refetches += 1
            hits = self._searcher.search(query, TIE_CANDIDATES, count=False).hits
            if len(hits) == TIE_CANDIDATES and hits[-1][0] == hits[k - 1][0]:
                self.ties_beyond_candidates += 1
        if not hits:
            return []
        positions = self._searcher.fast_field_values(_POSITION, [address for _, address in hits])
        scores = [score for score, _ in hits]
        ranked = sorted(zip(positions, scores, strict=True), key=lambda h: (-h[1], h[0]))[:k]
        return [SearchHit(self._store.passage(int(p)), float(s)) for p, s in ranked]


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
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{index_dir} has index format {meta.get('format_version')!r}, this copes reads "
            f"format {FORMAT_VERSION}; rebuild it"
        )
    return meta


@dataclass(frozen=True)
class _Source:
    """The corpus being indexed and the fingerprint that says a resume is of the same one."""

    path: Path | None
    passages: Iterable[Passage] | None
    format: str
    fingerprint: dict[str, Any]

    @classmethod
    def of(cls, corpus: Any, corpus_format: CorpusFormat, tokenizer: Tokenizer) -> _Source:
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
            }
            return cls(path, None, fmt, fingerprint)
        # An iterable cannot be re-read from a position: such builds restart, never resume.
        return cls(None, corpus, "passages", {"path": None, "tokenizer": settings})

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
    """One pass over the corpus into `staging` (fresh or resumed)."""

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

    def run(self, show_progress: bool) -> None:
        tantivy_dir = self.staging / _TANTIVY_DIR
        if self.state["checkpoints"]:
            try:
                index = _open_tantivy(tantivy_dir)
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"{self.staging}: the interrupted build cannot be opened ({err}); pass "
                    "restart=True (--restart) to build it over"
                ) from err
        else:
            index = _open_tantivy(tantivy_dir, _schema(_tantivy()))
            _write_json_atomic(self.staging / _STATE, self.state)
        committed = index.searcher().num_docs
        start_byte = self._resume_point(committed)
        writer = index.writer(heap_size=self.heap_mb * 2**20, num_threads=self.threads)
        store = PassageStoreWriter(self.staging)
        try:
            store.truncate(committed)
            if committed:
                logger.info("resuming the interrupted build at passage %d", committed)
            self._index_all(writer, store, committed, start_byte, show_progress)
            writer.wait_merging_threads()
            store.finish()
        except BaseException:
            store.close()
            raise
        meta = {
            "format_version": FORMAT_VERSION,
            "backend": "tantivy",
            "num_passages": store.count,
            "tokenizer": {"remove_stopwords": self.tokenizer.remove_stopwords},
            "k1": TANTIVY_K1,
            "b": BM25_B,
            "tantivy_version": _tantivy_version(),
            "corpus": self.source.fingerprint,
        }
        if store.count == 0:
            raise ValueError("the corpus has no passages; nothing to index")
        (self.staging / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (self.staging / _STATE).unlink(missing_ok=True)

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

    def _index_all(
        self, writer: Any, store: PassageStoreWriter, position: int, start_byte: int, show: bool
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
        with bar:
            for passage, end_byte in self.source.read(start_byte):
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
                if position % commit_every == 0:
                    self._commit(writer, store, position, end_byte)
                    rate = (position - done_at_start) / max(1e-9, time.monotonic() - started)
                    bar.set_postfix(passages=f"{position:,}", per_s=f"{rate:,.0f}")
            self._commit(writer, store, position, last_byte)

    def _commit(self, writer: Any, store: PassageStoreWriter, passages: int, byte: int) -> None:
        """Passages on disk first, then the checkpoint, then tantivy's commit (see module)."""
        store.flush()
        self.state["checkpoints"].append({"passages": passages, "corpus_byte": byte})
        _write_json_atomic(self.staging / _STATE, self.state)
        writer.commit()


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
