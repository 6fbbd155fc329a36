"""Peak resident memory of a command and every process it starts (a vLLM engine runs in a
child process, so the command's own RSS misses it), sampled every 0.1 s; written to JSON.

    python benchmarks/peak_rss.py --out benchmarks/results/peak_rss-X.json -- copes-eval ...

Prints the peak of the summed tree (the figure that must fit the machine) and each process's
own peak, with the command and the machine's total memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil


def tree_rss(root: psutil.Process) -> dict[str, int]:
    """RSS of `root` and each of its descendants, by "pid name"."""
    sizes = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            sizes[f"{process.pid} {process.name()}"] = process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    start = time.perf_counter()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_tree, peaks = 0, {}
    while child.poll() is None:
        sizes = tree_rss(root)
        peak_tree = max(peak_tree, sum(sizes.values()))
        for name, size in sizes.items():
            peaks[name] = max(peaks.get(name, 0), size)
        time.sleep(args.interval)
    result = {
        "command": command,
        "exit_status": child.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "peak_tree_rss_gib": round(peak_tree / 2**30, 3),
        "peak_rss_gib_by_process": {n: round(b / 2**30, 3) for n, b in peaks.items()},
        "machine_memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": platform.processor() or platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
