"""Step time of a CoPES population served over HTTP vs evaluated in process, side by side.

Both score the same members of the same steps on the same tasks in this process: the
in-process batched evaluator (`copes.optimizers.batched`, one episode loop over the stacked
members, copes' env loop inside it) and the served one (`copes.serve`: the same loop, each
episode a session whose turns arrive as OpenAI chat-completions requests from copes' own env
loop running on the real `openai` client in a harness thread). The figure of merit is the
ratio of their step seconds, served / in-process (target on 2 CPU cores: <= 1.3); besides
it: requests/s and generated tokens/s of the served step, the p50/p95 latency of a turn as
the client sees it, and whether rewards and episodes are the in-process ones.

    python benchmarks/serve_overhead.py                       # N = 16 x 16 tasks, 2 steps
    python benchmarks/serve_overhead.py --population-size 4 --tasks 3 --steps 1

Writes benchmarks/results/serve_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

LOAD_BEFORE = list(os.getloadavg())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--population-size", type=int, default=16)
    p.add_argument("--num-subspaces", type=int, default=2)
    p.add_argument("--sigma", type=float, default=0.01)
    p.add_argument("--tasks", type=int, default=16, help="tasks per member (the batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps measured")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", default="benchmarks/results/serve_overhead.json")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from copes.agents.hf import HFPolicy
    from copes.agents.policy import SamplingConfig
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES
    from copes.serve import EnvLoop, InProcessHarness, PolicyServer, ServedEvaluator
    from copes.train import TaskRollout

    policy = HFPolicy.from_pretrained(args.model, device="cpu")
    if args.dtype == "float64":
        policy.model.to(torch.float64)
    tasks = synthetic_math_tasks("train", 500, seed=0)

    def make_env() -> Any:
        return tool_math_env(tasks=tasks[:1], max_turns=args.max_turns, invalid_penalty=0.2)

    sampling = SamplingConfig(args.max_new_tokens, temperature=0.0)
    rollout = TaskRollout(make_env, tasks, args.tasks, 1, sampling, seed=0)
    n = args.population_size
    optimizer = CoPES(
        CoPESConfig(population_size=n, num_subspaces=args.num_subspaces, sigma=args.sigma,
                    antithetic=True, seed=0)
    )  # fmt: skip
    local_batches: dict[int, Any] = {}
    local = BatchedEvaluator(
        policy, rollout, n, on_batch=lambda m, b: local_batches.__setitem__(m, b)
    )
    latencies: list[float] = []
    env_loop = EnvLoop(make_env, pool=n * args.tasks)

    async def timed_episode(client: Any, model: str, task: dict) -> Any:
        post = client.post  # what copes' env loop sends its turns with

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            reply = await post(*args, **kwargs)
            latencies.append(time.perf_counter() - start)
            return reply

        client.post = timed
        return await env_loop(client, model, task)

    server = PolicyServer(policy, sampling)
    server.start()
    served = ServedEvaluator(server, InProcessHarness(timed_episode), policy, rollout, n)
    runs = []
    try:
        local.evaluate(0, optimizer.ask(0))  # warm-up of both paths, untimed
        served.evaluate(0, optimizer.ask(0))
        for step in range(1, args.steps + 1):
            members = optimizer.ask(step)
            latencies.clear()
            start = time.perf_counter()
            here = local.evaluate(step, members)
            local_seconds = time.perf_counter() - start
            start = time.perf_counter()
            there = served.evaluate(step, members)
            served_seconds = time.perf_counter() - start
            plan = rollout.population_plan(step, [m.member for m in members])
            same = [
                session.token_ids == local_batches[e.member][e.index].token_ids
                for e, session in zip(plan, served.last_served.sessions, strict=True)
            ]
            requests = sum(len(s.turns) for s in served.last_served.sessions)
            tokens = sum(r.generated_tokens for r in there)
            runs.append({
                "step": step,
                "in_process_seconds": local_seconds,
                "served_seconds": served_seconds,
                "ratio": served_seconds / local_seconds,
                "requests": requests,
                "requests_per_second": requests / served_seconds,
                "generated_tokens": tokens,
                "tokens_per_second": tokens / served_seconds,
                "turn_latency_p50": percentile(latencies, 0.5),
                "turn_latency_p95": percentile(latencies, 0.95),
                "rewards_match": sum(a.reward == b.reward for a, b in zip(here, there, strict=True))
                / n,
                "episodes_identical": sum(same) / len(same),
                "reward_mean": statistics.fmean(r.reward for r in here),
            })  # fmt: skip
            print(json.dumps(runs[-1]), flush=True)
    finally:
        server.stop()
        rollout.close()
    local_total = sum(r["in_process_seconds"] for r in runs)
    served_total = sum(r["served_seconds"] for r in runs)
    result = {
        "benchmark": "serve_overhead",
        "command": "python benchmarks/serve_overhead.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "population_size": n,
        "num_subspaces": args.num_subspaces,
        "tasks_per_member": args.tasks,
        "steps": args.steps,
        "ratio": served_total / local_total,
        "in_process_seconds_per_step": local_total / len(runs),
        "served_seconds_per_step": served_total / len(runs),
        "requests_per_second": sum(r["requests"] for r in runs) / served_total,
        "tokens_per_second": sum(r["generated_tokens"] for r in runs) / served_total,
        "turn_latency_p50": statistics.fmean(r["turn_latency_p50"] for r in runs),
        "turn_latency_p95": statistics.fmean(r["turn_latency_p95"] for r in runs),
        "rewards_match": statistics.fmean(r["rewards_match"] for r in runs),
        "episodes_identical": statistics.fmean(r["episodes_identical"] for r in runs),
        "runs": runs,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before_after": [LOAD_BEFORE, list(os.getloadavg())],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"served / in-process step time: {result['ratio']:.3f} "
        f"({result['requests_per_second']:.1f} requests/s, {result['tokens_per_second']:.0f} "
        f"tokens/s, turn p50 {result['turn_latency_p50'] * 1000:.0f} ms / p95 "
        f"{result['turn_latency_p95'] * 1000:.0f} ms); rewards match "
        f"{result['rewards_match']:.3f}, identical episodes {result['episodes_identical']:.3f}; "
        f"wrote {out}"
    )
    return result


if __name__ == "__main__":
    main()
