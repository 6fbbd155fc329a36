"""ES step time in one process against Ray with 1 and 2 workers: the same run, three ways.

One CoPES run (the tiny agent on ToolMath, same seed, same tasks, same population) is stepped
in this process (`--workers 0`, `CoPES.step`), then on a local Ray with W = 1 and W = 2
actors (`copes.distributed.RayPopulation`). Every mode uses one torch thread per replica, so
W = 1 against local is the overhead of Ray itself (actor calls, the driver's extra update)
and W = 2 against W = 1 is the speed-up from a second replica. Start-up (Ray, actors loading
the model and their environments) is timed apart from the steps. The three final weight
checksums must be equal.

    python benchmarks/ray_overhead.py --steps 4 --population-size 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from copes.train import TrainConfig, Trainer, optimizer_config


def make_trainer(args: argparse.Namespace, workers: int, out_dir: str) -> Trainer:
    config = TrainConfig(
        optimizer="copes", model=args.model, out_dir=out_dir, steps=args.steps,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, max_turns=3,
        num_train_tasks=100, eval_tasks=1, invalid_penalty=0.1, workers=workers,
        checksum_every=0, progress=False, tensorboard=False, device="cpu", seed=args.seed,
    )  # fmt: skip
    overrides = {"population_size": args.population_size, "num_subspaces": 2, "sigma": 0.05,
                 "learning_rate": 0.01}  # fmt: skip
    return Trainer(config, optimizer_config(config, **overrides))


def run_mode(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """Build the run, then time `args.steps` optimizer steps (W = 0: in this process)."""
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = make_trainer(args, workers, out_dir)
        population, startup = trainer.evaluator, 0.0  # None: this process
        if workers:
            start = time.perf_counter()
            population.start(0, trainer.policy.weights().checksum())
            startup = time.perf_counter() - start
        step_seconds, rewards = [], []
        try:
            for step in range(args.steps):
                start = time.perf_counter()
                stats = trainer.optimizer.step(trainer.policy, trainer.train_rollout, step)
                step_seconds.append(time.perf_counter() - start)
                rewards.append(stats.log["rewards"])
                logging.info("workers=%d step %d: %.2f s", workers, step, step_seconds[-1])
            round_trips = []
            for _ in range(50 if population is not None else 0):  # Ray's own cost of a call
                start = time.perf_counter()
                population.worker_pids()  # one tiny call to every actor, awaited together
                round_trips.append(time.perf_counter() - start)
        finally:
            if population is not None:
                population.close()
            trainer.train_rollout.close()
            trainer.eval_rollout.close()
        return {
            "workers": workers,
            "startup_seconds": startup,
            "step_seconds": step_seconds,
            "median_step_seconds": statistics.median(step_seconds),
            "mean_step_seconds": statistics.fmean(step_seconds),
            "call_round_trip_ms_median": 1000 * statistics.median(round_trips)
            if round_trips
            else None,
            "rewards": rewards,
            "checksum": trainer.policy.weights().checksum(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--population-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    # Seed 0 at these settings has a member write code that runs into the Python tool's 10 s
    # wall-clock timeout; whether that call can be interrupted depends on timing, so its
    # reward can differ between runs (docs/scaling.md). Seed 1 has none (checked).
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/ray_overhead.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # one thread per replica in every mode, as in the actors
    load_before = os.getloadavg()
    modes = [run_mode(args, workers) for workers in (0, 1, 2)]
    local, one, two = (m["median_step_seconds"] for m in modes)
    result = {
        "benchmark": "ray_overhead",
        "command": f"python benchmarks/ray_overhead.py --model {args.model} "
        f"--steps {args.steps} --population-size {args.population_size} "
        f"--batch-size {args.batch_size} --max-new-tokens {args.max_new_tokens} --seed {args.seed}",
        "model": args.model,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "modes": modes,
        "ray_w1_over_local": one / local,
        "ray_w2_over_local": two / local,
        "speedup_w2_over_w1": one / two,
        "identical_weights": len({m["checksum"] for m in modes}) == 1,
        "identical_rewards": all(m["rewards"] == modes[0]["rewards"] for m in modes),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"median step: local {local:.2f} s, Ray W=1 {one:.2f} s ({one / local:.2f}x local), "
        f"Ray W=2 {two:.2f} s ({two / local:.2f}x local, {one / two:.2f}x faster than W=1); "
        f"start-up W=1 {modes[1]['startup_seconds']:.1f} s, "
        f"W=2 {modes[2]['startup_seconds']:.1f} s; a call to every actor: "
        f"{modes[1]['call_round_trip_ms_median']:.2f} ms (W=1), "
        f"{modes[2]['call_round_trip_ms_median']:.2f} ms (W=2); "
        f"identical weights: {result['identical_weights']}"
    )


if __name__ == "__main__":
    main()
