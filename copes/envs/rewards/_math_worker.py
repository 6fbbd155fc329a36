"""The persistent math-verify/sympy worker behind `copes.envs.rewards.math.is_equivalent`.

sympy can hang on `(x+1)^{100000}`, `signal.alarm` only works on the main thread, and
rollouts grade from thread pools, so the symbolic check runs in a worker process with a hard
limit. The limit counts the worker's CPU time, not the caller's waiting, so that a verdict
does not depend on how loaded the machine is (issue 25). The worker is a fresh interpreter
(`python -c`), never a fork of the caller, which may hold a CUDA context; it is not a
`multiprocessing` spawn child either, because spawn re-imports the caller's `__main__` (a
training script that imports torch) in the child.

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

_STARTUP_TIMEOUT_S = 120.0  # worker start (imports, warm-up), before any check's budget starts
_MAX_POLL_S = 0.5  # longest wait between two reads of the worker's CPU clock
_WORKER_MEMORY_BYTES = 2 << 30  # address-space cap: a runaway `10^{10^{10}}` can't eat the host


@functools.lru_cache(maxsize=8192)
def symbolic_verdict(pred: str, gold: str, timeout: float) -> bool:
    """Whether two normalized answers are equal per math-verify within `timeout` CPU seconds;
    False on timeout or crash."""
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

    A check's `timeout` is CPU seconds of the worker, which the caller reads from outside
    (/proc/PID/stat), so a bigint power that holds the worker's GIL is still cut off. The
    worker also reports the CPU time it spent, and a reply over the budget counts as a
    timeout too: the verdict never depends on when the caller happened to look. A wall-clock
    backstop of max(60 s, 20 x timeout) ends a worker that stalls without computing. Starting
    or restarting the worker happens before a check's budget starts and never counts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()
        self._buffer = b""
        self._eof = False
        self._request_id = 0
        self._wall_clock_only = False  # no /proc on this OS: the budget is wall-clock

    def _reset_after_fork(self) -> None:
        # A forked child must not share the parent's worker pipes (or inherit a held lock).
        self._lock = threading.Lock()
        self._proc = None
        self._owner_pid = os.getpid()
        self._buffer = b""
        self._eof = False

    def start(self) -> None:
        """Start the worker now if it is not running (a check otherwise starts it lazily)."""
        with self._lock:
            self._ensure_running()

    def _ensure_running(self) -> None:
        """(Re)start the worker if this process has none alive; the caller holds the lock."""
        if self._owner_pid != os.getpid():
            self._reset_after_fork()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

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
        self._eof = False
        reply = self._read_reply(_STARTUP_TIMEOUT_S)
        if not (isinstance(reply, dict) and reply.get("ready")):
            self._kill()
            raise RuntimeError(
                f"math grader worker failed to start ({reply!r}); check that sympy and "
                f"math-verify import in {sys.executable} (the worker's stderr is above)"
            )
        from copes.sandbox.cpu_time import process_cpu_seconds

        if process_cpu_seconds(self._proc.pid) is None and not self._wall_clock_only:
            self._wall_clock_only = True
            logger.warning(
                "math grader: cannot read the worker's CPU time from /proc on this OS, so its "
                "timeout counts wall-clock seconds and verdicts can depend on machine load"
            )
        logger.debug("math grader worker started (pid %d)", self._proc.pid)

    def _cpu_seconds(self) -> float | None:
        """The worker's CPU clock (the caller's wall clock where /proc is missing)."""
        from copes.sandbox.cpu_time import process_cpu_seconds

        if self._wall_clock_only:
            return time.monotonic()
        assert self._proc is not None
        return process_cpu_seconds(self._proc.pid)

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
                self._eof = True
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _reply_to(
        self, request_id: int, timeout: float, cpu_start: float | None
    ) -> tuple[dict | None, str]:
        """The reply carrying `request_id` (earlier replies are dropped), or (None, why not).

        Waits until the worker has used `timeout` CPU seconds since `cpu_start`, or for the
        wall-clock backstop.
        """
        from copes.sandbox.cpu_time import wall_backstop

        backstop = wall_backstop(timeout)
        started = time.monotonic()
        while True:
            cpu_now = self._cpu_seconds()
            used = 0.0 if cpu_now is None or cpu_start is None else cpu_now - cpu_start
            waited = time.monotonic() - started
            if used > timeout:
                return None, f"timed out after {timeout:g} s of CPU time"
            if waited > backstop:
                return None, f"stalled for {backstop:g} s of wall-clock time ({used:.1f} s CPU)"
            # The worker is single-threaded: it cannot use more CPU than wall time passes, so
            # waiting for the budget left never overshoots it.
            wait = min(max(timeout - used, 0.01), backstop - waited, _MAX_POLL_S)
            reply = self._read_reply(wait)
            if reply is not None:
                if reply.get("id") == request_id:
                    return reply, ""
                logger.warning("math grader: dropped a stale reply %r", reply)
            elif self._eof:
                return None, "worker crashed"

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        """Whether math-verify finds `pred` equal to `gold` within `timeout` CPU seconds of
        the worker; False on timeout or crash (the worker then restarts on the next check)."""
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        with self._lock:
            self._ensure_running()
            assert self._proc is not None and self._proc.stdin is not None
            self._request_id += 1
            request_id = self._request_id
            request = json.dumps({"id": request_id, "pred": pred, "gold": gold}).encode()
            cpu_start = self._cpu_seconds()  # after the start: warm-up never counts
            try:
                self._proc.stdin.write(request + b"\n")
                self._proc.stdin.flush()
                reply, failure = self._reply_to(request_id, timeout, cpu_start)
            except BrokenPipeError:
                reply, failure = None, "worker crashed"
            except BaseException:  # its reply may still come: never let it answer another
                self._kill()
                raise
            if reply is None:
                self._kill()
                logger.warning(
                    "math grader %s on pred=%.200r gold=%.200r; counted as not equivalent, "
                    "worker restarts on the next symbolic check",
                    failure,
                    pred,
                    gold,
                )
                return False
            cpu_used = reply.get("cpu_s")
            over_budget = isinstance(cpu_used, (int, float)) and cpu_used > timeout
            if over_budget and not self._wall_clock_only:  # finished, but past the budget
                logger.warning(
                    "math grader timed out after %g s of CPU time (the reply came at %.2f s) "
                    "on pred=%.200r gold=%.200r; counted as not equivalent",
                    timeout,
                    cpu_used,
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


def _exact_decimals(latex: str) -> str:
    """Each decimal literal as the fraction it writes (`1.5` -> `{\\frac{15}{10}}`), so that
    sympy sees exact rationals: no Float reaches a comparison. Outside brackets `1,000.5` is one
    number; inside brackets a comma separates elements, so `(1,234.5)` is the pair (1, 234.5)
    on both sides, as the caller reads it."""
    import re

    def as_fraction(m: re.Match) -> str:
        before = latex[: m.start()]
        depth = sum(before.count(c) for c in "([") - sum(before.count(c) for c in ")]")
        whole, decimals = m.group(1), m.group(2)
        head = ""
        if "," in whole and depth > 0:
            head, whole = whole.rsplit(",", 1)
            head += ","
        digits = whole.replace(",", "") + decimals
        return head + "{\\frac{" + digits + "}{1" + "0" * len(decimals) + "}}"

    return re.sub(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)(?![\d.])", as_fraction, latex)


def _exact_numeric_eq(a, b, float_rounding, numeric_precision) -> bool:
    """Stands in for math-verify's `sympy_numeric_eq`, which rounds to `float_rounding` (6)
    decimals and evaluates `a - b` with `chop=True`: that made `1/2^99` equal `1/2^98` and
    `1/100!` equal `1/99!`. Here a number equals another only when their exact difference
    reduces to 0 (`radsimp` denests the surds that `simplify` is slow on); anything else is
    left to math-verify's symbolic check, `simplify(a - b).is_zero`."""
    from sympy import MatrixBase, expand, radsimp

    def is_zero(d) -> bool:
        return d == 0 or (d.is_number and radsimp(expand(d)) == 0)

    try:
        diff = (a - b).doit()
        if isinstance(diff, MatrixBase):
            return all(is_zero(d) for d in diff)
        return bool(is_zero(diff))
    except Exception:  # sets, relations, mismatched shapes: not numbers
        return False


def _imaginary_unit(expr):
    """MATH's free `i` is the imaginary unit; math-verify keeps it a symbol (`e^{i\\pi}` != -1)."""
    from sympy import Basic, I

    if not isinstance(expr, Basic):
        return expr
    return expr.xreplace({s: I for s in expr.free_symbols if getattr(s, "name", "") == "i"})


def _parse(latex: str) -> list:
    from math_verify import parse

    # math-verify's own timeouts use signal.alarm; the parent enforces ours instead.
    return [_imaginary_unit(e) for e in parse(f"\\boxed{{{latex}}}", parsing_timeout=None)]


def _within_tolerance(pred: str, gold: str) -> bool:
    """`gold` is `\\approx X \\pm T` (written by the caller, which decides when a tolerance
    applies and how large): whether `pred` is a real number within T of X."""
    from fractions import Fraction

    from sympy import Basic, Rational

    target, tolerance = (Fraction(part.strip()) for part in gold[len("\\approx ") :].split("\\pm"))
    for expr in _parse(_exact_decimals(pred)):
        if isinstance(expr, Basic) and expr.is_number:
            value = expr.evalf(60)
            if value.is_real:
                error = abs(Rational(str(value)) - Rational(target.numerator, target.denominator))
                return bool(error <= Rational(tolerance.numerator, tolerance.denominator))
    return False


def _symbolic_equal(pred: str, gold: str) -> bool:
    """The symbolic verdict on two normalized answers (runs inside the worker only).

    math-verify decides, with exact numbers: decimals become fractions, its rounding numeric
    check is replaced by an exact one (`_exact_numeric_eq`) and a free `i` is the imaginary unit.
    """
    import math_verify.grader
    from math_verify import verify

    if gold.startswith("\\approx "):
        return _within_tolerance(pred, gold)
    math_verify.grader.sympy_numeric_eq = _exact_numeric_eq
    gold_parsed = _parse(_exact_decimals(gold))
    pred_parsed = _parse(_exact_decimals(pred))
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


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
    equal = _symbolic_equal
    equal("x^2+1", "1+x^2")  # warm sympy's caches before reporting ready
    reply_out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = None
        cpu_start = time.process_time()
        try:
            request = json.loads(line)
            reply = {"id": request.get("id"), "equal": equal(request["pred"], request["gold"])}
        except Exception as e:  # includes MemoryError from the address-space cap
            reply = {"id": None, "equal": False, "error": f"{type(e).__name__}: {e}"[:500]}
            if isinstance(request, dict):
                reply["id"] = request.get("id")
        reply["cpu_s"] = time.process_time() - cpu_start  # the caller applies the budget
        reply_out.write(json.dumps(reply) + "\n")
