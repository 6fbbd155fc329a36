"""`PythonTool`: a persistent, sandboxed Python interpreter the agent uses as a calculator.

Model-written code never runs in the trainer's process. A small server process, started once
per trainer process and shared by every PythonTool, has sympy and math imported; each
episode gets its own interpreter forked from it (no Python start-up, no sympy import per
call), isolated by namespaces, resource limits and an unprivileged uid where the OS allows.
See docs/sandbox.md for the threat model and what each limit does.

    tool = PythonTool(timeout=10)
    tool(code="x = sympy.symbols('x')\\nsympy.factor(x**2 - 1)")   # -> "(x - 1)*(x + 1)"
    tool.reset(task)                                                 # new episode, fresh state
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from copes.sandbox import (
    SandboxError,
    Session,
    SessionLimits,
    WorkerLost,
    shared_server,
)
from copes.sandbox.cpu_time import wall_backstop

if TYPE_CHECKING:
    from copes.envs.tasks.base import Task

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_warned_lock = threading.Lock()

RESTARTED = "the interpreter was restarted and earlier variables are lost"
MAX_CODE_CHARS = 1_000_000


class PythonTool:
    """Runs Python code in a sandboxed interpreter whose variables persist within an episode.

    Calls never raise on anything the model wrote: errors, timeouts, crashes and exhausted
    limits come back as text the model can read.

    Args:
        timeout: CPU seconds per call, of the interpreter process (all its threads, not the
            processes it starts), so a loaded machine gives the same results: waiting for a
            core does not count, nor does the session's start. The code is interrupted then
            (its session and variables survive); code that cannot be interrupted is killed a
            grace period later (max(1 s, timeout / 5) of CPU time) and the next call starts a
            fresh interpreter.
        wall_timeout: wall-clock seconds per call, the backstop for code that sleeps or
            blocks without using CPU (`time.sleep(100)`, waiting on a subprocess); interrupted
            and killed like `timeout`, with its own message. Default max(60 s, 20 x timeout).
        memory_mb: address-space limit of each sandbox process (RLIMIT_AS); a session's
            total is at most max_processes times this.
        cpu_seconds: CPU seconds each sandbox process may use in total over the session
            (RLIMIT_CPU), a backstop across calls; a session that uses them up is killed and
            the next call starts a fresh one.
        max_processes: processes and threads the session may run at once, the interpreter
            included (RLIMIT_NPROC); whatever the code starts is killed when the call ends.
        max_file_bytes: the largest file the code may write (RLIMIT_FSIZE).
        max_open_files: file descriptors per process (RLIMIT_NOFILE).
        scratch_mb: size of the private writable /tmp (the working directory).
        max_output_chars: longer output keeps its head and tail around a truncation marker.
    """

    name = "python"

    def __init__(
        self,
        timeout: float = 10.0,
        wall_timeout: float | None = None,
        memory_mb: int = 1024,
        cpu_seconds: int = 60,
        max_processes: int = 16,
        max_file_bytes: int = 16 * 2**20,
        max_open_files: int = 256,
        scratch_mb: int = 64,
        max_output_chars: int = 4000,
    ) -> None:
        for label, value, minimum in (
            ("timeout", timeout, 0.01),
            ("memory_mb", memory_mb, 128),
            ("cpu_seconds", cpu_seconds, 1),
            ("max_processes", max_processes, 1),
            ("max_file_bytes", max_file_bytes, 1),
            ("max_open_files", max_open_files, 16),
            ("scratch_mb", scratch_mb, 1),
            ("max_output_chars", max_output_chars, 200),
        ):
            if not value >= minimum:
                raise ValueError(f"PythonTool({label}={value!r}): must be at least {minimum}")
        if wall_timeout is None:
            wall_timeout = wall_backstop(timeout)
        if not wall_timeout >= timeout:
            raise ValueError(
                f"PythonTool(wall_timeout={wall_timeout!r}): must be at least timeout "
                f"({timeout!r} CPU seconds), or None for max(60, 20 x timeout)"
            )
        self.timeout = float(timeout)
        self.wall_timeout = float(wall_timeout)
        self.max_output_chars = int(max_output_chars)
        self.limits = SessionLimits(
            memory_mb=int(memory_mb),
            cpu_seconds=int(cpu_seconds),
            max_processes=int(max_processes),
            max_file_bytes=int(max_file_bytes),
            max_open_files=int(max_open_files),
            scratch_mb=int(scratch_mb),
        )
        self.description = (
            "Run Python code (sympy and math are imported; variables persist between calls). "
            "print() what you need to see."
        )
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "Python source to run. print() what you want to see; the "
                    "value of a final expression is shown too.",
                }
            },
            "required": ["code"],
        }
        self._lock = threading.Lock()
        self._session: Session | None = None

    def __call__(self, code: str | None = None, **unexpected: Any) -> str:
        if code is None:
            return "Error: the python tool needs its `code` argument: Python source as a string."
        if unexpected:
            return (
                f"Error: the python tool takes one argument, `code`; got unexpected "
                f"{sorted(unexpected)}."
            )
        if not isinstance(code, str):
            return f"Error: `code` must be a string of Python source, got {type(code).__name__}."
        if len(code) > MAX_CODE_CHARS:
            return (
                f"Error: the code is {len(code)} characters long; the python tool runs at "
                f"most {MAX_CODE_CHARS}."
            )
        with self._lock:
            try:
                session = self._session_for_call()
            except SandboxError as exc:
                logger.error("the Python sandbox could not start: %s", exc)
                return f"Error: the Python sandbox could not start ({exc}); the code did not run."
            grace = max(1.0, self.timeout / 5)
            try:
                reply = session.run(
                    code, self.timeout, self.wall_timeout, grace, self.max_output_chars
                )
            except WorkerLost as lost:
                self._session = None
                return self._lost_message(lost.reason)
        output: str = reply["output"]
        limit = self.max_output_chars + 400  # the worker already bounds it; never trust that
        if len(output) > limit:
            cut = len(output) - limit
            output = output[:limit] + f"\n...[output truncated: {cut} more characters]"
        return output

    def reset(self, task: Task | None = None) -> None:
        """New episode: the next call starts a fresh interpreter (the old one is killed)."""
        self.close()

    def close(self) -> None:
        """Kill this tool's interpreter, if it has one; the shared server keeps running."""
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    def isolation(self) -> dict[str, Any]:
        """What the current session's sandbox enforces (starts one if needed).

        Keys: network (bool: private network namespace), filesystem ("private-root" or
        "scratch-dir"), pid_namespace (bool), host_processes_visible (bool), uid (the
        session's own uid, or None when it runs as the caller's user), user_namespace (bool),
        notes (what failed and why). Raises SandboxError when no session can be started.
        """
        with self._lock:
            return dict(self._session_for_call().isolation)

    def _session_for_call(self) -> Session:
        if self._session is not None and self._session.owner_pid != os.getpid():
            self._session = None  # inherited through fork; it belongs to the parent
        if self._session is None:
            self._session = shared_server().open_session(self.limits)
            _warn_once_about(self._session.isolation)
        return self._session

    def _lost_message(self, reason: str) -> str:
        if reason == "hard-timeout":
            return (
                f"Error: execution timed out after {self.timeout:g} s of CPU time and could "
                f"not be interrupted, so {RESTARTED}."
            )
        if reason == "wall-timeout":
            return (
                f"Error: execution ran past the {self.wall_timeout:g} s wall-clock limit (for "
                f"code that sleeps or waits) and could not be interrupted, so {RESTARTED}."
            )
        if reason == "cpu-limit":
            return (
                f"Error: the interpreter used up its {self.limits.cpu_seconds} s of CPU time "
                f"and was stopped; {RESTARTED}."
            )
        return f"Error: the interpreter stopped ({reason}); {RESTARTED}."


def _warn_once_about(isolation: dict[str, Any]) -> None:
    """Log, once per process, each protection this machine does not give the sandbox."""
    missing = []
    if not isolation.get("network"):
        missing.append("network access is NOT blocked")
    if isolation.get("filesystem") != "private-root":
        missing.append("the filesystem is visible (read access follows file permissions)")
    if isolation.get("host_processes_visible"):
        missing.append("the host's processes are visible in /proc")
    if isolation.get("uid") is None and not isolation.get("user_namespace"):
        missing.append("code runs as the trainer's own user")
    with _warned_lock:
        new = [m for m in missing if m not in _warned]
        _warned.update(new)
    if new:
        logger.warning(
            "Python sandbox on this machine: %s. Notes: %s. See docs/sandbox.md.",
            "; ".join(new),
            "; ".join(isolation.get("notes") or []) or "none",
        )
