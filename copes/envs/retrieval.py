"""BM25 retrieval for the search tool: a per-question pool and an on-disk open corpus.

Two backends behind one `Retriever` protocol, sharing one tokenizer and one scoring rule
(BM25 with the Lucene IDF `log(1 + (N - n + 0.5) / (n + 0.5))`, k1=1.5, b=0.75), so a
query ranks passages the same way in both modes:

- `PoolRetriever`: rank-bm25 over the 10-20 passages that come with each HotpotQA /
  2Wiki / MuSiQue question (the distractor setting). Built per episode, in memory.
- `CorpusRetriever`: bm25s over one corpus of up to millions of passages (e.g. the
  FlashRAG Wikipedia dump), built once to a directory and memory-mapped at load time.

Ties are broken by passage position (earlier first), so results are deterministic.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import re
import shutil
import unicodedata
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import bm25s
import numpy as np
from rank_bm25 import BM25Okapi
from tqdm.auto import tqdm

from copes.envs.tasks.base import Passage

logger = logging.getLogger(__name__)

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
        tokens = _TOKEN.findall(text)
        if self.remove_stopwords:
            return [t for t in tokens if t not in ENGLISH_STOPWORDS]
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


def _check_k(k: int) -> None:
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
        _check_k(k)
        tokens = self.tokenizer(query)
        if not tokens or not self._has_tokens:
            return []
        scores = np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)
        return [SearchHit(self.passages[i], float(scores[i])) for i in top_k_indices(scores, k)]


# --- the open corpus -------------------------------------------------------------------


def parse_contents(contents: str) -> tuple[str, str]:
    """Split a FlashRAG-style `contents` field, `"Title"\\ntext`, into (title, text).

    The first line is the title (surrounding double quotes removed). A single line is
    taken as text with no title unless it is quoted.
    """
    first, newline, rest = contents.partition("\n")
    first = first.strip()
    quoted = len(first) >= 2 and first.startswith('"') and first.endswith('"')
    if not newline and not quoted:
        return "", contents.strip()
    return (first[1:-1] if quoted else first), rest.strip()


def iter_corpus_jsonl(path: str | Path) -> Iterator[Passage]:
    """Passages of a corpus JSONL file, one object a line.

    Each line is `{"id": ..., "contents": "\\"Title\\"\\ntext"}` (FlashRAG's wiki dump) or
    `{"id": ..., "title": ..., "text": ...}`. Blank lines are skipped; a missing id becomes
    the passage's 0-based position. Errors name the file and line number.
    """
    path = Path(path)
    position = 0
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg}); {_FORMAT_HINT}") from err
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            passage_id = str(record.get("id", position))
            if isinstance(record.get("contents"), str):
                title, text = parse_contents(record["contents"])
            elif isinstance(record.get("text"), str):
                title, text = str(record.get("title") or ""), record["text"]
            else:
                raise ValueError(
                    f"{where}: no string 'contents' (or 'text') field, keys are "
                    f"{sorted(record)}; {_FORMAT_HINT}"
                )
            yield Passage(title=title, text=text, id=passage_id)
            position += 1


_FORMAT_HINT = 'expected one object a line like {"id": "0", "contents": "\\"Title\\"\\ntext"}'


class CorpusRetriever:
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
        passage_bytes: bytes | mmap.mmap,
        offsets: np.ndarray,
        tokenizer: Tokenizer,
        index_dir: Path,
    ) -> None:
        """Use `build` or `load`; this wires already-loaded parts together."""
        self._bm25 = bm25
        self._k1 = float(bm25.k1)
        self._vocab: dict[str, int] = bm25.vocab_dict
        self._passage_bytes = passage_bytes
        self._offsets = offsets
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
        offsets = array("q", [0])
        with (out_dir / _PASSAGES).open("wb") as out:
            for passage in tqdm(
                passages, desc="Tokenizing passages", unit=" passages", disable=not show_progress
            ):
                if not isinstance(passage, Passage):
                    raise TypeError(
                        f"corpus item {len(docs)} is a {type(passage).__name__}, expected a "
                        "Passage; pass Passage objects or the path of a corpus JSONL file"
                    )
                tokens = tokenizer(passage_index_text(passage))
                docs.append(array("i", [vocab.setdefault(t, len(vocab)) for t in tokens]))
                record = {"id": passage.id, "title": passage.title, "text": passage.text}
                line = json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
                out.write(line)
                offsets.append(offsets[-1] + len(line))
        if not docs:
            raise ValueError("the corpus has no passages; nothing to index")
        if not vocab:
            raise ValueError(f"none of the {len(docs)} passages has any searchable token")
        logger.info("indexing %d passages, %d distinct terms", len(docs), len(vocab))
        bm25 = bm25s.BM25(k1=k1, b=b, method="lucene", backend="numpy")
        bm25.index((docs, vocab), create_empty_token=False, show_progress=show_progress)
        bm25.save(out_dir / "bm25s", show_progress=False)
        np.save(out_dir / _OFFSETS, np.frombuffer(offsets, dtype=np.int64))
        meta = {
            "format_version": _FORMAT_VERSION,
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
        bm25 = bm25s.BM25.load(index_dir / "bm25s", mmap=memory_map, show_progress=False)
        offsets = np.load(index_dir / _OFFSETS, mmap_mode="r" if memory_map else None)
        with (index_dir / _PASSAGES).open("rb") as f:
            if memory_map:
                passage_bytes: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                passage_bytes = f.read()
        if len(offsets) != meta["num_passages"] + 1 or offsets[-1] != len(passage_bytes):
            raise ValueError(
                f"{index_dir}: {_PASSAGES} does not match {_OFFSETS} (truncated or edited "
                "after building?); rebuild the index with CorpusRetriever.build"
            )
        return cls(bm25, passage_bytes, offsets, Tokenizer(**meta["tokenizer"]), index_dir)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def passage(self, position: int) -> Passage:
        """The passage at 0-based `position` in the corpus, read from disk."""
        start, end = int(self._offsets[position]), int(self._offsets[position + 1])
        record = json.loads(self._passage_bytes[start:end])
        return Passage(title=record["title"], text=record["text"], id=record["id"])

    def search(self, query: str, k: int) -> list[SearchHit]:
        """Top-`k` passages of the corpus for `query`; terms unseen in the corpus are ignored."""
        _check_k(k)
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

    def close(self) -> None:
        """Unmap the passage file (the bm25s arrays are released with this object)."""
        if isinstance(self._passage_bytes, mmap.mmap):
            self._passage_bytes.close()

    def __enter__(self) -> CorpusRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FORMAT_VERSION = 1
_META = "copes_index.json"
_PASSAGES = "passages.jsonl"
_OFFSETS = "passages.offsets.npy"
