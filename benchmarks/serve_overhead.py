"""Step time of a CoPES population served over HTTP vs evaluated in process, side by side, with
clients holding 1, 4, 16 or all of a step's sessions in flight.

Every row scores the same members of the same step on the same tasks in this process:

- in process: the batched evaluator (`copes.optimizers.batched`, one episode loop over the
  stacked members), members one after another (`LocalEvaluator`), and the step's episodes
  played one at a time (each alone in the loop, with its member's weights and stream);
- served, deterministic schedule: every session at once through the in-process harness
  (copes' env loop on the real `openai` client), the reference for bit-identical episodes;
- served, as they come: an ask/tell client over HTTP (`copes.serve.client.ask_tell`, the env
  loop as its agent, in a thread of this process) with at most 1, 4, 16 or all sessions in
  flight.

Each row is timed `--repeats` times; the median is reported (the spread beside it).

Targets on 2 CPU cores: all in flight <= 1.3x the in-process batched step; 16 in flight <=
1.6x; 1 in flight <= 1.2x the same episodes played one at a time in process. Besides: tokens/s,
the p50/p95 of a turn as the client sees it, and the share of episodes (and rewards) equal to
the in-process batched step's (as they come, only the batch's composition differs: float
rounding).

    python benchmarks/serve_overhead.py                  # N = 16 x 8 tasks: 128 sessions
    python benchmarks/serve_overhead.py --population-size 4 --tasks 3 --in-flight 1 all
    python benchmarks/serve_overhead.py --model smollm2-135m --dtype bfloat16 \
        --demonstrations 2 --population-size 4 --tasks 4 --max-new-tokens 96 --repeats 1

Writes benchmarks/results/serve_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--demonstrations", type=int, default=0,
                   help="worked examples before each task (a real model needs them)")  # fmt: skip
    p.add_argument("--population-size", type=int, default=16)
    p.add_argument("--num-subspaces", type=int, default=2)
    p.add_argument("--sigma", type=float, default=0.01)
    p.add_argument("--tasks", type=int, default=8, help="tasks per member (the batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--in-flight", nargs="+", default=["1", "4", "16", "all"],
                   help="sessions a client holds at once (numbers, or all)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timings of each row (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", default="benchmarks/results/serve_overhead.json")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


class TimedEpisode:
    """copes' env loop as the agent, timing every turn as its client sees it."""

    def __init__(self, make_env: Any, pool: int) -> None:
        from copes.serve import EnvLoop

        self.env_loop = EnvLoop(make_env, pool=pool)
        self.latencies: list[float] = []

    async def __call__(self, client: Any, model: str, task: dict) -> Any:
        post = client.post  # what copes' env loop sends its turns with

        async def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            reply = await post(*a, **kw)
            self.latencies.append(time.perf_counter() - start)
            return reply

        client.post = timed
        return await self.env_loop(client, model, task)


def client_thread(url: str, in_flight: int, sessions: int, episode: Any, errors: list) -> None:
    """The agent: ask/tell with `in_flight` sessions at once until `sessions` played (in this
    process: on 2 cores an agent process beside the server's torch threads measured slower,
    docs/serving.md)."""
    import asyncio

    from copes.serve.client import ask_tell

    try:
        asyncio.run(ask_tell(url, episode, in_flight=in_flight, sessions=sessions))
    except BaseException as exc:
        errors.append(exc)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from copes.agents.hf import HFPolicy
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout as play
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES, LocalEvaluator
    from copes.serve import HttpHarness, InProcessHarness, PolicyServer, ServedEvaluator
    from copes.train import TaskRollout

    policy = HFPolicy.from_pretrained(args.model, device="cpu")
    if args.dtype != "float32":
        policy.model.to(getattr(torch, args.dtype))
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks

    tasks = synthetic_math_tasks("train", 500, seed=0)

    def make_env() -> Any:
        return tool_math_env(tasks=tasks[:1], max_turns=args.max_turns, invalid_penalty=0.2,
                             demonstrations=args.demonstrations)  # fmt: skip

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
    timed_episode = TimedEpisode(make_env, pool=sessions)  # the in-process harness's
    rows: dict[str, dict[str, Any]] = {}

    def record(name: str, times: list[float], tokens: int, served: Any = None,
               latencies: list[float] | None = None) -> None:  # fmt: skip
        seconds = statistics.median(times)
        row: dict[str, Any] = {"seconds": seconds, "seconds_each": times, "generated_tokens":
                               tokens, "tokens_per_second": tokens / seconds}  # fmt: skip
        if served is not None:  # the last repeat's sessions against the in-process batch
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
                "turn_latency_p50": percentile(latencies or [], 0.5),
                "turn_latency_p95": percentile(latencies or [], 0.95),
                "episodes_identical": sum(same) / len(same),
                "rewards_identical": sum(rewards) / len(rewards),
            }
        rows[name] = row
        print(name, json.dumps(row), flush=True)

    def repeated(function: Any, *a: Any) -> tuple[list[float], Any]:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = function(*a)
            times.append(time.perf_counter() - start)
        return times, result

    def tokens_of(results: list[Any]) -> int:
        return sum(r.generated_tokens for r in results)

    # ---- in process
    local.evaluate(0, optimizer.ask(0))  # warm-up, untimed
    times, results = repeated(local.evaluate, step, members)
    record("in_process_batched", times, tokens_of(results))
    times, results = repeated(LocalEvaluator(policy, rollout).evaluate, step, members)
    record("in_process_sequential_members", times, tokens_of(results))

    def one_at_a_time() -> int:
        """The step's episodes, each alone in the loop with its member's weights and stream."""
        local.members.load(members)
        population, tokens = local.members.policy, 0
        env = make_env()
        for e in plan:
            batch = play(
                population, [env], rollout.sampling_of(step, e.member),
                options=[{"task": e.task}], max_context=rollout.max_context,
                assign=lambda _, e=e: population.assign([e.slot], [e.stream]),
            )  # fmt: skip
            tokens += batch.stats.generated_tokens
        return tokens

    times, tokens = repeated(one_at_a_time)
    record("in_process_one_at_a_time", times, tokens)

    # ---- served, deterministic: every session at once (the in-process harness)
    server = PolicyServer(policy, sampling, schedule="deterministic")
    server.start()
    try:
        served = ServedEvaluator(server, InProcessHarness(timed_episode), policy, rollout, n)
        served.evaluate(0, optimizer.ask(0))  # warm-up, untimed
        timed_episode.latencies.clear()
        times, results = repeated(served.evaluate, step, members)
        record("served_deterministic_all", times, tokens_of(results), served.last_served,
               timed_episode.latencies)  # fmt: skip
    finally:
        server.stop()

    # ---- served, as they come: an ask/tell client with k sessions in flight
    server = PolicyServer(policy, sampling, schedule="as-they-come")
    server.start()
    try:
        served = ServedEvaluator(server, HttpHarness(), policy, rollout, n)
        for label in args.in_flight:
            k = sessions if label == "all" else int(label)
            times = []
            for _ in range(args.repeats):
                errors: list[BaseException] = []
                timed_episode.latencies.clear()
                client = threading.Thread(
                    target=client_thread,
                    args=(server.base_url, k, sessions, timed_episode, errors),
                    daemon=True,
                )
                client.start()
                start = time.perf_counter()
                results = served.evaluate(step, members)
                times.append(time.perf_counter() - start)
                client.join(timeout=600)
                if errors:
                    raise errors[0]
            record(f"served_as_they_come_{label}", times, tokens_of(results),
                   served.last_served, timed_episode.latencies)  # fmt: skip
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
        "demonstrations": args.demonstrations,
        "population_size": n,
        "num_subspaces": args.num_subspaces,
        "tasks_per_member": args.tasks,
        "sessions": sessions,
        "repeats": args.repeats,
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
