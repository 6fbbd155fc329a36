"""The tantivy backend: exact BM25 where tantivy's lengths are exact, the corpus formats users
have, a build killed for real and resumed, `copes-index`, and open-domain QA (env and
copes-eval) over a wiki-style index."""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from copes.envs.retrieval import (
    CorpusRetriever,
    HTTPRetriever,
    TantivyRetriever,
    Tokenizer,
    open_index,
    read_corpus,
)
from copes.envs.retrieval.cli import main as index_main
from copes.envs.tasks.base import Passage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
WORDS = (  # noqa: SIM905 - a word list reads better as text
    "river city bridge castle museum painter novel founder mill harbor valley mountain railway "
    "festival theatre glass lantern empire senate treaty war peace delta island ocean coast "
    "north south 1874 1912 varn ketter solden brightwater"
).split()


def random_passages(
    n: int, seed: int, max_words: int = 30, same_length: bool = False
) -> list[Passage]:
    """Passages of at most `max_words` tokens: tantivy stores lengths <= 40 exactly."""
    rng = np.random.default_rng(seed)
    passages = []
    for i in range(n):
        words = max_words if same_length else int(rng.integers(1, max_words))
        text = " ".join(rng.choice(WORDS, size=words))
        title = " ".join(rng.choice(WORDS, size=2)).title()
        passages.append(Passage(title=title, text=text, id=f"p{i}"))
    return passages


def queries(seed: int, count: int = 60) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 6)))) for _ in range(count)]


def write_jsonl(path: Path, passages: list[Passage], style: str = "flashrag") -> Path:
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            if style == "flashrag":
                record = {"id": p.id, "contents": f'"{p.title}"\n{p.text}'}
            else:
                record = {"id": p.id, "title": p.title, "text": p.text}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_dpr_tsv(path: Path, passages: list[Passage]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["id", "text", "title"])
        for p in passages:
            writer.writerow([p.id, p.text, p.title])
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[list[Passage], TantivyRetriever, CorpusRetriever]:
    root = tmp_path_factory.mktemp("small")
    passages = random_passages(400, seed=1)
    ours = TantivyRetriever.build(passages, root / "tv", commit_every=150, show_progress=False)
    exact = CorpusRetriever.build(passages, root / "exact", k1=1.2, show_progress=False)
    return passages, ours, exact


def test_same_ranking_and_scores_as_exact_bm25_with_tantivys_k1(small) -> None:
    _, ours, exact = small
    compared = 0
    for query in queries(2):
        got, want = ours.search(query, 10), exact.search(query, 10)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.score == pytest.approx(w.score, rel=2e-5)
        # Same passages in the same order: equal scores go to the earlier passage in both.
        assert [h.passage.id for h in got] == [h.passage.id for h in want]
        compared += len(got)
    assert compared > 300


def test_hits_are_the_passages_with_positions_and_ties_by_position(small) -> None:
    passages, ours, _ = small
    assert len(ours) == len(passages) and ours.passage(7) == passages[7]
    hits = ours.search("river", 50)
    assert all("river" in Tokenizer()(h.passage.title + " " + h.passage.text) for h in hits)
    for a, b in itertools.pairwise(hits):
        if a.score == b.score:
            assert int(a.passage.id[1:]) < int(b.passage.id[1:])
    assert ours.search("the of and", 3) == []  # only stopwords
    assert ours.search("zzzunseen", 3) == []
    with pytest.raises(ValueError, match="positive integer"):
        ours.search("river", 0)


def test_shards_score_with_the_corpus_idf_and_order_ties_across_shards(tmp_path) -> None:
    # Passages of one length, so every shard has the corpus's average length: then sharded
    # scores must be exact BM25 over the whole corpus (the IDF is the corpus's, not the
    # shard's), and equal scores in different shards must go to the earlier passage.
    passages = random_passages(900, seed=11, max_words=9, same_length=True)
    exact = CorpusRetriever.build(passages, tmp_path / "exact", k1=1.2, show_progress=False)
    sharded = TantivyRetriever.build(
        passages, tmp_path / "tv", shard_size=200, commit_every=70, threads=1, show_progress=False
    )
    one_thread = TantivyRetriever.load(tmp_path / "tv", search_threads=1)
    assert sharded.meta["shard_starts"] == [0, 200, 400, 600, 800]
    assert sharded.search_threads == min(5, os.cpu_count() or 1)
    compared = crossed = 0
    for query in [*queries(12, count=80), "river", "varn 1874"]:
        got, want = sharded.search(query, 10), exact.search(query, 10)
        assert [h.passage.id for h in got] == [h.passage.id for h in want], query
        for g, w in zip(got, want, strict=True):
            assert g.score == pytest.approx(w.score, rel=2e-5)
        assert one_thread.search(query, 10) == got
        compared += len(got)
        shards_hit = {int(h.passage.id[1:]) // 200 for h in got}
        crossed += len(shards_hit) > 1 and any(
            a.score == b.score for a, b in itertools.pairwise(got)
        )
    assert compared > 700 and crossed > 10  # ties spanning shards were really ordered
    many = sharded.search("river coast", 300)  # k beyond a shard's TIE_CANDIDATES
    assert len(many) == 300
    assert [h.passage.id for h in many] == [h.passage.id for h in exact.search("river coast", 300)]


def test_every_corpus_format_gives_the_same_index(tmp_path) -> None:
    passages = random_passages(120, seed=3)
    # Text a DPR file really holds: quotes (doubled in the TSV), a tab inside a quoted field.
    passages[5] = Passage("Aaron", 'Aaron ( or ; "Ahärôn") is\tthe brother of Moses', "p5")
    files = {
        "flashrag": write_jsonl(tmp_path / "wiki.jsonl", passages),
        "copes": write_jsonl(tmp_path / "copes.jsonl", passages, style="copes"),
        "dpr": write_dpr_tsv(tmp_path / "psgs_w100.tsv", passages),
    }
    with (tmp_path / "psgs_w100.tsv").open("rb") as f, gzip.open(tmp_path / "p.tsv.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    files["dpr-gz"] = tmp_path / "p.tsv.gz"
    for name, path in files.items():
        read = [p for p, _ in read_corpus(path)]
        assert read == passages, name
        index = TantivyRetriever.build(path, tmp_path / f"idx-{name}", show_progress=False)
        assert [index.passage(i) for i in range(len(index))] == passages
        assert index.search("Moses brother", 3)[0].passage.id == "p5"


def test_byte_positions_resume_a_read_exactly(tmp_path) -> None:
    passages = random_passages(50, seed=4)
    for path in (
        write_jsonl(tmp_path / "c.jsonl", passages),
        write_dpr_tsv(tmp_path / "c.tsv", passages),
    ):
        positions = [end for _, end in read_corpus(path)]
        assert positions[-1] == path.stat().st_size
        rest = [p for p, _ in read_corpus(path, start_byte=positions[19])]
        assert rest == passages[20:]


def test_bad_corpus_lines_are_named(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"A\\"\\nx"}\n{"id": 1, "body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: no string 'contents'"):
        TantivyRetriever.build(bad, tmp_path / "i", show_progress=False)
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("id\ttext\ttitle\n1\tonly two fields\n")
    with pytest.raises(ValueError, match=r"line 2: expected 3 tab-separated fields"):
        TantivyRetriever.build(tsv, tmp_path / "j", show_progress=False)
    assert not (tmp_path / "i").exists() and not (tmp_path / "j").exists()


_BUILD = """
import sys
from copes.envs.retrieval import TantivyRetriever
TantivyRetriever.build(sys.argv[1], sys.argv[2], commit_every=int(sys.argv[3]),
                       shard_size=int(sys.argv[4]), heap_mb=16, threads=1, show_progress=False)
"""


def test_a_build_killed_mid_way_resumes_from_its_last_commit(tmp_path, caplog) -> None:
    passages = random_passages(24_000, seed=5, max_words=12)
    corpus = write_jsonl(tmp_path / "wiki.jsonl", passages)
    out = tmp_path / "index"
    state = tmp_path / "index.building" / "build_state.json"
    # Shards of 5,000 with commits every 2,000: the kill lands in the second shard or later,
    # so the resume reopens a shard, cut mid-way, after finished ones.
    child = subprocess.Popen([sys.executable, "-c", _BUILD, str(corpus), str(out), "2000", "5000"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if state.is_file() and len(json.loads(state.read_text())["checkpoints"]) >= 4:
            break
        time.sleep(0.02)
    assert child.poll() is None, "the build ended before it could be killed; use more passages"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not out.exists()  # nothing half-built where a reader would look
    with pytest.raises(FileNotFoundError, match=r"interrupted in .*run the same build again"):
        open_index(out)
    # A checkpoint written just before a commit that never happened must not be trusted.
    recorded = json.loads(state.read_text())
    recorded["checkpoints"].append({"passages": 10**9, "corpus_byte": 1})
    state.write_text(json.dumps(recorded))

    caplog.set_level("INFO", logger="copes.envs.retrieval.tantivy_build")
    resumed = TantivyRetriever.build(
        corpus, out, commit_every=2000, shard_size=5000, show_progress=False
    )
    resumed_at = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    # >= 4 checkpoints were recorded (the 3rd ends shard 0); the last may not have committed.
    assert resumed_at and int(resumed_at[0].rsplit(" ", 1)[1]) >= 5_000
    assert resumed.meta["shard_starts"] == [0, 5000, 10000, 15000, 20000]
    reference = TantivyRetriever.build(
        passages, tmp_path / "ref", shard_size=5000, show_progress=False
    )
    assert len(resumed) == len(reference) == len(passages)
    assert [resumed.passage(i) for i in range(0, len(passages), 997)] == passages[::997]
    exact_order = 0
    for query in queries(6, count=60):
        before = resumed.ties_beyond_candidates + reference.ties_beyond_candidates
        got, want = resumed.search(query, 10), reference.search(query, 10)
        assert [h.score for h in got] == [h.score for h in want]
        if resumed.ties_beyond_candidates + reference.ties_beyond_candidates == before:
            assert [h.passage.id for h in got] == [h.passage.id for h in want]
            exact_order += 1
    assert exact_order >= 20 and resumed.ties_at_cut_off > 0


def test_an_interrupted_build_of_another_corpus_is_not_resumed(tmp_path) -> None:
    corpus = write_jsonl(tmp_path / "a.jsonl", random_passages(30, seed=7))
    staging = tmp_path / "index.building"
    staging.mkdir()
    (staging / "build_state.json").write_text(
        json.dumps({"source": {"path": "/x"}, "checkpoints": []})
    )
    with pytest.raises(ValueError, match=r"interrupted build of another corpus.*--restart"):
        TantivyRetriever.build(corpus, tmp_path / "index", show_progress=False)
    index = TantivyRetriever.build(corpus, tmp_path / "index", restart=True, show_progress=False)
    assert len(index) == 30
    with pytest.raises(FileExistsError, match="--overwrite"):
        TantivyRetriever.build(corpus, tmp_path / "index", show_progress=False)


def test_a_damaged_index_is_refused_at_load(tmp_path) -> None:
    index = tmp_path / "index"
    TantivyRetriever.build(random_passages(20, seed=8), index, show_progress=False)
    with (index / "passages.jsonl").open("ab") as f:
        f.write(b'{"id": "x"}\n')
    with pytest.raises(ValueError, match="does not match"):
        TantivyRetriever.load(index)
    with pytest.raises(FileNotFoundError, match="copes-index build"):
        open_index(tmp_path)
    other = tmp_path / "other"
    TantivyRetriever.build(random_passages(30, seed=9), other, show_progress=False)
    np.save(other / "shards" / "0000.positions.npy", np.arange(29, dtype=np.uint32))
    with pytest.raises(ValueError, match="position table does not match"):
        TantivyRetriever.load(other)
    meta = json.loads((other / "copes_index.json").read_text())
    (other / "copes_index.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(ValueError, match=r"format 1.*rebuild it with copes-index build"):
        TantivyRetriever.load(other)


def test_open_index_shares_one_retriever_and_knows_both_backends(small, tmp_path) -> None:
    _, ours, exact = small
    assert open_index(ours.index_dir) is open_index(ours.index_dir)
    assert isinstance(open_index(exact.index_dir), CorpusRetriever)


# --- copes-index -------------------------------------------------------------------------


def test_copes_index_build_query_and_one_line_errors(tmp_path, capsys) -> None:
    corpus = write_dpr_tsv(tmp_path / "psgs.tsv", random_passages(200, seed=9))
    assert index_main(["build", str(corpus), str(tmp_path / "idx"), "--quiet"]) == 0
    assert "indexed 200 passages" in capsys.readouterr().out
    assert index_main(["query", str(tmp_path / "idx"), "museum painter", "-k", "2", "--json"]) == 0
    hits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [h["rank"] for h in hits] == [1, 2] and hits[0]["score"] >= hits[1]["score"]

    cases = [
        (["build", str(corpus), str(tmp_path / "idx"), "--quiet"], "already exists"),
        (["build", str(tmp_path / "nope.tsv"), str(tmp_path / "x")], "does not exist"),
        (
            ["build", str(corpus), str(tmp_path / "y"), "--backend", "bm25s", "--restart"],
            "tantivy backend only",
        ),
        (["query", str(tmp_path), "river"], "not a copes corpus index"),
        (["query", str(tmp_path / "idx"), "river", "-k", "0"], "-k must be at least 1"),
    ]
    for argv, message in cases:
        assert index_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert (
            message in err and len(err.splitlines()) == 1 and err.startswith("copes-index: error")
        )


def test_copes_index_serve_answers_like_the_index(tmp_path) -> None:
    index_dir = tmp_path / "idx"
    TantivyRetriever.build(random_passages(300, seed=10), index_dir, show_progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "copes.envs.retrieval.cli",
            "serve",
            str(index_dir),
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        remote = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=2, retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                remote.search("river", 1)
                break
            except Exception:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.2)
        local = TantivyRetriever.load(index_dir)
        for query in queries(11, count=10):
            want = [(h.passage, pytest.approx(h.score, rel=1e-6)) for h in local.search(query, 4)]
            assert [(h.passage, h.score) for h in remote.search(query, 4)] == want
    finally:
        server.terminate()
        server.wait(timeout=30)


# --- open-domain QA: the env and copes-eval over a wiki-style index ---------------------------


@pytest.fixture(scope="module")
def wiki_index(tmp_path_factory) -> Path:
    """Every paragraph of the HotpotQA fixture plus filler, as one FlashRAG-style corpus."""
    from copes.envs.tasks.builtin import load_benchmark

    root = tmp_path_factory.mktemp("wiki")
    tasks = load_benchmark("hotpotqa", source=FIXTURES / "hotpot_dev_distractor_v1.json")
    seen: dict[str, Passage] = {}
    for task in tasks:
        for p in task.passages:
            seen.setdefault(p.title, Passage(p.title, p.text, f"wiki-{len(seen)}"))
    corpus = write_jsonl(root / "wiki.jsonl", [*seen.values(), *random_passages(500, seed=12)])
    assert index_main(["build", str(corpus), str(root / "index"), "--quiet"]) == 0
    return root / "index"


def test_toolqa_searches_the_wiki_index_instead_of_the_question_pool(wiki_index) -> None:
    from copes.envs.presets import tool_qa_env

    env = tool_qa_env(
        benchmark="flashrag-hotpotqa",
        source=FIXTURES / "flashrag_hotpotqa_dev.jsonl",
        corpus_index=str(wiki_index),
    )
    env.reset(seed=0)
    observation, *_ = env.step("<search>Glass Lantern Theatre</search>")
    assert "Glass Lantern Theatre" in observation and "[1]" in observation
    env.close()


def test_copes_eval_runs_open_domain_over_the_index(tiny_agent_dir, wiki_index, tmp_path) -> None:
    from copes.evaluation.cli import main as eval_main

    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(FIXTURES / "flashrag_hotpotqa_dev.jsonl", data / "flashrag-hotpotqa.jsonl")
    common = [
        "--model", str(tiny_agent_dir), "--benchmarks", "flashrag-hotpotqa", "--data-dir",
        str(data), "--pass-k", "1", "-n", "1", "--limit", "2", "--max-new-tokens", "32",
        "--max-turns", "2", "--device", "cpu", "--quiet", "--save-messages",
    ]  # fmt: skip
    out = tmp_path / "eval"
    kwargs = json.dumps({"corpus_index": str(wiki_index), "top_k": 2})
    assert eval_main([*common, "--env-kwargs", kwargs, "--out", str(out)]) == 0
    config = json.loads((out / "eval_config.json").read_text())
    assert config["env_kwargs"] == {"corpus_index": str(wiki_index), "top_k": 2}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    # Resuming into the same folder with another index is refused, not mixed.
    other = json.dumps({"corpus_index": str(wiki_index), "top_k": 3})
    assert eval_main([*common, "--env-kwargs", other, "--out", str(out)]) == 2
    # A folder that is not an index fails before the model is loaded.
    started = time.monotonic()
    bad = json.dumps({"corpus_index": str(tmp_path)})
    assert eval_main([*common, "--env-kwargs", bad, "--out", str(tmp_path / "e2")]) == 2
    assert time.monotonic() - started < 20
    graded = json.dumps({"qa_rule": "squad"})
    assert eval_main([*common, "--env-kwargs", graded, "--out", str(tmp_path / "e3")]) == 2
