"""The persistent math-verify/sympy worker behind `copes.envs.rewards.math.is_equivalent`.

sympy can hang on `(x+1)^{100000}`, `signal.alarm` only works on the main thread, and
rollouts grade from thread pools, so the symbolic check runs in a worker process with a hard
timeout. The worker is a fresh interpreter (`python -c`), never a fork of the caller, which
may hold a CUDA context; it is not a `multiprocessing` spawn child either, because spawn
re-imports the caller's `__main__` (a training script that imports torch) in the child.

The worker loads this file alone, by path, not the `copes` package, so it imports only sympy
and math-verify: keep this module free of `copes` imports and of third-party imports at the
top level.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 60.0  # worker start (imports sympy + math-verify); not the per-pair budget
_WORKER_MEMORY_BYTES = 2 << 30  # address-space cap: a runaway `10^{10^{10}}` can't eat the host


@functools.lru_cache(maxsize=8192)
def symbolic_verdict(pred: str, gold: str, timeout: float) -> bool:
    """Whether two normalized answers are equal per math-verify; False on timeout or crash."""
    # GRPO groups repeat answers; caching also keeps a repeated hanging answer from costing a
    # full timeout every time. Keyed on the timeout, so a longer budget gets a fresh try.
    return GRADER.check(pred, gold, timeout)


# ---------------------------------------------------------------------------------------------
# Caller side


class SymbolicGrader:
    """One process-wide grader worker; requests are serialized by a lock.

    Protocol: one JSON object per line on the worker's stdin, each with a request id; one
    reply line per request on a dedicated fd, carrying the id back. A reply is only ever
    taken for the request whose id it carries, and if anything interrupts a request after it
    was written (a timeout, a crash, an exception or KeyboardInterrupt in the caller) the
    worker is killed, so a late reply can never be read as another request's verdict. The
    worker restarts lazily on the next request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()
        self._buffer = b""
        self._request_id = 0

    def _reset_after_fork(self) -> None:
        # A forked child must not share the parent's worker pipes (or inherit a held lock).
        self._lock = threading.Lock()
        self._proc = None
        self._owner_pid = os.getpid()
        self._buffer = b""

    def _start(self) -> None:
        code = (
            "import importlib.util as u, sys; "
            "s = u.spec_from_file_location('_copes_math_grader_worker', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m._worker_main()"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._buffer = b""
        reply = self._read_reply(_STARTUP_TIMEOUT_S)
        if not (isinstance(reply, dict) and reply.get("ready")):
            self._kill()
            raise RuntimeError(
                f"math grader worker failed to start ({reply!r}); check that sympy and "
                f"math-verify import in {sys.executable} (the worker's stderr is above)"
            )
        logger.debug("math grader worker started (pid %d)", self._proc.pid)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _read_reply(self, timeout: float) -> dict | None:
        """The next reply line, or None on timeout or worker exit."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _reply_to(self, request_id: int, timeout: float) -> dict | None:
        """The reply carrying `request_id` (earlier replies are dropped), or None."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_reply(max(0.0, deadline - time.monotonic()))
            if reply is None or reply.get("id") == request_id:
                return reply
            logger.warning("math grader: dropped a stale reply %r", reply)

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        with self._lock:
            if self._owner_pid != os.getpid():
                self._reset_after_fork()
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            self._request_id += 1
            request_id = self._request_id
            request = json.dumps({"id": request_id, "pred": pred, "gold": gold}).encode()
            try:
                self._proc.stdin.write(request + b"\n")
                self._proc.stdin.flush()
                reply = self._reply_to(request_id, timeout)
            except BrokenPipeError:
                reply = None
            except BaseException:  # its reply may still come: never let it answer another
                self._kill()
                raise
            if reply is None:
                crashed = self._proc.poll() is not None
                self._kill()
                logger.warning(
                    "math grader %s on pred=%.200r gold=%.200r; counted as not equivalent, "
                    "worker restarts on the next symbolic check",
                    "worker crashed" if crashed else f"timed out after {timeout:.1f}s",
                    pred,
                    gold,
                )
                return False
            if "error" in reply:
                logger.debug("math grader: symbolic check failed: %s", reply["error"])
            return bool(reply.get("equal", False))

    def close(self) -> None:
        with self._lock:
            if self._owner_pid == os.getpid():
                self._kill()


GRADER = SymbolicGrader()
atexit.register(GRADER.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=GRADER._reset_after_fork)


# ---------------------------------------------------------------------------------------------
# Worker side (runs in the `python -c` process started by `SymbolicGrader._start`)


def _watch_caller(worker_pid: int) -> None:
    """Forked from the worker at start: SIGKILL it once the caller is gone.

    A thread inside the worker cannot do this: a runaway bigint power holds the GIL for
    minutes. The caller holds the only write end of the worker's stdin, so the kernel flags
    that pipe with POLLHUP when the caller dies, even while it is an unreaped zombie.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # drop our copies of the reply pipe and the caller's stderr, so
    os.dup2(devnull, 2)  # whoever reads them sees EOF as soon as the worker dies
    lifeline = select.poll()
    lifeline.register(0, 0)  # POLLHUP/POLLERR are always reported; never POLLIN (requests)
    while os.getppid() == worker_pid:
        if lifeline.poll(1000):
            os.kill(worker_pid, signal.SIGKILL)
            break
    os._exit(0)


def _worker_main() -> None:
    """Worker loop: read {"pred", "gold"} lines, reply {"equal"} via math-verify/sympy."""
    worker_pid = os.getpid()
    if hasattr(os, "fork") and os.fork() == 0:  # fresh interpreter, no threads yet: safe
        _watch_caller(worker_pid)
    reply_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the reply channel
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft > _WORKER_MEMORY_BYTES:
            cap = (
                _WORKER_MEMORY_BYTES
                if hard == resource.RLIM_INFINITY
                else min(hard, _WORKER_MEMORY_BYTES)
            )
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, ValueError, OSError):
        pass
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its "timeout disabled" notice
    from math_verify import parse, verify

    def equal(pred: str, gold: str) -> bool:
        # math-verify's own timeouts use signal.alarm; the parent enforces ours instead.
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
        pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))

    equal("x^2+1", "1+x^2")  # warm sympy's caches before reporting ready
    reply_out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = None
        try:
            request = json.loads(line)
            reply = {"id": request.get("id"), "equal": equal(request["pred"], request["gold"])}
        except Exception as e:  # includes MemoryError from the address-space cap
            reply = {"id": None, "equal": False, "error": f"{type(e).__name__}: {e}"[:500]}
            if isinstance(request, dict):
                reply["id"] = request.get("id")
        reply_out.write(json.dumps(reply) + "\n")
