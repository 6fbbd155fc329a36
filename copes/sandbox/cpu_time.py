"""CPU time of another process, the clock that the grader's and the Python tool's limits use.

Rewards must be a function of (answer, task), never of how loaded the machine is. A
wall-clock limit is not: on a busy node a 45 ms symbolic check waits seconds for a core. So
both limits count the CPU time the worker process itself used, read from outside it (a
runaway C call that holds the GIL cannot stop that clock), and keep a wall-clock backstop far
above it only for code that sleeps or blocks.
"""

from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds used so far by every thread of `pid` (not its children).

    Read from /proc/PID/stat (10 ms resolution with the usual 100 Hz ticks, monotonic); None
    when that file cannot be read (the process is gone, or the OS has no /proc).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after
    # the last ")". utime and stime are fields 14 and 15 of proc(5).
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def wall_backstop(cpu_seconds: float) -> float:
    """The wall-clock limit behind a CPU-time limit: max(60 s, 20 x), far above any load."""
    return max(60.0, 20.0 * cpu_seconds)
