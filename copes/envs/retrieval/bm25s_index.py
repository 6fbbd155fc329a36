"""`CorpusRetriever`: bm25s over an open corpus, for corpora up to a few million passages.

bm25s builds its sparse score matrix in RAM (about 23 bytes per corpus token at peak), so it
is the exact-BM25 backend for small and mid-sized corpora and the parity oracle of the
tantivy backend (`copes.envs.retrieval.tantivy_index`), which is the one for Wikipedia scale.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from copes.envs.retrieval.base import (
    BM25_B,
    BM25_K1,
    SearchHit,
    Tokenizer,
    check_k,
    passage_index_text,
    top_k_indices,
)
from copes.envs.retrieval.corpus_files import iter_corpus_jsonl, only_passages
from copes.envs.retrieval.passage_store import PassageStore, PassageStoreWriter, StoredPassages
from copes.envs.tasks.base import Passage

if TYPE_CHECKING:
    import bm25s

logger = logging.getLogger(__name__)


class CorpusRetriever(StoredPassages):
    """bm25s over an open corpus, with the index and the passage texts on disk.

    Build once with `CorpusRetriever.build(corpus, index_dir)`, then `load(index_dir)` in
    every process: the score matrix and the passages are memory-mapped, so many workers
    share one copy through the page cache. An index directory holds:

    - `copes_index.json`: format version, passage count, tokenizer and BM25 settings;
    - `bm25s/`: the bm25s index (sparse score matrix as .npy arrays, vocabulary, params);
    - `passages.jsonl` + `passages.offsets.npy`: the passages, one JSON object a line, and
      the byte offset of each line (N + 1 entries) for random access.
    """

    def __init__(
        self,
        bm25: bm25s.BM25,
        store: PassageStore,
        tokenizer: Tokenizer,
        index_dir: Path,
    ) -> None:
        """Use `build` or `load`; this wires already-loaded parts together."""
        self._bm25 = bm25
        self._k1 = float(bm25.k1)
        self._vocab: dict[str, int] = bm25.vocab_dict
        self._store = store
        self.tokenizer = tokenizer
        self.index_dir = index_dir

    @classmethod
    def build(
        cls,
        corpus: str | os.PathLike[str] | Iterable[Passage],
        index_dir: str | os.PathLike[str],
        *,
        tokenizer: Tokenizer | None = None,
        k1: float = BM25_K1,
        b: float = BM25_B,
        overwrite: bool = False,
        show_progress: bool = True,
        memory_map: bool = True,
    ) -> CorpusRetriever:
        """Index `corpus` (a JSONL path, see `iter_corpus_jsonl`, or Passages) into `index_dir`.

        Passage texts are streamed to disk, but the token ids and bm25s's score matrix are
        built in RAM: about 23 bytes per corpus token at peak (226 MiB for 10M tokens), so
        a 21M-passage Wikipedia dump needs a machine with ~50 GB. The index is written to
        a sibling `.building` directory and moved into place only when complete.
        """
        index_dir = Path(index_dir)
        if index_dir.exists() and any(index_dir.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{index_dir} already exists and is not empty; load it with "
                "CorpusRetriever.load(index_dir), or pass overwrite=True to rebuild it"
            )
        tokenizer = tokenizer or Tokenizer()
        if isinstance(corpus, (str, os.PathLike)):
            passages: Iterable[Passage] = iter_corpus_jsonl(corpus)
        else:
            passages = corpus
        staging = index_dir.with_name(index_dir.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            cls._write_index(passages, staging, tokenizer, k1, b, show_progress)
            if index_dir.exists():
                shutil.rmtree(index_dir)
            staging.rename(index_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls.load(index_dir, memory_map=memory_map)

    @staticmethod
    def _write_index(
        passages: Iterable[Passage],
        out_dir: Path,
        tokenizer: Tokenizer,
        k1: float,
        b: float,
        show_progress: bool,
    ) -> None:
        vocab: dict[str, int] = {}
        docs: list[array] = []
        store = PassageStoreWriter(out_dir)
        try:
            for passage in tqdm(
                only_passages(passages),
                desc="Tokenizing passages",
                unit=" passages",
                disable=not show_progress,
            ):
                tokens = tokenizer(passage_index_text(passage))
                docs.append(array("i", [vocab.setdefault(t, len(vocab)) for t in tokens]))
                store.append(passage)
        except BaseException:
            store.close()
            raise
        store.finish()
        if not docs:
            raise ValueError("the corpus has no passages; nothing to index")
        if not vocab:
            raise ValueError(f"none of the {len(docs)} passages has any searchable token")
        logger.info("indexing %d passages, %d distinct terms", len(docs), len(vocab))
        import bm25s  # here, not at import: bm25s loads numba where it is installed (1-2 s)

        bm25 = bm25s.BM25(k1=k1, b=b, method="lucene", backend="numpy")
        bm25.index((docs, vocab), create_empty_token=False, show_progress=show_progress)
        bm25.save(out_dir / "bm25s", show_progress=False)
        meta = {
            "format_version": _FORMAT_VERSION,
            "backend": "bm25s",
            "num_passages": len(docs),
            "tokenizer": {"remove_stopwords": tokenizer.remove_stopwords},
            "k1": k1,
            "b": b,
            "bm25s_version": bm25s.__version__,
        }
        (out_dir / _META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, index_dir: str | os.PathLike[str], *, memory_map: bool = True) -> CorpusRetriever:
        """Open an index written by `build`; `memory_map=False` reads it all into RAM."""
        index_dir = Path(index_dir)
        meta_path = index_dir / _META
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{index_dir} is not a corpus index (no {_META}); build one with "
                "CorpusRetriever.build(corpus_jsonl, index_dir)"
            )
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(
                f"{index_dir} has index format {meta.get('format_version')!r}, this copes reads "
                f"format {_FORMAT_VERSION}; rebuild it with CorpusRetriever.build"
            )
        import bm25s

        bm25 = bm25s.BM25.load(index_dir / "bm25s", mmap=memory_map, show_progress=False)
        store = PassageStore(index_dir, memory_map=memory_map)
        if len(store) != meta["num_passages"]:
            raise ValueError(
                f"{index_dir}: the passage file holds {len(store)} passages, the index "
                f"{meta['num_passages']}; rebuild the index with CorpusRetriever.build"
            )
        return cls(bm25, store, Tokenizer(**meta["tokenizer"]), index_dir)

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Top-`k` passages of the corpus for `query`; terms unseen in the corpus are ignored."""
        check_k(k)
        token_ids = [self._vocab[t] for t in self.tokenizer(query) if t in self._vocab]
        if not token_ids:
            return []
        scores = self._bm25.get_scores_from_ids(token_ids)
        # bm25s's Lucene variant leaves out the constant factor (k1 + 1) that rank-bm25
        # keeps; put it back so both backends report the same scores for the same passages.
        scale = self._k1 + 1.0
        return [
            SearchHit(self.passage(int(i)), float(scores[i]) * scale)
            for i in top_k_indices(scores, k)
        ]


_FORMAT_VERSION = 1
_META = "copes_index.json"
