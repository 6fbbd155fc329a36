"""BM25 retrieval: tokenizer, per-question pool (and the IDF trap it avoids), on-disk corpus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from copes.envs.retrieval import (
    CorpusRetriever,
    PoolRetriever,
    Retriever,
    Tokenizer,
    iter_corpus_jsonl,
    parse_contents,
    passage_index_text,
    top_k_indices,
)
from copes.envs.tasks.base import Passage

# A HotpotQA-like distractor pool: the distractors were chosen because they share the
# question's words, so every query term is in half the passages or more.
QUESTION = "Which river flows through the capital of Freedonia?"
SUPPORT = 0
POOL = tuple(
    Passage(title, text)
    for title, text in [
        (
            "Freedonia",
            "Freedonia is a small republic. The Silver River flows through Fredville, its capital.",
        ),
        (
            "Sylvania",
            "Sylvania is a neighbouring kingdom. The Amber River flows through the "
            "capital of Sylvania.",
        ),
        (
            "Amber River",
            "The Amber River is a river that flows through three capital cities "
            "before it reaches the sea; no river in the region is longer.",
        ),
        (
            "Capital punishment in Sylvania",
            "Capital punishment was abolished in Sylvania in 1950; the capital hosted the vote.",
        ),
        (
            "Fredville",
            "Fredville is a city in Freedonia founded in 1820. It hosts a river "
            "festival each summer.",
        ),
        ("Marx Brothers", "Duck Soup is a 1933 film by the Marx Brothers set in Freedonia."),
        (
            "Duck Soup",
            "Duck Soup is a comedy film in which Rufus T. Firefly becomes leader of Freedonia.",
        ),
        (
            "Rivers of Europe",
            "This list of rivers names each river that flows through a capital city of Europe.",
        ),
        (
            "Capital city",
            "A capital city is the seat of government; many a capital grew where "
            "a river flows through fertile land.",
        ),
        (
            "Freedonia (disambiguation)",
            "Freedonia may refer to a fictional country or to Freedonia, New York.",
        ),
    ]
)


def test_tokenizer_lowercases_splits_and_folds_accents() -> None:
    tokenize = Tokenizer(remove_stopwords=False)
    assert tokenize("The U.S. won 3-1 in_2010!") == ["the", "u", "s", "won", "3", "1", "in", "2010"]
    assert tokenize("Beyoncé Knowles-Carter") == tokenize("BEYONCE knowles carter")
    assert tokenize("") == []


def test_tokenizer_drops_stopwords_only_when_asked() -> None:
    assert Tokenizer()("Who is the director of Jaws?") == ["director", "jaws"]
    assert Tokenizer(remove_stopwords=False)("Who is") == ["who", "is"]


def test_plain_bm25okapi_fails_on_a_distractor_pool() -> None:
    """The trap the fix is for: terms in >= half the pool get IDF 0 or a tiny floor."""
    tokenize = Tokenizer()
    okapi = BM25Okapi([tokenize(passage_index_text(p)) for p in POOL])
    query = tokenize(QUESTION)
    assert okapi.idf["freedonia"] == 0.0  # in exactly 5 of 10 passages
    scores = okapi.get_scores(query)
    assert np.argmax(scores) != SUPPORT
    assert scores[SUPPORT] < scores.max()


def test_pool_retriever_ranks_the_supporting_passage_first() -> None:
    retriever = PoolRetriever(POOL)
    hits = retriever.search(QUESTION, k=3)
    assert hits[0].passage == POOL[SUPPORT]
    assert hits[0].score > hits[1].score
    assert isinstance(retriever, Retriever)


def test_pool_retriever_indexes_the_title() -> None:
    pool = [Passage("Scott Derrickson", "He is an American director."), Passage("Ed Wood", "x")]
    hits = PoolRetriever(pool).search("Derrickson", k=5)
    assert [h.passage.title for h in hits] == ["Scott Derrickson"]


def test_pool_retriever_leaves_out_non_matching_passages_and_handles_empty_queries() -> None:
    retriever = PoolRetriever(POOL)
    hits = retriever.search("Marx", k=10)
    assert [h.passage.title for h in hits] == ["Marx Brothers"]
    assert all(h.score > 0 for h in retriever.search(QUESTION, k=10))
    assert retriever.search("zebra", k=3) == []
    assert retriever.search("the of ?!", k=3) == []  # nothing left after tokenizing


def test_pool_retriever_breaks_ties_by_position() -> None:
    pool = [Passage(f"Copy {i}", "identical text about rivers") for i in range(6)]
    for _ in range(3):
        hits = PoolRetriever(pool).search("rivers", k=4)
        assert [h.passage.title for h in hits] == ["Copy 0", "Copy 1", "Copy 2", "Copy 3"]


def test_top_k_indices_is_deterministic_at_the_cut_off() -> None:
    scores = np.array([0.5, 2.0, 1.0, 2.0, 1.0, 1.0, 0.0, 3.0])
    assert top_k_indices(scores, 3).tolist() == [7, 1, 3]
    assert top_k_indices(scores, 4).tolist() == [7, 1, 3, 2]
    assert top_k_indices(scores, 5).tolist() == [7, 1, 3, 2, 4]
    assert top_k_indices(scores, 100).tolist() == [7, 1, 3, 2, 4, 5, 0]  # zero left out


def test_pool_retriever_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty pool"):
        PoolRetriever([])
    with pytest.raises(ValueError, match="positive integer"):
        PoolRetriever(POOL).search("river", k=0)
    assert PoolRetriever([Passage("", "")]).search("river", k=1) == []


# --- open corpus ---------------------------------------------------------------------


def _random_corpus(n: int, seed: int = 0) -> list[Passage]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    return [
        Passage(
            title=f"Entity {i} {rng.choice(words)}",
            text=" ".join(rng.choices(words, k=rng.randint(5, 40))),
            id=f"doc-{i}",
        )
        for i in range(n)
    ]


def _write_flashrag_jsonl(path: Path, passages: list[Passage]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            record = {"id": p.id, "contents": f'"{p.title}"\n{p.text}'}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _queries(seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(300)}" for _ in range(rng.randint(1, 4))) for _ in range(30)]


def test_corpus_round_trip_gives_the_same_results(tmp_path: Path) -> None:
    passages = _random_corpus(400)
    passages[7] = Passage("Zürich", 'The "largest" city of Switzerland.\nSecond line.', id="z")
    corpus_path = tmp_path / "wiki.jsonl"
    _write_flashrag_jsonl(corpus_path, passages)

    built = CorpusRetriever.build(corpus_path, tmp_path / "index", show_progress=False)
    assert len(built) == 400
    assert built.passage(7) == passages[7]
    assert built.search("zurich largest", k=1)[0].passage.id == "z"

    for memory_map in (True, False):
        with CorpusRetriever.load(tmp_path / "index", memory_map=memory_map) as loaded:
            for query in _queries():
                expected = built.search(query, k=5)
                got = loaded.search(query, k=5)
                assert [h.passage for h in got] == [h.passage for h in expected]
                assert [h.score for h in got] == [h.score for h in expected]
    built.close()


def test_corpus_and_pool_backends_agree(tmp_path: Path) -> None:
    """Same tokenizer, same BM25 formula: the two backends rank and score alike."""
    passages = _random_corpus(150, seed=3)
    pool = PoolRetriever(passages)
    with CorpusRetriever.build(passages, tmp_path / "index", show_progress=False) as corpus:
        for query in _queries(seed=4):
            expected, got = pool.search(query, k=5), corpus.search(query, k=5)
            assert [h.passage.id for h in got] == [h.passage.id for h in expected]
            assert [h.score for h in got] == pytest.approx([h.score for h in expected], rel=1e-4)


def test_corpus_keeps_tokenizer_settings(tmp_path: Path) -> None:
    passages = [Passage("The Who", "An English rock band."), Passage("Other", "Nothing here.")]
    CorpusRetriever.build(
        passages,
        tmp_path / "index",
        tokenizer=Tokenizer(remove_stopwords=False),
        show_progress=False,
    ).close()
    with CorpusRetriever.load(tmp_path / "index") as loaded:
        assert loaded.tokenizer == Tokenizer(remove_stopwords=False)
        assert loaded.search("the who", k=1)[0].passage.title == "The Who"
        assert loaded.search("unknownterm", k=3) == []


def test_malformed_jsonl_names_the_line(tmp_path: Path) -> None:
    corpus_path = tmp_path / "bad.jsonl"
    corpus_path.write_text(
        '{"id": "0", "contents": "\\"A\\"\\ntext"}\n\n{"id": "1", "contents": "\\"B\\"\\n\n',
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not valid JSON"):
        CorpusRetriever.build(corpus_path, tmp_path / "index", show_progress=False)
    assert not (tmp_path / "index").exists()  # nothing half-built is left behind
    assert not (tmp_path / "index.building").exists()

    corpus_path.write_text('{"id": "0", "contents": "ok"}\n{"id": "1", "body": "x"}\n')
    with pytest.raises(ValueError, match=r"line 2: no string 'contents'"):
        list(iter_corpus_jsonl(corpus_path))
    corpus_path.write_text('["not", "an", "object"]\n')
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object"):
        list(iter_corpus_jsonl(corpus_path))


def test_iter_corpus_jsonl_reads_both_record_shapes(tmp_path: Path) -> None:
    corpus_path = tmp_path / "c.jsonl"
    corpus_path.write_text(
        '{"id": 12, "contents": "\\"Ed Wood\\"\\nEdward Davis Wood Jr."}\n'
        '{"title": "Jaws", "text": "A 1975 film."}\n',
        encoding="utf-8",
    )
    assert list(iter_corpus_jsonl(corpus_path)) == [
        Passage("Ed Wood", "Edward Davis Wood Jr.", id="12"),
        Passage("Jaws", "A 1975 film.", id="1"),
    ]


@pytest.mark.parametrize(
    ("contents", "title", "text"),
    [
        (
            '"Ed Wood"\nEdward Davis Wood Jr. was a filmmaker.',
            "Ed Wood",
            "Edward Davis Wood Jr. was a filmmaker.",
        ),
        ('"Title"\nline one\nline two', "Title", "line one\nline two"),
        ('"Only a title"', "Only a title", ""),
        ("no title, just text", "", "no title, just text"),
        ("Unquoted title\ntext", "Unquoted title", "text"),
        ('"A "quoted" word"\ntext', 'A "quoted" word', "text"),
    ],
)
def test_parse_contents(contents: str, title: str, text: str) -> None:
    assert parse_contents(contents) == (title, text)


def test_build_and_load_refuse_the_wrong_directory(tmp_path: Path) -> None:
    passages = _random_corpus(20)
    CorpusRetriever.build(passages, tmp_path / "index", show_progress=False).close()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        CorpusRetriever.build(passages, tmp_path / "index", show_progress=False)
    CorpusRetriever.build(passages[:5], tmp_path / "index", overwrite=True, show_progress=False)
    assert len(CorpusRetriever.load(tmp_path / "index")) == 5

    with pytest.raises(FileNotFoundError, match="not a corpus index"):
        CorpusRetriever.load(tmp_path)
    with pytest.raises(ValueError, match="no passages"):
        CorpusRetriever.build([], tmp_path / "empty", show_progress=False)
    with pytest.raises(TypeError, match="expected a Passage"):
        CorpusRetriever.build(["text"], tmp_path / "strs", show_progress=False)  # type: ignore[list-item]


def test_load_detects_a_passage_file_changed_after_building(tmp_path: Path) -> None:
    CorpusRetriever.build(_random_corpus(10), tmp_path / "index", show_progress=False).close()
    with (tmp_path / "index" / "passages.jsonl").open("a") as f:
        f.write('{"id": "extra", "title": "", "text": ""}\n')
    with pytest.raises(ValueError, match="rebuild the index"):
        CorpusRetriever.load(tmp_path / "index")
