"""Linux isolation primitives for the sandbox: namespaces, a private root, limits, privileges.

Only the sandbox server's forked children run this code, never the trainer. Python 3.11 has
no os.unshare, mount or pivot_root, so they go through ctypes on the C library. Every step
can fail on a restricted host (a container without CAP_SYS_ADMIN, a kernel that forbids
unprivileged user namespaces); callers record what worked and report it instead of failing.
Standard library only: the server loads this file by path, without importing `copes`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
MS_STRICTATIME = 0x1000000
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
_MOUNT_OPTION_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
# Device nodes the private root exposes (bound from the host); everything else in /dev is absent.
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    ret = _libc.mount(
        enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data) if data else None
    )
    _check(ret, f"mount {source!r} on {target!r}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to kill this process when its parent dies (cleared by any uid change)."""
    prctl(PR_SET_PDEATHSIG, int(sig))


def enter_namespaces(is_root: bool, notes: list[str]) -> dict[str, bool]:
    """Unshare network, mount, pid and IPC namespaces; returns which ones this process got.

    As root the namespaces are created directly. Otherwise a user namespace that maps the
    caller's uid to itself comes first, which is what lets an unprivileged process create
    the others (where the kernel allows unprivileged user namespaces). Why a namespace could
    not be had is appended to `notes`.
    """
    wanted = {"net": CLONE_NEWNET, "mount": CLONE_NEWNS, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC}
    got = dict.fromkeys(wanted, False)
    got["user"] = False
    if is_root:
        try:
            unshare(sum(wanted.values()))
            return {**dict.fromkeys(wanted, True), "user": False}
        except OSError:
            for name, flag in wanted.items():  # a partial set is still worth having
                try:
                    unshare(flag)
                    got[name] = True
                except OSError as exc:
                    notes.append(f"no {name} namespace: {exc.strerror}")
            return got
    uid, gid = os.getuid(), os.getgid()
    for names in (("net", "mount", "pid", "ipc"), ("net",)):
        try:
            unshare(CLONE_NEWUSER | sum(wanted[n] for n in names))
        except OSError as exc:
            notes.append(f"no user namespace with {'+'.join(names)}: {exc.strerror}")
            continue
        got["user"] = True
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as exc:
            # Unmapped, we hold no capability in the namespace: no mounts. The network
            # namespace itself is still in place and still isolating.
            notes.append(f"user namespace without a uid map: {exc.strerror}")
            return {**got, "net": "net" in names}
        return {**got, **{n: True for n in names}}
    return got


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def build_private_root(
    new_root: str,
    visible: list[list[str]],
    scratch_mb: int,
    owner: tuple[int, int],
    with_proc: bool,
) -> list[str]:
    """Replace this mount namespace's root with a minimal read-only one.

    The new root holds read-only binds of the `visible` system and Python directories
    (("bind", path) or ("symlink", path, target) entries), a few device nodes, /proc (when
    `with_proc`: only for the init of a fresh pid namespace, so that it shows only that
    namespace), and a size-limited tmpfs at /tmp (owned by `owner`) that is the only
    writable place. Everything else (home directories, the project, /run and its sockets,
    the trainer's files) is simply not there. `new_root` must be an empty directory.
    Raises OSError when the root could not be switched; returns notes on what could not be
    set up (a missing /proc, mounts left writable).
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    uid, gid = owner
    tmp = new_root + "/tmp"
    os.mkdir(tmp)
    mount(
        "tmpfs",
        tmp,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={scratch_mb}m,mode=0700,uid={uid},gid={gid}",
    )
    for entry in visible:
        kind, path = entry[0], entry[1]
        dst = new_root + path
        if kind == "symlink":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(entry[2], dst)
            continue
        if os.path.isdir(path):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        mount(path, dst, None, MS_BIND | MS_REC)
    os.makedirs(new_root + "/dev", exist_ok=True)
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{new_root}/dev/{name}", "a").close()
            mount("/dev/" + name, f"{new_root}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("shm", "/tmp"),
    ):
        os.symlink(target, f"{new_root}/dev/{name}")
    os.makedirs(new_root + "/var", exist_ok=True)
    os.symlink("/tmp", new_root + "/var/tmp")
    os.mkdir(new_root + "/proc")
    notes = []
    if with_proc:
        try:  # before the pivot: in a user namespace the kernel only allows a new proc
            # mount while an unobscured one is still visible
            mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as exc:
            notes.append(f"no /proc in the sandbox: {exc}")
    notes += _make_read_only(new_root, keep_writable={new_root + "/tmp"})
    os.chdir(new_root)
    _check(_libc.syscall(_SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    return notes


def _make_read_only(under: str, keep_writable: set[str]) -> list[str]:
    """Remount every mount at or below `under` read-only, except `keep_writable`.

    The per-mount options (nosuid, atime mode...) are kept: inside a user namespace the
    kernel refuses a remount that would clear them.
    """
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    failures = []
    for line in lines:
        fields = line.split()
        target = _unescape(fields[4])
        if target in keep_writable or not (target == under or target.startswith(under + "/")):
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for option in fields[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            mount(None, target, None, flags)
        except OSError as exc:
            failures.append(f"{target} stays writable ({exc.strerror})")
    return failures


def _unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1 : i + 4].isdigit() and i + 4 <= len(path):
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def set_limits(
    memory_mb: int, cpu_seconds: int, max_processes: int, max_file_bytes: int, max_open_files: int
) -> None:
    """Apply the resource limits (hard = soft, so the sandboxed code cannot raise them)."""
    for limit, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_NPROC, max_processes),
        (resource.RLIMIT_FSIZE, max_file_bytes),
        (resource.RLIMIT_NOFILE, max_open_files),
    ):
        _soft, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))


def drop_privileges(uid: int, gid: int) -> None:
    """Become `uid`/`gid` for good (real, effective and saved ids); root's capabilities go."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() != uid or os.getegid() != gid:
        raise OSError(errno.EPERM, f"still running as {os.geteuid()} after dropping to {uid}")


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def clear_capabilities() -> None:
    """Drop every capability (a user namespace gives its creator all of them inside it)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def no_new_privileges() -> None:
    """execve can never gain privileges again (setuid binaries such as su stay powerless)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def start_uid_killer(uid: int) -> int:
    """Fork a helper that takes `uid` and SIGKILLs every process running as it; returns its pid.

    Exact because each session has a uid of its own, and one kill(-1) suffices: the kernel
    signals all of them under the task-list lock, and a process with a pending SIGKILL can no
    longer fork. The caller reaps the helper, and the killed orphans if they are its own.
    """
    if uid == 0:
        raise ValueError("refusing to kill every process of uid 0")
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        drop_privileges(uid, uid)
        if os.geteuid() != 0:  # never kill(-1) as root
            for _ in range(2):
                os.kill(-1, signal.SIGKILL)  # other uids' processes just answer EPERM
            code = 0
    finally:
        os._exit(code)


def kill_other_processes(reap: bool = True) -> None:
    """From the session's worker: kill every other process it can signal, then reap them.

    Only called where "every process it can signal" is exactly the session's own processes:
    as init of its own pid namespace, or as the session's private uid.
    """
    if os.geteuid() == 0 and os.getpid() != 1:
        raise RuntimeError("refusing to kill(-1) as root outside a private pid namespace")
    for _ in range(2):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # only in a pid namespace: nobody else is left
            break
    if not reap:
        return
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # the killed become zombies of ours (init or subreaper)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)
