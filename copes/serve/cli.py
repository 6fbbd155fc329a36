"""`copes-serve`: `copes-train` whose rollouts are served to clients that ask over HTTP.

Every `copes-train` flag applies; ``--harness`` defaults to ``http`` (clients call
``POST /copes/v1/ask``, run their agent against each session's base URL, and post one
reward per session). ``--harness module:function`` runs the episodes in this process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def serve_main(argv: Sequence[str] | None = None) -> int:
    from copes.cli import train_main

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--harness" or a.startswith("--harness=") for a in args):
        args = ["--harness", "http", *args]
    return train_main(args, prog="copes-serve")


def main() -> None:
    sys.exit(serve_main())
