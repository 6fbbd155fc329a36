"""One error path for both command lines: a user's mistake is one line and exit code 2.

A bad flag value, a bad or unreadable file, a folder that cannot be written, a device that is
not there, a resume with other settings: each surfaces as a `UserError` or as one of the
exception types that the standard library and the loaders raise for bad input (`ValueError`,
`OSError`, `ImportError` for a missing optional backend, YAML's parse error). The command
prints ``prog: error: <what was wrong and how to fix it>`` and exits 2; `--debug` shows the
traceback instead. Anything else (a bug) keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """A mistake in the user's input; its message says what was wrong and how to fix it."""


def json_object_flag(flag: str, text: str | None, example: str) -> dict[str, Any]:
    """The JSON object a flag holds (`--env-kwargs`, `--chat-template-kwargs`); {} when not
    given. Raises ValueError (one line, with an example) for text that is not one."""
    if text is None or text == "":
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{flag} is not JSON ({exc.msg}): {text!r}; e.g. {flag} '{example}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}; e.g. {flag} '{example}'")
    return value


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [UserError, ValueError, OSError, ImportError]
    try:
        import yaml

        types.append(yaml.YAMLError)
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        pass
    return tuple(types)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def run_command(prog: str, main: Callable[[], int], debug: bool) -> int:
    """Run `main`; a user error becomes one line on stderr and exit code 2."""
    try:
        return main()
    except _user_error_types() as exc:
        if debug:
            raise
        print(f"{prog}: error: {one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def check_device(device: str) -> None:
    """`cuda` / `cuda:N` only where torch sees a CUDA device (else one clear line)."""
    if not str(device).startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        raise UserError(
            f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
            f"{build}); use --device cpu or --device auto"
        )
    index = str(device).partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise UserError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
