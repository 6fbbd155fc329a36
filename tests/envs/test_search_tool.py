"""The `search` tool as the model sees it: schema, output format, and every error path."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from copes.envs.retrieval import CorpusRetriever, PoolRetriever, SearchHit
from copes.envs.tasks.base import Passage, Task
from copes.envs.tools.base import Tool, close_tool, reset_tool
from copes.envs.tools.search import SearchTool, truncate

HOTPOT_PASSAGES = (
    Passage("Scott Derrickson", "Scott Derrickson (born July 16, 1966) is an American director."),
    Passage("Ed Wood", "Edward Davis Wood Jr. (1924-1978) was an American filmmaker."),
    Passage(
        "Doctor Strange (2016 film)", "Doctor Strange is a 2016 film directed by Scott Derrickson."
    ),
    Passage("Tyler Bates", "Tyler Bates is an American musician and film composer."),
)


def _task(task_id: str = "q1", passages: tuple[Passage, ...] = HOTPOT_PASSAGES) -> Task:
    return Task(
        id=task_id,
        question="Were Scott Derrickson and Ed Wood of the same nationality?",
        answers=("yes",),
        kind="qa",
        passages=passages,
    )


def test_schema_matches_the_tool_protocol() -> None:
    tool = SearchTool(top_k=2)
    assert isinstance(tool, Tool)
    assert tool.name == "search"
    assert tool.parameters["type"] == "object"
    assert tool.parameters["required"] == ["query"]
    assert tool.parameters["properties"]["query"]["type"] == "string"
    assert "2 best matches" in tool.description


def test_pool_mode_returns_numbered_titled_passages() -> None:
    tool = SearchTool(top_k=2)
    reset_tool(tool, _task())
    out = tool(query="Scott Derrickson director")
    blocks = out.split("\n\n")
    assert len(blocks) == 2
    assert blocks[0] == (
        "[1] Scott Derrickson\nScott Derrickson (born July 16, 1966) is an American director."
    )
    assert blocks[1].startswith("[2] Doctor Strange (2016 film)\n")


def test_reset_switches_to_the_new_questions_pool() -> None:
    tool = SearchTool()
    tool.reset(_task())
    assert "[1] Ed Wood" in tool(query="Ed Wood")
    tool.reset(_task("q2", (Passage("Jaws", "A 1975 film by Steven Spielberg."),)))
    assert (
        tool(query="Ed Wood")
        == "No results for 'Ed Wood'. Try other keywords (names, dates, places)."
    )
    assert tool(query="Spielberg").startswith("[1] Jaws\n")


def test_calls_before_reset_or_without_passages_return_errors() -> None:
    tool = SearchTool()
    assert tool(query="Ed Wood").startswith("Error: search is not ready")
    tool.reset(None)
    assert tool(query="Ed Wood").startswith("Error: search is not ready")
    tool.reset(_task("empty", ()))
    out = tool(query="Ed Wood")
    assert out.startswith("Error:") and "'empty'" in out and "no passages" in out


def test_bad_arguments_return_errors() -> None:
    tool = SearchTool()
    tool.reset(_task())
    for bad in ({}, {"query": ""}, {"query": "   "}, {"query": None}):
        assert tool(**bad).startswith("Error: the search query is empty")
    out = tool(query=["Ed", "Wood"])
    assert out.startswith("Error: the search query must be a string") and "list" in out
    out = tool(query="Ed Wood", top_k=5)
    assert out.startswith("Error: search takes one argument") and "top_k" in out


def test_no_hits_message_quotes_the_query() -> None:
    tool = SearchTool()
    tool.reset(_task())
    assert tool(query="  zebra  ").startswith("No results for 'zebra'.")


def test_long_passages_are_truncated_at_a_word_boundary() -> None:
    text = "alpha " * 200
    tool = SearchTool(max_chars_per_passage=50)
    tool.reset(_task(passages=(Passage("Long", text),)))
    body = tool(query="alpha").split("\n", 1)[1]
    assert len(body) <= 50 and body.endswith("alpha...")
    assert truncate("short", 50) == "short"
    assert truncate("x" * 100, 10) == "x" * 7 + "..."  # one long word: cut inside it
    assert truncate("abcdef", 2) == "ab"


def test_shared_retriever_survives_reset_and_close(tmp_path: Path) -> None:
    passages = [Passage(f"Entity {i}", f"fact number {i}", id=str(i)) for i in range(20)]
    retriever = CorpusRetriever.build(passages, tmp_path / "index", show_progress=False)
    tool = SearchTool(retriever, top_k=1)
    tool.reset(_task("no-pool", ()))  # the open corpus ignores the task's own passages
    assert tool(query="entity 7") == "[1] Entity 7\nfact number 7"
    close_tool(tool)
    assert tool(query="entity 8") == "[1] Entity 8\nfact number 8"
    assert retriever.search("entity 9", k=1)[0].passage.id == "9"
    retriever.close()


class _BrokenRetriever:
    """A backend that fails, like a corrupted index would."""

    def search(self, query: str, k: int) -> list[SearchHit]:
        raise OSError("index file vanished")


def test_backend_failure_is_reported_not_raised() -> None:
    out = SearchTool(_BrokenRetriever())(query="Ed Wood")
    assert out == "Error: search failed (OSError: index file vanished); try another query."


def test_untitled_passages_print_without_a_title() -> None:
    tool = SearchTool(PoolRetriever([Passage("", "an untitled note about otters")]))
    assert tool(query="otters") == "[1]\nan untitled note about otters"


def test_concurrent_searches_and_resets_stay_well_formed() -> None:
    tool = SearchTool()
    tasks = [_task(f"q{i}") for i in range(4)]
    tool.reset(tasks[0])
    well_formed = re.compile(r"^\[1\] .+\n.+", re.DOTALL)

    def work(i: int) -> str:
        if i % 10 == 0:
            tool.reset(tasks[(i // 10) % 4])
        return tool(query="American director")

    with ThreadPoolExecutor(max_workers=8) as pool:
        outputs = list(pool.map(work, range(200)))
    assert all(well_formed.match(out) for out in outputs)
