"""Query latency and build time of the two BM25 backends on one synthetic corpus.

Why: the search tool runs inside every rollout step, so its latency multiplies by the
number of tool calls per training step. This measures `PoolRetriever` (rank-bm25, meant
for 10-20 passage pools) against `CorpusRetriever` (bm25s, meant for open corpora) on the
same passages and queries, through the same API the tool uses (tokenizing, scoring,
top-k, fetching passages), to show where each one belongs.

The corpus is seeded and synthetic: a Zipf-distributed vocabulary of pseudo-words,
passages of 40-160 words with a two-word title; each query takes 2-5 words of one random
passage, so every query has hits.

    python benchmarks/retrieval_latency.py --passages 100000 --queries 200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import string
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from copes.envs.retrieval import CorpusRetriever, PoolRetriever, Retriever
from copes.envs.tasks.base import Passage

DEFAULT_OUT = Path(__file__).parent / "results" / "retrieval_latency.json"


def make_corpus(num_passages: int, vocab_size: int, seed: int) -> list[Passage]:
    """Seeded passages whose word frequencies follow Zipf's law, like real text."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase))
    lengths = rng.integers(3, 10, size=vocab_size)
    vocab = sorted({"".join(rng.choice(letters, size=n)) for n in lengths})
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    weights /= weights.sum()
    passage_lengths = rng.integers(40, 161, size=num_passages)
    words = rng.choice(len(vocab), size=int(passage_lengths.sum()) + 2 * num_passages, p=weights)
    passages, cursor = [], 0
    for i, n in enumerate(tqdm(passage_lengths, desc="Generating passages", unit=" passages")):
        title = " ".join(vocab[w].capitalize() for w in words[cursor : cursor + 2])
        text = " ".join(vocab[w] for w in words[cursor + 2 : cursor + 2 + n])
        passages.append(Passage(title=title, text=text, id=str(i)))
        cursor += 2 + n
    return passages


def make_queries(passages: list[Passage], num_queries: int, seed: int) -> list[str]:
    """2-5 words of a random passage (title included), as an agent's keyword query."""
    rng = np.random.default_rng(seed + 1)
    queries = []
    for doc in rng.integers(0, len(passages), size=num_queries):
        words = f"{passages[doc].title} {passages[doc].text}".lower().split()
        queries.append(" ".join(rng.choice(words, size=int(rng.integers(2, 6)), replace=False)))
    return queries


def time_queries(retriever: Retriever, queries: list[str], k: int, desc: str) -> dict:
    """Per-query wall time in milliseconds (after two warm-up queries)."""
    for query in queries[:2]:
        retriever.search(query, k)
    times, top1 = [], []
    for query in tqdm(queries, desc=desc, unit=" queries"):
        start = time.perf_counter()
        hits = retriever.search(query, k)
        times.append((time.perf_counter() - start) * 1000.0)
        top1.append(hits[0].passage.id if hits else None)
    return {
        "num_queries": len(times),
        "median_ms": statistics.median(times),
        "p95_ms": float(np.percentile(times, 95)),
        "mean_ms": statistics.fmean(times),
        "top1": top1,
    }


def cpu_model() -> str:
    """The CPU model name on Linux (`platform.processor()` is often empty there)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000, help="corpus size")
    parser.add_argument("--queries", type=int, default=200, help="queries timed on bm25s")
    parser.add_argument(
        "--rank-bm25-queries",
        type=int,
        default=None,
        help="queries timed on rank-bm25 (a prefix of the same queries); default: --queries",
    )
    parser.add_argument("--k", type=int, default=10, help="hits per query")
    parser.add_argument("--vocab", type=int, default=50_000, help="vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args()
    rank_queries = args.queries if args.rank_bm25_queries is None else args.rank_bm25_queries

    passages = make_corpus(args.passages, args.vocab, args.seed)
    queries = make_queries(passages, args.queries, args.seed)

    pool, pool_build_s = timed(PoolRetriever, passages)
    rank = time_queries(pool, queries[:rank_queries], args.k, "rank-bm25 queries")
    del pool

    with tempfile.TemporaryDirectory() as tmp:
        index_dir = Path(tmp) / "index"
        built, corpus_build_s = timed(CorpusRetriever.build, passages, index_dir)
        built.close()
        index_mb = sum(f.stat().st_size for f in index_dir.rglob("*") if f.is_file()) / 2**20
        results = {}
        load_s = {}
        for memory_map in (True, False):
            name = "bm25s_mmap" if memory_map else "bm25s_in_memory"
            retriever, load_s[name] = timed(CorpusRetriever.load, index_dir, memory_map=memory_map)
            results[name] = time_queries(retriever, queries, args.k, f"{name} queries")
            retriever.close()

    # rank-bm25 may time only a prefix of the queries; compare on that prefix.
    agree = [a == b for a, b in zip(rank["top1"], results["bm25s_mmap"]["top1"], strict=False)]
    report = {
        "config": {
            "passages": args.passages,
            "queries": args.queries,
            "rank_bm25_queries": rank_queries,
            "k": args.k,
            "vocab": args.vocab,
            "seed": args.seed,
            "mean_passage_words": float(np.mean([len(p.text.split()) for p in passages])),
        },
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "rank_bm25": version("rank-bm25"),
            "bm25s": version("bm25s"),
        },
        "build_s": {"rank_bm25": pool_build_s, "bm25s": corpus_build_s},
        "load_s": load_s,
        "index_mb_on_disk": index_mb,
        "latency_ms": {"rank_bm25": rank, **results},
        "median_ratio_rank_bm25_over_bm25s_mmap": rank["median_ms"]
        / results["bm25s_mmap"]["median_ms"],
        "top1_agreement": sum(agree) / len(agree),
    }
    for stats in report["latency_ms"].values():
        del stats["top1"]

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    print(f"\n{args.passages:,} passages, k={args.k}")
    print(f"{'backend':<18}{'build s':>9}{'load s':>8}{'queries':>9}{'median ms':>11}{'p95 ms':>9}")
    for name, stats in report["latency_ms"].items():
        build = report["build_s"].get("rank_bm25" if name == "rank_bm25" else "bm25s")
        load = f"{load_s[name]:.2f}" if name in load_s else "-"
        print(
            f"{name:<18}{build:>9.1f}{load:>8}{stats['num_queries']:>9}"
            f"{stats['median_ms']:>11.2f}{stats['p95_ms']:>9.2f}"
        )
    print(
        f"rank-bm25 / bm25s (mmap) median latency: "
        f"{report['median_ratio_rank_bm25_over_bm25s_mmap']:.0f}x; "
        f"top-1 agreement {report['top1_agreement']:.0%}; index {index_mb:.0f} MiB on disk"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
