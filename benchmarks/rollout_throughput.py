"""Tokens/s of a multi-turn `rollout` over ToolMath against plain batched `model.generate`.

Both run in this process on the same prompts, with the same number of sequences and the same
number of generated tokens per sequence: the rollout first (tools, grading and all), then
`model.generate` forced to produce exactly as many tokens per sequence as the rollout did in
all its turns (min_new_tokens = max_new_tokens), in one batched call. The ratio
rollout / generate is the figure of merit (target: >= 0.8).

    python benchmarks/rollout_throughput.py --episodes 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from copes.agents.hf import HFPolicy
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout
from copes.envs.presets import tool_math_env
from copes.envs.tasks.synthetic import synthetic_math_tasks


def measure_rollout(policy: HFPolicy, episodes: int, max_new_tokens: int, seed: int):
    tasks = synthetic_math_tasks("validation", episodes, seed=seed)
    envs = [tool_math_env(tasks=[t]) for t in tasks]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    try:
        start = time.perf_counter()
        batch = rollout(policy, envs, sampling)
        seconds = time.perf_counter() - start
    finally:
        for env in envs:
            env.close()
    prompts = [t.token_ids[: t.prompt_length] for t in batch]
    lengths = [t.num_generated_tokens for t in batch]
    return seconds, prompts, lengths, batch.stats


def measure_generate(policy: HFPolicy, prompts: list[list[int]], tokens_each: int, seed: int):
    """One batched generate, every sequence forced to `tokens_each` new tokens."""
    from transformers import GenerationConfig

    tok = policy.tokenizer
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=tokens_each, min_new_tokens=tokens_each, do_sample=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        policy.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/rollout_throughput.json")
    args = parser.parse_args()
    policy = HFPolicy.from_pretrained(args.model, device="cpu")
    measure_rollout(policy, 4, args.max_new_tokens, seed=999)  # warm-up: sandbox, grader
    runs = []
    for repeat in range(args.repeats):
        seconds, prompts, lengths, stats = measure_rollout(
            policy, args.episodes, args.max_new_tokens, seed=repeat
        )
        total = sum(lengths)
        tokens_each = max(1, round(total / len(lengths)))
        raw_seconds = measure_generate(policy, prompts, tokens_each, seed=repeat)
        raw_total = tokens_each * len(prompts)
        runs.append(
            {
                "rollout_tokens": total,
                "rollout_seconds": seconds,
                "rollout_tokens_per_s": total / seconds,
                "rollout_generation_seconds": stats.generation_seconds,
                "rollout_env_seconds": stats.env_seconds,
                "generate_calls": stats.generate_calls,
                "raw_tokens": raw_total,
                "raw_seconds": raw_seconds,
                "raw_tokens_per_s": raw_total / raw_seconds,
                "ratio": (total / seconds) / (raw_total / raw_seconds),
            }
        )
        print(json.dumps(runs[-1]))
    result = {
        "benchmark": "rollout_throughput",
        "model": args.model,
        "episodes": args.episodes,
        "max_new_tokens": args.max_new_tokens,
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "runs": runs,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"rollout / raw generate tokens-per-second: {result['median_ratio']:.2f} (median)")


if __name__ == "__main__":
    main()
