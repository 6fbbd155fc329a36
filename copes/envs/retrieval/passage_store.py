"""The passages of an on-disk index: one JSON object a line plus the byte offset of each line.

Both disk backends keep the passages this way, beside their index, so a hit is read back
by position with one slice of a memory-mapped file and any number of processes share one
copy through the page cache:

- `passages.jsonl`: `{"id", "title", "text"}` a line (a self-contained copy of the corpus);
- `passages.offsets.npy`: N + 1 int64 byte offsets, line i is `[offsets[i], offsets[i+1])`.

`PassageStoreWriter` appends while an index streams in, keeping the offsets in an
append-only `passages.offsets.bin`, so a killed build can cut both files back to the last
committed passage and go on (`truncate`); `finish` turns the offsets into the `.npy`.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from copes.envs.tasks.base import Passage

if TYPE_CHECKING:
    from typing_extensions import Self

PASSAGES = "passages.jsonl"
OFFSETS = "passages.offsets.npy"
_OFFSETS_BIN = "passages.offsets.bin"  # int64 little-endian, while building
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


class PassageStore:
    """Read-only passages by position, memory-mapped (or read into RAM)."""

    def __init__(self, directory: str | os.PathLike[str], *, memory_map: bool = True) -> None:
        directory = Path(directory)
        self.offsets = np.load(directory / OFFSETS, mmap_mode="r" if memory_map else None)
        with (directory / PASSAGES).open("rb") as f:
            if memory_map and os.fstat(f.fileno()).st_size:
                self._bytes: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                self._bytes = f.read()
        if len(self.offsets) < 1 or int(self.offsets[-1]) != len(self._bytes):
            raise ValueError(
                f"{directory}: {PASSAGES} does not match {OFFSETS} (truncated or edited after "
                "building?); rebuild the index"
            )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def passage(self, position: int) -> Passage:
        """The passage at 0-based `position`, read from disk."""
        start, end = int(self.offsets[position]), int(self.offsets[position + 1])
        record = json.loads(self._bytes[start:end])
        return Passage(title=record["title"], text=record["text"], id=record["id"])

    def close(self) -> None:
        if isinstance(self._bytes, mmap.mmap):
            self._bytes.close()


class StoredPassages:
    """What a disk index whose passages are in a `PassageStore` (`self._store`) answers."""

    _store: PassageStore

    def __len__(self) -> int:
        return len(self._store)

    def passage(self, position: int) -> Passage:
        """The passage at 0-based `position` in the corpus, read from disk."""
        return self._store.passage(position)

    def close(self) -> None:
        """Unmap the passage file (the index itself is released with this object)."""
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PassageStoreWriter:
    """Appends passages to `directory`; `truncate(n)` cuts back to the first n (resume)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._passages = (self.directory / PASSAGES).open("ab")
        self._offsets = (self.directory / _OFFSETS_BIN).open("ab")
        self._end = self._passages.tell()
        self.count = max(0, self._offsets.tell() // 8 - 1)
        if self._offsets.tell() == 0:
            self._offsets.write(np.int64(0).tobytes())

    def append(self, passage: Passage) -> None:
        record = {"id": passage.id, "title": passage.title, "text": passage.text}
        line = _ENCODE(record).encode("utf-8") + b"\n"
        self._passages.write(line)
        self._end += len(line)
        self._offsets.write(self._end.to_bytes(8, "little", signed=True))
        self.count += 1

    def flush(self) -> None:
        """Make everything appended so far durable (called before the index commits)."""
        for f in (self._passages, self._offsets):
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, count: int) -> None:
        """Keep the first `count` passages and drop the rest (they were never committed)."""
        self.flush()
        if count > self.count:
            raise ValueError(
                f"cannot resume at passage {count}: the passage file holds only {self.count}; "
                "start the build over (--restart)"
            )
        offsets = np.fromfile(self.directory / _OFFSETS_BIN, dtype="<i8", count=count + 1)
        end = int(offsets[count])
        self._passages.truncate(end)
        self._offsets.truncate((count + 1) * 8)
        self._passages.seek(end)
        self._offsets.seek((count + 1) * 8)
        self._end, self.count = end, count

    def finish(self) -> None:
        """Close the files and write `passages.offsets.npy` from the append-only offsets."""
        self.flush()
        self._passages.close()
        self._offsets.close()
        raw = np.fromfile(self.directory / _OFFSETS_BIN, dtype="<i8")
        np.save(self.directory / OFFSETS, raw.astype(np.int64, copy=False))
        (self.directory / _OFFSETS_BIN).unlink()

    def close(self) -> None:
        self._passages.close()
        self._offsets.close()
