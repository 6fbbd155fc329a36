"""JSON Lines: one JSON value a line, read with every damaged line named.

The one parser behind the benchmark loader (`copes.envs.tasks.io`) and the run logs
(`copes.run_log`): they differ only in what they tell the user to do about a bad line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def parse_json_lines(
    lines: Iterable[str], path: str | Path, advice: str, limit: int | None = None
) -> list[Any]:
    """The values of `lines` (blank lines skipped; at most `limit`). A line that is not JSON
    raises ValueError naming `path`, its line number and the parser's reason, then `advice`."""
    records: list[Any] = []
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path} line {number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                f"{advice}"
            ) from exc
    return records
