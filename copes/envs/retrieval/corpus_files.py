"""Reading the corpus files users have, one passage at a time, in bounded memory.

Three formats, told apart by the file name (`.tsv` is DPR's) and, for JSONL, line by line:

- DPR `psgs_w100.tsv` (the 21,015,324-passage Wikipedia of DPR, Search-R1, R1-Searcher):
  a header `id<TAB>text<TAB>title`, then one passage a row, fields quoted CSV-style
  (`"..."`, inner quotes doubled), as DPR's own loader reads it with `csv.reader`.
- FlashRAG / Search-R1 JSONL: `{"id": ..., "contents": "\\"Title\\"\\ntext"}` a line.
- copes' own JSONL: `{"id": ..., "title": ..., "text": ...}` a line.

Any of them may be gzipped (`.gz`). `read_corpus` also reports, after each passage, the
byte position in the (uncompressed) file where the next one starts, so an interrupted index
build resumes by seeking there instead of re-reading what it already indexed.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

from copes.envs.tasks.base import Passage

CorpusFormat = Literal["auto", "jsonl", "dpr-tsv"]
CORPUS_FORMATS: tuple[str, ...] = ("auto", "jsonl", "dpr-tsv")

_FORMAT_HINT = 'expected one object a line like {"id": "0", "contents": "\\"Title\\"\\ntext"}'
_DPR_HEADER = ["id", "text", "title"]


def parse_contents(contents: str) -> tuple[str, str]:
    """Split a FlashRAG-style `contents` field, `"Title"\\ntext`, into (title, text).

    The first line is the title (surrounding double quotes removed). A single line is
    taken as text with no title unless it is quoted.
    """
    first, newline, rest = contents.partition("\n")
    first = first.strip()
    quoted = len(first) >= 2 and first.startswith('"') and first.endswith('"')
    if not newline and not quoted:
        return "", contents.strip()
    return (first[1:-1] if quoted else first), rest.strip()


def resolve_format(path: str | os.PathLike[str], corpus_format: CorpusFormat = "auto") -> str:
    """The format of `path`: `dpr-tsv` for `*.tsv[.gz]`, `jsonl` otherwise, unless given."""
    if corpus_format not in CORPUS_FORMATS:
        raise ValueError(
            f"unknown corpus format {corpus_format!r}; choose one of {', '.join(CORPUS_FORMATS)}"
        )
    if corpus_format != "auto":
        return corpus_format
    name = Path(path).name.lower().removesuffix(".gz")
    return "dpr-tsv" if name.endswith(".tsv") else "jsonl"


def _open_binary(path: Path) -> BinaryIO:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb")


def read_corpus(
    path: str | os.PathLike[str], corpus_format: CorpusFormat = "auto", start_byte: int = 0
) -> Iterator[tuple[Passage, int]]:
    """(passage, byte position after it) for every passage of `path`, from `start_byte` on.

    `start_byte` must be a position this function reported (a passage boundary). A passage
    without an id gets its 0-based position in the file as id (counted from `start_byte`
    on, so pass 0 unless ids are in the file). Errors name the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    fmt = resolve_format(path, corpus_format)
    with _open_binary(path) as f:
        if start_byte:
            f.seek(start_byte)
        if fmt == "dpr-tsv":
            yield from _read_dpr_tsv(f, path, start_byte)
        else:
            yield from _read_jsonl(f, path, start_byte)


def iter_corpus_jsonl(path: str | os.PathLike[str]) -> Iterator[Passage]:
    """Passages of a FlashRAG or copes JSONL corpus (see the module docstring)."""
    for passage, _ in read_corpus(path, "jsonl"):
        yield passage


def _read_jsonl(f: BinaryIO, path: Path, position: int) -> Iterator[tuple[Passage, int]]:
    count = 0
    for line_number, line in enumerate(f, start=1):
        position += len(line)
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            message = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
            raise ValueError(f"{where}: not valid JSON ({message}); {_FORMAT_HINT}") from err
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        passage_id = str(record.get("id", count))
        if isinstance(record.get("contents"), str):
            title, text = parse_contents(record["contents"])
        elif isinstance(record.get("text"), str):
            title, text = str(record.get("title") or ""), record["text"]
        else:
            raise ValueError(
                f"{where}: no string 'contents' (or 'text') field, keys are "
                f"{sorted(record)}; {_FORMAT_HINT}"
            )
        yield Passage(title=title, text=text, id=passage_id), position
        count += 1


def _read_dpr_tsv(f: BinaryIO, path: Path, position: int) -> Iterator[tuple[Passage, int]]:
    """DPR's TSV through `csv` (a quoted text may hold a tab or a newline).

    `csv.reader` pulls one physical line at a time and never reads ahead of the row it
    returns, so the bytes counted by `lines()` end exactly where the row ends.
    """
    consumed = position
    line_number = 0

    def lines() -> Iterator[str]:
        nonlocal consumed, line_number
        for raw in f:
            consumed += len(raw)
            line_number += 1
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}, line {line_number}: not UTF-8 ({err})") from err

    rows = csv.reader(lines(), delimiter="\t")
    for row in rows:
        if not row or row == [""]:
            continue
        if position == 0 and line_number == 1 and row[:3] == _DPR_HEADER:
            continue
        if len(row) != 3:
            raise ValueError(
                f"{path}, line {line_number}: expected 3 tab-separated fields (id, text, "
                f"title) as in DPR's psgs_w100.tsv, got {len(row)}; pass --format jsonl if "
                "this is not a DPR file"
            )
        passage_id, text, title = row
        yield Passage(title=title, text=text, id=passage_id), consumed


def only_passages(items: Iterable[object]) -> Iterator[Passage]:
    """`items`, checked one by one to be `Passage`s (an index built in memory takes any
    iterable; a wrong item is named, not indexed)."""
    for position, item in enumerate(items):
        if not isinstance(item, Passage):
            raise TypeError(
                f"corpus item {position} is a {type(item).__name__}, expected a Passage; "
                "pass Passage objects or the path of a corpus file"
            )
        yield item


def count_bytes(path: str | os.PathLike[str]) -> int | None:
    """The corpus file's size if the reader's byte positions can be compared with it."""
    path = Path(path)
    return None if path.name.lower().endswith(".gz") else path.stat().st_size


__all__ = [
    "CORPUS_FORMATS",
    "CorpusFormat",
    "count_bytes",
    "iter_corpus_jsonl",
    "only_passages",
    "parse_contents",
    "read_corpus",
    "resolve_format",
]
