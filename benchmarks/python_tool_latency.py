"""Latency of PythonTool against starting a fresh interpreter per call.

Measures, in one run and interleaved (so background load hits both sides alike):

- ``tool_trivial`` / ``tool_sympy``: a call in a running session (the common case: every
  tool call of an episode after its first), ``print(1+1)`` and a sympy factorization;
- ``tool_new_episode``: ``reset()`` plus the first trivial call (forks a fresh session);
- ``subprocess_trivial`` / ``subprocess_sympy``: ``subprocess.run([python, "-c", code])``
  with ``import sympy`` in the code, the naive way to sandbox a call;
- ``server_start``: the one-time start of the shared server (first call of the process).

Usage:
    python benchmarks/python_tool_latency.py --repeats 30 \\
        --out benchmarks/results/python_tool_latency.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from copes.envs.tools.python import PythonTool

TRIVIAL = "print(1+1)"
SYMPY = "print(sympy.factorint(2**64-1))"
SYMPY_ANSWER = "{3: 1, 5: 1, 17: 1, 257: 1, 641: 1, 65537: 1, 6700417: 1}"


def summarize(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    return {
        "median_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * p95,
        "samples": len(ordered),
    }


def timed(fn, expected: str) -> float:
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    if out.strip() != expected:
        raise RuntimeError(f"wrong output {out!r}, expected {expected!r}")
    return elapsed


def fresh_interpreter(code: str) -> str:
    """The baseline: a new Python per call, importing sympy like the sandbox has."""
    result = subprocess.run(
        [sys.executable, "-c", "import sympy\n" + code], capture_output=True, text=True, check=True
    )
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="samples per measurement")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/python_tool_latency.json")
    )
    args = parser.parse_args()

    tool = PythonTool(timeout=30)
    samples: dict[str, list[float]] = {
        name: []
        for name in (
            "tool_trivial",
            "tool_sympy",
            "tool_new_episode",
            "subprocess_trivial",
            "subprocess_sympy",
        )
    }
    samples["server_start"] = [timed(lambda: tool(code=TRIVIAL), "2")]
    for _ in range(3):  # warm up the session (first sympy calls fill its caches)
        tool(code=SYMPY)
    for i in range(args.repeats):
        samples["tool_trivial"].append(timed(lambda: tool(code=TRIVIAL), "2"))
        samples["tool_sympy"].append(timed(lambda: tool(code=SYMPY), SYMPY_ANSWER))
        samples["subprocess_trivial"].append(timed(lambda: fresh_interpreter(TRIVIAL), "2"))
        samples["subprocess_sympy"].append(timed(lambda: fresh_interpreter(SYMPY), SYMPY_ANSWER))

        def new_episode() -> str:
            tool.reset(None)
            return tool(code=TRIVIAL)

        samples["tool_new_episode"].append(timed(new_episode, "2"))
        print(f"\r{i + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    isolation = tool.isolation()
    tool.close()

    results = {name: summarize(values) for name, values in samples.items()}

    def ratio(baseline: str, ours: str) -> float:
        return results[baseline]["median_ms"] / results[ours]["median_ms"]

    speedup = {
        "trivial": ratio("subprocess_trivial", "tool_trivial"),
        "sympy": ratio("subprocess_sympy", "tool_sympy"),
        "new_episode_vs_subprocess_trivial": ratio("subprocess_trivial", "tool_new_episode"),
    }
    report = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "user": "root" if os.geteuid() == 0 else "non-root",
        },
        "isolation": isolation,
        "repeats": args.repeats,
        "results": results,
        "speedup_median": speedup,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{'measurement':<22} {'median ms':>10} {'p95 ms':>10}")
    for name, r in results.items():
        print(f"{name:<22} {r['median_ms']:>10.2f} {r['p95_ms']:>10.2f}")
    for name, ratio in speedup.items():
        print(f"speedup {name}: {ratio:.0f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
