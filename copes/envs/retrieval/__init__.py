"""Retrieval for the `search` tool: BM25 backends behind one `Retriever` protocol.

- `PoolRetriever` (`pool`): rank-bm25 over one question's 10-20 passages, in memory.
- `CorpusRetriever` (`bm25s_index`): exact BM25 (bm25s) over an open corpus held on disk;
  its build needs RAM in proportion to the corpus (fine to a few million passages).
- `TantivyRetriever` (`tantivy_index`): a disk-based inverted index (tantivy) built by
  streaming in bounded memory, for Wikipedia-scale corpora (21M passages).
- `HTTPRetriever` (`http`): an existing Search-R1 / FlashRAG style retrieval server;
  `http_server.make_app` serves any `Retriever` in the same format.

`open_index(path)` loads whichever disk index a folder holds. Corpus files are read by
`corpus_files`; the passages of a disk index live in a `passage_store`.
"""

from copes.envs.retrieval.base import (
    BM25_B,
    BM25_K1,
    ENGLISH_STOPWORDS,
    Retriever,
    SearchHit,
    Tokenizer,
    passage_index_text,
    top_k_indices,
)
from copes.envs.retrieval.bm25s_index import CorpusRetriever
from copes.envs.retrieval.corpus_files import iter_corpus_jsonl, parse_contents, read_corpus
from copes.envs.retrieval.http import HTTPRetriever, RetrieverUnavailable
from copes.envs.retrieval.open_index import open_index
from copes.envs.retrieval.pool import PoolRetriever
from copes.envs.retrieval.tantivy_index import TantivyRetriever

__all__ = [
    "BM25_B",
    "BM25_K1",
    "ENGLISH_STOPWORDS",
    "CorpusRetriever",
    "HTTPRetriever",
    "PoolRetriever",
    "Retriever",
    "RetrieverUnavailable",
    "SearchHit",
    "TantivyRetriever",
    "Tokenizer",
    "iter_corpus_jsonl",
    "open_index",
    "parse_contents",
    "passage_index_text",
    "read_corpus",
    "top_k_indices",
]
