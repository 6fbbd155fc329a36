"""`open_index`: load whichever disk index a folder holds, once per process.

Every environment of a run asks for the same index; they get one shared retriever (both
backends are read-only and safe to search from several threads), and every process on the
machine shares the index's pages through the page cache.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from copes.envs.retrieval.base import Retriever
from copes.envs.retrieval.tantivy_format import read_meta

_OPENED: dict[tuple[str, int], Retriever] = {}
_LOCK = threading.Lock()


def open_index(index_dir: str | os.PathLike[str]) -> Retriever:
    """The retriever over the index in `index_dir` (tantivy or bm25s), shared in-process."""
    path = Path(index_dir).resolve()
    meta = read_meta(path)
    key = (str(path), (path / "copes_index.json").stat().st_mtime_ns)
    with _LOCK:
        if key not in _OPENED:
            backend = meta.get("backend", "bm25s")
            if backend == "tantivy":
                from copes.envs.retrieval.tantivy_index import TantivyRetriever

                _OPENED[key] = TantivyRetriever.load(path)
            elif backend == "bm25s":
                from copes.envs.retrieval.bm25s_index import CorpusRetriever

                _OPENED[key] = CorpusRetriever.load(path)
            else:
                raise ValueError(
                    f"{path} holds a {backend!r} index; this copes reads tantivy and bm25s ones"
                )
        return _OPENED[key]
