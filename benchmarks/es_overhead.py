"""Where the time of one ES / CoPES step goes: generation, tools, grading, weight operations.

Runs a few real training steps of ES (K = 1) and CoPES (K = 4 by default) on the same agent
(`--model`, default the tiny agent) through the trainer's own rollout (`copes.train.
TaskRollout`: same task batch for every member, greedy, tool calls in parallel threads) and
splits each step's wall time into:

- generation: the policy's generation (wall): its episode loop when it has one (the
  transformers backend), whose env steps run in threads *while* other episodes decode, so
  that time is inside generation and reported apart as `environment_overlapped`; otherwise
  the per-turn `generate_ids` calls;
- environment: stepping the envs between turns on the turn-by-turn path (wall; tool calls,
  grading, parsing and re-encoding, in parallel threads); 0 under the episode loop. The time
  inside tool calls and inside the grader is reported summed over episodes (threads overlap,
  so the sums can exceed the wall time they are part of);
- perturb + restore: the weight-space engine before and after every member (wall);
- update: `tell()`, the one update of the step (wall); and, separately, the same update with
  every member's coefficient non-zero (the engine skips zero coefficients, and an agent
  whose rewards are all equal has nothing but zeros), the worst case;
- other: the rest (reward bookkeeping, the progress bar).

Target: weight operations (perturb + restore + update) under 5% of the step, with either
update. The first step
is a warm-up (the sandbox's first import, allocator) and is reported but not averaged.

    python benchmarks/es_overhead.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

TARGET = 0.05


def time_steps(args: argparse.Namespace, subspaces: int) -> list[dict[str, float]]:
    """`args.steps + 1` steps of CoPES with K = `subspaces`; the split of each."""
    from copes.agents.hf import HFPolicy
    from copes.agents.policy import SamplingConfig
    from copes.optimizers.es import CoPES, CoPESConfig
    from copes.train import TaskRollout, TrainConfig, env_factory, load_tasks_for

    config = TrainConfig(env=args.env, model=args.model, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, max_turns=args.max_turns)  # fmt: skip
    policy = HFPolicy.from_pretrained(args.model, device="cpu")
    optimizer = CoPES(CoPESConfig(
        population_size=args.population, num_subspaces=subspaces, sigma=0.02,
        learning_rate=0.01, seed=0,
    ))  # fmt: skip
    train_rollout = TaskRollout(
        env_factory(config), load_tasks_for(config, "train", 200), args.batch_size, 1,
        SamplingConfig(args.max_new_tokens, temperature=0.0), seed=0,
    )  # fmt: skip
    rollouts: list[Any] = []

    def recording(policy: Any, step: int, member: int | None = None) -> Any:
        batch = train_rollout(policy, step, member)
        rollouts.append(batch.stats)
        return batch

    steps = []
    try:
        for step in range(args.steps + 1):
            rollouts.clear()
            start = time.perf_counter()
            stats = optimizer.step(policy, recording, step)
            total = time.perf_counter() - start
            weights = stats.metrics["perturb_restore_seconds"]
            update = stats.metrics["update_seconds"]
            update_full = time_full_update(optimizer, policy, step)
            split = {
                "step": step,
                "subspaces": subspaces,
                "total": total,
                "generation": sum(s.generation_seconds for s in rollouts),
                "environment": sum(s.env_seconds for s in rollouts if not s.engine),
                "environment_overlapped": sum(s.env_seconds for s in rollouts if s.engine),
                "tool_calls_summed": sum(s.tool_seconds for s in rollouts),
                "grading_summed": sum(s.grade_seconds for s in rollouts),
                "perturb_restore": weights,
                "update": update,
                "generated_tokens": stats.generated_tokens,
            }
            split["other"] = total - split["generation"] - split["environment"] - weights - update
            split["weight_fraction"] = (weights + update) / total
            split["update_all_members"] = update_full
            full_total = total - update + update_full
            split["weight_fraction_all_members"] = (weights + update_full) / full_total
            steps.append(split)
            print(json.dumps({k: round(v, 4) for k, v in split.items()}), flush=True)
    finally:
        train_rollout.close()
    return steps


def time_full_update(optimizer: Any, policy: Any, step: int) -> float:
    """Seconds of one update in which every member has a non-zero coefficient.

    The engine skips members whose standardized reward is exactly 0, so a step whose rewards
    are all equal (an agent at 0% accuracy) costs almost no update; rewards 2^i (all
    different, none equal to their mean) give the worst case, which the target must also
    meet. This applies a second update to the weights, which no measurement here depends on.
    """
    members = optimizer.ask(step)
    rewards = [2.0**i for i in range(len(members))]
    start = time.perf_counter()
    optimizer.tell(step, members, rewards, policy.weights())
    return time.perf_counter() - start


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """Means over the measured (post warm-up) steps; the weight fraction of the summed time."""
    measured = steps[1:] or steps
    keys = [k for k in measured[0] if k not in ("step", "subspaces")]
    mean = {k: sum(s[k] for s in measured) / len(measured) for k in keys}
    mean["weight_fraction"] = (mean["perturb_restore"] + mean["update"]) / mean["total"]
    full_total = mean["total"] - mean["update"] + mean["update_all_members"]
    mean["weight_fraction_all_members"] = (
        mean["perturb_restore"] + mean["update_all_members"]
    ) / full_total
    worst = max(mean["weight_fraction"], mean["weight_fraction_all_members"])
    mean["meets_target"] = float(worst < TARGET)
    return mean


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--env", default="ToolMath-v0", choices=["ToolMath-v0", "ToolQA-v0"])
    p.add_argument("--subspaces", type=int, nargs="+", default=[1, 4], help="K values (1 = ES)")
    p.add_argument("--population", type=int, default=16, help="N")
    p.add_argument("--batch-size", type=int, default=8, help="tasks per member")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default="benchmarks/results/es_overhead.json")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    runs = {}
    for k in args.subspaces:
        name = "es" if k == 1 else f"copes-k{k}"
        steps = time_steps(args, k)
        runs[name] = {"steps": steps, "mean": summarize(steps)}
    result = {
        "benchmark": "es_overhead",
        "command": "python benchmarks/es_overhead.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "target_weight_fraction": TARGET,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "load_average": os.getloadavg(),
        },
        "runs": runs,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'':>9} {'step s':>7} {'gen':>6} {'env':>6} {'tools*':>6} {'grade*':>6} "
          f"{'pert+rest':>9} {'update':>7} {'full upd':>8} {'weights/step':>12} "
          f"{'(full upd)':>10}")  # fmt: skip
    for name, run in runs.items():
        m = run["mean"]
        print(
            f"{name:>9} {m['total']:7.2f} {m['generation']:6.2f} {m['environment']:6.2f} "
            f"{m['tool_calls_summed']:6.2f} {m['grading_summed']:6.2f} "
            f"{m['perturb_restore']:9.3f} {m['update']:7.3f} {m['update_all_members']:8.3f} "
            f"{m['weight_fraction']:12.2%} {m['weight_fraction_all_members']:10.2%}"
            f"  (target < {TARGET:.0%}: {'met' if m['meets_target'] else 'NOT met'})"
        )
    print("* summed over episodes; the env threads overlap")
    print(f"wrote {out} in {result['wall_seconds']} s")
    return result


if __name__ == "__main__":
    main()
