"""PythonTool: a persistent sympy calculator that hostile code cannot use to hurt the trainer.

Every hostile snippet runs for real in the sandbox; each test then checks that the answer is a
clear error, that this process is unharmed, and that the same tool and a new one still work.
Protections the host cannot provide (no namespaces in an unprivileged container, say) are
skipped with the reason the sandbox itself reports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from copes.envs.tools.base import Tool, tool_schema
from copes.envs.tools.python import PythonTool
from copes.sandbox import shared_server
from copes.sandbox.repl import OutputCapture

IS_ROOT = os.geteuid() == 0
# The time limit counts CPU time, so a 1 s budget can take longer on a loaded machine; a call
# that ends well before the 60 s wall-clock backstop ended by its CPU budget.
WELL_BEFORE_THE_BACKSTOP = 30.0


@pytest.fixture
def tool():
    t = PythonTool(timeout=1.0)
    yield t
    t.close()


def assert_healthy(tool: PythonTool) -> None:
    """The tool that ran the hostile code, and a brand-new one, still compute."""
    assert tool(code="print(6 * 7)") == "42"
    fresh = PythonTool(timeout=5.0)
    try:
        assert fresh(code="sympy.isprime(2**61 - 1)") == "True"
    finally:
        fresh.close()


def host_processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    real_uid = next(line for line in f if line.startswith("Uid:")).split()[1]
            except (OSError, StopIteration):
                continue
            if int(real_uid) == uid:
                pids.append(int(entry))
    return pids


def wait_until_no_processes_of(uid: int, within: float = 5.0) -> list[int]:
    end = time.monotonic() + within
    while (left := host_processes_of(uid)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


# ---------------------------------------------------------------------------------------
# Normal behaviour


def test_protocol_and_schema():
    t = PythonTool()
    assert isinstance(t, Tool)
    assert t.name == "python"
    assert t.parameters["required"] == ["code"]
    assert t.parameters["properties"]["code"]["type"] == "string"
    assert "sympy" in t.description and "print()" in t.description and "persist" in t.description
    assert tool_schema(t)["function"]["name"] == "python"
    with pytest.raises(ValueError, match="timeout"):
        PythonTool(timeout=0)
    with pytest.raises(ValueError, match=r"wall_timeout=1\.0\): must be at least timeout"):
        PythonTool(timeout=5, wall_timeout=1.0)
    assert PythonTool(timeout=1).wall_timeout == 60.0  # max(60 s, 20 x timeout)
    assert PythonTool(timeout=10).wall_timeout == 200.0


def test_variables_persist_and_last_expression_is_shown(tool):
    assert tool(code="x = 20\ndef double(v):\n    return 2 * v") == (
        "(no output; print() what you want to see)"
    )
    assert tool(code="x + 1") == "21"
    assert tool(code="print('a')\ndouble(x)") == "a\n40"
    assert tool(code="y = double(x)\ny") == "40"
    assert tool(code="None") == "(no output; print() what you want to see)"


def test_reset_starts_a_fresh_interpreter(tool):
    tool(code="secret = 123")
    tool.reset(None)
    out = tool(code="secret")
    assert "NameError" in out and "secret" in out
    assert tool(code="'sympy' in globals()") == "True"


def test_sympy_and_math_are_imported(tool):
    assert tool(code="sympy.factorint(2**64 - 1)") == (
        "{3: 1, 5: 1, 17: 1, 257: 1, 641: 1, 65537: 1, 6700417: 1}"
    )
    assert tool(code="x = sympy.symbols('x')\nsympy.solve(x**2 - 4, x)") == "[-2, 2]"
    assert tool(code="print(math.comb(10, 3))") == "120"
    assert tool(code="from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)") == (
        "Fraction(1, 2)"
    )


def test_errors_read_like_python(tool):
    out = tool(code="a = 1\nb = 0\na / b")
    assert out.startswith("Traceback (most recent call last):")
    assert 'File "<cell-' in out and "a / b" in out
    assert out.endswith("ZeroDivisionError: division by zero")
    assert "_sandbox" not in out  # the REPL's own frames are not shown

    out = tool(code="def f(:\n    pass")
    assert "SyntaxError" in out and "line 1" in out and "Traceback" not in out

    out = tool(code="def r(n):\n    return r(n + 1)\nr(0)")
    assert "RecursionError" in out
    assert len(out.splitlines()) <= 16  # shortened to the useful last lines
    assert tool(code="print('still here')") == "still here"


def test_stderr_and_subprocess_output_are_captured(tool):
    out = tool(code="import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert out == "out\nerr"
    out = tool(
        code="import os, subprocess\nos.write(2, b'raw fd\\n')\n"
        "subprocess.run(['echo', 'from echo'])"
    )
    assert "raw fd" in out and "from echo" in out


def test_long_output_is_truncated_with_a_marker():
    t = PythonTool(timeout=5.0, max_output_chars=500)
    try:
        out = t(code="for i in range(10000):\n    print(i)")
        assert "...[output truncated: " in out and "more characters]" in out
        assert out.startswith("0\n1\n2\n") and out.endswith("9998\n9999")
        assert len(out) <= 600
    finally:
        t.close()


def test_output_capture_keeps_head_and_tail_in_bounded_memory():
    small = OutputCapture(limit=1000)
    small.write("short\n")
    assert small.render(200) == "short\n"
    capture = OutputCapture(limit=300)
    capture.write("".join(f"{i:04d}" for i in range(250)))  # 1000 characters
    text = capture.render(200)
    assert text.startswith("0000000100020003") and text.endswith("02470248" + "0249")
    assert "...[output truncated: 800 more characters]" in text
    capture.skip(10_000)
    capture.write("the end")
    text = capture.render(200)
    assert text.startswith("0000") and text.endswith("the end")
    assert "...[output truncated: 10807 more characters]" in text  # 11007 - 193 - 7
    huge = OutputCapture(limit=300)
    assert huge.write("x" * 10**8) == 10**8  # counted, not stored
    assert len(huge.render(300)) < 400


def test_concurrent_tools_give_isolated_answers():
    tools = [PythonTool(timeout=10.0) for _ in range(8)]
    results: dict[int, list[str]] = {}

    def work(i: int) -> None:
        t = tools[i]
        t(code=f"mine = {i}")
        time.sleep(0.05)  # let the other sessions write their own `mine`
        results[i] = [t(code="mine * 1000 + sympy.prime(5)"), t(code="import os\nos.getcwd()")]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    try:
        assert {i: r[0] for i, r in results.items()} == {i: str(i * 1000 + 11) for i in range(8)}
    finally:
        for t in tools:
            t.close()


def test_invalid_arguments_come_back_as_messages(tool):
    assert tool(code=123).startswith("Error: `code` must be a string")
    assert tool(code="1", extra=2).startswith("Error: the python tool takes one argument")


# ---------------------------------------------------------------------------------------
# Hostile code


def test_infinite_loop_is_interrupted_and_variables_survive(tool):
    tool(code="kept = 'yes'")
    start = time.monotonic()
    out = tool(code="while True:\n    pass")
    assert time.monotonic() - start < WELL_BEFORE_THE_BACKSTOP
    assert out.startswith("Error: execution timed out after 1 s of CPU time and was interrupted")
    assert tool(code="kept") == "'yes'"
    assert_healthy(tool)


def test_uninterruptible_code_is_killed_and_the_interpreter_restarted(tool):
    tool(code="lost = 1")
    start = time.monotonic()
    out = tool(  # swallows the interrupt (which may still land between two of its lines)
        code="while True:\n    try:\n        while True:\n            pass\n"
        "    except BaseException:\n        pass"
    )
    assert time.monotonic() - start < WELL_BEFORE_THE_BACKSTOP  # timeout + grace, in CPU time
    assert out.startswith("Error: execution timed out after 1 s of CPU time and "), out
    tool(code="lost = 1")
    start = time.monotonic()
    out = tool(  # ignores the signal: only the trainer's kill at 2 s of CPU time stops it
        code="import signal\nsignal.signal(signal.SIGPROF, signal.SIG_IGN)\nwhile True:\n    pass"
    )
    assert time.monotonic() - start < WELL_BEFORE_THE_BACKSTOP
    assert "timed out after 1 s of CPU time and could not be interrupted" in out
    assert "earlier variables are lost" in out
    assert "NameError" in tool(code="lost")
    assert_healthy(tool)


@pytest.mark.xdist_group("timing")  # wall-clock windows: never beside the CPU hogs
def test_waiting_does_not_count_against_the_cpu_time_limit():
    """A wall-clock limit would stop this call at 0.5 s; it uses almost no CPU."""
    t = PythonTool(timeout=0.5, wall_timeout=10.0)
    try:
        start = time.monotonic()
        assert t(code="import time\ntime.sleep(1.5)\nprint('slept')") == "slept"
        assert time.monotonic() - start >= 1.5
    finally:
        t.close()


@pytest.mark.xdist_group("timing")  # wall-clock windows: never beside the CPU hogs
def test_sleeping_code_is_stopped_by_the_wall_clock_limit():
    t = PythonTool(timeout=1.0, wall_timeout=2.0)
    try:
        t(code="kept = 'yes'")
        start = time.monotonic()
        out = t(code="import time\ntime.sleep(100)")
        elapsed = time.monotonic() - start
        assert 2.0 <= elapsed < 2.0 + 1.0 + 1.5, elapsed  # not before, nor past the grace
        assert out == (
            "Error: execution was interrupted at line 2 after 2 s of wall-clock time (the limit "
            "for code that sleeps or waits; the 1 s limit counts CPU time); variables "
            "assigned before that point are kept."
        )
        assert t(code="kept") == "'yes'"
        start = time.monotonic()
        out = t(  # ignores the interrupt: killed a grace period (1 s) later
            code="import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "time.sleep(100)"
        )
        assert 2.0 + 1.0 <= time.monotonic() - start < 2.0 + 1.0 + 1.5
        assert out.startswith(
            "Error: execution ran past the 2 s wall-clock limit (for code "
            "that sleeps or waits) and could not be interrupted"
        ), out
        assert "NameError" in t(code="kept")
        assert_healthy(t)
    finally:
        t.close()


def test_fork_bomb_is_contained_and_cleaned_up(tool):
    before = tool.isolation()
    start = time.monotonic()
    out = tool(code="import os\nwhile True:\n    os.fork()")
    assert time.monotonic() - start < WELL_BEFORE_THE_BACKSTOP
    assert "BlockingIOError" in out or "timed out" in out
    # A bomb whose children swallow the error: they must not outlive the call.
    out = tool(
        code="import os\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        pass"
    )
    assert "Error: execution timed out after 1 s of CPU time and was interrupted" in out, out
    if before["pid_namespace"]:
        assert tool(code="import os\nsorted(p for p in os.listdir('/proc') if p.isdigit())") == (
            "['1']"
        )
    if before["uid"] is not None:  # one worker left, and nothing else of its uid
        assert len(host_processes_of(before["uid"])) == 1
        tool.close()
        assert wait_until_no_processes_of(before["uid"]) == []
    assert_healthy(tool)


def test_memory_bombs_fail_with_memory_error(tool):
    out = tool(code="x = bytearray(10**11)")
    assert "MemoryError" in out and "1024 MB" in out
    out = tool(code="hog = []\nwhile True:\n    hog.append(' ' * 10**6)")
    assert "MemoryError" in out or "timed out" in out
    tool(code="del hog")
    assert_healthy(tool)


def test_gigabyte_of_output_is_bounded(tool):
    start = time.monotonic()
    out = tool(code="print('x' * 10**9)")  # building the string alone can take a second
    assert "MemoryError" in out or "output truncated" in out or "timed out" in out
    out = tool(code="while True:\n    print('spam' * 100)")
    assert time.monotonic() - start < WELL_BEFORE_THE_BACKSTOP
    assert "timed out" in out and "output truncated" in out
    assert len(out) <= 4000 + 400
    big = PythonTool(timeout=10.0, memory_mb=4096)
    try:
        out = big(code="print('y' * 10**9)")
        assert "output truncated: " in out and len(out) <= 4400
    finally:
        big.close()
    assert_healthy(tool)


def test_cannot_write_outside_the_scratch_dir(tool, tmp_path):
    report = tool.isolation()
    if report["filesystem"] != "private-root" and report["uid"] is None:
        pytest.skip(f"code runs as this user with the host's filesystem: {report['notes']}")
    targets = [
        tmp_path / "private.txt",
        Path(__file__).with_name("pwned.txt"),
        Path("/etc/copes-sandbox-test.txt"),
    ]
    open_dir = Path(tempfile.mkdtemp(prefix="copes-test-"))
    open_dir.chmod(0o777)  # world-writable, like /tmp itself
    if report["filesystem"] == "private-root":  # else a uid of its own may write there
        targets.append(open_dir / "open.txt")
    try:
        for target in targets:
            out = tool(code=f"open({str(target)!r}, 'w').write('pwned')")
            assert "Error" in out, out
            assert not target.exists()
    finally:
        shutil.rmtree(open_dir)
    assert tool(code="open('notes.txt', 'w').write('ok')\nopen('notes.txt').read()") == "'ok'"
    assert_healthy(tool)


def test_file_size_limit(tmp_path):
    t = PythonTool(timeout=5.0, max_file_bytes=1000)
    try:
        out = t(code="with open('big.bin', 'wb') as f:\n    f.write(b'x' * 100_000)")
        assert "File too large" in out
        assert t(code="print('alive')") == "alive"
    finally:
        t.close()


def test_sessions_do_not_see_each_others_files():
    a, b = PythonTool(timeout=5.0), PythonTool(timeout=5.0)
    try:
        a(code="open('mine.txt', 'w').write('a')")
        if a.isolation()["filesystem"] != "private-root":
            pytest.skip(f"no private filesystem here: {a.isolation()['notes']}")
        assert b(code="import os\nos.listdir('.')") == "[]"
        a.reset(None)
        assert a(code="import os\nos.listdir('.')") == "[]"
    finally:
        a.close()
        b.close()


def test_parent_environment_is_not_readable(monkeypatch):
    report = PythonTool().isolation()
    if report["host_processes_visible"] and report["uid"] is None:
        pytest.skip(f"code runs as this user and sees its processes: {report['notes']}")
    secret = "copes-secret-7f3a9"
    monkeypatch.setenv("COPES_TEST_SECRET", secret)
    shared_server().stop()  # the next server starts from a process that holds the secret
    holder = subprocess.Popen(["sleep", "30"], env={**os.environ, "COPES_TEST_SECRET": secret})
    t = PythonTool(timeout=5.0)
    try:
        pids = [os.getpid(), holder.pid, shared_server().pid or 1]
        out = t(
            code=(
                "import os\n"
                f"print(dict(os.environ))\n"
                f"for pid in {pids!r} + [os.getppid(), 1]:\n"
                "    try:\n"
                "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
                "    except Exception as e:\n"
                "        print(pid, type(e).__name__)\n"
            )
        )
        assert secret not in out
        assert "COPES_TEST_SECRET" not in out
        assert_healthy(t)
    finally:
        t.close()
        holder.kill()
        holder.wait()


def test_no_network(tool):
    if not tool.isolation()["network"]:
        pytest.skip(f"no network namespace on this host: {tool.isolation()['notes']}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0copes-test-{os.getpid()}"
    abstract.bind(name)
    abstract.listen()
    try:
        for target in (f"('127.0.0.1', {port})", "('8.8.8.8', 53)", "('localhost', 80)"):
            out = tool(code=f"import socket\nsocket.create_connection({target}, timeout=1)")
            assert "Error" in out, (target, out)
        out = tool(code=f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({name!r})")
        assert "Error" in out
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
        abstract.close()
    assert_healthy(tool)


def test_cannot_signal_the_trainer(tool):
    report = tool.isolation()
    if report["uid"] is None and not report["pid_namespace"]:
        pytest.skip(f"code runs as this user in its pid namespace: {report['notes']}")
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append(True))
    try:
        server_pid = shared_server().pid
        out = tool(
            code=(
                "import os, signal\n"
                f"for pid in ({os.getpid()}, {server_pid}, os.getppid()):\n"
                "    try:\n"
                "        os.kill(pid, signal.SIGTERM)\n"
                "        print(pid, 'signalled')\n"
                "    except Exception as e:\n"
                "        print(pid, type(e).__name__)\n"
            )
        )
        time.sleep(0.2)
        assert not received, out
        assert f"{os.getpid()} signalled" not in out
        assert shared_server().pid == server_pid
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert_healthy(tool)


def test_worker_crash_and_cpu_limit_are_reported():
    t = PythonTool(timeout=5.0, cpu_seconds=1)
    try:
        out = t(code="import os\nos._exit(3)")
        assert out.startswith("Error: the interpreter stopped") and "variables are lost" in out, out
        assert t(code="print('back')") == "back"
        out = t(
            code="n = 0\nwhile True:\n    try:\n        n += 1\n    except BaseException:\n"
            "        pass"
        )
        assert "CPU time" in out and "variables are lost" in out, out
        assert t(code="print('back again')") == "back again"
    finally:
        t.close()


def test_server_is_restarted_after_it_dies(tool):
    assert tool(code="1 + 1") == "2"
    pid = shared_server().pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while shared_server().pid == pid and time.monotonic() < deadline:
        time.sleep(0.01)
    out = tool(code="1 + 1")  # its session dies with the server: "2" if it answers first
    assert out == "2" or "variables are lost" in out
    fresh = PythonTool(timeout=5.0)
    try:
        assert fresh(code="2 + 2") == "4"  # a new session needs, and gets, a new server
        assert shared_server().pid not in (None, pid)
    finally:
        fresh.close()
    tool.reset(None)
    assert tool(code="3 + 3") == "6"


@pytest.mark.skipif(not IS_ROOT, reason="the per-session uid needs root")
def test_isolation_as_root(tool):
    report = tool.isolation()
    assert report["uid"] is not None and report["uid"] > 65535
    assert tool(code="import os\nos.getuid(), os.getgid()") == f"({report['uid']}, {report['uid']})"
    if report["pid_namespace"]:
        assert tool(code="import os\nos.getpid()") == "1"
    if report["filesystem"] == "private-root":  # the trainer's files are not even there
        assert tool(code=f"import os\nos.path.exists({__file__!r})") == "False"


def test_tool_works_in_a_forked_trainer_child(tool):
    assert tool(code="1") == "1"  # the parent's server and session exist before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            out = tool(code="3 * 3")
            os.write(write_end, out.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 100) == b"9"
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tool(code="2 * 2") == "4"
