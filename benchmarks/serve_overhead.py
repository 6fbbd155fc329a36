"""Step time of a CoPES population served over HTTP vs evaluated in process, side by side, with
clients holding 1, 4, 16 or all of a step's sessions in flight.

Every row scores the same members of the same step on the same tasks in this process:

- in process: the batched evaluator (`copes.optimizers.batched`, one episode loop over the
  stacked members), members one after another (`LocalEvaluator`), and the step's episodes
  played one at a time (each alone in the loop, with its member's weights and stream);
- served, deterministic schedule: every session at once through the in-process harness
  (copes' env loop on the real `openai` client), the reference for bit-identical episodes;
- served, as they come: an ask/tell client over HTTP (`copes.serve.client.ask_tell`, the env
  loop as its agent) with at most 1, 4, 16 or all sessions in flight.

Targets on 2 CPU cores: all in flight <= 1.3x the in-process batched step; 16 in flight <=
1.6x; 1 in flight <= 1.2x the same episodes played one at a time in process. Besides: tokens/s,
the p50/p95 of a turn as the client sees it, and the share of episodes (and rewards) equal to
the in-process batched step's (as they come, only the batch's composition differs: float
rounding).

    python benchmarks/serve_overhead.py                  # N = 16 x 8 tasks: 128 sessions
    python benchmarks/serve_overhead.py --population-size 4 --tasks 3 --in-flight 1 all

Writes benchmarks/results/serve_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

LOAD_BEFORE = list(os.getloadavg())
TARGETS = {"all": ("in_process_batched", 1.3), "16": ("in_process_batched", 1.6),
           "1": ("in_process_one_at_a_time", 1.2)}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--population-size", type=int, default=16)
    p.add_argument("--num-subspaces", type=int, default=2)
    p.add_argument("--sigma", type=float, default=0.01)
    p.add_argument("--tasks", type=int, default=8, help="tasks per member (the batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--in-flight", nargs="+", default=["1", "4", "16", "all"],
                   help="sessions a client holds at once (numbers, or all)")  # fmt: skip
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
    from copes.agents.rollout import rollout as play
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES, LocalEvaluator
    from copes.serve import EnvLoop, HttpHarness, InProcessHarness, PolicyServer, ServedEvaluator
    from copes.serve.client import ask_tell
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
    sessions = n * args.tasks
    optimizer = CoPES(
        CoPESConfig(population_size=n, num_subspaces=args.num_subspaces, sigma=args.sigma,
                    antithetic=True, seed=0)
    )  # fmt: skip
    step = 1
    members = optimizer.ask(step)
    plan = rollout.population_plan(step, [m.member for m in members])
    local_batches: dict[int, Any] = {}
    local = BatchedEvaluator(
        policy, rollout, n, on_batch=lambda m, b: local_batches.__setitem__(m, b)
    )
    latencies: list[float] = []
    env_loop = EnvLoop(make_env, pool=sessions)

    async def timed_episode(client: Any, model: str, task: dict) -> Any:
        post = client.post  # what copes' env loop sends its turns with

        async def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            reply = await post(*a, **kw)
            latencies.append(time.perf_counter() - start)
            return reply

        client.post = timed
        return await env_loop(client, model, task)

    rows: dict[str, dict[str, Any]] = {}

    def record(name: str, seconds: float, results: list[Any], served: Any = None) -> None:
        row: dict[str, Any] = {"seconds": seconds}
        if results:
            tokens = sum(r.generated_tokens for r in results)
            row |= {"generated_tokens": tokens, "tokens_per_second": tokens / seconds}
        if served is not None:
            same = [
                session.token_ids == local_batches[e.member][e.index].token_ids
                for e, session in zip(plan, served.sessions, strict=True)
            ]
            rewards = [
                session.reward == local_batches[e.member][e.index].reward
                for e, session in zip(plan, served.sessions, strict=True)
            ]
            row |= {
                "requests": sum(len(s.turns) for s in served.sessions),
                "turn_latency_p50": percentile(latencies, 0.5),
                "turn_latency_p95": percentile(latencies, 0.95),
                "episodes_identical": sum(same) / len(same),
                "rewards_identical": sum(rewards) / len(rewards),
            }
        rows[name] = row
        print(name, json.dumps(row), flush=True)

    def timed(function: Any, *a: Any) -> tuple[float, Any]:
        latencies.clear()
        start = time.perf_counter()
        result = function(*a)
        return time.perf_counter() - start, result

    # ---- in process
    local.evaluate(0, optimizer.ask(0))  # warm-up, untimed
    seconds, results = timed(local.evaluate, step, members)
    record("in_process_batched", seconds, results)
    seconds, results = timed(LocalEvaluator(policy, rollout).evaluate, step, members)
    record("in_process_sequential_members", seconds, results)

    def one_at_a_time() -> int:
        """The step's episodes, each alone in the loop with its member's weights and stream."""
        local._load(members)
        population, tokens = local.population_policy, 0
        env = make_env()
        for e in plan:
            batch = play(
                population, [env], rollout.sampling_of(step, e.member),
                options=[{"task": e.task}], max_context=rollout.max_context,
                assign=lambda _, e=e: population.assign([e.slot], [e.stream], [e.seed]),
            )  # fmt: skip
            tokens += batch.stats.generated_tokens
        return tokens

    seconds, tokens = timed(one_at_a_time)
    rows["in_process_one_at_a_time"] = {"seconds": seconds, "generated_tokens": tokens,
                                        "tokens_per_second": tokens / seconds}  # fmt: skip
    print("in_process_one_at_a_time", json.dumps(rows["in_process_one_at_a_time"]), flush=True)

    # ---- served, deterministic: every session at once (the in-process harness)
    server = PolicyServer(policy, sampling, schedule="deterministic")
    server.start()
    try:
        served = ServedEvaluator(server, InProcessHarness(timed_episode), policy, rollout, n)
        served.evaluate(0, optimizer.ask(0))  # warm-up, untimed
        seconds, results = timed(served.evaluate, step, members)
        record("served_deterministic_all", seconds, results, served.last_served)
    finally:
        server.stop()

    # ---- served, as they come: an HTTP ask/tell client with k sessions in flight
    server = PolicyServer(policy, sampling, schedule="as-they-come")
    server.start()
    try:
        served = ServedEvaluator(server, HttpHarness(), policy, rollout, n)
        for label in args.in_flight:
            k = sessions if label == "all" else int(label)
            client_error: list[BaseException] = []

            def client(k: int = k, client_error: list = client_error) -> None:
                try:
                    asyncio.run(
                        ask_tell(server.base_url, timed_episode, in_flight=k, sessions=sessions)
                    )
                except BaseException as exc:
                    client_error.append(exc)

            latencies.clear()
            thread = threading.Thread(target=client, daemon=True)
            thread.start()
            start = time.perf_counter()
            results = served.evaluate(step, members)
            seconds = time.perf_counter() - start
            thread.join(timeout=600)
            if client_error:
                raise client_error[0]
            record(f"served_as_they_come_{label}", seconds, results, served.last_served)
    finally:
        server.stop()
        rollout.close()

    ratios = {}
    for label in args.in_flight:
        if label in TARGETS:
            base, target = TARGETS[label]
            ratio = rows[f"served_as_they_come_{label}"]["seconds"] / rows[base]["seconds"]
            ratios[f"{label}_in_flight"] = {"against": base, "ratio": ratio, "target": target,
                                            "met": ratio <= target}  # fmt: skip
    fixed = rows["served_deterministic_all"]["seconds"] / rows["in_process_batched"]["seconds"]
    ratios["deterministic_all"] = {"against": "in_process_batched", "ratio": fixed,
                                   "target": 1.3, "met": fixed <= 1.3}  # fmt: skip
    result = {
        "benchmark": "serve_overhead",
        "command": "python benchmarks/serve_overhead.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "population_size": n,
        "num_subspaces": args.num_subspaces,
        "tasks_per_member": args.tasks,
        "sessions": sessions,
        "ratios": ratios,
        "rows": rows,
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
    for name, r in ratios.items():
        print(f"{name}: {r['ratio']:.3f}x {r['against']} (target <= {r['target']}: "
              f"{'met' if r['met'] else 'NOT met'})")  # fmt: skip
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
