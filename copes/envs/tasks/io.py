"""Read benchmark records from a local file or the Hugging Face hub, as plain dicts.

Every loader goes through `load_records`, so a user whose machine cannot reach the hub only
has to point at the files on disk (JSON, JSONL or Parquet in the public schema).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from copes.jsonl import parse_json_lines

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")

# A directory's files may name the split differently from the hub ("dev" for "validation").
# `dev500` is the 500-question dev sample R1-Searcher evaluates on (`hotpotqa_500.jsonl`,
# `2wiki_500.jsonl`, `musique_500.jsonl`): a split of its own, never taken for the full dev.
_SPLIT_ALIASES = {
    "validation": ("dev", "val"),
    "dev": ("validation", "val"),
    "val": ("validation", "dev"),
    "dev500": ("_500",),
}


class SchemaError(ValueError):
    """A record lacks a field its benchmark's public schema has (usually: the wrong file)."""


def looks_like_path(source: str | os.PathLike) -> bool:
    """True when `source` names a local file or folder rather than a hub id.

    Used to tell a missing local file (a typo worth reporting) from a hub id, which also
    contains a "/" but never starts with one or ends in a file suffix.
    """
    if isinstance(source, os.PathLike):
        return True
    text = str(source)
    if Path(text).expanduser().exists():
        return True
    return text.startswith(("/", "./", "../", "~", ".\\")) or text.endswith(SUPPORTED_SUFFIXES)


def load_records(
    source: str | os.PathLike,
    *,
    split: str,
    config: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Records of one split, from a local path or a hub id.

    A local `source` may be a `.jsonl` file, a `.json` file (a list of records or
    `{"data": [...]}`), a `.parquet` file, or a directory holding exactly one such file
    whose name contains `split` ("dev" and "validation" stand in for each other). `config`
    only matters for hub ids. Anything else is passed to `datasets.load_dataset`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    if looks_like_path(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"benchmark file {str(path)!r} does not exist; pass an existing .jsonl, .json or "
                f".parquet file (or a folder holding one per split), or a Hugging Face hub id"
            )
        if path.is_dir():
            path = _file_for_split(path, split)
        return _read_file(path, limit)
    return _load_from_hub(str(source), config=config, split=split, limit=limit)


def _file_for_split(directory: Path, split: str) -> Path:
    """The one data file in `directory` whose name mentions `split` (or an alias of it)."""
    files = sorted(
        p for p in directory.iterdir() if p.is_file() and p.name.endswith(SUPPORTED_SUFFIXES)
    )
    for name in (split, *_SPLIT_ALIASES.get(split, ())):
        matches = [p for p in files if name in p.name]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            listed = ", ".join(p.name for p in matches)
            raise ValueError(
                f"{len(matches)} files in {str(directory)!r} match split {split!r}: {listed}; "
                f"keep one file per split there, or pass the file itself as the source"
            )
    listed = ", ".join(p.name for p in files) or "no .jsonl/.json/.parquet files"
    others = [
        name
        for name in ("train", "test", "validation", "dev500")
        if name != split
        and any(a in p.name for a in (name, *_SPLIT_ALIASES.get(name, ())) for p in files)
    ]
    hint = f"; it holds split {' and '.join(map(repr, others))} (--split)" if others else ""
    raise FileNotFoundError(
        f"no file for split {split!r} in {str(directory)!r} (found: {listed}){hint}; expected "
        f"a file whose name contains {split!r}, e.g. {split}.jsonl, or pass the file itself"
    )


def _read_file(path: Path, limit: int | None) -> list[dict[str, Any]]:
    readers = {
        ".jsonl": lambda: _read_jsonl(path, limit),
        ".json": lambda: _read_json(path),
        ".parquet": lambda: _read_parquet(path),
    }
    suffix = path.suffix.lower()
    if suffix not in readers:
        raise ValueError(
            f"unsupported benchmark file {str(path)!r}: expected one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}; convert it or rename it if it is JSONL"
        )
    try:
        records = readers[suffix]()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"benchmark file {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            "re-encode it as UTF-8"
        ) from None
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(
                f"{str(path)!r}: record {index} is a {type(record).__name__}, expected a JSON "
                f"object with the benchmark's fields"
            )
    logger.debug("read %d records from %s", len(records), path)
    return records if limit is None else records[:limit]


def _read_jsonl(path: Path, limit: int | None) -> list[Any]:
    with path.open(encoding="utf-8") as handle:
        return parse_json_lines(
            handle, repr(str(path)), "a .jsonl file needs one JSON object per line", limit
        )


def _read_json(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several objects: a JSONL file named .json
            logger.info("%s holds one JSON object per line; reading it as JSONL", path)
            return _read_jsonl(path, None)
        raise ValueError(
            f"{str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
            f'{exc.colno}; expected a list of records or {{"data": [...]}}'
        ) from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    if isinstance(data, list):
        return data
    raise ValueError(
        f"{str(path)!r} holds a JSON {type(data).__name__}"
        f"{' with keys ' + str(sorted(data)[:10]) if isinstance(data, dict) else ''}; "
        f'expected a list of records or {{"data": [...]}}'
    )


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{str(path)!r} is not a readable Parquet file: {exc}") from exc


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub (`HF_ENDPOINT`) answers a TCP connection within
    `timeout` seconds: checked before `datasets` spends ~30 s in retries on a machine
    without a route to it."""
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout).close()
    except OSError:
        return False
    return True


def _load_from_hub(
    source: str, *, config: str | None, split: str, limit: int | None
) -> list[dict[str, Any]]:
    import datasets

    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE")
    if not offline and not hub_reachable():
        raise ConnectionError(
            f"the Hugging Face hub cannot be reached from this machine, so {source!r} split "
            f"{split!r} cannot be downloaded: put the split in a local folder and pass it with "
            "--data-dir (docs/evaluation.md), or set HF_DATASETS_OFFLINE=1 to use a copy "
            "already in the datasets cache"
        )
    try:
        dataset = datasets.load_dataset(source, config, split=split)
    except OSError as exc:  # ConnectionError, DatasetNotFoundError, offline mode
        where = f"{source!r}" + (f" (config {config!r})" if config else "")
        raise ConnectionError(
            f"could not load {where}, split {split!r}, from the Hugging Face hub: {exc}. If this "
            f"machine cannot reach the hub, download the split elsewhere (e.g. "
            f"`datasets.load_dataset(...).to_json('{split}.jsonl')`) and pass the local "
            f".jsonl/.json/.parquet file or its folder as `source` (or use `data_dir`)"
        ) from exc
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset.to_list()


def required(record: dict[str, Any], key: str, *, benchmark: str, index: int) -> Any:
    """`record[key]`, or an error that says which record lacks it and what it has instead.

    A missing field almost always means the file belongs to another benchmark (or another
    version of it), so the message lists the fields that are there.
    """
    if key in record and record[key] is not None:
        return record[key]
    record_id = record.get("id", record.get("_id", record.get("unique_id")))
    where = f"record {index}" + (f" (id {record_id!r})" if record_id is not None else "")
    raise SchemaError(
        f"{benchmark}: {where} has no {key!r} field; it has {sorted(record)}. Check that the "
        f"file is the {benchmark} benchmark in its public schema, or use the "
        f"loader that matches it"
    )


def other_fields(record: dict[str, Any], *consumed: str) -> dict[str, Any]:
    """The fields a task does not already hold (level, subject, year, ...), kept as metadata."""
    return {key: value for key, value in record.items() if key not in consumed}
