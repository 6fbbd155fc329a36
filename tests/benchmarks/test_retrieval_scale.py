"""benchmarks/retrieval_scale.py end to end at a small size (CI's size; 21M is run by hand)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import retrieval_scale  # noqa: E402


def test_the_corpus_is_the_same_for_any_number_of_writers(tmp_path) -> None:
    vocab = retrieval_scale.Vocabulary(20_000, seed=3)
    assert len(set(vocab.words)) == 20_000
    one = retrieval_scale.write_corpus(tmp_path / "a.jsonl", 12_000, vocab, 3, 1, chunk=2_500)
    two = retrieval_scale.write_corpus(tmp_path / "b.jsonl", 12_000, vocab, 3, 2, chunk=2_500)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert one == two and len(one) >= 1000
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) == 12_000 and json.loads(lines[7])["id"] == "7"
    # Zipf: the commonest word (a stopword) is drawn ln 2 / ln(V + 1) of the time.
    ranks = vocab.sample(np.random.default_rng(0), 200_000)
    assert np.mean(ranks == 0) == pytest.approx(np.log(2) / np.log(20_001), rel=0.05)


def test_small_end_to_end_writes_every_figure(tmp_path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "retrieval_scale.py"), "--passages", "20000",
         "--vocab", "30000", "--queries-per-bucket", "12", "--exact", "1.2", "--workers", "1",
         "--heap-mb", "64", "--shard-size", "6000", "--work-dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["passages"] == 20_000 and report["config"]["queries"] == 108
    assert report["build"]["build_s"] > 0 and report["build"]["peak_rss_mib"] > 0
    assert report["index_bytes"]["tantivy"] > 0 and report["index_bytes"]["passages"] > 0
    assert report["index_bytes"]["position_tables"] > 0
    assert report["build"]["shards"] == 4 and len(report["build"]["segments_per_shard"]) == 4
    query = report["query"]
    for name in (
        "cold",
        "warm",
        "warm_one_search_thread",
        "warm_without_the_tie_rule",
        "search_tool_top3_warm",
        "env_step_search_top3_warm",
    ):
        stats = query[name]
        assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"]
    assert len(query["by_bucket"]) == 9
    assert all(b["queries"] == 12 and b["mean_hits"] > 0 for b in query["by_bucket"].values())
    assert query["rss_mib_after_queries"]["RssAnon"] > 0
    agreement = report["exact_bm25"]["k1=1.2"]["agreement"]
    for bucket in ("all", "head", "passage", "tail"):
        a = agreement[bucket]
        assert 0.5 < a["top_k_overlap"] <= a["tie_aware_overlap"] + 1e-9 <= 1 + 1e-9
        assert 0.95 < a["score_recall"] <= 1 + 1e-6
    assert not any(tmp_path.glob("retrieval_scale-*")), "the work folder was not removed"


def test_a_kept_run_is_searched_again_without_a_build(tmp_path) -> None:
    script = [sys.executable, str(ROOT / "benchmarks" / "retrieval_scale.py")]
    small = ["--vocab", "20000", "--queries-per-bucket", "4", "--workers", "1", "--heap-mb", "32"]
    first = subprocess.run(
        [*script, "--passages", "3000", *small, "--work-dir", str(tmp_path), "--keep",
         "--shard-size", "1000", "--out", str(tmp_path / "first.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    (kept,) = tmp_path.glob("retrieval_scale-*")
    again = subprocess.run(
        [*script, "--reuse", str(kept), "--out", str(tmp_path / "again.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads((tmp_path / "again.json").read_text())
    assert report["build"] == {"reused": str(kept), "shards": 3}
    assert report["config"]["passages"] == 3000 and report["query"]["warm"]["p50_ms"] > 0
    assert (kept / "index").is_dir()  # a reused run never deletes what it did not make
    bad = subprocess.run(
        [*script, "--reuse", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "lacks corpus.jsonl, queries.json, index" in bad.stderr
