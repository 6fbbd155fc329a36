"""The on-disk layout of a tantivy corpus index, which its build writes and its searcher
reads: the schema (pre-tokenized text, a position field), the folder of shards, each
shard's address -> corpus position table, and `copes_index.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TANTIVY_K1 = 1.2  # tantivy's Bm25Weight constant (tantivy/src/query/bm25.rs)
FORMAT_VERSION = 2
META = "copes_index.json"
BUILD_STATE = "build_state.json"
SHARDS_DIR = "shards"
FIELD = "body"
POSITION = "pos"
ANALYZER = "copes_pretokenized"


def tantivy_module() -> Any:
    try:
        import tantivy
    except ImportError as err:  # pragma: no cover - tantivy is a dependency
        raise ImportError(
            "the tantivy backend needs the tantivy package: pip install tantivy"
        ) from err
    return tantivy


def schema(tantivy: Any) -> Any:
    builder = tantivy.SchemaBuilder()
    # 'freq': doc ids and term frequencies, no positions (BM25 needs no phrases).
    builder.add_text_field(FIELD, stored=False, tokenizer_name=ANALYZER, index_option="freq")
    builder.add_unsigned_field(POSITION, stored=False, indexed=False, fast=True)
    return builder.build()


def open_tantivy(path: Path, schema: Any | None = None) -> Any:
    tantivy = tantivy_module()
    if schema is None:
        index = tantivy.Index.open(str(path))
    else:
        index = tantivy.Index(schema, path=str(path), reuse=False)
    # Our tokens never hold whitespace ([^\W_]+ runs), so splitting on it gives them back.
    index.register_tokenizer(
        ANALYZER, tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build()
    )
    return index


def positions_path(shard_dir: Path) -> Path:
    return shard_dir.with_name(shard_dir.name + ".positions.npy")


def segments_path(shard_dir: Path) -> Path:
    return shard_dir.with_name(shard_dir.name + ".segments.npy")


def shard_name(number: int) -> str:
    return f"{number:04d}"


def read_meta(index_dir: Path) -> dict[str, Any]:
    """The `copes_index.json` of a disk index, with one-line errors for a wrong folder."""
    meta_path = index_dir / META
    if not meta_path.is_file():
        hint = (
            f"; a build was interrupted in {index_dir}.building: run the same build again "
            "to resume it"
            if (index_dir.with_name(index_dir.name + ".building") / BUILD_STATE).is_file()
            else "; build one with copes-index build CORPUS OUT"
        )
        raise FileNotFoundError(f"{index_dir} is not a copes corpus index (no {META}){hint}")
    return json.loads(meta_path.read_text(encoding="utf-8"))
