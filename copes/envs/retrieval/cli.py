"""`copes-index`: build, query and serve the corpus index the `search` tool reads.

    copes-index build psgs_w100.tsv indexes/wiki18      # streaming, resumes if killed
    copes-index query indexes/wiki18 "Scott Derrickson director" -k 5
    copes-index serve indexes/wiki18 --port 8000         # Search-R1 style POST /retrieve

Errors in the input are one line and exit code 2 (`copes.errors.run_command`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from copes.envs.retrieval.corpus_files import CORPUS_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="copes-index",
        description="Build, query and serve the BM25 corpus index of the search tool "
        "(docs/retrieval.md).",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of input errors")
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser(
        "build",
        help="index a corpus file (DPR psgs_w100.tsv, FlashRAG/Search-R1 JSONL, copes JSONL)",
        description="Index a corpus file in bounded memory. A killed build resumes from its "
        "last commit when the same command is run again.",
    )
    build.add_argument("corpus", help="corpus file: *.tsv[.gz] (DPR) or *.jsonl[.gz]")
    build.add_argument("out", help="index folder to create")
    build.add_argument(
        "--backend",
        choices=("tantivy", "bm25s"),
        default="tantivy",
        help="tantivy: disk-based, streaming, any size (default); bm25s: exact BM25 with "
        "k1=1.5, builds in RAM (~23 bytes a corpus token), for up to a few million passages",
    )
    build.add_argument("--format", choices=CORPUS_FORMATS, default="auto", dest="corpus_format")
    build.add_argument(
        "--heap-mb", type=int, default=None, help="tantivy's indexing memory (default 1024)"
    )
    build.add_argument("--threads", type=int, default=None, help="tantivy indexing threads")
    build.add_argument(
        "--commit-every",
        type=int,
        default=None,
        help="passages between commits, the points a killed build resumes from (default 1M)",
    )
    build.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="passages a shard; shards are searched in parallel, one a core (default 2M)",
    )
    build.add_argument(
        "--keep-stopwords", action="store_true", help="index function words too (e.g. 'The Who')"
    )
    build.add_argument(
        "--restart", action="store_true", help="discard an interrupted build instead of resuming"
    )
    build.add_argument("--overwrite", action="store_true", help="replace an existing index")
    build.add_argument("--quiet", action="store_true", help="no progress bar")

    query = commands.add_parser("query", help="search an index from the shell")
    query.add_argument("index", help="index folder (from copes-index build)")
    query.add_argument("text", help="the query, as the agent would write it")
    query.add_argument("-k", type=int, default=3, help="number of passages (default 3)")
    query.add_argument("--json", action="store_true", help="one JSON object a hit")

    serve = commands.add_parser(
        "serve", help="serve an index over HTTP (Search-R1 style POST /retrieve)"
    )
    serve.add_argument("index", help="index folder (from copes-index build)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    return parser


def _build(args: argparse.Namespace) -> int:
    from copes.envs.retrieval.base import Tokenizer

    tokenizer = Tokenizer(remove_stopwords=not args.keep_stopwords)
    started = time.monotonic()
    if args.backend == "tantivy":
        from copes.envs.retrieval.tantivy_build import SHARD_SIZE
        from copes.envs.retrieval.tantivy_index import TantivyRetriever

        retriever = TantivyRetriever.build(
            args.corpus,
            args.out,
            corpus_format=args.corpus_format,
            tokenizer=tokenizer,
            heap_mb=1024 if args.heap_mb is None else args.heap_mb,
            threads=args.threads,
            commit_every=1_000_000 if args.commit_every is None else args.commit_every,
            shard_size=SHARD_SIZE if args.shard_size is None else args.shard_size,
            restart=args.restart,
            overwrite=args.overwrite,
            show_progress=not args.quiet,
        )
    else:
        from copes.envs.retrieval.bm25s_index import CorpusRetriever
        from copes.envs.retrieval.corpus_files import read_corpus

        tantivy_only = [
            flag
            for flag, value in (
                ("--heap-mb", args.heap_mb),
                ("--threads", args.threads),
                ("--commit-every", args.commit_every),
                ("--shard-size", args.shard_size),
                ("--restart", args.restart or None),
            )
            if value is not None
        ]
        if tantivy_only:
            raise ValueError(
                f"{', '.join(tantivy_only)} apply to the tantivy backend only; drop them or "
                "use --backend tantivy (bm25s builds in RAM in one go and never resumes)"
            )
        passages = (p for p, _ in read_corpus(args.corpus, args.corpus_format))
        retriever = CorpusRetriever.build(
            passages,
            args.out,
            tokenizer=tokenizer,
            overwrite=args.overwrite,
            show_progress=not args.quiet,
        )
    print(
        f"indexed {len(retriever):,} passages into {args.out} ({args.backend}) in "
        f"{time.monotonic() - started:.0f} s"
    )
    return 0


def _query(args: argparse.Namespace) -> int:
    from copes.envs.retrieval.open_index import open_index

    if args.k < 1:
        raise ValueError(f"-k must be at least 1 (passages to return), got {args.k}")
    retriever = open_index(args.index)
    for rank, hit in enumerate(retriever.search(args.text, args.k), start=1):
        p = hit.passage
        if args.json:
            record = {"rank": rank, "score": hit.score, "id": p.id, "title": p.title}
            print(json.dumps({**record, "text": p.text}, ensure_ascii=False))
        else:
            print(f"[{rank}] {p.title} (id {p.id}, score {hit.score:.3f})\n{p.text}\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from copes.envs.retrieval.http_server import serve
    from copes.envs.retrieval.open_index import open_index

    serve(open_index(args.index), host=args.host, port=args.port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `copes-index`; returns the exit status (2 on an input error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from copes.errors import run_command

    command = {"build": _build, "query": _query, "serve": _serve}[args.command]
    return run_command("copes-index", lambda: command(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
