"""The sandbox server ("zygote"): a fresh interpreter that forks one isolated session per episode.

Started once per trainer process by `client.py` as ``python -I server.py``
with a cleared environment. It imports sympy and math once, then waits on a control socket.
Each request carries two sockets (SCM_RIGHTS) and the session's limits; for each the server
picks a uid and a scratch directory and forks the session's supervisor, which forks the
worker that runs the code (see `session.py`). Fork gives every session the imported
modules for free; nothing here ever runs in the trainer.
Standard library (plus sympy) only: this file and its siblings load by path, under the
module names `_copes_sandbox_NAME` (no name user code could mean).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

logger = logging.getLogger("copes.sandbox.server")

UID_BASE = 1_500_000_000  # far above system users and /etc/subuid ranges (100000 + 65536 n)
UID_COUNT = 65536
BASE_PREFIX = "copes-sandbox-"
PRELOAD = (
    "math",
    "cmath",
    "fractions",
    "decimal",
    "itertools",
    "functools",
    "collections",
    "statistics",
    "random",
    "re",
    "json",
    "string",
    "heapq",
    "bisect",
    "operator",
    "datetime",
    "sympy",
)


def _load_sibling(name: str) -> ModuleType:
    """Import `copes/sandbox/<name>.py` by path, so `copes` itself is never imported here."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_copes_sandbox_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


iso: Any = None  # the sibling modules, loaded by path in main()
session: Any = None


def visible_paths() -> list[list[str]]:
    """What the private root shows: system directories and wherever Python and its packages
    live (the venv may sit under /root, which the session's uid could not traverse)."""
    system = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    python = [
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        *sys.path,
    ]
    candidates = set()
    for path in system + python:
        if path and os.path.isabs(path) and os.path.exists(path):
            candidates.update({os.path.abspath(path), os.path.realpath(path)})
    candidates.discard("/")
    chosen: list[str] = []
    entries: list[list[str]] = []
    for path in sorted(candidates, key=lambda p: (p.count("/"), p)):
        if any(path.startswith(c + "/") for c in chosen):
            continue
        chosen.append(path)
        if path in system and os.path.islink(path):
            entries.append(["symlink", path, os.readlink(path)])
        else:
            entries.append(["bind", path])
    return entries


class UidPool:
    """Hands out per-session uids, unique across every server on the machine.

    Each uid this server holds is locked with an flock on a file in a root-only directory;
    the kernel drops the lock when the server dies, so a crashed server frees its uids. A
    finished session's uid stays locked and is reused by the next session, without a sweep
    when the session ended cleanly (all its processes are known dead).
    """

    def __init__(self) -> None:
        base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
        self.dir = os.path.join(base, "copes-sandbox-uids")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)
        if st.st_uid != 0 or st.st_mode & 0o077 or not os.path.isdir(self.dir):
            raise RuntimeError(f"{self.dir} must be a directory owned by root with mode 0700")
        self.locks: dict[int, int] = {}  # every uid we hold -> fd of its locked file
        self.clean: list[int] = []  # idle, and no process of theirs can be alive
        self.dirty: list[int] = []  # idle, but their session did not end cleanly

    def acquire(self) -> tuple[int, bool]:
        """-> (uid, whether processes of a crashed server or session may still run as it)."""
        if self.clean:
            return self.clean.pop(), False
        if self.dirty:
            return self.dirty.pop(), True
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            if uid in self.locks:
                continue
            fd = os.open(
                os.path.join(self.dir, str(uid)),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another server's
                os.close(fd)
                continue
            self.locks[uid] = fd
            return uid, True
        raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use")

    def release(self, uid: int, clean: bool) -> None:
        (self.clean if clean else self.dirty).append(uid)


class Server:
    """The zygote's state: its control socket, live sessions and what they need."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.pid = os.getpid()
        self.is_root = os.geteuid() == 0
        self.uids = UidPool() if self.is_root else None
        _remove_stale_bases()
        self.base = tempfile.mkdtemp(prefix=BASE_PREFIX)
        os.chmod(self.base, 0o711)  # session uids may enter their own scratch dir, not list
        self.base_lock = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(self.base_lock, fcntl.LOCK_EX)  # "in use"; released when we die
        self.visible = visible_paths()
        self.sessions: dict[int, tuple[int | None, str]] = {}  # supervisor pid -> uid, scratch
        self.counter = 0
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)

    def serve(self) -> None:
        wire_ready = json.dumps({"ready": True, "pid": self.pid}).encode()
        self.control.send(wire_ready)
        while True:
            readable, _, _ = select.select([self.control, self.wake_r], [], [])
            if self.wake_r in readable:
                while True:
                    try:
                        if not os.read(self.wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                self._reap()
            if self.control in readable:
                try:
                    message, fds, _, _ = socket.recv_fds(self.control, 1 << 16, 2)
                except OSError:
                    message, fds = b"", []
                if not message:
                    return  # the trainer closed the control socket or died
                self._start_session(message, fds)

    def shutdown(self) -> None:
        for pid in list(self.sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while self.sessions and time.monotonic() < end:
            self._reap()
            time.sleep(0.01)
        for uid in self.uids.locks if self.uids is not None else ():
            # A worker that cleared its parent-death signal would outlive its supervisor.
            os.waitpid(iso.start_uid_killer(uid), 0)
        shutil.rmtree(self.base, ignore_errors=True)

    def _start_session(self, message: bytes, fds: list[int]) -> None:
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            logger.error("ignored a session request with %d file descriptors, not 2", len(fds))
            return
        worker_sock = socket.socket(fileno=fds[0])
        status_sock = socket.socket(fileno=fds[1])
        uid = None
        sweep = False
        try:
            limits = json.loads(message)
            if self.uids is not None:
                uid, sweep = self.uids.acquire()
            self.counter += 1
            scratch = os.path.join(self.base, f"s{self.counter}")
            os.mkdir(scratch, 0o700)
            if uid is not None:
                os.chown(scratch, uid, uid)
        except Exception as exc:  # report to the caller instead of dying
            session.try_send(status_sock, {"error": f"the server could not start a session: {exc}"})
            if uid is not None:
                self.uids.release(uid, clean=not sweep)
            worker_sock.close()
            status_sock.close()
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.control.close()
                spec = session.SessionSpec(
                    self.pid, self.is_root, self.visible, limits, uid, scratch, sweep
                )
                code = session.supervise(spec, worker_sock, status_sock)
            except BaseException as exc:
                session.try_send(status_sock, {"error": f"the session supervisor failed: {exc!r}"})
            finally:
                os._exit(code)
        worker_sock.close()
        status_sock.close()
        self.sessions[pid] = (uid, scratch)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            uid, scratch = self.sessions.pop(pid, (None, ""))
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            if uid is not None and self.uids is not None:
                self.uids.release(uid, clean=os.waitstatus_to_exitcode(status) == 0)


def _remove_stale_bases() -> None:
    """Delete the scratch bases of servers that died without cleaning up (SIGKILL, OOM).

    A live server holds an flock on its base directory, so a lockable one is stale.
    """
    parent = tempfile.gettempdir()
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(BASE_PREFIX):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or time.time() - st.st_mtime < 60:
                continue  # not ours, or so new that its server may not have locked it yet
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # locked: its server is alive
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    global iso, session
    parser = argparse.ArgumentParser(description="copes sandbox server (started by PythonTool)")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        help="extra import path (where the trainer found sympy)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="copes sandbox: %(message)s")
    control = socket.socket(fileno=args.control_fd)
    for path in args.path:
        if path not in sys.path:
            sys.path.append(path)
    try:
        for name in ("wire", "isolation", "repl"):
            _load_sibling(name)
        iso = sys.modules["_copes_sandbox_isolation"]
        session = _load_sibling("session")
        for name in PRELOAD:
            __import__(name)
        server = Server(control)
    except Exception as exc:
        control.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    gc.collect()
    gc.freeze()  # sessions share these pages copy-on-write; a frozen heap is not rescanned
    try:
        server.serve()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
