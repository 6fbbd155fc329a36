"""Peak memory of one training step of ES, CoPES, GRPO and LoRA-GRPO, measured and in theory.

Measured: every (optimizer, trajectory length) pair runs in a fresh Python process (so no
allocation of one can hide in another's peak), on the same model (`--model`, default the
tiny agent). The process loads the model, builds the optimizer, then runs exactly one
training step whose rollouts are L-token trajectories: a real ToolMath prompt continued by
sampled tokens up to L in all (`model.generate` with min = max new tokens, so every
optimizer sees the same length), with fixed mixed 0/1 rewards so every update is non-zero.
A thread samples the process's resident memory (/proc/self/statm) every 2 ms during the
step; `ru_maxrss` (the lifetime peak) is recorded too. The figure of merit is the step's
peak minus the resident memory just before it: what the optimizer adds on top of the loaded
model and the Python runtime.

The allocator matters on CPU. Generation grows the KV cache by re-allocating every layer's
keys and values each token; with glibc's default dynamic mmap threshold the freed blocks stay
in the heap, and the resident set of a 1,024-token rollout grows ~10x past the tensors alive
(measured: +594 MiB vs +47 MiB for the same ES step). `--malloc fixed` (the default) sets
MALLOC_MMAP_THRESHOLD_=65536 in the children, so large tensors are returned to the OS when
freed and RSS tracks what the optimizer really holds; `--malloc default` measures what an
unconfigured process sees.

Theory: `copes.memory` for a Qwen3-4B-sized model (the stand-in for the paper's
Qwen3.5-4B; bf16, batch 1, 8K-128K context) set against the paper's claim that CoPES needs
under 1/8 of full-parameter GRPO's GPU memory.

    python benchmarks/memory.py                           # 4 optimizers x 3 lengths
    python benchmarks/memory.py --lengths 64 128 --optimizers es grpo   # a small check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

OPTIMIZERS = ("es", "copes", "grpo", "lora-grpo")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
MMAP_THRESHOLD = 65536  # bytes: larger allocations are mmap'ed, and unmapped when freed


# ---------------------------------------------------------------------- the child process
class RssSampler:
    """Samples this process's resident set size in a background thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def fixed_length_rollout(policy: Any, length: int, episodes: int, seed: int) -> Any:
    """A `RolloutFn` whose trajectories are a real prompt plus sampled tokens, `length` in all."""
    import torch

    from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks

    task = synthetic_math_tasks("validation", 1, seed=seed)[0]
    env = tool_math_env(tasks=[task])
    _, info = env.reset(options={"task": task})
    env.close()
    prompt = policy.chat.encode_prompt(info["messages"], None)[: length // 2]
    new = length - len(prompt)
    calls = {"n": 0}

    def rollout(policy: Any, step: int, member: int | None = None) -> RolloutBatch:
        rows = episodes
        ids = torch.tensor([prompt] * rows)
        torch.manual_seed(seed + calls["n"])
        start = time.perf_counter()
        with torch.no_grad():
            out = policy.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                max_new_tokens=new, min_new_tokens=new, output_logits=True,
                return_dict_in_generate=True, pad_token_id=policy.tokenizer.pad_token_id,
            )  # fmt: skip
        gen = out.sequences[:, len(prompt) :]
        logp = torch.stack(
            [torch.log_softmax(s.float(), -1).gather(-1, gen[:, t, None])[:, 0]
             for t, s in enumerate(out.logits)], dim=1,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        call = calls["n"]
        calls["n"] += 1
        trajectories = []
        for row in range(rows):  # mixed rewards: GRPO groups and ES members both get signal
            reward = float((row + call) % 3 == 0)
            trajectories.append(Trajectory(
                task_id=task.id, messages=[], token_ids=prompt + gen[row].tolist(),
                generated_mask=[0] * len(prompt) + [1] * new,
                logprobs=[0.0] * len(prompt) + logp[row].tolist(),
                prompt_length=len(prompt), reward=reward, correct=bool(reward),
            ))  # fmt: skip
        stats = RolloutStats(generation_seconds=seconds, generated_tokens=rows * new)
        return RolloutBatch(trajectories, stats)

    return rollout


def measure(optimizer: str, length: int, model: str, episodes: int, population: int) -> dict:
    """One training step of `optimizer` at `length` tokens, in this (fresh) process."""
    import torch

    torch.set_num_threads(1)
    from copes.agents.hf import HFPolicy
    from copes.train import TrainConfig, build_optimizer, optimizer_config

    rss_start = RssSampler.rss()
    policy = HFPolicy.from_pretrained(model, device="cpu")
    if length > policy.max_context:
        raise SystemExit(f"length {length} exceeds the model's context {policy.max_context}")
    overrides: dict[str, Any]
    if optimizer in ("es", "copes"):  # members run one after another: N does not change the peak
        overrides = {"population_size": population, "sigma": 0.02, "learning_rate": 0.01,
                     "num_subspaces": 1 if optimizer == "es" else 2}  # fmt: skip
    else:
        overrides = {"learning_rate": 1e-4, "micro_batch_size": episodes, "group_size": episodes}
    config = TrainConfig(optimizer=optimizer, model=model, steps=1)
    opt = build_optimizer(config, optimizer_config(config, **overrides), policy)
    if optimizer in ("es", "copes"):
        policy.weights()  # the fp32 master copy exists from the start of training
    rollout = fixed_length_rollout(policy, length, episodes, seed=0)
    rss_before = RssSampler.rss()
    start = time.perf_counter()
    with RssSampler() as sampler:
        stats = opt.step(policy, rollout)
    return {
        "optimizer": optimizer,
        "length": length,
        "episodes_per_rollout": episodes,
        "population": population if optimizer in ("es", "copes") else None,
        "parameters": sum(p.numel() for p in policy.model.parameters()),
        "trainable": sum(p.numel() for p in policy.model.parameters() if p.requires_grad),
        "rss_at_start_mib": rss_start / MIB,
        "rss_before_step_mib": rss_before / MIB,
        "peak_during_step_mib": sampler.peak / MIB,
        "step_increase_mib": (sampler.peak - rss_before) / MIB,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB,
        "step_seconds": time.perf_counter() - start,
        "generated_tokens": stats.generated_tokens,
    }


# ---------------------------------------------------------------------- the parent
def run_child(args: argparse.Namespace, optimizer: str, length: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", optimizer, str(length), "--model", args.model,
           "--episodes", str(args.episodes), "--population", str(args.population)]  # fmt: skip
    env = {**os.environ}
    if args.malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"optimizer": optimizer, "length": length,
                "error": (proc.stderr or proc.stdout)[-1500:]}  # fmt: skip
    return json.loads(lines[-1])


def theory(seq_lens: list[int]) -> dict[str, Any]:
    from copes.memory import GIB, QWEN3_4B, format_memory_table, memory_table

    variants = {
        "batch 1": {},
        "batch 1, chunked GRPO loss (8K-token logits chunks)": {"logits_chunk_tokens": 8192},
        "CoPES generating 8 sequences at once": {"generation_batch_size": 8},
    }
    out = {}
    for name, kwargs in variants.items():
        rows = memory_table(QWEN3_4B, seq_lens, batch_size=1, **kwargs)
        out[name] = {
            "rows_gib": [
                {k: (v / GIB if k not in ("seq_len", "grpo/copes") else v) for k, v in r.items()}
                for r in rows
            ],
            "claim_copes_below_one_eighth": [r["grpo/copes"] > 8 for r in rows],
            "markdown": format_memory_table(rows),
        }
    return {"model": "qwen3-4b (stand-in for Qwen3.5-4B), bf16", "variants": out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--episodes", type=int, default=4, help="trajectories per rollout call")
    p.add_argument("--population", type=int, default=2, help="ES/CoPES N (peak is N-free)")
    p.add_argument("--jobs", type=int, default=2, help="child processes at once")
    p.add_argument(
        "--malloc",
        choices=["fixed", "default"],
        default="fixed",
        help="glibc mmap threshold in the children: fixed 64 KiB or glibc's dynamic",
    )
    p.add_argument("--theory-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--out", default="benchmarks/results/memory.json")
    p.add_argument("--child", nargs=2, metavar=("OPTIMIZER", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = measure(args.child[0], int(args.child[1]), args.model, args.episodes,
                         args.population)  # fmt: skip
        print(json.dumps(result))
        return result
    if args.model == "tiny":  # build (or find) the agent once, not in every child at once
        from copes.agents.models import resolve_model_path

        args.model = resolve_model_path("tiny")
    pairs = [(o, n) for n in args.lengths for o in args.optimizers]
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        measured = list(pool.map(lambda pair: run_child(args, *pair), pairs))
    result = {
        "benchmark": "memory",
        "command": "python benchmarks/memory.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "malloc": args.malloc,
        "malloc_mmap_threshold": MMAP_THRESHOLD if args.malloc == "fixed" else "glibc dynamic",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "measured": measured,
        "theory": theory(args.theory_lengths),
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'optimizer':>10} {'length':>6} {'before':>8} {'peak':>8} {'step +':>8}  (MiB)")
    for r in measured:
        if "error" in r:
            print(f"{r['optimizer']:>10} {r['length']:>6}  FAILED: {r['error'][-300:]}")
            continue
        print(f"{r['optimizer']:>10} {r['length']:>6} {r['rss_before_step_mib']:8.1f} "
              f"{r['peak_during_step_mib']:8.1f} {r['step_increase_mib']:8.1f}")  # fmt: skip
    print(result["theory"]["variants"]["batch 1"]["markdown"])
    print(f"wrote {out} in {result['wall_seconds']} s")
    return result


if __name__ == "__main__":
    main()
