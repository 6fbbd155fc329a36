"""Time per pair of the math grader on the peer suites, and its worker's start time.

Why: the grader's limit is CPU seconds of its worker (5 s by default, `is_equivalent`'s
`timeout`), so the numbers that matter are how far below it real pairs stay, measured as the
worker's CPU time and as the caller's wall time. Every case of the peer math suites is graded
once through `copes.envs.rewards.math.is_equivalent`, with its verdict cache cleared and a
warm worker, so each pair pays its full cost (cheap checks, normalization and the symbolic
check when it is reached). The worker's cold start (a fresh `python -c`, imports, warm-up)
is measured separately, `--starts` times: it happens before a check's budget and never
counts against it.

`--samples FILE...` also re-grades a real model's answers: the predictions stored in
copes-eval's samples.jsonl files, each against its gold with its benchmark's grader (a fresh
verdict cache), timing each episode's grading; how many answers the size bound refused
(`copes.envs.rewards._math_size`, power towers) is counted too.

    python benchmarks/grading_time.py --out benchmarks/results/grading_time.json
    python benchmarks/grading_time.py --samples evals/*/samples.jsonl --out ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

from copes.envs.rewards._math_worker import GRADER, symbolic_verdict
from copes.envs.rewards.math import is_equivalent
from copes.sandbox.cpu_time import process_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).parent / "results" / "grading_time.json"
DEFAULT_PEER_DIR = ROOT / "tests" / "fixtures" / "peer_graders"
PEER_FILES = ("mathverify_cases.json", "hendrycks_cases.json", "qwen_examples.json")


def summarize(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_s": statistics.median(ordered),
        "p95_s": ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)],
        "max_s": ordered[-1],
        "total_s": sum(ordered),
        "samples": len(ordered),
    }


def worker_cpu() -> float:
    """CPU seconds the grader's worker has used (it is running: started before timing)."""
    proc = GRADER._proc
    cpu = None if proc is None else process_cpu_seconds(proc.pid)
    return 0.0 if cpu is None else cpu  # None: it just died; its restart is not timed here


def time_samples(paths: list[Path]) -> dict:
    """Per-episode grading time of the predictions in copes-eval samples files."""
    from copes.envs.rewards._math_size import size_verdict
    from copes.envs.tasks.base import Task
    from copes.registry import get_benchmark

    graders: dict = {}
    wall, refused, rows = [], 0, []
    symbolic_verdict.cache_clear()
    GRADER.start()
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("prediction") is None:
                continue
            name = record["benchmark"]
            benchmark = get_benchmark(name)
            if name not in graders:
                graders[name] = benchmark.make_grader()
            task = Task(record["task_id"], "", tuple(record["gold"]), benchmark.kind,
                        checks=tuple(record.get("checks", ())), source=name)  # fmt: skip
            begin = time.perf_counter()
            graders[name](record["prediction"], task)
            seconds = time.perf_counter() - begin
            if GRADER._proc is None:
                GRADER.start()
            wall.append(seconds)
            if benchmark.kind == "math" and size_verdict(record["prediction"], None) is False:
                refused += 1
            rows.append((seconds, name, record["task_id"], record["prediction"][:120]))
    symbolic_verdict.cache_clear()
    rows.sort(reverse=True)
    return {
        "files": [str(p) for p in paths],
        "graded_episodes": len(wall),
        "per_episode_wall": summarize(wall) if wall else None,
        "refused_by_the_size_bound": refused,
        "slowest": [
            {"wall_s": w, "benchmark": b, "task_id": t, "prediction": p} for w, b, t, p in rows[:10]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-dir", type=Path, default=DEFAULT_PEER_DIR, help="peer cases")
    parser.add_argument("--timeout", type=float, default=5.0, help="CPU seconds per pair")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of the worker timed")
    parser.add_argument("--slowest", type=int, default=10, help="slowest pairs listed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument(
        "--samples", type=Path, nargs="+", help="copes-eval samples.jsonl files to re-grade"
    )
    args = parser.parse_args()
    if args.samples:
        result = {"command": "python " + " ".join(sys.argv), **time_samples(args.samples)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        w = result["per_episode_wall"] or {}
        print(f"{result['graded_episodes']} episodes: grading p50 {w.get('p50_s', 0):.4f} s, "
              f"p95 {w.get('p95_s', 0):.4f} s, max {w.get('max_s', 0):.3f} s; "
              f"{result['refused_by_the_size_bound']} refused by the size bound")  # fmt: skip
        return
    missing = [name for name in PEER_FILES if not (args.peer_dir / name).is_file()]
    if missing:
        sys.exit(f"error: {args.peer_dir} lacks {', '.join(missing)}; pass --peer-dir DIR")
    if args.starts < 1:
        sys.exit(f"error: --starts must be at least 1, got {args.starts}")
    cases = []
    for name in PEER_FILES:
        for case in json.loads((args.peer_dir / name).read_text(encoding="utf-8")):
            cases.append({**case, "suite": name})

    starts = []
    for _ in range(args.starts):
        GRADER.close()
        begin = time.perf_counter()
        GRADER.start()
        starts.append(time.perf_counter() - begin)

    symbolic_verdict.cache_clear()
    wall, cpu, rows = [], [], []
    for case in cases:
        cpu_before, begin = worker_cpu(), time.perf_counter()
        verdict = is_equivalent(case["copes_pred"], case["copes_gold"], timeout=args.timeout)
        seconds = time.perf_counter() - begin
        used = max(0.0, worker_cpu() - cpu_before)
        if GRADER._proc is None:  # it timed out or crashed: start the next pair warm again
            GRADER.start()
        wall.append(seconds)
        cpu.append(used)
        rows.append((seconds, used, case["id"], case["suite"], verdict))
    symbolic_verdict.cache_clear()
    rows.sort(reverse=True)

    report = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "sympy": version("sympy"),
            "math_verify": version("math-verify"),
        },
        "timeout_cpu_s": args.timeout,
        "pairs": len(cases),
        "suites": {name: sum(c["suite"] == name for c in cases) for name in PEER_FILES},
        "per_pair_wall": summarize(wall),
        "per_pair_worker_cpu": summarize(cpu),
        "worker_cold_start": {**summarize(starts), "first_s": starts[0]},
        "equivalent": sum(row[4] for row in rows),
        "slowest": [
            {"wall_s": w, "worker_cpu_s": c, "id": i, "suite": s, "equivalent": v}
            for w, c, i, s, v in rows[: args.slowest]
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    w, c, s = report["per_pair_wall"], report["per_pair_worker_cpu"], report["worker_cold_start"]
    print(
        f"{len(cases)} pairs: wall p50 {w['p50_s']:.3f} s, p95 {w['p95_s']:.3f} s, max "
        f"{w['max_s']:.3f} s; worker CPU p95 {c['p95_s']:.3f} s, max {c['max_s']:.3f} s "
        f"(budget {args.timeout:g} s); worker start {s['p50_s']:.2f} s (median of "
        f"{len(starts)}); load {report['machine']['load_avg_1m']:.1f}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
