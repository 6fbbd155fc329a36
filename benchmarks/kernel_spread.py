"""How much the shipped tiny agent's greedy episodes depend on the CPU's kernels.

float32 arithmetic differs between kernel sets (ATen's AVX2 and AVX-512 code, MKL's
code paths for each CPU vendor), so one agent can decode another greedy token on another
machine. This script runs the agent's greedy validation episodes (the 64 math + 64 QA tasks
its build report scores) once per kernel set, each in a fresh process that selects the set
through the libraries' own switches before torch loads, and compares the episodes token for
token: the fraction of episodes whose tokens differ from the native set's, and the accuracy
under each set.

Kernel sets (one machine can run all of them):
- native: what torch and MKL pick on this CPU;
- avx2: `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`,
  the kernels of an AVX2-only CPU (the AMD EPYC of issue 25);
- mkl-compatible: `MKL_CBWR=COMPATIBLE`, MKL's vendor-neutral SSE2 code path;
- default: `ATEN_CPU_CAPABILITY=default`, ATen's scalar code.

    python benchmarks/kernel_spread.py                       # float32, all sets
    python benchmarks/kernel_spread.py --dtype float64       # the pinned runs' precision

Writes benchmarks/results/kernel_spread-<dtype>.json (or --out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KERNEL_SETS = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
}


def episodes(dtype: str, tasks: int, threads: int) -> dict:
    """Greedy validation episodes of the shipped agent under this process's kernels."""
    import torch

    from copes.agents.hf import HFPolicy
    from copes.agents.models import shipped_tiny_agent
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.agents.tiny import machine_info
    from copes.envs.presets import tool_math_env, tool_qa_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    torch.set_num_threads(threads)
    folder = shipped_tiny_agent()
    seed = json.loads((folder / "copes_tiny.json").read_text())["config"]["seed"]
    policy = HFPolicy.from_pretrained(folder, device="cpu", dtype=dtype)
    out: dict = {"machine": machine_info(), "task_seed": seed, "kinds": {}}
    for kind, make_tasks, make_env in (
        ("math", synthetic_math_tasks, tool_math_env),
        ("qa", synthetic_qa_tasks, tool_qa_env),
    ):
        envs = [make_env(tasks=[t]) for t in make_tasks("validation", tasks, seed=seed)]
        try:
            batch = rollout(policy, envs, SamplingConfig(max_new_tokens=96, temperature=0.0))
        finally:
            for env in envs:
                env.close()
        out["kinds"][kind] = [
            {
                "task_id": t.task_id,
                "correct": bool(t.correct),
                "tokens_sha256": hashlib.sha256(json.dumps(t.token_ids).encode()).hexdigest(),
            }
            for t in batch
        ]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--tasks", type=int, default=64, help="validation tasks per kind")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument("--sets", nargs="+", default=list(KERNEL_SETS), choices=list(KERNEL_SETS))
    p.add_argument("--out", default=None, help="default: results/kernel_spread-<dtype>.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(episodes(args.dtype, args.tasks, args.threads)))
        return
    load_before = os.getloadavg()[0]
    runs: dict[str, dict] = {}
    for name in args.sets:
        env = {k: v for k, v in os.environ.items() if k not in KERNEL_SETS["avx2"]}
        env.pop("MKL_CBWR", None)
        env.update(KERNEL_SETS[name])
        start = time.perf_counter()
        child = [sys.executable, __file__, "--child", "--dtype", args.dtype,
                 "--tasks", str(args.tasks), "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"kernel set {name} failed:\n{done.stderr[-3000:]}")
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
        runs[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {runs[name]['machine']['cpu_capability']} in {runs[name]['seconds']} s")
    reference = args.sets[0]
    summary: dict[str, dict] = {}
    for name, run in runs.items():
        row: dict = {"cpu_capability": run["machine"]["cpu_capability"], "env": KERNEL_SETS[name]}
        for kind, eps in run["kinds"].items():
            ref = runs[reference]["kinds"][kind]
            pairs = zip(eps, ref, strict=True)
            differ = sum(a["tokens_sha256"] != b["tokens_sha256"] for a, b in pairs)
            row[kind] = {
                "accuracy": sum(e["correct"] for e in eps) / len(eps),
                "episodes_differing_from_" + reference: differ,
                "episodes": len(eps),
            }
        summary[name] = row
    result = {
        "benchmark": "kernel_spread",
        "command": "python benchmarks/"
        + Path(__file__).name
        + " "
        + " ".join(argv or sys.argv[1:]),
        "dtype": args.dtype,
        "threads": args.threads,
        "machine": runs[reference]["machine"],
        "load_average_before": load_before,
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"kernel_spread-{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in summary.items():
        cells = ", ".join(
            f"{kind} acc {row[kind]['accuracy']:.3f} "
            f"({row[kind]['episodes_differing_from_' + reference]}/{row[kind]['episodes']} differ)"
            for kind in ("math", "qa")
        )
        print(f"{name:15s} {row['cpu_capability']:8s} {cells}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
