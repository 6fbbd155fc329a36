"""`HTTPRetriever` against real local servers: a copes index served by `make_app` gives the
same hits and the same tool output as the index in process; a server that is down, hangs,
fails once, refuses the request or answers the wrong shape ends in bounded time with an
error (never an empty result); ToolQA runs an episode over a served corpus."""

import dataclasses
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

# Real requests with half-second timeouts: in the xdist group of the wall-clock checks, so
# never beside the CPU hogs of test_grading_under_load.
pytestmark = pytest.mark.xdist_group("timing")

from copes.envs.presets import tool_qa_env  # noqa: E402
from copes.envs.retrieval import (  # noqa: E402
    CorpusRetriever,
    HTTPRetriever,
    PoolRetriever,
    RetrieverUnavailable,
)
from copes.envs.retrieval.http_server import document_of, make_app  # noqa: E402
from copes.envs.tasks.base import Passage  # noqa: E402
from copes.envs.tasks.synthetic import synthetic_qa_tasks  # noqa: E402
from copes.envs.tools.search import SearchTool  # noqa: E402

TIMEOUT = 0.5
QUERIES = ["Freedonia river capital", "Zurich largest city", "w3 w17", "w42", "nothing-matches"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(app) -> Iterator[str]:
    """Run `app` with uvicorn in a thread; yields its base URL."""
    port = _free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _corpus() -> list[Passage]:
    passages = [
        Passage("Freedonia", "The Silver River flows through Fredville, its capital.", "0"),
        Passage("Zürich", 'The "largest" city of Switzerland.\nSecond line.', "z"),
        Passage('A "quoted" title', "  text with spaces around  ", "q"),
        Passage("", "A passage without a title about Freedonia.", "untitled"),
    ]
    passages += [
        Passage(f"Title {i}", " ".join(f"w{(i * 7 + j) % 50}" for j in range(8)), str(i))
        for i in range(60)
    ]
    return passages


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory) -> Iterator[CorpusRetriever]:
    index_dir = tmp_path_factory.mktemp("http") / "idx"
    with CorpusRetriever.build(_corpus(), index_dir, show_progress=False) as index:
        yield index


@pytest.fixture(scope="module")
def served_index(corpus_index) -> Iterator[str]:
    yield from (f"{base}/retrieve" for base in _serve(make_app(corpus_index)))


def _misbehaving_app(answers: dict, calls: Counter):
    """Routes that answer what `answers[name]` says; `calls` counts the requests per name."""
    import asyncio

    from fastapi import FastAPI, Request, Response

    app = FastAPI()

    @app.post("/{name}")
    async def answer(name: str, request: Request) -> Response:
        calls[name] += 1
        body = await request.json()
        reply = answers[name](calls[name], body)
        if isinstance(reply, float):  # hang
            await asyncio.sleep(reply)
            reply = {"result": [[]]}
        status, payload = reply if isinstance(reply, tuple) else (200, reply)
        text = payload if isinstance(payload, str) else json.dumps(payload)
        return Response(text, status_code=status, media_type="application/json")

    return app


ZURICH = {"id": "z", "contents": '"Zürich"\nThe largest city.'}
ANSWERS = {
    "hang": lambda n, body: 3.0,
    "flaky": lambda n, body: (500, "boom") if n == 1 else {"result": [[{"document": ZURICH}]]},
    "bad-request": lambda n, body: (422, {"detail": "queries must be a list"}),
    "down": lambda n, body: (503, "warming up"),
    "no-result": lambda n, body: {"results": [[]]},
    "two-results": lambda n, body: {"result": [[], []]},
    "not-json": lambda n, body: "<html>oops</html>",
    "no-text": lambda n, body: {"result": [[{"document": {"id": "1"}, "score": 1.0}]]},
    "bare": lambda n, body: {"result": [[ZURICH, {"id": 2, "title": "T", "text": "x"}] * 3]},
    "dense": lambda n, body: {"result": [[{"document": ZURICH, "score": 0.83}]]},
    "echo": lambda n, body: {"result": [[{"document": {"id": "0", "text": json.dumps(body)}}]]},
}


@pytest.fixture(scope="module")
def odd_server() -> Iterator[tuple[str, Counter]]:
    calls: Counter = Counter()
    for base in _serve(_misbehaving_app(ANSWERS, calls)):
        yield base, calls


def _retriever(url: str, **options) -> HTTPRetriever:
    options = {"timeout_s": TIMEOUT, "retries": 2, "backoff_s": 0.05, **options}
    return HTTPRetriever(url, **options)


# ---------------------------------------------------------------- same answers as in process
def test_served_index_gives_the_in_process_hits_and_scores(corpus_index, served_index) -> None:
    with _retriever(served_index) as remote:
        for query in QUERIES:
            for k in (1, 3, 10):
                expected = corpus_index.search(query, k)
                got = remote.search(query, k)
                assert [h.passage for h in got] == [h.passage for h in expected], (query, k)
                assert [h.score for h in got] == [h.score for h in expected], (query, k)
    assert corpus_index.search("Zurich largest city", 1)[0].passage.id == "z"


def test_search_tool_output_is_the_same_over_http(corpus_index, served_index) -> None:
    local, remote = SearchTool(corpus_index, top_k=3), SearchTool(_retriever(served_index))
    for query in [*QUERIES, "  quoted title  "]:
        assert remote(query=query) == local(query=query)
    assert "[1] Freedonia" in remote(query="Freedonia river")


def test_threads_share_one_http_retriever(corpus_index, served_index) -> None:
    remote, errors = _retriever(served_index), []

    def work(query: str) -> None:
        for _ in range(5):
            if remote.search(query, 3) != corpus_index.search(query, 3):
                errors.append(query)

    threads = [threading.Thread(target=work, args=(q,)) for q in QUERIES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    remote.close()
    assert errors == [] and len(remote._clients) == 0
    with pytest.raises(RuntimeError, match="closed"):
        remote.search("w3", 1)


def test_the_server_speaks_search_r1s_schema(served_index, corpus_index) -> None:
    import httpx

    hit = corpus_index.search("Zurich largest city", 1)[0]
    body = {"queries": ["Zurich largest city", "w42"], "topk": 1, "return_scores": True}
    answer = httpx.post(served_index, json=body).json()
    assert len(answer["result"]) == 2
    assert answer["result"][0] == [{"document": document_of(hit), "score": hit.score}]
    assert (
        document_of(hit)["contents"] == '"Zürich"\nThe "largest" city of Switzerland.\nSecond line.'
    )
    bare = httpx.post(served_index, json={"queries": ["Zurich largest city"]}).json()
    assert bare["result"][0][0] == document_of(hit) and len(bare["result"][0]) <= 3
    assert httpx.get(served_index.replace("/retrieve", "/health")).json() == {"status": "ok"}
    assert httpx.post(served_index, json={"topk": 2}).status_code == 422


def test_the_request_is_search_r1s_and_other_document_shapes_are_read(odd_server) -> None:
    base, _ = odd_server
    echoed = _retriever(f"{base}/echo").search("who?", 4)[0].passage.text
    assert json.loads(echoed) == {"queries": ["who?"], "topk": 4, "return_scores": True}
    dense = _retriever(f"{base}/dense").search("q", 3)
    assert dense[0].passage == Passage("Zürich", "The largest city.", "z")
    assert dense[0].score == 0.83
    bare = _retriever(f"{base}/bare").search("q", 4)  # no scores, more hits than asked
    assert [h.score for h in bare] == [4.0, 3.0, 2.0, 1.0]
    assert bare[1].passage == Passage("T", "x", "2")


# ---------------------------------------------------------------- failures, in bounded time
def test_a_server_that_is_down_gives_an_error_in_bounded_time() -> None:
    url = f"http://127.0.0.1:{_free_port()}/retrieve"  # nothing listens there
    retriever = _retriever(url)
    start = time.monotonic()
    with pytest.raises(RetrieverUnavailable) as caught:
        retriever.search("Freedonia", 3)
    assert time.monotonic() - start < TIMEOUT * 3 + 1.0
    message = str(caught.value)
    assert url in message and "cannot connect" in message and "3 attempts" in message
    assert "\n" not in message

    start = time.monotonic()
    reply = SearchTool(retriever)(query="Freedonia")
    assert time.monotonic() - start < TIMEOUT * 3 + 1.0
    assert reply.startswith("Error: search failed (RetrieverUnavailable: retrieval server ")
    assert reply.endswith("try another query.") and len(reply) < 300


def test_a_hanging_server_times_out(odd_server) -> None:
    base, calls = odd_server
    retriever = _retriever(f"{base}/hang", retries=1)
    start = time.monotonic()
    with pytest.raises(RetrieverUnavailable, match=r"no answer within 0\.5 s; 2 attempts"):
        retriever.search("q", 3)
    assert TIMEOUT * 2 <= time.monotonic() - start < TIMEOUT * 2 + 1.0
    assert calls["hang"] == 2


def test_a_5xx_is_retried_and_a_4xx_is_not(odd_server) -> None:
    base, calls = odd_server
    hits = _retriever(f"{base}/flaky").search("q", 3)
    assert [h.passage.id for h in hits] == ["z"] and calls["flaky"] == 2

    with pytest.raises(RetrieverUnavailable, match=r"HTTP 422.*; 1 attempt in") as caught:
        _retriever(f"{base}/bad-request").search("q", 3)
    assert "queries must be a list" in str(caught.value) and calls["bad-request"] == 1

    with pytest.raises(RetrieverUnavailable, match="HTTP 503 \\(warming up\\); 3 attempts"):
        _retriever(f"{base}/down").search("q", 3)
    assert calls["down"] == 3


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("no-result", r"answered no 'result' \(got \['results'\]\)"),
        ("two-results", "answered 2 result lists for 1 query"),
        ("not-json", r"answered something that is not JSON \(<html>oops</html>\)"),
        ("no-text", "result 1: the document has no string 'contents' or 'text'"),
    ],
)
def test_a_malformed_answer_is_an_error_not_an_empty_result(odd_server, name, problem) -> None:
    base, calls = odd_server
    before = calls[name]
    with pytest.raises(RetrieverUnavailable, match=problem) as caught:
        _retriever(f"{base}/{name}").search("q", 3)
    assert f"{base}/{name}" in str(caught.value) and "Search-R1" in str(caught.value)
    assert calls[name] == before + 1  # a malformed answer is not retried


@pytest.mark.parametrize(
    ("url", "options", "problem"),
    [
        ("127.0.0.1:8000/retrieve", {}, "http"),
        ("ftp://host/retrieve", {}, "http"),
        ("http:///retrieve", {}, "http"),
        ("http://h/retrieve", {"timeout_s": 0}, "timeout_s"),
        ("http://h/retrieve", {"timeout_s": float("inf")}, "timeout_s"),
        ("http://h/retrieve", {"retries": -1}, "retries"),
        ("http://h/retrieve", {"retries": 1.5}, "retries"),
        ("http://h/retrieve", {"backoff_s": -1}, "backoff_s"),
    ],
)
def test_bad_constructor_input_is_a_one_line_value_error(url, options, problem) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        HTTPRetriever(url, **options)
    assert "\n" not in str(caught.value)


def test_bad_k_is_refused_before_any_request() -> None:
    with pytest.raises(ValueError, match="k must be a positive integer"):
        HTTPRetriever("http://127.0.0.1:9/retrieve").search("q", 0)


# ---------------------------------------------------------------- ToolQA over a server
def test_toolqa_runs_an_episode_over_a_retrieval_server(tmp_path: Path) -> None:
    tasks = synthetic_qa_tasks("test", 3, seed=3)
    pool = PoolRetriever([p for t in tasks for p in t.passages])
    open_domain = [dataclasses.replace(t, passages=()) for t in tasks]  # nothing local
    for base in _serve(make_app(pool)):
        env = tool_qa_env(tasks=open_domain[:1], retriever_url=f"{base}/retrieve", max_turns=3)
        env.reset(seed=0)
        hops = tasks[0].metadata["hops"]
        obs, reward, *_ = env.step(f"<search>{hops[0]['query']}</search>")
        assert hops[0]["answer"] in obs and reward == 0.0
        assert obs.strip() == SearchTool(pool)(query=hops[0]["query"])
        _, reward, terminated, *_ = env.step(f"<answer>{tasks[0].answers[0]}</answer>")
        assert reward == 1.0 and terminated
        env.close()

    with pytest.raises(ValueError, match="not both"):
        tool_qa_env(tasks=open_domain, corpus_index=tmp_path, retriever_url="http://h/retrieve")
    with pytest.raises(ValueError, match="only apply with retriever_url"):
        tool_qa_env(tasks=tasks, retriever_timeout_s=1.0)
    with pytest.raises(ValueError, match="retriever_url"):
        tool_qa_env(tasks=open_domain)
    env = tool_qa_env(
        tasks=open_domain,
        retriever_url="http://h/retrieve",
        retriever_timeout_s=2,
        retriever_retries=0,
    )
    retriever = env.unwrapped.tools["search"]._shared_retriever
    assert (retriever.timeout_s, retriever.retries) == (2.0, 0)
    env.close()
