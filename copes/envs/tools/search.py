"""The `search` tool: BM25 over the question's passage pool or over an open corpus.

Two modes, chosen by the `retriever` argument:

- `SearchTool()` (pool mode): each `reset(task)` indexes `task.passages`, the 10-20
  candidate passages of a HotpotQA / 2Wiki / MuSiQue question (the distractor setting).
- `SearchTool(open_index(index_dir))` (open-corpus mode): one shared index for every
  question (tantivy or bm25s on disk, or `HTTPRetriever` for a retrieval server); `reset`
  changes nothing and `close` leaves the shared index open.

The tool never raises at the model: bad arguments, a missing pool or a failing backend
come back as an `Error: ...` string the model can read and react to.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from copes.envs.retrieval import PoolRetriever, Retriever, RetrieverUnavailable, SearchHit

if TYPE_CHECKING:
    from copes.envs.tasks.base import Task

logger = logging.getLogger(__name__)


class SearchTool:
    """Keyword (BM25) search that returns numbered passages: `[1] Title\\ntext`."""

    name = "search"

    def __init__(
        self,
        retriever: Retriever | None = None,
        top_k: int = 3,
        max_chars_per_passage: int = 600,
    ) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1 (passages per search), got {top_k}")
        if max_chars_per_passage < 1:
            raise ValueError(
                f"max_chars_per_passage must be at least 1, got {max_chars_per_passage}"
            )
        self.top_k = top_k
        self.max_chars_per_passage = max_chars_per_passage
        self._shared_retriever = retriever
        self._retriever: Retriever | None = retriever
        self._unavailable = (
            "Error: search is not ready: no passages are loaded for this question "
            "(the environment must call reset(task) first)."
        )
        self._lock = threading.Lock()
        self.description = (
            f"Search encyclopedia passages by keywords; returns the {top_k} best matches, each "
            "as a title and its text. Search once per fact you need."
        )
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "Keywords to search for: an entity name plus what you "
                    "want to know about it.",
                }
            },
            "required": ["query"],
        }

    def reset(self, task: Task | None) -> None:
        """Index the new question's passages (pool mode); a no-op with a shared retriever."""
        if self._shared_retriever is not None:
            return
        retriever: Retriever | None = None
        message = self._unavailable
        if task is not None and task.passages:
            retriever = PoolRetriever(task.passages)
        elif task is not None:
            message = (
                f"Error: question {task.id!r} comes with no passages, so there is nothing "
                "to search; answer from what you know."
            )
        with self._lock:
            self._retriever, self._unavailable = retriever, message

    def __call__(self, query: Any = None, **kwargs: Any) -> str:
        """Run one search; every failure is returned as an `Error: ...` string."""
        if kwargs:
            return (
                f"Error: search takes one argument, query; got unexpected {sorted(kwargs)}. "
                'Call it as search(query="...").'
            )
        if query is not None and not isinstance(query, str):
            return (
                f"Error: the search query must be a string of keywords, got "
                f'{type(query).__name__}; call it as search(query="...").'
            )
        if query is None or not query.strip():
            return 'Error: the search query is empty; give keywords, e.g. search(query="...").'
        with self._lock:
            retriever, unavailable = self._retriever, self._unavailable
        if retriever is None:
            return unavailable
        query = query.strip()
        try:
            hits = retriever.search(query, self.top_k)
        except Exception as err:  # the model sees a message, the log keeps the traceback
            if isinstance(err, RetrieverUnavailable):  # a server down: one line, not a flood
                logger.warning("search failed for query %r: %s", query, err)
            else:
                logger.exception("search backend failed for query %r", query)
            return f"Error: search failed ({type(err).__name__}: {err}); try another query."
        if not hits:
            return f"No results for {query!r}. Try other keywords (names, dates, places)."
        return "\n\n".join(self._format_hit(i, hit) for i, hit in enumerate(hits, start=1))

    def _format_hit(self, number: int, hit: SearchHit) -> str:
        title = hit.passage.title.strip()
        header = f"[{number}] {title}" if title else f"[{number}]"
        return f"{header}\n{truncate(hit.passage.text.strip(), self.max_chars_per_passage)}"

    def close(self) -> None:
        """Drop the per-question index; a shared retriever stays open for its other users."""
        if self._shared_retriever is None:
            with self._lock:
                self._retriever = None


def truncate(text: str, max_chars: int) -> str:
    """Cut `text` to at most `max_chars` characters, at a word boundary, marking the cut."""
    if len(text) <= max_chars:
        return text
    ellipsis = "..."
    if max_chars <= len(ellipsis):
        return text[:max_chars]
    cut = text[: max_chars - len(ellipsis)]
    last_space = cut.rfind(" ")
    if not text[len(cut)].isspace() and last_space > len(cut) // 2:
        cut = cut[:last_space]  # do not split a word, unless that loses half the passage
    return cut.rstrip() + ellipsis
