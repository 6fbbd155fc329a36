"""The read-eval-print loop of one sandbox session; runs in the session's worker process.

The worker receives code frames, runs each in one persistent globals dict (so variables
survive across calls of an episode), shows the value of a trailing expression like a
notebook, and answers with the output text: stdout and stderr interleaved, the traceback
cut to its useful last lines, everything bounded by the caller's character budget. A call
that overruns its CPU time is interrupted by SIGPROF (ITIMER_PROF: this process's CPU time,
so waiting for a core on a loaded machine does not count), one that sleeps or blocks past
the wall-clock limit by SIGALRM; the session normally survives either. The caller's hard
limits behind them cover code that cannot be interrupted.
"""

from __future__ import annotations

import ast
import contextlib
import io
import linecache
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

try:
    from . import wire
except ImportError:  # loaded by path inside the sandbox server, where there is no package
    import _copes_sandbox_wire as wire  # type: ignore[no-redef]

MAX_REQUEST_BYTES = 64 * 2**20
MAX_TRACEBACK_LINES = 16
MAX_LINE_CHARS = 400
NO_OUTPUT = "(no output; print() what you want to see)"


class ExecutionTimeout(BaseException):
    """Raised inside the sandboxed code when the call's time is up (not an Exception, so a
    plain `except Exception` in the code does not swallow it)."""


TIMERS = {signal.SIGPROF: signal.ITIMER_PROF, signal.SIGALRM: signal.ITIMER_REAL}
REFIRE_S = 0.005


class OutputCapture(io.TextIOBase):
    """A text stream that keeps the first and the last `limit` characters written.

    Counting instead of storing is what makes `print("x" * 10**9)` or an endless print loop
    cheap: memory stays O(limit) however much the code writes.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.total = 0
        self._head: list[str] = []
        self._head_len = 0
        self._tail = ""
        self._contiguous = True  # False once something was skipped between head and tail

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        n = len(text)
        self.total += n
        start = 0
        if self._head_len < self.limit:
            start = min(n, self.limit - self._head_len)
            self._head.append(text[:start])
            self._head_len += start
        if n > start:  # slices stay O(limit): no copy of a gigabyte-long string
            self._tail = (self._tail + text[max(start, n - self.limit) :])[-self.limit :]
        return n

    def skip(self, n: int) -> None:
        """Count `n` characters that were produced but not kept."""
        self.total += n
        self._tail = ""
        self._contiguous = False

    def render(self, budget: int) -> str:
        """All the output if it fits in `budget` characters, else its head and tail."""
        budget = max(budget, 200)
        head = "".join(self._head)
        complete = self._contiguous and self.total == len(head) + len(self._tail)
        if complete:
            text = head + self._tail
            if len(text) <= budget:
                return text
            head_part, tail_part = text[: budget // 2], text[budget // 2 - budget :]
        else:  # the middle is gone; share the budget, giving one end's slack to the other
            t = min(len(self._tail), budget - min(len(head), budget // 2))
            head_part = head[: budget - t]
            tail_part = self._tail[len(self._tail) - t :] if t else ""
        omitted = self.total - len(head_part) - len(tail_part)
        return f"{head_part}\n...[output truncated: {omitted} more characters]\n{tail_part}"


def _quiet_about_timeouts(unraisable: Any) -> None:
    """Say nothing of the timeouts the interpreter had to swallow (the alarm fires again)."""
    if not isinstance(unraisable.exc_value, ExecutionTimeout):
        sys.__unraisablehook__(unraisable)


def format_exception(exc: BaseException) -> str:
    """The traceback as Python prints it, minus the REPL's frames, cut to its last lines."""
    if isinstance(exc, SyntaxError):
        lines = traceback.format_exception_only(type(exc), exc)
    else:
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        _drop_repl_frames(report, set())
        lines = list(report.format())
    text = "".join(lines).rstrip("\n").splitlines()
    text = [_shorten(line) for line in text]
    if len(text) > MAX_TRACEBACK_LINES:
        kept = MAX_TRACEBACK_LINES - 2
        text = [text[0], f"  ... ({len(text) - 1 - kept} lines omitted)", *text[-kept:]]
    return "\n".join(text)


def _drop_repl_frames(report: traceback.TracebackException, seen: set[int]) -> None:
    """Hide this module's frames (the exec call, the output stream) in the whole chain."""
    if id(report) in seen:
        return
    seen.add(id(report))
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != __file__]
    )
    for linked in (report.__cause__, report.__context__):
        if linked is not None:
            _drop_repl_frames(linked, seen)


def _shorten(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    half = MAX_LINE_CHARS // 2
    return f"{line[:half]}...[{len(line) - 2 * half} characters]...{line[-half:]}"


def _cell_line(exc: BaseException, filename: str) -> int | None:
    """The line of `filename` (the running cell) that was executing when `exc` was raised."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


class Repl:
    """One session's interpreter state and its request loop.

    Args:
        sock: the connection to the caller (the only one the worker has).
        namespace: the globals every call runs in (pre-imported modules already in it).
        output_fd: where file-descriptor-level output (subprocesses, C code) lands; its
            content is appended to the call's output and then cleared.
        kill_strays: kills every other process (and reaps them unless called with
            reap=False) after each call and when the time is up, so a fork bomb neither
            outlives the call nor starves the worker. Only safe where every process the
            worker can signal is its own: as init of a private pid namespace, or as the
            session's private uid.
        memory_mb: shown in the hint that follows a MemoryError.
    """

    def __init__(
        self,
        sock: socket.socket,
        namespace: dict[str, Any],
        output_fd: int,
        kill_strays: Callable[..., None] | None,
        memory_mb: int,
    ) -> None:
        self.sock = sock
        self.ns = namespace
        self.output_fd = output_fd
        self.kill_strays = kill_strays
        self.memory_mb = memory_mb
        self.cells = 0
        self.owner = os.getpid()
        self._reserve: bytearray | None = bytearray(2**20)  # freed to report a MemoryError
        self._armed = False  # whether a timer may interrupt (only while the code runs)
        self._expired: int | None = None  # the signal of the limit that ran out first
        os.register_at_fork(after_in_child=self._in_child)

    def _on_timer(self, signum: int, frame: Any) -> None:
        if not self._armed:  # a late timer, after the code finished: nothing to interrupt
            return
        if self._expired is None:
            self._expired = signum
        if self.kill_strays is not None and os.getpid() == self.owner:
            self.kill_strays(reap=False)
        raise ExecutionTimeout

    def _in_child(self) -> None:
        """A process the code forked must never talk to the caller; its prints go to the fd.

        It also yields the CPU to the worker, so that a fork bomb cannot starve the worker's
        own timeout handling.
        """
        with contextlib.suppress(OSError):
            os.close(self.sock.detach())
        with contextlib.suppress(OSError):
            os.nice(10)
        # A timer signal the worker caught just before forking must not interrupt the child.
        for signum in TIMERS:
            signal.signal(signum, signal.SIG_DFL)
        sys.stdout = sys.stderr = io.TextIOWrapper(
            io.FileIO(self.output_fd, "w", closefd=False), line_buffering=True
        )

    def serve(self, hello: dict[str, Any]) -> None:
        """Answer requests until the caller hangs up."""
        wire.send_frame(self.sock, hello)
        while True:
            try:
                request = wire.recv_frame(self.sock, None, MAX_REQUEST_BYTES)
            except (wire.FrameError, OSError):
                return
            reply = self.run(
                str(request["code"]),
                float(request["timeout"]),
                float(request["wall_timeout"]),
                int(request["max_chars"]),
            )
            wire.send_frame(self.sock, reply)
            if self._reserve is None:
                with contextlib.suppress(MemoryError):
                    self._reserve = bytearray(2**20)

    def run(self, code: str, timeout: float, wall_timeout: float, max_chars: int) -> dict[str, Any]:
        """Run one cell with `timeout` CPU seconds and `wall_timeout` wall-clock seconds;
        returns {"output": text, "timed_out": bool}."""
        self.cells += 1
        filename = f"<cell-{self.cells}>"
        capture = OutputCapture(max_chars)
        sys.stdout = sys.stderr = capture
        sys.stdin = io.StringIO()  # input() gets EOFError, even after exit() closed stdin
        sys.unraisablehook = _quiet_about_timeouts
        error = ""
        timed_out = False
        self._expired = None
        for signum in TIMERS:
            signal.signal(signum, self._on_timer)
        try:
            # Re-fire every 5 ms once expired: an exception raised inside an at-fork hook or
            # a __del__ is swallowed by the interpreter, so one signal is not always enough.
            # (A fork loop spends most of its CPU time in fork() and its hooks: SIGPROF,
            # which only ticks while the worker runs, lands there often.)
            self._armed = True
            signal.setitimer(signal.ITIMER_PROF, timeout, REFIRE_S)
            signal.setitimer(signal.ITIMER_REAL, wall_timeout, REFIRE_S)
            try:
                self._execute(code, filename, capture)
            finally:
                self._armed = False  # first: from here on a late signal interrupts nothing
                for which in TIMERS.values():
                    signal.setitimer(which, 0)
        except ExecutionTimeout as exc:
            timed_out = True
            line = _cell_line(exc, filename)
            where = f" at line {line}" if line else ""
            if self._expired == signal.SIGALRM:
                error = (
                    f"Error: execution was interrupted{where} after {wall_timeout:g} s of "
                    f"wall-clock time (the limit for code that sleeps or waits; the {timeout:g} s "
                    "limit counts CPU time); variables assigned before that point are kept."
                )
            else:
                error = (
                    f"Error: execution timed out after {timeout:g} s of CPU time and was "
                    f"interrupted{where}; variables assigned before that point are kept."
                )
        except SystemExit as exc:
            if exc.code not in (None, 0):
                error = f"SystemExit: {exc.code}"
        except BaseException as exc:  # everything the code raises is part of its output
            if isinstance(exc, MemoryError):
                self._reserve = None
            error = format_exception(exc)
            if isinstance(exc, MemoryError):
                error += f"\nNote: the interpreter is limited to {self.memory_mb} MB of memory."
        finally:
            if os.getpid() != self.owner:  # the code forked and this is the child
                os._exit(0)
        self._collect_fd_output(capture, max_chars)
        if self.kill_strays is not None:
            self.kill_strays()
        budget = max(max_chars - len(error), max_chars // 4)
        output = capture.render(budget)
        if error and output and not output.endswith("\n"):
            output += "\n"
        text = (output + error).rstrip("\n") or NO_OUTPUT
        # Lone surrogates (print("\ud800")) cannot be sent as UTF-8.
        return {"output": text.encode("utf-8", "replace").decode("utf-8"), "timed_out": timed_out}

    def _execute(self, code: str, filename: str, capture: OutputCapture) -> None:
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            value = eval(compile(last, filename, "eval"), self.ns)
            if value is not None:
                self.ns["_"] = value
                capture.write(repr(value) + "\n")

    def _collect_fd_output(self, capture: OutputCapture, max_chars: int) -> None:
        size = os.fstat(self.output_fd).st_size
        if size == 0:
            return
        chunk = 4 * max_chars  # bytes; enough for max_chars characters of UTF-8
        if size <= 2 * chunk:
            capture.write(os.pread(self.output_fd, size, 0).decode("utf-8", "replace"))
        else:
            capture.write(os.pread(self.output_fd, chunk, 0).decode("utf-8", "replace"))
            capture.skip(size - 2 * chunk)
            capture.write(os.pread(self.output_fd, chunk, size - chunk).decode("utf-8", "replace"))
        os.ftruncate(self.output_fd, 0)
        os.lseek(self.output_fd, 0, os.SEEK_SET)
