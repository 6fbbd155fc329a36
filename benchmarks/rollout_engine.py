"""copes' episodes on a real model against their own engine's plain generation.

For one backend (`--backend hf` in the main environment, `--backend vllm` where vLLM is
installed), on SmolLM2-135M-Instruct by default, reasoning-gym `products` with 2
demonstrations at temperature 1:

1. **copes**: the tasks x samples episodes through `rollout` (the one episode loop, tools and
   grading included) in batches of `--batch-episodes`, as copes-eval plays them; tokens/s =
   generated tokens / seconds of those rollouts.
2. **plain**: the same engine, from the same first prompts, generating as many tokens as the
   episodes did in all their turns, in the same batches. vLLM: a fresh `vllm.LLM` as a user
   starts it (vLLM's defaults, packed CPU weights included; the same KV space as copes'
   engine), each row exactly its episode's count (`min_tokens = max_tokens = n_i`); the same
   with its engine core in this process (`plain_in_process`); and the same requests on copes'
   own engine, its layout and its engine core (`plain_same_engine`);
   transformers: one `model.generate` a batch with the static KV cache, every row at the
   batch's mean count (`generate` has no per-row lengths; `--exact` also measures rows at
   their own counts, which decode until the batch's longest row ends).
3. **end to end** (`--e2e`): copes-eval on the same tasks in a subprocess: its generated
   tokens over its own evaluation seconds, and the peak RSS of its whole process tree
   (`peak_rss.py`).

The ratio copes / plain is the figure of merit (issue 50's target: >= 0.8). Run nothing else
on the machine meanwhile.

    python benchmarks/rollout_engine.py --backend hf --e2e \\
        --out benchmarks/results/rollout_engine-hf.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _raw_generate helper


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("hf", "vllm"), required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--benchmark", default="rg:products")
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="episodes per task")
    parser.add_argument("--demonstrations", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-episodes", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="hf: float32 or bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e", action="store_true", help="also copes-eval end to end")
    parser.add_argument(
        "--exact", action="store_true",
        help="hf: also the plain baseline at each row's own length (slow: padding steps)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-access", action="store_true",
        help="vllm: start copes' engine as copes-train does (weights ES can change in place: "
        "unpacked on a CPU) instead of as copes-eval does (vLLM's own layout)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="JSON file to write")
    return parser.parse_args(argv)


def copes_rollouts(policy: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The episodes through copes' loop: (seconds, first prompts, tokens generated per row)."""
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.envs.core import EpisodeRules
    from copes.registry import get_benchmark
    from copes.seeding import derive_seed

    benchmark = get_benchmark(args.benchmark)
    tasks = benchmark.load_tasks(limit=args.tasks)
    items = [task for task in tasks for _ in range(args.samples)]
    batches = [
        items[i : i + args.batch_episodes] for i in range(0, len(items), args.batch_episodes)
    ]
    rules = EpisodeRules(max_turns=args.max_turns)
    envs = [
        benchmark.make_env(tasks, rules=rules, demonstrations=args.demonstrations)
        for _ in range(max(len(b) for b in batches))
    ]
    sampling = SamplingConfig(args.max_new_tokens, temperature=args.temperature)
    prompts: list[list[list[int]]] = []
    lengths: list[list[int]] = []
    seconds = 0.0
    tool_calls = correct = 0
    try:
        for index, batch in enumerate(batches):
            seed = derive_seed("rollout_engine", args.seed, index)
            start = time.perf_counter()
            trajectories = rollout(
                policy, envs[: len(batch)], replace(sampling, seed=seed),
                options=[{"task": task} for task in batch],
            )  # fmt: skip
            seconds += time.perf_counter() - start
            prompts.append([list(t.token_ids[: t.prompt_length]) for t in trajectories])
            lengths.append([t.num_generated_tokens for t in trajectories])
            tool_calls += sum(t.tool_calls > 0 for t in trajectories)
            correct += sum(bool(t.correct) for t in trajectories)
    finally:
        for env in envs:
            env.close()
    tokens = sum(map(sum, lengths))
    return {
        "episodes": len(items),
        "seconds": seconds,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "episodes_calling_python": tool_calls,
        "correct": correct,
        "mean_prompt_tokens": sum(len(p) for b in prompts for p in b) / len(items),
        "_prompts": prompts,
        "_lengths": lengths,
    }


def plain_same_engine(
    policy: Any, prompts: list[list[list[int]]], lengths: list[list[int]], args: Any
) -> dict[str, float]:
    """Plain generation on copes' own engine (its layout, its engine core), the same rows and
    lengths in the same batches: what copes' loop adds on top of its engine."""
    from vllm import SamplingParams

    seconds, tokens = 0.0, 0
    for index, (batch, counts) in enumerate(zip(prompts, lengths, strict=True)):
        requests = [
            (prompt, SamplingParams(temperature=args.temperature, max_tokens=n, min_tokens=n,
                                    ignore_eos=True, seed=args.seed + 1000 * index + row), None)
            for row, (prompt, n) in enumerate(zip(batch, counts, strict=True))
        ]  # fmt: skip
        start = time.perf_counter()
        outputs = policy.requests.run(requests)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "generated_tokens": tokens, "tokens_per_s": tokens / seconds}


def plain_vllm(
    source: str,
    space: int,
    prompts: list[list[list[int]]],
    lengths: list[list[int]],
    args: Any,
    in_process: bool = False,
) -> dict[str, float]:
    """A fresh engine with vLLM's defaults (the same KV space), the same rows and lengths;
    `in_process`: its engine core in this process."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from copes.agents.vllm.policy import multiprocessing_setting

    with multiprocessing_setting(not in_process):
        llm = LLM(source, seed=args.seed, kv_cache_memory_bytes=space)
    try:
        warm = [TokensPrompt(prompt_token_ids=prompts[0][0])]
        llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)
        seconds, tokens = 0.0, 0
        for index, (batch, counts) in enumerate(zip(prompts, lengths, strict=True)):
            params = [
                SamplingParams(
                    temperature=args.temperature,
                    max_tokens=n,
                    min_tokens=n,
                    ignore_eos=True,
                    seed=args.seed + 1000 * index + row,
                )
                for row, n in enumerate(counts)
            ]
            requests = [TokensPrompt(prompt_token_ids=p) for p in batch]
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            got = [len(o.outputs[0].token_ids) for o in outputs]
            if got != counts:
                raise RuntimeError(f"vLLM generated {got}, expected {counts}")
            tokens += sum(got)
    finally:
        llm.llm_engine.engine_core.shutdown()
        if in_process:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
    return {"seconds": seconds, "generated_tokens": tokens, "tokens_per_s": tokens / seconds}


def plain_hf(policy: Any, prompts: list[list[list[int]]], lengths: list[list[int]], args: Any):
    """One `model.generate` a batch with transformers' static KV cache, every row at the
    batch's mean length (as issue 50 measured it): `generate` has no per-row lengths, and
    rows at their own lengths would keep the batch decoding until its longest row ends (a
    wasted step for every shorter row; measured here too, `exact_lengths`)."""
    from _raw_generate import measure_generate

    def run(exact: bool, cache: str | None) -> dict[str, float]:
        seconds, tokens = 0.0, 0
        for index, (batch, counts) in enumerate(zip(prompts, lengths, strict=True)):
            mean = max(1, round(sum(counts) / len(counts)))
            rows = [max(1, n) for n in counts] if exact else [mean] * len(counts)
            spent, made = measure_generate(policy, batch, rows, args.seed + index, cache)
            seconds, tokens = seconds + spent, tokens + made
        return {"seconds": seconds, "generated_tokens": tokens, "tokens_per_s": tokens / seconds}

    plain = run(exact=False, cache="static")
    plain["exact_lengths_default_cache"] = run(exact=True, cache=None) if args.exact else None
    return plain


def end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    """copes-eval on the same tasks, under `peak_rss.py`."""
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as folder:
        out, rss = Path(folder) / "eval", Path(folder) / "rss.json"
        command = [
            sys.executable, "-m", "copes.evaluation.cli", "--model", args.model,
            "--backend", args.backend, "--benchmarks", args.benchmark, "--limit",
            str(args.tasks), "-n", str(args.samples), "--pass-k", "1",
            "--temperature", str(args.temperature), "--demonstrations", str(args.demonstrations),
            "--max-turns", str(args.max_turns), "--max-new-tokens", str(args.max_new_tokens),
            "--batch-episodes", str(args.batch_episodes), "--seed", str(args.seed),
            "--quiet", "--out", str(out),
        ]  # fmt: skip
        if args.backend == "hf":
            command += ["--dtype", args.dtype, "--device", "cpu"]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(here / "peak_rss.py"), "--out", str(rss), "--", *command],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"copes-eval failed:\n{done.stderr[-2000:]}")
        wall = time.perf_counter() - start
        report = json.loads((out / "report.json").read_text())
        samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        memory = json.loads(rss.read_text())
    tokens = sum(s["generated_tokens"] for s in samples)
    return {
        "command": command,
        "wall_seconds_with_model_load": wall,
        "evaluation_seconds": report["seconds"],
        "generated_tokens": tokens,
        "tokens_per_s": tokens / report["seconds"],
        "peak_tree_rss_gib": memory["peak_tree_rss_gib"],
        "pass_at_1": {b: r["pass_at_k"]["1"] for b, r in report["benchmarks"].items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from copes.agents.loading import load_policy
    from copes.agents.tiny import machine_info

    policy = load_policy(
        args.model, backend=args.backend, device="cpu", seed=args.seed,
        dtype=args.dtype if args.backend == "hf" else None, rows=args.batch_episodes,
        weight_access=args.weight_access,
    )  # fmt: skip
    warm = argparse.Namespace(**{**vars(args), "tasks": 2, "samples": 2})
    copes_rollouts(policy, warm)  # sandbox sessions, grader workers, first-call costs
    copes = copes_rollouts(policy, args)
    prompts, lengths = copes.pop("_prompts"), copes.pop("_lengths")
    extra: dict[str, Any] = {}
    if args.backend == "vllm":
        space = policy.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
        extra["copes_engine_in_process"] = policy.in_process
        same = plain_same_engine(policy, prompts, lengths, args)
        extra["plain_same_engine"] = same
        extra["ratio_copes_to_plain_same_engine"] = copes["tokens_per_s"] / same["tokens_per_s"]
        policy.close()  # one engine at a time
        plain = plain_vllm(policy.source, space, prompts, lengths, args)
        inside = plain_vllm(policy.source, space, prompts, lengths, args, in_process=True)
        extra["plain_in_process"] = inside
        extra["ratio_copes_to_plain_in_process"] = copes["tokens_per_s"] / inside["tokens_per_s"]
    else:
        plain = plain_hf(policy, prompts, lengths, args)
        policy.close()
    result: dict[str, Any] = {
        "backend": args.backend,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "e2e")},
        "machine": {
            **machine_info(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "copes": copes,
        "plain": plain,
        "ratio_copes_to_plain": copes["tokens_per_s"] / plain["tokens_per_s"],
        **extra,
    }
    if args.e2e:
        result["end_to_end"] = end_to_end(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=2))
    return result


if __name__ == "__main__":
    main()
