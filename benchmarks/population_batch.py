"""Step time of a CoPES population evaluated in one batch vs one member after another.

Both evaluators score the same members of the same steps on the same tasks in this process
(the README's quick-start settings by default: N = 16 members x 16 tasks, K = 2, greedy
member rollouts), sequential first, then batched (`copes.optimizers.batched`); the figure of
merit is the ratio of their evaluation seconds, batched / sequential (target on 2 CPU
cores: <= 0.6). Rewards are compared member by member (`rewards_match`: the fraction equal)
and episode by episode (`episodes_identical`: the fraction whose token ids are equal; in
float32 a batched matmul may round differently and flip a greedy token).

    python benchmarks/population_batch.py                      # tiny agent, 3 steps
    python benchmarks/population_batch.py --rows 64 128 256    # episode-loop rows to try
    python benchmarks/population_batch.py --model PATH --device cuda --dtype bfloat16
    python benchmarks/population_batch.py --noise lowrank --noise-rank 4 \
        --out benchmarks/results/population_batch-lowrank.json   # members served as adapters
    python benchmarks/population_batch.py --backend vllm --noise lowrank --model PATH \
        --dtype bfloat16 --out benchmarks/results/population_batch-vllm.json   # on a GPU

With `--noise lowrank` both evaluators run the low-rank family (sequential: the delta added
to the weights; batched: N rank-r adapters on the unperturbed weights). With `--backend vllm`
sequential members are perturbed in place in the engine, one after another, and batched ones
are N LoRA adapters in one vLLM batch (`copes.agents.vllm.population`).

Writes benchmarks/results/population_batch.json (or --out).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _raw_generate helper

from _raw_generate import measure_generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face folder")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--population-size", type=int, default=16)
    p.add_argument("--num-subspaces", type=int, default=2)
    p.add_argument("--sigma", type=float, default=0.01)
    p.add_argument("--noise", default="full", choices=["full", "lowrank"], help="noise family")
    p.add_argument("--noise-rank", type=int, default=4, help="r of --noise lowrank")
    p.add_argument("--tasks", type=int, default=16, help="tasks per member (the batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--demonstrations", type=int, default=0,
                   help="worked examples before each task (a real model needs them)")  # fmt: skip
    p.add_argument("--raw-generate", action="store_true",
                   help="also time a plain generate of the batched tokens (hf)")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="steps measured (members of each)")
    p.add_argument(
        "--rows", type=int, nargs="+", default=[0], help="batched loop rows (0: all episodes)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="--backend vllm")
    p.add_argument("--max-model-len", type=int, default=1024, help="--backend vllm")
    p.add_argument("--out", default="benchmarks/results/population_batch.json")
    return p.parse_args(argv)


def build_policy(args: argparse.Namespace) -> Any:
    """The policy both evaluators share: transformers, or a vLLM engine serving the
    population's N LoRA adapters (and, for sequential evaluation, in-place members)."""
    import torch

    if args.backend == "vllm":
        from copes.agents.vllm import VLLMPolicy

        for name, value in {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }.items():
            os.environ.setdefault(name, value)  # vllm-cpu: a small KV cache, no core pinning
        return VLLMPolicy.from_pretrained(
            args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len, lora_members=args.population_size,
            lora_rank=args.noise_rank,
        )  # fmt: skip
    from copes.agents.hf import HFPolicy

    policy = HFPolicy.from_pretrained(
        args.model, device=args.device, dtype="float32" if args.dtype == "float64" else args.dtype
    )
    if args.dtype == "float64":
        policy.model.to(torch.float64)
    return policy


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.backend == "vllm" and args.raw_generate:
        raise SystemExit("population_batch.py: --raw-generate times transformers' generate; "
                         "drop it with --backend vllm")  # fmt: skip
    if args.backend == "vllm" and args.noise != "lowrank":
        raise SystemExit(
            "population_batch.py: --backend vllm serves a batched population as LoRA adapters, "
            "which only the low-rank family has: add --noise lowrank (full-rank members batch "
            "on --backend hf)"
        )
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from copes.agents.policy import SamplingConfig
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES, LocalEvaluator
    from copes.train import TaskRollout

    policy = build_policy(args)
    tasks = synthetic_math_tasks("train", 500, seed=0)

    def make_env() -> Any:
        return tool_math_env(tasks=tasks[:1], max_turns=args.max_turns, invalid_penalty=0.2,
                             demonstrations=args.demonstrations)  # fmt: skip

    sampling = SamplingConfig(args.max_new_tokens, temperature=0.0)
    rollout = TaskRollout(make_env, tasks, args.tasks, 1, sampling, seed=0)
    n = args.population_size
    optimizer = CoPES(
        CoPESConfig(
            population_size=n, num_subspaces=args.num_subspaces, sigma=args.sigma,
            antithetic=True, seed=0, noise=args.noise, noise_rank=args.noise_rank,
        )
    )  # fmt: skip
    rank = optimizer.config.perturbation_rank
    episodes: dict[tuple[str, int, int], list[Any]] = {}

    def recorder(kind: str, step: int):
        def record(member: int, batch: Any) -> None:
            episodes[(kind, step, member)] = [
                (t.token_ids, t.reward, t.token_ids[: t.prompt_length], t.num_generated_tokens)
                for t in batch
            ]

        return record

    default_rows = n * args.tasks
    rows_tried = [r or default_rows for r in args.rows]
    if args.backend == "vllm" and rows_tried != [default_rows]:
        raise SystemExit(
            "population_batch.py: --rows is the transformers loop's; vLLM schedules rows itself"
        )
    runs: list[dict[str, Any]] = []
    try:
        LocalEvaluator(policy, rollout).evaluate(0, optimizer.ask(0)[:1])  # warm-up, untimed
        for step in range(args.steps):
            members = optimizer.ask(step)
            sequential = LocalEvaluator(policy, rollout, recorder("sequential", step))
            start = time.perf_counter()
            seq = sequential.evaluate(step, members)
            seq_seconds = time.perf_counter() - start
            for rows in rows_tried:
                batched = BatchedEvaluator(
                    policy,
                    rollout,
                    n,
                    batch_size=rows,
                    on_batch=recorder(f"batched-{rows}", step),
                    rank=rank,
                )
                start = time.perf_counter()
                bat = batched.evaluate(step, members)
                bat_seconds = time.perf_counter() - start
                same_episodes = [
                    a[0] == b[0]
                    for m in range(n)
                    for a, b in zip(
                        episodes[("sequential", step, m)],
                        episodes[(f"batched-{rows}", step, m)],
                        strict=True,
                    )
                ]
                raw: dict[str, float] = {}
                if args.raw_generate:  # the same first prompts, each row its episode's tokens
                    done = [e for m in range(n) for e in episodes[(f"batched-{rows}", step, m)]]
                    lengths = [max(1, e[3]) for e in done]
                    raw_seconds, raw_tokens = measure_generate(
                        policy, [e[2] for e in done], lengths, seed=step
                    )
                    batched_rate = sum(e[3] for e in done) / bat_seconds
                    raw_rate = raw_tokens / raw_seconds
                    # The stronger baseline: every row the mean length, so generate pads no
                    # finished row (the same rows and about the same tokens).
                    mean = max(1, round(sum(lengths) / len(lengths)))
                    even_seconds, even_tokens = measure_generate(
                        policy, [e[2] for e in done], [mean] * len(done), seed=step
                    )
                    raw = {"raw_generate_seconds": raw_seconds,
                           "raw_generate_tokens_per_second": raw_rate,
                           "batched_tokens_per_second": batched_rate,
                           "batched_over_raw": batched_rate / raw_rate,
                           "mean_length_generate_seconds": even_seconds,
                           "mean_length_generate_tokens_per_second": even_tokens / even_seconds,
                           "batched_over_mean_length": batched_rate
                           / (even_tokens / even_seconds)}  # fmt: skip
                runs.append(
                    {
                        **raw,
                        "step": step,
                        "rows": rows,
                        "sequential_seconds": seq_seconds,
                        "batched_seconds": bat_seconds,
                        "ratio": bat_seconds / seq_seconds,
                        "rewards_match": sum(
                            a.reward == b.reward for a, b in zip(seq, bat, strict=True)
                        )
                        / n,
                        "episodes_identical": sum(same_episodes) / len(same_episodes),
                        "generated_tokens": sum(r.generated_tokens for r in seq),
                        "reward_mean": sum(r.reward for r in seq) / n,
                    }
                )
                print(json.dumps(runs[-1]), flush=True)
                batched.close()
    finally:
        rollout.close()
        policy.close()
    by_rows = {}
    for rows in rows_tried:
        mine = [r for r in runs if r["rows"] == rows]
        seq_total = sum(r["sequential_seconds"] for r in mine)
        bat_total = sum(r["batched_seconds"] for r in mine)
        by_rows[rows] = {
            "ratio": bat_total / seq_total,
            "sequential_seconds_per_step": seq_total / len(mine),
            "batched_seconds_per_step": bat_total / len(mine),
            "rewards_match": sum(r["rewards_match"] for r in mine) / len(mine),
            "episodes_identical": sum(r["episodes_identical"] for r in mine) / len(mine),
        }
        if args.raw_generate:  # tokens/s of the batched steps against the raw generates
            tokens = sum(r["batched_tokens_per_second"] * r["batched_seconds"] for r in mine)
            raw_seconds = sum(r["raw_generate_seconds"] for r in mine)
            by_rows[rows]["batched_over_raw"] = (tokens / bat_total) / (tokens / raw_seconds)
            even_tokens = sum(
                r["mean_length_generate_tokens_per_second"] * r["mean_length_generate_seconds"]
                for r in mine
            )
            even_seconds = sum(r["mean_length_generate_seconds"] for r in mine)
            by_rows[rows]["batched_over_mean_length"] = (tokens / bat_total) / (
                even_tokens / even_seconds
            )
    best = min(by_rows, key=lambda rows: by_rows[rows]["ratio"])
    main_rows = default_rows if default_rows in by_rows else best
    result = {
        "benchmark": "population_batch",
        "command": "python benchmarks/population_batch.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "backend": args.backend,
        "dtype": args.dtype,
        "device": args.device,
        "population_size": n,
        "num_subspaces": args.num_subspaces,
        "noise": args.noise,
        "noise_rank": rank,
        "tasks_per_member": args.tasks,
        "steps": args.steps,
        "rows": main_rows,  # the figures below; default: every episode in one loop
        "ratio": by_rows[main_rows]["ratio"],
        "rewards_match": by_rows[main_rows]["rewards_match"],
        "episodes_identical": by_rows[main_rows]["episodes_identical"],
        "batched_over_raw": by_rows[main_rows].get("batched_over_raw"),
        "batched_over_mean_length": by_rows[main_rows].get("batched_over_mean_length"),
        "demonstrations": args.demonstrations,
        "best_rows": best,
        "best_ratio": by_rows[best]["ratio"],
        "by_rows": by_rows,
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
        f"batched / sequential evaluation time: {result['ratio']:.3f} at {main_rows} rows "
        f"(best: {result['best_ratio']:.3f} at {best}); rewards match "
        f"{result['rewards_match']:.3f}, identical episodes {result['episodes_identical']:.3f}; "
        f"wrote {out}"
    )
    return result


LOAD_BEFORE = list(os.getloadavg())

if __name__ == "__main__":
    main()
