"""Tokens/s of a multi-turn `rollout` over ToolMath against plain batched `model.generate`.

Both run in this process on the same prompts: the rollout first (tools, grading and all),
then one plain batched `model.generate` call over its prompts in which sequence i produces
exactly as many tokens as episode i generated in all its turns (a logits processor ends it
with eos there; `generate` keeps finished rows padded until the longest ends, as it does for
any batch). The ratio of the tokens/s, rollout / generate, is the figure of merit (target:
>= 0.8). A second, stricter baseline gives every sequence the mean length instead (a batch
of equal-length sequences, no padding steps): `ratio_mean_length`.

Each repeat measures both rollout paths: the policy's episode loop (`continuous`) and one
`generate_ids` call per turn (`per_turn`), each against its own baselines.

    python benchmarks/rollout_throughput.py --episodes 32 --repeats 3
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _raw_generate helper

from _raw_generate import measure_generate

from copes.agents.hf import HFPolicy
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout
from copes.envs.presets import tool_math_env
from copes.envs.tasks.synthetic import synthetic_math_tasks


def measure_rollout(
    policy: HFPolicy, episodes: int, max_new_tokens: int, seed: int, continuous: bool = True
):
    tasks = synthetic_math_tasks("validation", episodes, seed=seed)
    envs = [tool_math_env(tasks=[t]) for t in tasks]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    try:
        start = time.perf_counter()
        batch = rollout(policy, envs, sampling, continuous_batching=continuous)
        seconds = time.perf_counter() - start
    finally:
        for env in envs:
            env.close()
    prompts = [t.token_ids[: t.prompt_length] for t in batch]
    lengths = [t.num_generated_tokens for t in batch]
    return seconds, prompts, lengths, batch.stats


def compare(policy: HFPolicy, args: argparse.Namespace, seed: int, continuous: bool) -> dict:
    """One rollout, then the two raw `generate` baselines on its prompts."""
    seconds, prompts, lengths, stats = measure_rollout(
        policy, args.episodes, args.max_new_tokens, seed, continuous
    )
    total = sum(lengths)
    same_seconds, same_total = measure_generate(policy, prompts, lengths, seed)
    mean = max(1, round(total / len(lengths)))
    mean_seconds, mean_total = measure_generate(policy, prompts, [mean] * len(lengths), seed)
    rate = total / seconds
    return {
        "rollout_tokens": total,
        "rollout_seconds": seconds,
        "rollout_tokens_per_s": rate,
        "rollout_generation_seconds": stats.generation_seconds,
        "rollout_env_seconds": stats.env_seconds,
        "generate_calls": stats.generate_calls,
        "engine": stats.engine,
        "lengths": {"min": min(lengths), "mean": total / len(lengths), "max": max(lengths)},
        "raw_same_lengths_seconds": same_seconds,
        "raw_same_lengths_tokens_per_s": same_total / same_seconds,
        "ratio": rate / (same_total / same_seconds),
        "raw_mean_length_seconds": mean_seconds,
        "raw_mean_length_tokens_per_s": mean_total / mean_seconds,
        "ratio_mean_length": rate / (mean_total / mean_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", default="benchmarks/results/rollout_throughput.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = HFPolicy.from_pretrained(args.model, device="cpu")
    for continuous in (True, False):  # warm-up: sandbox sessions, grader, both paths
        measure_rollout(policy, args.episodes, args.max_new_tokens, 999, continuous)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"continuous": [], "per_turn": []}
    for repeat in range(args.repeats):
        for mode, continuous in (("continuous", True), ("per_turn", False)):
            runs[mode].append(compare(policy, args, repeat, continuous))
            print(mode, json.dumps(runs[mode][-1]))
    result = {
        "benchmark": "rollout_throughput",
        "model": args.model,
        "episodes": args.episodes,
        "max_new_tokens": args.max_new_tokens,
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "runs": runs,
    }
    for mode, mode_runs in runs.items():
        for key in ("ratio", "ratio_mean_length"):
            result[f"{mode}_median_{key}"] = statistics.median(r[key] for r in mode_runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for mode in runs:
        print(
            f"{mode}: rollout / raw generate tokens-per-second, median: "
            f"{result[f'{mode}_median_ratio']:.2f} (same lengths per sequence), "
            f"{result[f'{mode}_median_ratio_mean_length']:.2f} (every sequence the mean length)"
        )


if __name__ == "__main__":
    main()
