"""One sandbox session: the supervisor and the worker that the server forks for an episode.

    server ──fork──▶ supervisor (root, or root of a user namespace; runs no model code)
                       unshare net/mount/pid/ipc namespaces; kills or reports the worker
                       └──fork──▶ worker (pid 1 of the new pid namespace)
                                   private read-only root with /proc and a tmpfs /tmp,
                                   limits, unprivileged uid, no capabilities → REPL loop

The worker talks to the caller over one socket. The supervisor holds the other: when the
caller closes it (hard timeout, reset, close, or the trainer dying) the supervisor kills the
worker, and when the worker dies on its own the supervisor reports why over it. Standard
library only; the server loads this file by path.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

try:
    from . import isolation as iso
    from . import repl, wire
except ImportError:  # loaded by path inside the sandbox server, where there is no package
    import _copes_sandbox_isolation as iso  # type: ignore[no-redef]
    import _copes_sandbox_repl as repl  # type: ignore[no-redef]
    import _copes_sandbox_wire as wire  # type: ignore[no-redef]

logger = logging.getLogger("copes.sandbox.session")

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class SessionSpec:
    """Everything the server decided for one session.

    Attributes:
        server_pid: the server's pid (to notice that it died before we armed our death signal).
        is_root: whether the server runs as root (then `uid` is the session's own uid).
        visible: the private root's bind list (see `server.visible_paths`).
        limits: the caller's `SessionLimits` as a dict.
        uid: the session's private uid, or None when not root.
        scratch: an empty host directory owned by the session: the new root's mount point,
            or the working directory when there is no mount namespace.
        sweep_first: processes of `uid` may be left from a crashed server or session.
    """

    server_pid: int
    is_root: bool
    visible: list[list[str]]
    limits: dict[str, Any]
    uid: int | None
    scratch: str
    sweep_first: bool


def try_send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        wire.send_frame(sock, message)


def _close_fds_except(keep: set[int]) -> None:
    last = -1
    for fd in sorted(keep | {0, 1, 2}):
        if fd > last + 1:  # careful: os.closerange(3, 0) closes every fd from 3 up
            os.closerange(last + 1, fd)
        last = fd
    os.closerange(last + 1, max(os.sysconf("SC_OPEN_MAX"), last + 2))


def supervise(spec: SessionSpec, worker_sock: socket.socket, status_sock: socket.socket) -> int:
    """The supervisor: isolate, fork the worker, then kill or report it. Returns exit code.

    Runs in a fresh fork of the server; closes every descriptor but the two sockets.
    """
    os.setsid()
    iso.set_parent_death_signal()
    if os.getppid() != spec.server_pid:
        return 1  # the server died before the death signal was armed
    _close_fds_except({worker_sock.fileno(), status_sock.fileno()})
    uid = spec.uid
    if spec.sweep_first and uid is not None:  # before the pid namespace, whose first
        _sweep_uid(uid, until_no_children=False)  # child would become its init
    notes: list[str] = []
    layers = iso.enter_namespaces(spec.is_root, notes)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            status_sock.close()
            worker_main(spec, worker_sock, alive_r, layers, notes)
        except BaseException as exc:
            try_send(worker_sock, {"error": f"the session could not start: {exc!r}"})
        finally:
            os._exit(1)
    os.close(alive_r)
    worker_sock.close()
    # The caller's time limit reads the worker's CPU clock from /proc: it needs the pid as
    # the caller's pid namespace (ours, not the worker's new one) names it.
    try_send(status_sock, {"worker_pid": pid})
    iso.prctl(iso.PR_SET_CHILD_SUBREAPER, 1)
    killed_by_caller = _wait_worker(pid, status_sock)
    if not layers["pid"] and uid is None:
        # Degraded mode: take the worker's process group along. The worker is a zombie
        # until wait4 below, so its pid (the group's id) cannot have been reused.
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    report = {
        "code": None,
        "signal": None,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "killed_by_caller": killed_by_caller,
    }
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            report["signal"] = signal.Signals(number).name
        except ValueError:  # a real-time signal has no name
            report["signal"] = f"signal {number}"
    else:
        report["code"] = os.waitstatus_to_exitcode(status)
    try_send(status_sock, {"exit": report})
    # With a pid namespace the kernel killed every process in it along with its init.
    if uid is not None and not layers["pid"] and not _sweep_uid(uid, until_no_children=True):
        return 1  # the server sweeps this uid again before reusing it
    return 0


def _wait_worker(pid: int, status_sock: socket.socket) -> bool:
    """Wait until the worker has exited (left unreaped) or kill it when the caller hangs up.

    Returns whether the caller's hang-up was the reason.
    """
    poller = select.poll()
    poller.register(status_sock, select.POLLIN)
    try:
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
        interval = None
    except (AttributeError, OSError):
        interval = 50  # ms; without pidfds, poll for the worker's exit
    while True:
        events = poller.poll(interval)
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return False
        if any(fd == status_sock.fileno() for fd, _ in events):
            os.kill(pid, signal.SIGKILL)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            return True


def _sweep_uid(uid: int, until_no_children: bool) -> bool:
    """Kill every process of the session's uid, reaping the orphans that come back to us.

    Returns False when some were still not reaped after 3 s.
    """
    helper = iso.start_uid_killer(uid)
    if not until_no_children:
        os.waitpid(helper, 0)
        return True
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            time.sleep(0.002)
    logger.warning("processes of sandbox uid %d were not reaped within 3 s", uid)
    return False


def worker_main(
    spec: SessionSpec,
    sock: socket.socket,
    alive_r: int,
    layers: dict[str, bool],
    notes: list[str],
) -> None:
    """The worker: finish the isolation from inside, then serve the REPL until hung up.

    The worker, not the supervisor, builds the private root: only the init of the new pid
    namespace can mount a /proc that shows that namespace.
    """
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # under memory pressure the kernel kills this, not the trainer
    os.setsid()  # kill(0, ...) by the code must not reach the supervisor's process group
    uid, limits = spec.uid, spec.limits
    pid_namespace = layers["pid"] and os.getpid() == 1
    private_root = False
    if layers["mount"]:
        owner = (uid, uid) if uid is not None else (os.getuid(), os.getgid())
        try:
            notes += iso.build_private_root(
                spec.scratch, spec.visible, limits["scratch_mb"], owner, with_proc=pid_namespace
            )
            private_root = True
        except OSError as exc:
            notes.append(f"no private filesystem: {exc}")
    cwd = spec.scratch
    if private_root:
        # A fresh directory of its own inside the private /tmp: when the Python installation
        # itself lives under /tmp (a venv in a CI checkout), its bind mount shows up in /tmp.
        cwd = "/tmp/work"
        os.mkdir(cwd, 0o700)
        os.chown(cwd, *owner)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(SANDBOX_ENV, HOME=cwd, TMPDIR=cwd)
    output_fd = os.memfd_create("sandbox-output", os.MFD_CLOEXEC)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(null)
    _close_fds_except({sock.fileno(), alive_r, output_fd})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG errors instead of death
    max_processes = limits["max_processes"]
    if uid is None and not layers["user"]:
        max_processes += _count_tasks_of(os.getuid())  # RLIMIT_NPROC counts the whole user
    iso.set_limits(
        limits["memory_mb"],
        limits["cpu_seconds"],
        max_processes,
        limits["max_file_bytes"],
        limits["max_open_files"],
    )
    os.umask(0o077)
    if not pid_namespace:
        iso.prctl(iso.PR_SET_CHILD_SUBREAPER, 1)  # orphans come back here to be killed
    if uid is not None:
        iso.drop_privileges(uid, uid)
    elif layers["user"]:
        iso.clear_capabilities()
    iso.no_new_privileges()
    if not private_root and not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
        notes.append(
            f"the session's uid cannot read {os.path.dirname(os.__file__)}: only "
            "modules the server pre-imported can be imported; make the Python "
            "installation world-readable (o+rx on it and its parents)"
        )
    iso.set_parent_death_signal()
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(1)  # the supervisor died before the death signal was armed
    isolation = {
        "network": layers["net"],
        "filesystem": "private-root" if private_root else "scratch-dir",
        "pid_namespace": pid_namespace,
        "host_processes_visible": not private_root,  # the host's /proc is still mounted
        "uid": uid,
        "user_namespace": layers["user"],
        "notes": notes,
    }
    strays = iso.kill_other_processes if pid_namespace or uid is not None else None
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    namespace.update({name: sys.modules[name] for name in ("sympy", "math")})
    session = repl.Repl(sock, namespace, output_fd, strays, limits["memory_mb"])
    session.serve({"ready": True, "isolation": isolation})


def _count_tasks_of(uid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            total += int(fields.get("Threads", "1").strip())
    return total
