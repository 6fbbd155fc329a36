"""The paper's experiment in miniature: ES vs CoPES vs GRPO under equal budgets.

Every method trains the same agent (`--model`, default the embedded tiny agent) on synthetic
ToolMath (`--env ToolQA-v0` for QA) under the same budget of generated tokens (or of wall
seconds, `--budget-kind seconds`), for several seeds, validating every few steps. The report
(benchmarks/results/learning[-quick][-qa].{json,png,md}) gives, with intervals over seeds:
accuracy-vs-budget curves, the fraction of GRPO's validation gain each method recovers at the
budget of GRPO's best validation checkpoint (paper: CoPES 92%, ES 67%), the budget each
needs to reach a target (default: half of GRPO's gain over each seed's own base; paper: ES
480.6 vs CoPES 68.65 GPU-hours), and pass@k of the final weights on the synthetic test split.
Definitions: copes/evaluation/curves.py.

    python benchmarks/learning.py --quick                 # CI smoke: ~1-2 min on 2 cores
    python benchmarks/learning.py                         # full: 6 methods x 3 seeds
    python benchmarks/learning.py --ablations             # + the paper's ablations
    python benchmarks/learning.py --budget-kind seconds --budget 600

Runs live in --runs-dir (one folder each); a killed benchmark started again with the same
arguments skips finished runs and resumes the others.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _learning_* helpers

from _learning_report import summarize, write_outputs
from _learning_runs import RunSpec, check_finished_runs, run_one

# ---------------------------------------------------------------------- hyper-parameters
# fmt: off
# One row per method; every key is a copes-train flag. ES methods share N, sigma and alpha,
# so the K sweep changes only K (sigma_k = sqrt(K) sigma is CoPES's own scaling). ES presets
# for the tiny agent (docs/results.md, "Post-training the tiny agent"): sigma 0.01 (about 1/8
# of a weight's spread; 0.005 and below hardly change a greedy output, 0.02 breaks members),
# alpha 0.002, antithetic pairs; chosen from two exploratory 30-step runs on seed 0 (sigma
# 0.01 vs 0.005), so ES/CoPES got that much more tuning than GRPO, whose presets are the
# usual small-model AdamW rates (1e-4 full, 1e-3 LoRA), untuned. eval_every makes every
# method validate every 512 training episodes (an ES step rolls out N x batch = 256
# episodes, a GRPO step G x batch = 128), i.e. at about the same token spacing.
#
# Tuning rule, the same effort for every method: with --tune each method gets 3 trials, its
# learning rate x {1/3, 1, 3} with everything else fixed, on seed 100 (never a reported seed)
# at a third of the budget; the best final validation accuracy wins (a tie keeps the preset).
# Without --tune the presets are used as they stand, and the JSON says so ("tuned": null).
ES = {"population_size": 16, "sigma": 0.01, "learning_rate": 0.002, "antithetic": True,
      "eval_every": 2}
GRPO = {"group_size": 8, "micro_batch_size": 8, "temperature": 1.0, "eval_every": 4}
METHODS: dict[str, dict[str, Any]] = {
    "es":        {"optimizer": "es",        **ES, "num_subspaces": 1},
    "copes-k2":  {"optimizer": "copes",     **ES, "num_subspaces": 2},
    "copes-k4":  {"optimizer": "copes",     **ES, "num_subspaces": 4},
    "copes-k8":  {"optimizer": "copes",     **ES, "num_subspaces": 8},
    "grpo":      {"optimizer": "grpo",      **GRPO, "learning_rate": 1e-4},
    "lora-grpo": {"optimizer": "lora-grpo", **GRPO, "learning_rate": 1e-3},
    # The same ES/CoPES with the whole population in one batched rollout
    # (copes.optimizers.batched): the same updates, more of them per second.
    "es-batched":       {"optimizer": "es",    **ES, "num_subspaces": 1,
                         "population_eval": "batched"},
    "copes-k4-batched": {"optimizer": "copes", **ES, "num_subspaces": 4,
                         "population_eval": "batched"},
    # CoPES K=4 with the low-rank family (--noise lowrank, rank 4, the same sigma and alpha:
    # its noise has unit variance per entry too; untuned): sequential, and served as N
    # adapters in one batch.
    "copes-k4-lowrank":         {"optimizer": "copes", **ES, "num_subspaces": 4,
                                 "noise": "lowrank", "noise_rank": 4},
    "copes-k4-lowrank-batched": {"optimizer": "copes", **ES, "num_subspaces": 4,
                                 "noise": "lowrank", "noise_rank": 4,
                                 "population_eval": "batched"},
}
# The paper's ablations, at its best K = 4: one mean/std per subspace instead of one joint;
# no sqrt(K) sigma scaling; ES with CoPES-K=4's larger per-coordinate sigma (2 sigma) alone.
ABLATIONS: dict[str, dict[str, Any]] = {
    "copes-k4-per-subspace":     {**METHODS["copes-k4"], "standardization": "per_subspace"},
    "copes-k4-no-sigma-scaling": {**METHODS["copes-k4"], "scale_sigma": False},
    "es-sigma-x2":               {**METHODS["es"], "sigma": 2 * ES["sigma"]},
}
TUNE_FACTORS = (1 / 3, 1.0, 3.0)
TUNE_SEED = 100

# Shared settings of every run, full mode and --quick (a CI smoke run: a few steps).
FULL = {
    "methods": list(METHODS), "seeds": [0, 1, 2], "budget_tokens": 320_000,
    "budget_seconds": 600, "budget_cpu-seconds": 600,
    # invalid_penalty: -0.2 per turn with neither a closed tool call nor an answer, the
    # shaping under which ES moved the tiny agent (docs/results.md); every method gets it.
    "train": {"batch_size": 16, "max_new_tokens": 64, "max_turns": 3, "eval_tasks": 64,
              "num_train_tasks": 1000, "invalid_penalty": 0.2, "eval_task_seed": 0},
    "passk": {"passk_n": 4, "passk_ks": (1, 4), "passk_tasks": 32},
}
QUICK = {
    "methods": ["es", "copes-k2", "grpo"], "seeds": [0], "budget_tokens": 2_500,
    "budget_seconds": 20, "budget_cpu-seconds": 20,
    "train": {"batch_size": 4, "max_new_tokens": 48, "max_turns": 3, "eval_tasks": 8,
              "num_train_tasks": 200, "invalid_penalty": 0.2, "eval_task_seed": 0},
    "passk": {"passk_n": 2, "passk_ks": (1, 2), "passk_tasks": 8},
}
# fmt: on


def method_table(quick: bool, ablations: bool) -> dict[str, dict[str, Any]]:
    """The methods to run; --quick shrinks populations and groups so a step takes seconds."""
    table = {m: dict(s) for m, s in {**METHODS, **(ABLATIONS if ablations else {})}.items()}
    if quick:
        for settings in table.values():
            settings["eval_every"] = 1
            if "population_size" in settings:  # N_k = 2 per subspace, as small as it gets
                settings["population_size"] = 2 * max(2, settings["num_subspaces"])
            else:
                settings["group_size"], settings["micro_batch_size"] = 4, 4
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI smoke run: tiny budget, 1 seed")
    p.add_argument("--model", default="tiny", help="'tiny', a local HF folder or a hub id")
    p.add_argument("--env", default="ToolMath-v0", choices=["ToolMath-v0", "ToolQA-v0"])
    p.add_argument("--methods", help="comma-separated subset of the table (default: all)")
    p.add_argument("--ablations", action="store_true", help="add the paper's ablations")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0 1 2; quick: 0)")
    p.add_argument(
        "--budget-kind",
        choices=["tokens", "seconds", "cpu-seconds"],
        default="tokens",
        help="seconds: use --workers 1 on an idle machine (parallel runs share cores); "
        "cpu-seconds: each run's own CPU time, robust to other work on the cores",
    )
    p.add_argument("--budget", type=float, help="per run, in --budget-kind units")
    p.add_argument(
        "--target-accuracy",
        type=float,
        help="absolute target (default: each seed's base + half of GRPO's mean gain)",
    )
    p.add_argument("--tune", action="store_true", help="tune learning rates first (see top)")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (1 thread each)")
    p.add_argument("--runs-dir", help="default: runs/benchmarks/<name>")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--name", help="output file stem (default: learning[-quick][-qa][-seconds])")
    return p.parse_args(argv)


def plan(args: argparse.Namespace, table: dict[str, dict[str, Any]], runs_dir: Path,
         budget: float, seeds: list[int]) -> list[RunSpec]:  # fmt: skip
    mode = QUICK if args.quick else FULL
    return [
        RunSpec(
            method=m,
            seed=seed,
            settings=table[m],
            run_dir=str(runs_dir / f"{m}-seed{seed}"),
            model=args.model,
            env=args.env,
            budget_kind=args.budget_kind,
            budget=budget,
            train=mode["train"],
            **mode["passk"],
        )
        for m in table
        for seed in seeds
    ]


def execute(specs: list[RunSpec], workers: int) -> list[dict[str, Any]]:
    """Run every spec (finished ones are read back); in parallel processes when workers > 1."""
    try:
        check_finished_runs(specs)
    except ValueError as exc:
        raise SystemExit(f"learning.py: {exc}") from None
    if workers <= 1:
        return [_logged(run_one(s)) for s in specs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [_logged(r) for r in pool.map(run_one, specs)]


def _logged(record: dict[str, Any]) -> dict[str, Any]:
    spec = record["spec"]
    state = "FAILED" if "error" in record else "done"
    print(f"[learning] {spec['method']} seed {spec['seed']}: {state}", flush=True)
    return record


def tune(
    args: argparse.Namespace, table: dict[str, dict[str, Any]], runs_dir: Path, budget: float
) -> dict[str, Any]:
    """The same 3 learning-rate trials per method; the best final validation accuracy wins."""
    tuned, trials = {}, []
    for m, settings in table.items():
        specs = []
        for factor in TUNE_FACTORS:
            trial = {**settings, "learning_rate": settings["learning_rate"] * factor}
            name = f"tune-{m}-lr{factor:.2f}"
            specs += plan(args, {name: trial}, runs_dir, budget / 3, [TUNE_SEED])
        results = execute(specs, args.workers)
        scores = [r["curve"]["accuracy"][-1] if "error" not in r else -1.0 for r in results]
        best = max(range(len(scores)), key=lambda i: (scores[i], TUNE_FACTORS[i] == 1.0))
        tuned[m] = results[best]["spec"]["settings"]
        trials.append({"method": m, "factors": list(TUNE_FACTORS), "final_accuracy": scores})
    return {"table": tuned, "trials": trials}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("COPES_BENCH_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["COPES_BENCH_THREADS"]))
    mode = QUICK if args.quick else FULL
    table = method_table(args.quick, args.ablations)
    if args.methods:
        wanted = args.methods.split(",")
        unknown = [m for m in wanted if m not in table]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; choose from {sorted(table)}")
        table = {m: table[m] for m in wanted}
    elif args.quick:
        table = {m: table[m] for m in mode["methods"] if m in table}
    seeds = args.seeds or mode["seeds"]
    budget = args.budget or mode[f"budget_{args.budget_kind}"]
    suffix = ("-quick" if args.quick else "") + ("-qa" if args.env == "ToolQA-v0" else "")
    suffix += "" if args.budget_kind == "tokens" else f"-{args.budget_kind}"
    suffix += "-ablations" if args.ablations else ""
    name = args.name or f"learning{suffix}"
    runs_dir = Path(args.runs_dir or f"runs/benchmarks/{name}")
    start = time.perf_counter()
    tuning = tune(args, table, runs_dir, budget) if args.tune else None
    if tuning:
        table = tuning["table"]
    records = execute(plan(args, table, runs_dir, budget, seeds), args.workers)
    summary = summarize(records, list(table), args.budget_kind, budget,
                        target=args.target_accuracy)  # fmt: skip
    meta = {
        "benchmark": "learning",
        "command": "python benchmarks/learning.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "env": args.env,
        "seeds": seeds,
        "hyperparameters": table,
        "tuned": tuning,
        "train_settings": mode["train"],
        "passk_settings": mode["passk"],
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads_per_run": int(os.environ["COPES_BENCH_THREADS"]),
            "workers": args.workers,
            "load_average": os.getloadavg(),
        },
        "wall_seconds": round(time.perf_counter() - start, 1),  # this invocation
        "run_wall_seconds": {  # when each run was trained (a rerun reads them back)
            f"{r['spec']['method']}-seed{r['spec']['seed']}": r.get("wall_seconds") for r in records
        },
    }
    title = f"{args.env}, {Path(args.model).name} agent{' (quick)' if args.quick else ''}"
    paths = write_outputs(summary, meta, Path(args.results_dir), name, title)
    print(paths["md"].read_text())
    print(f"[learning] wrote {', '.join(str(p) for p in paths.values())} "
          f"in {meta['wall_seconds']} s")  # fmt: skip
    return {**meta, **summary}


if __name__ == "__main__":
    main()
