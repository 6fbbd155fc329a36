"""The trainer's side of the sandbox: one shared server process and per-episode sessions.

`SandboxServer` owns the zygote (`server.py`), started lazily once per process
with subprocess (fork+exec in C, safe in a process holding a torch model and threads),
shared by every `PythonTool` behind a lock, and restarted if it dies. `Session` is one
episode's interpreter: two socket pairs handed to the server, one to the worker that runs
the code and one to its supervisor, which kills the worker when we close our end.

A call's limit counts the worker's CPU time: the worker interrupts itself (ITIMER_PROF), and
`Session.run` reads its CPU clock from /proc to kill it when the interrupt does not land,
with a wall-clock limit behind both for code that sleeps or blocks. Waiting for a core on a
loaded machine therefore never turns into a timeout.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from copes.sandbox.cpu_time import process_cpu_seconds
from copes.sandbox.wire import FrameError, recv_frame, send_frame

logger = logging.getLogger(__name__)

SERVER_SCRIPT = Path(__file__).with_name("server.py")
SERVER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
SERVER_START_TIMEOUT = 120.0  # importing sympy on a loaded 2-core CI machine is slow
SESSION_START_TIMEOUT = 30.0
MAX_REPLY_BYTES = 8 * 2**20
MAX_CPU_POLL_S = 0.25  # longest wait between two reads of the worker's CPU clock


class SandboxError(RuntimeError):
    """The sandbox could not run the code: the server or the session failed to start."""


class WorkerLost(RuntimeError):
    """The session's worker is gone (killed, crashed or timed out); `reason` says why:
    "hard-timeout" (over its CPU time), "wall-timeout", "cpu-limit" (RLIMIT_CPU) or text."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SessionLimits:
    """What one session may use; see `PythonTool` for the meaning of each field."""

    memory_mb: int
    cpu_seconds: int
    max_processes: int
    max_file_bytes: int
    max_open_files: int
    scratch_mb: int


class Session:
    """One episode's interpreter; not thread-safe (its tool serializes calls)."""

    def __init__(
        self, worker: socket.socket, supervisor: socket.socket, limits: SessionLimits
    ) -> None:
        self.worker = worker
        self.supervisor = supervisor
        self.limits = limits
        self.owner_pid = os.getpid()
        self.isolation: dict[str, Any] = {}
        self.worker_pid: int | None = None  # in our pid namespace, as the supervisor saw it

    def wait_ready(self, deadline: float) -> None:
        try:
            hello = recv_frame(self.worker, deadline, MAX_REPLY_BYTES)
        except TimeoutError:
            self.close()
            raise SandboxError("the session did not start in time") from None
        except FrameError:
            reason = self._supervisor_news(time.monotonic() + 5.0)
            self.close()
            raise SandboxError(reason) from None
        if isinstance(hello, dict) and "error" in hello:
            self.close()
            raise SandboxError(str(hello["error"]))
        if not isinstance(hello, dict) or not hello.get("ready"):
            self.close()
            raise SandboxError(f"unexpected greeting from the session: {hello!r:.200}")
        self.isolation = dict(hello.get("isolation") or {})
        try:  # sent before the worker was even started, so it is already here
            news = recv_frame(self.supervisor, deadline, MAX_REPLY_BYTES)
        except (TimeoutError, FrameError):
            news = None
        if not (isinstance(news, dict) and isinstance(news.get("worker_pid"), int)):
            self.close()
            raise SandboxError(f"the session's supervisor did not name its worker: {news!r:.200}")
        self.worker_pid = news["worker_pid"]
        if self._worker_cpu() is None:
            logger.warning(
                "cannot read the sandbox worker's CPU time (/proc/%d/stat): code that "
                "swallows the CPU-time interrupt is only stopped by the wall-clock limit",
                self.worker_pid,
            )

    def run(
        self, code: str, timeout: float, wall_timeout: float, grace: float, max_chars: int
    ) -> dict[str, Any]:
        """Run `code` with `timeout` CPU seconds and `wall_timeout` wall-clock seconds.

        The worker interrupts the code at either limit; raises WorkerLost when the worker dies
        or is still running `grace` seconds (CPU or wall) past one of them.
        """
        cpu_limit = timeout + grace
        cpu_start = self._worker_cpu()

        def watch() -> float:
            cpu = self._worker_cpu()
            used = 0.0 if cpu is None or cpu_start is None else cpu - cpu_start
            if used >= cpu_limit:
                raise WorkerLost("hard-timeout")
            # Threads could use CPU faster than the wall clock runs: look at least every
            # MAX_CPU_POLL_S; a single thread cannot overshoot the budget left before then.
            return min(max(cpu_limit - used, 0.01), MAX_CPU_POLL_S)

        deadline = time.monotonic() + wall_timeout + grace
        request = {
            "code": code,
            "timeout": timeout,
            "wall_timeout": wall_timeout,
            "max_chars": max_chars,
        }
        try:
            send_frame(self.worker, request)
            reply = recv_frame(self.worker, deadline, MAX_REPLY_BYTES, watch)
        except WorkerLost:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise WorkerLost("wall-timeout") from None
        except (FrameError, OSError):
            reason = self._supervisor_news(time.monotonic() + 2.0)
            self.close()
            raise WorkerLost(reason) from None
        if (
            not isinstance(reply, dict)
            or not isinstance(reply.get("output"), str)
            or not isinstance(reply.get("timed_out"), bool)
        ):
            self.close()
            raise WorkerLost("the session sent a malformed reply")
        return reply

    def _worker_cpu(self) -> float | None:
        """CPU seconds the worker has used (None if it cannot be read: it is gone)."""
        return None if self.worker_pid is None else process_cpu_seconds(self.worker_pid)

    def _supervisor_news(self, deadline: float) -> str:
        """Why the worker went away, as the supervisor reports it."""
        try:
            news = recv_frame(self.supervisor, deadline, MAX_REPLY_BYTES)
            if isinstance(news, dict) and "worker_pid" in news:  # not yet read by wait_ready
                news = recv_frame(self.supervisor, deadline, MAX_REPLY_BYTES)
        except (TimeoutError, FrameError, OSError):
            return "the session stopped without a report"
        if not isinstance(news, dict):
            return "the session stopped without a report"
        if "error" in news:
            return str(news["error"])
        exit_ = news.get("exit") or {}
        cpu = exit_.get("cpu_s") or 0.0
        # The kernel enforces RLIMIT_CPU on its precise clock; rusage may read a bit lower.
        if exit_.get("signal") in ("SIGKILL", "SIGXCPU") and cpu >= 0.9 * self.limits.cpu_seconds:
            return "cpu-limit"
        if exit_.get("signal"):
            return f"killed by {exit_['signal']}"
        return f"exited with status {exit_.get('code')}"

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """End the session: the supervisor sees our end close and kills the worker."""
        for sock in (self.worker, self.supervisor):
            try:  # noqa: SIM105  (at interpreter exit __del__ may outlive contextlib)
                sock.close()
            except OSError:
                pass


class SandboxServer:
    """The process-wide zygote: started on first use, restarted when it has died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._owner_pid = os.getpid()

    @property
    def pid(self) -> int | None:
        """The server's pid, or None when it is not running."""
        with self._lock:
            return self._proc.pid if self._alive() and self._proc is not None else None

    def open_session(self, limits: SessionLimits) -> Session:
        """Fork a fresh isolated interpreter from the server and wait until it is ready."""
        for attempt in range(2):
            worker, worker_remote = socket.socketpair()
            supervisor, supervisor_remote = socket.socketpair()
            try:
                with self._lock:
                    self._ensure_started()
                    assert self._control is not None
                    try:
                        socket.send_fds(
                            self._control,
                            [json.dumps(asdict(limits)).encode()],
                            [worker_remote.fileno(), supervisor_remote.fileno()],
                        )
                    except OSError as exc:  # the server died since we last looked
                        self._stop()
                        worker.close()
                        supervisor.close()
                        if attempt:
                            raise SandboxError(f"the sandbox server refused: {exc}") from exc
                        continue
            finally:
                worker_remote.close()
                supervisor_remote.close()
            session = Session(worker, supervisor, limits)
            try:
                session.wait_ready(time.monotonic() + SESSION_START_TIMEOUT)
            except SandboxError:
                with self._lock:
                    died = not self._alive()
                if died and not attempt:
                    continue  # the server died under us; the next round starts a new one
                raise
            return session
        raise SandboxError("the sandbox server died twice while starting a session")

    def stop(self) -> None:
        """Stop the server; live sessions end with it. The next session starts a new one."""
        with self._lock:
            self._stop()

    def _alive(self) -> bool:
        return (
            self._proc is not None and self._proc.poll() is None and self._owner_pid == os.getpid()
        )

    def _ensure_started(self) -> None:
        if self._alive():
            return
        self._stop()
        if not sys.executable:
            raise SandboxError("sys.executable is empty, so no Python can be started")
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-I", str(SERVER_SCRIPT), "--control-fd", str(child.fileno())]
        for path in _package_roots("sympy", "mpmath"):
            command += ["--path", path]
        try:
            proc = subprocess.Popen(
                command,
                pass_fds=(child.fileno(),),
                env=SERVER_ENV,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            parent.close()
            raise SandboxError(f"could not run {sys.executable}: {exc}") from exc
        finally:
            child.close()
        parent.settimeout(SERVER_START_TIMEOUT)
        try:
            hello = json.loads(parent.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            hello = {}
        parent.settimeout(None)
        if not hello.get("ready"):
            proc.kill()
            proc.wait()
            parent.close()
            detail = hello.get("error", f"it exited with status {proc.returncode}")
            raise SandboxError(f"the sandbox server did not start: {detail}")
        self._proc, self._control, self._owner_pid = proc, parent, os.getpid()
        logger.debug("sandbox server started as pid %d", proc.pid)

    def _stop(self) -> None:
        if self._owner_pid != os.getpid():  # inherited through fork: the parent's, not ours
            self._proc = self._control = None
            self._owner_pid = os.getpid()
            return
        if self._control is not None:
            self._control.close()  # the server sees EOF, kills its sessions and exits
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _forget_after_fork(self) -> None:
        """In a forked child: drop the parent's server (closing our copy of its socket)."""
        self._lock = threading.Lock()
        if self._control is not None:
            self._control.close()
        self._proc = self._control = None
        self._owner_pid = os.getpid()


def _package_roots(*names: str) -> list[str]:
    """The directories the trainer imports `names` from, for a server started with -I."""
    roots = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            root = str(Path(spec.origin).parent.parent)
            if root not in roots:
                roots.append(root)
    return roots


_server = SandboxServer()
atexit.register(_server.stop)
os.register_at_fork(after_in_child=_server._forget_after_fork)


def shared_server() -> SandboxServer:
    """The server every PythonTool of this process shares."""
    return _server
