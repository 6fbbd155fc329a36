"""`HTTPRetriever`: the `search` tool over an existing Search-R1 / FlashRAG retrieval server.

Teams that already serve e5 + FAISS on their GPU keep their server; copes sends it one
query a call in Search-R1's wire format (PeterGriffinJin/Search-R1,
`search_r1/search/retrieval_server.py`, `retrieve_endpoint`):

    POST <url>  {"queries": ["..."], "topk": k, "return_scores": true}
    ->          {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"},
                              "score": 0.83}, ...]]}

one inner list per query. A server that ignores `return_scores` answers bare document dicts
instead of `{"document", "score"}` pairs; both are read. A document is read from its `text`
(and `title`) when it has a string `text`, else from `contents` (`parse_contents`), since
Search-R1's BM25 server sends all three and the corpus rows of its dense server only
`id` and `contents`.

Every call ends in bounded time: each attempt is cut after `timeout_s`, failures that may
pass (no connection, a timeout, HTTP 5xx or 429) are retried `retries` times with doubling
back-off, and anything else (HTTP 4xx, a malformed answer) fails at once. Failures raise
`RetrieverUnavailable`, which `SearchTool` hands to the model as an `Error: ...` string.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from copes.envs.retrieval.base import SearchHit, check_k
from copes.envs.retrieval.corpus_files import parse_contents
from copes.envs.tasks.base import Passage

if TYPE_CHECKING:
    import httpx

MAX_RESPONSE_BYTES = 16 * 2**20  # a top-k answer is kilobytes; more is a wrong endpoint
_RETRIED_STATUS = frozenset({429})  # and every 5xx
_SNIPPET_CHARS = 120


class _ThreadClient(threading.local):
    """Each thread's own HTTP client (httpx clients are not shared across threads)."""

    client: httpx.Client | None = None


class RetrieverUnavailable(RuntimeError):
    """The retrieval server gave no usable answer (down, too slow, an error or a bad reply)."""


class HTTPRetriever:
    """A `Retriever` backed by a Search-R1 style `POST /retrieve` server.

    Args:
        url: the full endpoint, e.g. ``http://127.0.0.1:8000/retrieve``.
        timeout_s: the most one attempt may take (connecting, sending, waiting, reading).
        retries: attempts after the first for failures that may pass.
        backoff_s: the wait before the first retry; it doubles before each next one.

    A call gives up after about ``(retries + 1) * timeout_s`` plus the back-off waits.
    Hits keep the server's order and its score (on the server's own scale); a server that
    sends no score gets ``k - rank`` (k, k - 1, ...), so scores still fall with rank. At
    most `k` hits are kept. Safe to share between threads: each thread gets its own
    connection pool.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5
    ) -> None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"retriever url must be an http(s) endpoint like "
                f"http://127.0.0.1:8000/retrieve, got {url!r}"
            )
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)):
            raise ValueError(f"backoff_s must be a number of seconds >= 0, got {backoff_s!r}")
        if not (backoff_s >= 0 and math.isfinite(backoff_s)):
            raise ValueError(f"backoff_s must be a number of seconds >= 0, got {backoff_s!r}")
        try:
            import httpx
        except ImportError:
            raise ImportError(
                "HTTPRetriever needs httpx, which is not installed: pip install 'copes[serve]'"
            ) from None
        self._httpx = httpx
        self.url = url
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self._local = _ThreadClient()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()
        self._closed = False

    def search(self, query: str, k: int) -> list[SearchHit]:
        """The server's top-`k` passages for `query`; raises `RetrieverUnavailable` on failure."""
        check_k(k)
        payload = {"queries": [query], "topk": int(k), "return_scores": True}
        return self._hits(self._post(payload), k)

    # ------------------------------------------------------------------ transport
    def _client(self) -> httpx.Client:
        if self._closed:
            raise RuntimeError(f"HTTPRetriever for {self.url} is closed")
        client = self._local.client
        if client is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"HTTPRetriever for {self.url} is closed")
                client = self._httpx.Client(follow_redirects=False)
                self._clients.append(client)
            self._local.client = client
        return client

    def _post(self, payload: dict[str, Any]) -> Any:
        """The decoded JSON answer, after at most `retries + 1` attempts."""
        httpx = self._httpx
        backoffs = [self.backoff_s * 2**i for i in range(self.retries)]
        start = time.monotonic()
        deadline = start + self.timeout_s * (self.retries + 1) + sum(backoffs)
        attempts, problem = 0, ""
        while True:
            attempts += 1
            retry = False
            try:
                status, body = self._attempt(
                    payload, min(self.timeout_s, deadline - time.monotonic())
                )
            except httpx.TimeoutException:
                problem, retry = f"no answer within {self.timeout_s:g} s", True
            except httpx.ConnectError as err:
                problem, retry = f"cannot connect ({err})", True
            except httpx.TransportError as err:
                problem, retry = f"{type(err).__name__} ({err})", True
            except _TooLarge:
                problem = f"answered more than {MAX_RESPONSE_BYTES} bytes"
            else:
                if 200 <= status < 300:
                    return self._decode(body)
                problem = f"answered HTTP {status} ({_snippet(body)})"
                retry = status >= 500 or status in _RETRIED_STATUS
            wait = backoffs[attempts - 1] if attempts <= len(backoffs) else None
            if not retry or wait is None or time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
        elapsed = time.monotonic() - start
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        raise RetrieverUnavailable(
            f"retrieval server {self.url} {problem}; {tries} in {elapsed:.1f} s"
        )

    def _attempt(self, payload: dict[str, Any], budget_s: float) -> tuple[int, bytes]:
        """One POST. httpx bounds each connect, write and read by `budget_s`; the clock check
        between chunks stops a server that trickles its answer (worst case about 2 x budget)."""
        budget_s = max(budget_s, 0.001)
        ends = time.monotonic() + budget_s
        client = self._client()
        timeout = self._httpx.Timeout(budget_s)
        with client.stream("POST", self.url, json=payload, timeout=timeout) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise _TooLarge
                if time.monotonic() > ends:
                    raise self._httpx.ReadTimeout("the answer took too long")
            return response.status_code, b"".join(chunks)

    # ------------------------------------------------------------------ the answer
    def _bad(self, what: str) -> RetrieverUnavailable:
        return RetrieverUnavailable(
            f"retrieval server {self.url} {what}; expected Search-R1's "
            '{"result": [[{"document": {...}, "score": ...}, ...]]}'
        )

    def _decode(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._bad(f"answered something that is not JSON ({_snippet(body)})") from None

    def _hits(self, answer: Any, k: int) -> list[SearchHit]:
        if not isinstance(answer, dict) or "result" not in answer:
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise self._bad(f"answered no 'result' (got {keys})")
        result = answer["result"]
        if not isinstance(result, list) or len(result) != 1:
            count = len(result) if isinstance(result, list) else type(result).__name__
            raise self._bad(f"answered {count} result lists for 1 query")
        items = result[0]
        if not isinstance(items, list):
            raise self._bad(f"answered a {type(items).__name__} as the query's result list")
        hits = []
        for rank, item in enumerate(items[:k]):
            where = f"result {rank + 1}"
            if not isinstance(item, dict):
                raise self._bad(f"{where} is a {type(item).__name__}, not an object")
            if "document" in item:  # {"document": {...}, "score": s}, as return_scores asks
                document, score = item["document"], item.get("score")
            else:  # a bare document: the server ignored return_scores
                document, score = item, None
            if score is None:
                score = float(k - rank)
            elif isinstance(score, bool) or not isinstance(score, (int, float)):
                raise self._bad(f"{where} has a non-numeric score {score!r}")
            hits.append(SearchHit(self._passage(document, where), float(score)))
        return hits

    def _passage(self, document: Any, where: str) -> Passage:
        if not isinstance(document, dict):
            raise self._bad(f"{where}: the document is a {type(document).__name__}")
        passage_id = "" if document.get("id") is None else str(document["id"])
        if isinstance(document.get("text"), str):
            title = document.get("title")
            return Passage(title if isinstance(title, str) else "", document["text"], passage_id)
        if isinstance(document.get("contents"), str):
            title, text = parse_contents(document["contents"])
            return Passage(title, text, passage_id)
        raise self._bad(f"{where}: the document has no string 'contents' or 'text'")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close every thread's connections; later searches raise."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def __enter__(self) -> HTTPRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"


class _TooLarge(Exception):
    pass


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    if not text:
        return "empty body"
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 3] + "..."


__all__ = ["MAX_RESPONSE_BYTES", "HTTPRetriever", "RetrieverUnavailable"]
