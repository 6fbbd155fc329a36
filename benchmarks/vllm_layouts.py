"""What vLLM's CPU engine gives for each way copes can start it: plain batched generation.

Every configuration is a fresh `vllm.LLM` on the same model, generating `--rows` rows of
`--tokens` tokens each (`min_tokens = max_tokens`, EOS ignored) from prompts that share a
`--prefix`-token prefix, twice; tokens/s of each repeat. The configurations:

- `engine`: its engine core in this process (`in-process`, copes' CPU default) or in vLLM's
  own process (`process`, vLLM's default);
- `weights`: vLLM's own packed CPU weights (`packed`, copes-eval) or plain tensors that ES
  changes in place (`unpacked`, copes-train; `copes.agents.vllm.worker`);
- `graph`: eager PyTorch (copes' CPU default) or vLLM's torch.compile (`compiled`, vLLM's).

Each configuration runs in its own subprocess (one engine per process, started the same
way). Run nothing else on the machine meanwhile.

    python benchmarks/vllm_layouts.py --out benchmarks/results/vllm_layouts-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = [
    ("process", "packed", "compiled"),  # vLLM as a user starts it
    ("in-process", "packed", "compiled"),
    ("in-process", "packed", "eager"),  # copes-eval on a CPU
    ("in-process", "unpacked", "compiled"),
    ("in-process", "unpacked", "eager"),  # copes-train on a CPU
    ("process", "unpacked", "eager"),  # copes-train before the engine moved in-process
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=400, help="tokens every prompt shares")
    parser.add_argument("--suffix", type=int, default=46, help="tokens of each row's own")
    parser.add_argument("--kv-cache-gib", type=float, default=0.8)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's config
    parser.add_argument("--out", default=None, help="JSON file to write")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, engine: str, weights: str, graph: str) -> dict[str, Any]:
    """One configuration, in this process."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import copes.agents.vllm.worker as worker
    from copes.agents.models import resolve_model_path
    from copes.agents.vllm.policy import EXTENSION, multiprocessing_setting

    options: dict[str, Any] = {
        "dtype": args.dtype,
        "seed": 0,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        "enable_prefix_caching": True,
        "enforce_eager": graph == "eager",
    }
    if weights == "unpacked":  # copes' loader, registered where its worker extension loads
        options["load_format"] = worker.UNPACKED_LOAD_FORMAT
        options["worker_extension_cls"] = EXTENSION
    start = time.perf_counter()
    with multiprocessing_setting(engine == "process"):
        llm = LLM(resolve_model_path(args.model), **options)
    start_seconds = time.perf_counter() - start
    draw = random.Random(0)
    prefix = [draw.randrange(100, 40_000) for _ in range(args.prefix)]
    suffixes = [[draw.randrange(100, 40_000) for _ in range(args.suffix)] for _ in range(args.rows)]
    prompts = [TokensPrompt(prompt_token_ids=prefix + suffix) for suffix in suffixes]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    repeats = []
    for repeat in range(2):
        params = [
            SamplingParams(temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens,
                           ignore_eos=True, seed=1000 * repeat + row)
            for row in range(args.rows)
        ]  # fmt: skip
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        repeats.append(tokens / seconds)
    return {
        "engine": engine,
        "weights": weights,
        "graph": graph,
        "start_seconds": start_seconds,
        "tokens_per_s": repeats,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(args, *args.one.split(","))))
        return {}
    from copes.agents.tiny import machine_info

    results = []
    for config in CONFIGS:
        command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--one", ",".join(config)]
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"{config} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(lines[-1]))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("one", "out")},
        "machine": machine_info(),
        "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
