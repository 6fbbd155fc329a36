"""Building a tantivy corpus index: one streamed pass over the corpus, shard after shard,
resumable after a kill (`copes.envs.retrieval.tantivy_index` says why tantivy, why shards).

A build commits every `commit_every` passages and at the end of every shard, and records,
just before each commit, how many passages are in and where the corpus file resumes. A
killed build restarts from its last commit (the index holds exactly the committed passages;
the passage file is cut back to match), and the finished index is renamed into place only
when complete, so no reader ever sees a half-built index.
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

import numpy as np
from tqdm.auto import tqdm

from copes.envs.retrieval.base import BM25_B, Tokenizer, passage_index_text
from copes.envs.retrieval.corpus_files import (
    CorpusFormat,
    count_bytes,
    only_passages,
    read_corpus,
    resolve_format,
)
from copes.envs.retrieval.passage_store import PassageStoreWriter
from copes.envs.retrieval.tantivy_format import (
    BUILD_STATE,
    FIELD,
    FORMAT_VERSION,
    META,
    POSITION,
    SHARDS_DIR,
    TANTIVY_K1,
    open_tantivy,
    positions_path,
    schema,
    segments_path,
    shard_name,
    tantivy_module,
)
from copes.envs.tasks.base import Passage

logger = logging.getLogger(__name__)

SHARD_SIZE = 2_000_000  # passages a shard: 11 for wiki-18's 21M, which 2 threads split evenly


def default_threads() -> int:
    """Indexing threads: the cores left after the Python thread that tokenizes (1 to 4)."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def build_index(
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
) -> Path:
    """Index `corpus` (a corpus file, see `corpus_files`, or Passages) into `index_dir`;
    returns it (`TantivyRetriever.load` opens it).

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
    return index_dir


def _write_positions(shard_dir: Path, start: int) -> None:
    """Write a finished shard's address -> position table.

    Asked of the searcher itself (every passage, ordered by its position field), so the
    table holds whatever segment order and sizes tantivy's merges left.
    """
    tantivy = tantivy_module()
    searcher = open_tantivy(shard_dir).searcher()
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
            order_by_field=POSITION,
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
    np.save(segments_path(shard_dir), segment_starts)
    tmp = shard_dir.with_name(shard_dir.name + ".positions.tmp.npy")
    np.save(tmp, positions)
    os.replace(tmp, positions_path(shard_dir))  # last: the mark of a finished shard


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
    state_path = staging / BUILD_STATE
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
            _write_json_atomic(self.staging / BUILD_STATE, self.state)
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
            path = self.shards / shard_name(number)  # between its commit and its table
            if not positions_path(path).is_file():
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
        (self.staging / BUILD_STATE).unlink(missing_ok=True)

    def _committed(self, shard_size: int) -> int:
        """Passages tantivy has committed, shard by shard (shards are filled in order)."""
        total = 0
        for number in range(sum(1 for path in self.shards.iterdir() if path.is_dir()) + 1):
            path = self.shards / shard_name(number)
            if not (path / "meta.json").is_file():
                shutil.rmtree(path, ignore_errors=True)  # made, never committed to
                break
            try:
                docs = open_tantivy(path).searcher().num_docs
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
        path = self.shards / shard_name(number)
        if (path / "meta.json").is_file():
            index = open_tantivy(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
            index = open_tantivy(path, schema(tantivy_module()))
        return index.writer(heap_size=self.heap_mb * 2**20, num_threads=self.threads)

    def _index_all(
        self,
        store: PassageStoreWriter,
        position: int,
        start_byte: int,
        shard_size: int,
        show: bool,
    ) -> None:
        tantivy = tantivy_module()
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
                document.add_text(FIELD, " ".join(tokenizer(passage_index_text(passage))))
                document.add_unsigned(POSITION, position)
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
        _write_json_atomic(self.staging / BUILD_STATE, self.state)
        writer.commit()

    def _finish_shard(self, writer: Any, number: int, shard_size: int) -> None:
        """Let tantivy's merges end (they move passages between segments), then write the
        shard's address -> position table."""
        writer.wait_merging_threads()
        _write_positions(self.shards / shard_name(number), number * shard_size)


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
