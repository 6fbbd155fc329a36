"""The search tool at Wikipedia scale: build, memory and latency of the tantivy index.

Why: agentic-search work (Search-R1, FlashRAG, R1-Searcher) retrieves from the 2018
Wikipedia of 21,015,324 passages (DPR's psgs_w100: a title + 100 words). This builds a
seeded synthetic corpus of that shape, indexes it with `copes-index build`'s code in a
child process, and times top-10 searches through the API the `search` tool uses, so the
figures say what an agent's env.step pays.

The corpus: passages of 100 words (one in ten shorter, 20-99, like the last passage of an
article) and a 1-4 word title; words are drawn from a Zipf law (exponent 1) over a
vocabulary of `--vocab` words (5M by default, about Wikipedia's count of distinct tokens).
As in English text, the commonest ranks are function words: the first 63 are copes'
stopwords (`ENGLISH_STOPWORDS`, 27% of the tokens here, about 40% in English), which the
tokenizer drops, so the commonest indexed word is in about 10% of the passages, as
Wikipedia's commonest content words are. The rest are pseudo-words. Titles draw from
outside the 1,000 commonest content words, as entity names do. It is
written as FlashRAG / Search-R1 JSONL (`{"id", "contents": "\\"Title\\"\\ntext"}`) in chunks
generated in parallel from per-chunk seeds (the same file for any number of workers),
streamed to disk and never held in memory.

The queries: >= 1,000, in 9 buckets of length (1-2, 3-5, 6-10 terms) by rarity:
`head` (only the 1,000 commonest content words: the longest posting lists), `passage`
(content words of one random passage and its title, as an agent's query) and `tail` (a
passage's words ranked below the 10,000 commonest).

Latency: the index is opened in a fresh process; `cold` is the first pass over all queries
right after the index files are evicted from the page cache (posix_fadvise DONTNEED, no
root needed), `warm` the third pass. Memory at query time is reported as RSS split into
anonymous memory (what the process owns) and file pages (the shared page cache).

    python benchmarks/retrieval_scale.py --passages 1000000 --exact 1.2 1.5 \
        --out benchmarks/results/retrieval_scale-1M.json
    python benchmarks/retrieval_scale.py --passages 21015324 \
        --out benchmarks/results/retrieval_scale-21M.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from copes.envs.retrieval.base import ENGLISH_STOPWORDS

WIKI18_PASSAGES = 21_015_324
CHUNK = 50_000
LENGTH_BUCKETS = {"1-2": (1, 2), "3-5": (3, 5), "6-10": (6, 10)}
RARITY_BUCKETS = ("head", "passage", "tail")
STOPWORDS = sorted(ENGLISH_STOPWORDS)  # ranks 0-62: dropped by the tokenizer, as in English
HEAD = (len(STOPWORDS), len(STOPWORDS) + 1_000)  # the 1,000 commonest indexed words
TAIL_RANK = 10_000


# --- the corpus -----------------------------------------------------------------------


class Vocabulary:
    """`size` distinct lowercase pseudo-words; short ones are frequent, as in real text."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 1])
        ranks = np.arange(size)
        lengths = np.clip(
            np.round(2.5 + 1.15 * np.log10(ranks + 10) + rng.normal(0, 1.2, size)), 2, 16
        ).astype(np.int64)
        words: dict[str, None] = dict.fromkeys(STOPWORDS)
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
        while len(words) < size:
            need = size - len(words)
            lens = lengths[len(words) : len(words) + need]
            if len(lens) < need:  # pseudo-words that were stopwords: draw lengths again
                lens = np.concatenate([lens, rng.integers(3, 12, need - len(lens))])
            buffer = letters[rng.integers(0, 26, size=int(lens.sum()))].tobytes().decode()
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            for start, n in zip(starts.tolist(), lens.tolist(), strict=True):
                words.setdefault(buffer[start : start + n])
        self.words = list(words)[:size]
        self._log_size = float(np.log(size + 1))

    def sample(self, rng: np.random.Generator, n: int, low_rank: int = 0) -> np.ndarray:
        """`n` word ranks, P(rank r) = ln((r + 2) / (r + 1)) / ln(V + 1) (Zipf, exponent 1),
        restricted to ranks >= `low_rank`; drawn by inverting the CDF in closed form."""
        low = float(np.log(low_rank + 1))
        x = np.exp(low + (self._log_size - low) * rng.random(n))
        return np.minimum(x.astype(np.int64) - 1, len(self.words) - 1)


_VOCAB: Vocabulary | None = None


def _chunk(args: tuple[int, int, int, int]) -> tuple[bytes, list[tuple[int, list[int]]]]:
    """Passages [start, stop) as JSONL bytes, plus the word ranks of the query passages."""
    seed, start, stop, query_every = args
    vocab = _VOCAB
    assert vocab is not None
    rng = np.random.default_rng([seed, 2, start])
    n = stop - start
    lengths = np.where(rng.random(n) < 0.1, rng.integers(20, 100, n), 100)
    title_lengths = rng.integers(1, 5, n)
    text_ids = vocab.sample(rng, int(lengths.sum()))
    title_ids = vocab.sample(rng, int(title_lengths.sum()), low_rank=HEAD[1])
    words = vocab.words
    text_ids, title_ids = text_ids.tolist(), title_ids.tolist()
    lengths, title_lengths = lengths.tolist(), title_lengths.tolist()
    lines, sources = [], []
    t = w = 0
    for i in range(n):
        title_words = title_ids[t : t + title_lengths[i]]
        ids = text_ids[w : w + lengths[i]]
        title = " ".join([words[j].capitalize() for j in title_words])
        text = " ".join(map(words.__getitem__, ids))
        lines.append(f'{{"id": "{start + i}", "contents": "\\"{title}\\"\\n{text}"}}\n')
        if (start + i) % query_every == 0:
            sources.append((start + i, [*title_words, *ids]))
        t += title_lengths[i]
        w += lengths[i]
    return "".join(lines).encode(), sources


def write_corpus(
    path: Path, passages: int, vocab: Vocabulary, seed: int, workers: int, chunk: int = CHUNK
) -> list[tuple[int, list[int]]]:
    """Stream the corpus to `path`; returns the word ranks of every 1 in ~N/2000 passages."""
    global _VOCAB
    _VOCAB = vocab
    query_every = max(1, passages // 2000)
    jobs = [(seed, s, min(s + chunk, passages), query_every) for s in range(0, passages, chunk)]
    sources: list[tuple[int, list[int]]] = []
    context = multiprocessing.get_context("fork")  # workers share the vocabulary pages
    with (
        path.open("wb") as out,
        context.Pool(workers) as pool,
        tqdm(total=passages, desc="Writing corpus", unit=" passages", unit_scale=True) as bar,
    ):
        for blob, chunk_sources in pool.imap(_chunk, jobs):
            out.write(blob)
            sources.extend(chunk_sources)
            bar.update(min(chunk, passages - bar.n))
    return sources


def make_queries(
    vocab: Vocabulary, sources: list[tuple[int, list[int]]], per_bucket: int, seed: int
) -> list[dict[str, Any]]:
    """`per_bucket` queries in each of the 9 (length, rarity) buckets."""
    rng = np.random.default_rng([seed, 3])
    queries = []
    for length_name, (low, high) in LENGTH_BUCKETS.items():
        for rarity in RARITY_BUCKETS:
            made = 0
            while made < per_bucket:
                n = int(rng.integers(low, high + 1))
                if rarity == "head":
                    ranks = rng.integers(*HEAD, n)
                else:
                    _, words = sources[int(rng.integers(len(sources)))]
                    rarest = TAIL_RANK if rarity == "tail" else HEAD[0]
                    pool = [r for r in words if r >= rarest]
                    pool = list(dict.fromkeys(pool))
                    if len(pool) < n:
                        continue
                    ranks = rng.choice(pool, size=n, replace=False)
                text = " ".join(vocab.words[int(r)] for r in ranks)
                queries.append({"text": text, "length": length_name, "rarity": rarity})
                made += 1
    return queries


# --- the child processes ---------------------------------------------------------------


def _peak_memory_of(pid: int, stop: threading.Event, peak: dict[str, int]) -> None:
    """Poll /proc/PID/status for the peak anonymous and file-backed resident memory."""
    while not stop.wait(0.5):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS"):
                kib = int(value.split()[0])
                peak[key] = max(peak.get(key, 0), kib)


def run_child(args: list[str]) -> tuple[dict[str, Any], dict[str, float]]:
    """Run this script as a child with `args`; its JSON result and its peak memory (MiB)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = Path(f.name)
    process = subprocess.Popen([sys.executable, __file__, *args, "--child-out", str(result_path)])
    peak: dict[str, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_peak_memory_of, args=(process.pid, stop, peak))
    poller.start()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    poller.join()
    if process.returncode != 0:
        raise SystemExit(f"child {args[0]} failed with exit code {process.returncode}")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    memory = {
        "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
        "peak_rss_anon_mib": peak.get("RssAnon", 0) / 1024,
        "peak_rss_file_mib": peak.get("RssFile", 0) / 1024,
    }
    return result, memory


def child_build(
    corpus: str, index_dir: str, heap_mb: int, threads: int | None, shard_size: int
) -> dict:
    from copes.envs.retrieval.tantivy_index import TantivyRetriever

    started = time.perf_counter()
    retriever = TantivyRetriever.build(
        corpus, index_dir, heap_mb=heap_mb, threads=threads, shard_size=shard_size, overwrite=True
    )
    seconds = time.perf_counter() - started
    shards = retriever._shards
    segments = [shard.searcher.num_segments for shard in shards]
    retriever.close()
    return {"build_s": seconds, "shards": len(shards), "segments_per_shard": segments}


def _evict(directory: Path) -> None:
    """Drop `directory`'s files from the page cache (clean pages; no root needed)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rss_split() -> dict[str, float]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            values[key] = int(value.split()[0]) / 1024
    return values


def _percentiles(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": statistics.fmean(ms),
    }


def _timed(function: Any, *args: Any) -> float:
    """Milliseconds one call takes."""
    t0 = time.perf_counter()
    function(*args)
    return (time.perf_counter() - t0) * 1000.0


def child_query(index_dir: str, queries_path: str, k: int) -> dict:
    from copes.envs.presets import tool_qa_env
    from copes.envs.retrieval.tantivy_index import TantivyRetriever
    from copes.envs.tools.search import SearchTool

    queries = json.loads(Path(queries_path).read_text())
    _evict(Path(index_dir))
    rss_before = _rss_split()
    started = time.perf_counter()
    retriever = TantivyRetriever.load(index_dir)
    load_s = time.perf_counter() - started
    passes: list[list[float]] = []
    hits: list[list[str]] = []
    for number in range(3):
        retriever.ties_at_cut_off = retriever.ties_beyond_candidates = 0
        times = []
        for query in queries:
            t0 = time.perf_counter()
            found = retriever.search(query["text"], k)
            times.append((time.perf_counter() - t0) * 1000.0)
            if number == 0:
                hits.append([h.passage.id for h in found])
        passes.append(times)
    tool = SearchTool(retriever, top_k=3)
    tool_ms = [_timed(tool, query["text"]) for query in queries]
    # What an agent's turn pays: ToolQA-v0's env.step on a search call (parsing the turn,
    # the tool, the observation), the index opened as copes-train opens it.
    env = tool_qa_env(benchmark="synthetic-qa", limit=8, corpus_index=index_dir, max_turns=64)
    env.reset(seed=0)
    step_ms = []
    for number, query in enumerate(queries):
        if number % 60 == 59:
            env.reset(seed=number)
        t0 = time.perf_counter()
        env.step(f"<search>{query['text']}</search>")
        step_ms.append((time.perf_counter() - t0) * 1000.0)
    env.close()
    cold, warm = passes[0], passes[2]
    ties = {  # of the last pass: the share of searches whose top-k cut-off fell in a tie
        "cut_off_in_a_tie": retriever.ties_at_cut_off / len(queries),
        "tie_beyond_candidates": retriever.ties_beyond_candidates / len(queries),
    }
    # Side by side with the warm pass: the shards searched one after the other (what the
    # search threads buy), and each shard returning k + 1 hits instead of TIE_CANDIDATES
    # (what ordering ties by corpus position costs).
    from copes.envs.retrieval import tantivy_index

    threads, retriever.search_threads = retriever.search_threads, 1
    one_thread = [_timed(retriever.search, query["text"], k) for query in queries]
    retriever.search_threads = threads
    saved, tantivy_index.TIE_CANDIDATES = tantivy_index.TIE_CANDIDATES, 0
    no_tie_rule = [_timed(retriever.search, query["text"], k) for query in queries]
    tantivy_index.TIE_CANDIDATES = saved
    by_bucket = {}
    for length in LENGTH_BUCKETS:
        for rarity in RARITY_BUCKETS:
            idx = [
                i for i, q in enumerate(queries) if (q["length"], q["rarity"]) == (length, rarity)
            ]
            by_bucket[f"{length}/{rarity}"] = {
                "queries": len(idx),
                "warm": _percentiles([warm[i] for i in idx]),
                "mean_hits": statistics.fmean(len(hits[i]) for i in idx),
            }
    return {
        "load_s": load_s,
        "cold": _percentiles(cold),
        "warm": _percentiles(warm),
        "ties": ties,
        "search_threads": threads,
        "warm_one_search_thread": _percentiles(one_thread),
        "warm_without_the_tie_rule": _percentiles(no_tie_rule),
        "search_tool_top3_warm": _percentiles(tool_ms),
        "env_step_search_top3_warm": _percentiles(step_ms),
        "by_bucket": by_bucket,
        "rss_mib_before_load": rss_before,
        "rss_mib_after_queries": _rss_split(),
        "hits": hits,
    }


def child_exact(
    corpus: str, index_dir: str, queries_path: str, ours_path: str, k: int, k1: float
) -> dict:
    """Exact BM25 (bm25s, in RAM) with the given k1: its top-k, and the exact scores of the
    tantivy hits, so ties and near-ties can be told from real disagreements."""
    from copes.envs.retrieval.bm25s_index import CorpusRetriever
    from copes.envs.retrieval.corpus_files import read_corpus

    queries = json.loads(Path(queries_path).read_text())
    ours = json.loads(Path(ours_path).read_text())
    started = time.perf_counter()
    passages = (p for p, _ in read_corpus(corpus))
    retriever = CorpusRetriever.build(passages, index_dir, k1=k1, overwrite=True)
    build_s = time.perf_counter() - started
    exact_hits, exact_scores, our_scores = [], [], []
    for query, our_ids in zip(queries, ours, strict=True):
        hits = retriever.search(query["text"], k)
        exact_hits.append([h.passage.id for h in hits])
        exact_scores.append([h.score for h in hits])
        token_ids = [retriever._vocab.get(t) for t in retriever.tokenizer(query["text"])]
        token_ids = [t for t in token_ids if t is not None]
        scores = retriever._bm25.get_scores_from_ids(token_ids) * (k1 + 1.0) if token_ids else None
        # The synthetic corpus's ids are the passages' positions.
        our_scores.append([float(scores[int(i)]) if scores is not None else 0.0 for i in our_ids])
    retriever.close()
    return {
        "build_s": build_s,
        "hits": exact_hits,
        "scores": exact_scores,
        "our_scores": our_scores,
    }


def agreement(
    queries: list[dict], ours: list[list[str]], exact: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """How tantivy's top-k compares with exact BM25's, overall and by query rarity:

    - `top_k_overlap`: the share of exact top-k passages tantivy returns;
    - `tie_aware_overlap`: the share of tantivy's hits whose exact score reaches the exact
      k-th score (a passage tied with the k-th is as right as the one exact BM25 kept);
    - `top1_same`: the first hit is the same passage;
    - `score_recall`: the exact scores of tantivy's hits over those of the exact top-k.
    """

    def summary(idx: list[int]) -> dict[str, float]:
        overlap, tie_aware, top1, recall = [], [], [], []
        for i in idx:
            want, got = exact["hits"][i], ours[i]
            if not want:
                continue
            kth = exact["scores"][i][-1] * (1 - 1e-6)
            overlap.append(len(set(got) & set(want)) / len(want))
            tie_aware.append(sum(s >= kth for s in exact["our_scores"][i]) / len(want))
            top1.append(got[:1] == want[:1])
            recall.append(sum(exact["our_scores"][i]) / sum(exact["scores"][i]))
        return {
            "queries": len(overlap),
            "top_k_overlap": statistics.fmean(overlap),
            "tie_aware_overlap": statistics.fmean(tie_aware),
            "top1_same": statistics.fmean(top1),
            "score_recall": statistics.fmean(recall),
        }

    result = {"all": summary(list(range(len(queries))))}
    for rarity in RARITY_BUCKETS:
        result[rarity] = summary([i for i, q in enumerate(queries) if q["rarity"] == rarity])
    return result


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "python": platform.python_version(),
        "tantivy": version("tantivy"),
        "bm25s": version("bm25s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000, help=f"wiki-18: {WIKI18_PASSAGES}")
    parser.add_argument("--vocab", type=int, default=5_000_000, help="distinct words")
    parser.add_argument("--queries-per-bucket", type=int, default=112, help="9 buckets")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heap-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shard-size", type=int, default=None, help="default: copes-index's")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="corpus writers")
    parser.add_argument(
        "--exact",
        type=float,
        nargs="*",
        default=None,
        metavar="K1",
        help="also rank with exact BM25 (bm25s, in RAM: ~10 GB at 1M passages) at these k1 "
        "(default 1.2, tantivy's) and report the top-k agreement",
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="where corpus and index go")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and index")
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        metavar="WORK_DIR",
        help="search the index of a run kept with --keep again (no corpus, no build)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results path")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard_size is None:
        from copes.envs.retrieval.tantivy_build import SHARD_SIZE

        args.shard_size = SHARD_SIZE

    if args.child:
        kind, *rest = args.child
        if kind == "build":
            result = child_build(rest[0], rest[1], int(rest[2]), int(rest[3]) or None, int(rest[4]))
        elif kind == "query":
            result = child_query(rest[0], rest[1], int(rest[2]))
        else:
            result = child_exact(rest[0], rest[1], rest[2], rest[3], int(rest[4]), float(rest[5]))
        args.child_out.write_text(json.dumps(result))
        return

    if args.passages < CHUNK and args.passages < 1:
        parser.error("--passages must be positive")
    exact_k1 = [] if args.exact is None else (args.exact or [1.2])
    load_before = os.getloadavg()
    reused = args.reuse is not None
    if reused:
        work = args.reuse
        missing = [n for n in ("corpus.jsonl", "queries.json", "index") if not (work / n).exists()]
        if missing:
            parser.error(f"--reuse {work} lacks {', '.join(missing)} (keep a run with --keep)")
    else:
        work = Path(tempfile.mkdtemp(prefix="retrieval_scale-", dir=args.work_dir))
    try:
        corpus = work / "corpus.jsonl"
        queries_path = work / "queries.json"
        index_dir = work / "index"
        if reused:
            # Search only: the corpus, queries and index of a kept run (the search code
            # changed, the index did not); the build figures are that run's.
            queries = json.loads(queries_path.read_text())
            vocab_s = corpus_s = None
            meta = json.loads((index_dir / "copes_index.json").read_text())
            build, build_memory = {"reused": str(work), "shards": len(meta["shard_starts"])}, {}
            args.passages = meta["num_passages"]
        else:
            started = time.perf_counter()
            vocab = Vocabulary(args.vocab, args.seed)
            vocab_s = time.perf_counter() - started
            started = time.perf_counter()
            sources = write_corpus(corpus, args.passages, vocab, args.seed, args.workers)
            corpus_s = time.perf_counter() - started
            queries = make_queries(vocab, sources, args.queries_per_bucket, args.seed)
            queries_path.write_text(json.dumps(queries))
            del vocab, sources
            build, build_memory = run_child(
                [
                    "--child",
                    "build",
                    str(corpus),
                    str(index_dir),
                    str(args.heap_mb),
                    str(args.threads or 0),
                    str(args.shard_size),
                ]
            )
        index_bytes = {
            "tantivy": sum(
                f.stat().st_size
                for f in (index_dir / "shards").rglob("*")
                if f.is_file() and not f.name.endswith(".npy")
            ),
            "position_tables": sum(f.stat().st_size for f in (index_dir / "shards").glob("*.npy")),
            "passages": sum(f.stat().st_size for f in index_dir.glob("passages.*")),
        }
        query, query_memory = run_child(
            ["--child", "query", str(index_dir), str(queries_path), str(args.k)]
        )
        exact = {}
        ours_path = work / "ours.json"
        ours_path.write_text(json.dumps(query["hits"]))
        for k1 in exact_k1:
            result, memory = run_child(
                [
                    "--child",
                    "exact",
                    str(corpus),
                    str(work / f"bm25s-{k1}"),
                    str(queries_path),
                    str(ours_path),
                    str(args.k),
                    str(k1),
                ]
            )
            shutil.rmtree(work / f"bm25s-{k1}", ignore_errors=True)
            exact[f"k1={k1}"] = {
                "build_s": result["build_s"],
                "peak_rss_mib": memory["peak_rss_mib"],
                "agreement": agreement(queries, query["hits"], result),
            }
        del query["hits"]
        report = {
            "config": {
                "passages": args.passages,
                "vocab": args.vocab,
                "queries": len(queries),
                "k": args.k,
                "seed": args.seed,
                "heap_mb": args.heap_mb,
                "threads": args.threads,
                "shard_size": args.shard_size,
                "corpus_bytes": corpus.stat().st_size,
            },
            "machine": machine(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "corpus_write_s": corpus_s,
            "vocabulary_s": vocab_s,
            "build": {**build, **build_memory},
            "index_bytes": index_bytes,
            "query": {**query, "process_memory": query_memory},
            "exact_bm25": exact,
        }
    finally:
        if not args.keep and not reused:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    q = report["query"]
    built = (
        f"reused {work}"
        if reused
        else f"built in {build['build_s']:.0f} s, peak RSS {build_memory['peak_rss_mib']:.0f} MiB"
    )
    print(
        f"\n{args.passages:,} passages ({report['config']['corpus_bytes'] / 2**30:.1f} GiB): "
        f"{built}, index {sum(index_bytes.values()) / 2**30:.2f} GiB, "
        f"loaded in {q['load_s'] * 1000:.0f} ms"
    )
    for name, label in (
        ("cold", f"search top-{args.k}, cold"),
        ("warm", f"search top-{args.k}, warm"),
        ("warm_one_search_thread", f"search top-{args.k}, warm, shards one after the other"),
        ("env_step_search_top3_warm", "ToolQA env.step with a search (top 3), warm"),
    ):
        stats = q[name]
        print(
            f"{label}: p50 {stats['p50_ms']:.2f} ms, p95 {stats['p95_ms']:.2f} ms, "
            f"p99 {stats['p99_ms']:.2f} ms"
        )
    after = q["rss_mib_after_queries"]
    print(
        f"query-time RSS: {after.get('RssAnon', 0):.0f} MiB anonymous, "
        f"{after.get('RssFile', 0):.0f} MiB file pages"
    )
    for name, e in exact.items():
        a = e["agreement"]["all"]
        print(
            f"vs exact BM25 {name}: top-{args.k} overlap {a['top_k_overlap']:.3f} "
            f"({a['tie_aware_overlap']:.3f} counting ties), top-1 same {a['top1_same']:.3f}, "
            f"score recall {a['score_recall']:.4f}"
        )
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
