"""Serve any copes `Retriever` (a disk index, a pool) over HTTP in Search-R1's wire format.

Other projects' agents (Search-R1, FlashRAG, R1-Searcher clients) and copes' own
`HTTPRetriever` can then search a copes index. The schema is that of Search-R1's
`search_r1/search/retrieval_server.py` (PeterGriffinJin/Search-R1):

    POST /retrieve  {"queries": ["..."], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id", "contents", "title", "text"}, "score": s}, ...], ...]}

one list per query; bare documents when `return_scores` is false (Search-R1's default).
`contents` is FlashRAG's `"Title"\\ntext`; `title` and `text` are also sent so a client
needs no parsing. `GET /health` answers `{"status": "ok"}`.

fastapi and uvicorn are optional (`pip install 'copes[serve]'`) and imported on use.
Requests are answered in a thread pool, so the retriever must allow concurrent `search`
calls, as the `search` tool already requires of a retriever shared by threaded envs.
"""

# No `from __future__ import annotations`: FastAPI reads the request model from the
# endpoint's annotation, and a model defined inside `make_app` must be a real object there.

from typing import Any

from copes.envs.retrieval.base import Retriever, SearchHit

DEFAULT_TOPK = 3


def _import_fastapi() -> Any:
    try:
        import fastapi
        import pydantic
    except ImportError:
        raise ImportError(
            "serving a retriever over HTTP needs fastapi and uvicorn: pip install 'copes[serve]'"
        ) from None
    return fastapi, pydantic


def document_of(hit: SearchHit) -> dict[str, str]:
    """A hit's passage as a Search-R1 / FlashRAG document."""
    passage = hit.passage
    return {
        "id": passage.id,
        "contents": f'"{passage.title}"\n{passage.text}',
        "title": passage.title,
        "text": passage.text,
    }


def make_app(retriever: Retriever, default_topk: int = DEFAULT_TOPK) -> Any:
    """A FastAPI app serving `retriever` at `POST /retrieve` and `GET /health`.

    `topk` missing, null or 0 means `default_topk`, as in Search-R1's server.
    """
    if isinstance(default_topk, bool) or not isinstance(default_topk, int) or default_topk < 1:
        raise ValueError(f"default_topk must be a positive integer, got {default_topk!r}")
    fastapi, pydantic = _import_fastapi()

    class QueryRequest(pydantic.BaseModel):
        queries: list[str]
        topk: int | None = None
        return_scores: bool = False

    app = fastapi.FastAPI(title="copes retrieval server")

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict[str, Any]:
        k = request.topk or default_topk
        if k < 1:
            raise fastapi.HTTPException(422, f"topk must be a positive integer, got {k}")
        result: list[list[dict[str, Any]]] = []
        for query in request.queries:
            hits = retriever.search(query, k)
            if request.return_scores:
                result.append([{"document": document_of(h), "score": h.score} for h in hits])
            else:
                result.append([document_of(h) for h in hits])
        return {"result": result}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    default_topk: int = DEFAULT_TOPK,
    log_level: str = "info",
) -> None:
    """Serve `retriever` until interrupted (uvicorn); its endpoint is http://HOST:PORT/retrieve."""
    app = make_app(retriever, default_topk)
    try:
        import uvicorn
    except ImportError:
        raise ImportError(
            "serving a retriever over HTTP needs fastapi and uvicorn: pip install 'copes[serve]'"
        ) from None
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["DEFAULT_TOPK", "document_of", "make_app", "serve"]
