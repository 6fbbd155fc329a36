"""float32 against bfloat16 on a real model on this CPU: generation speed side by side, and
how much of an ES/CoPES member's perturbation survives bf16 rounding.

1. **Speed.** The same batch of real prompts (GSM8K test questions in ToolMath's first
   message, with the recommended demonstrations) is generated greedily in float32 and in
   bfloat16, alternating, `--repeats` times each; every row makes exactly `--new-tokens`
   tokens (eos is suppressed), so both dtypes do the same work. Reported: tokens/s of each
   (the fastest repeat) and bf16/fp32, beside the bf16/fp32 time of the matrix product that
   `--dtype auto` measures (`copes.agents.loading.cpu_auto_dtype`).
2. **Training's matrix products.** A GRPO backward runs each linear layer's product in three
   layouts: the forward (x W^T), the input gradient (g W) and the weight gradient (g^T x).
   Each is timed in both dtypes at the shape of SmolLM2's MLP (`--tokens` x 576 by 576 x
   1,536), best of 3, one call each: GFLOP/s per layout and dtype. A CPU without native bf16
   runs some layouts on torch's fallback kernel.
3. **Perturbation survival.** ES keeps an fp32 master and writes `bf16(master + sigma_k eps)`
   into the bf16 weights (`copes.weights`). For each sigma and K, one member of
   one subspace is applied to the real weights, and the change that reached the bf16
   weights is compared with the intended one over the member's coordinates: the share of
   coordinates whose bf16 value changed at all, and ||realized|| / ||intended|| and their
   cosine (1.0: the perturbation arrived whole).

    python benchmarks/real_model_dtype.py --model smollm2-135m \\
        --out benchmarks/results/real_model_dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).parent / "results" / "real_model_dtype.json"
SIGMAS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def prompts(policy, count: int, demonstrations: int, data_dir: str) -> list[list[int]]:
    from copes.registry import get_benchmark

    benchmark = get_benchmark("gsm8k")
    tasks = benchmark.load_tasks(data_dir=data_dir, limit=count)
    env = benchmark.make_env(tasks, demonstrations=demonstrations)
    try:
        out = []
        for task in tasks:
            _, info = env.reset(options={"task": task})
            out.append(policy.chat.encode_prompt(info["messages"]))
        return out
    finally:
        env.close()


def generation_seconds(model, tokenizer, batch: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    return time.perf_counter() - start


def survival(model, sigma: float, num_subspaces: int, seed: int = 7) -> dict[str, float]:
    """One member's realized vs intended perturbation on bf16 weights with an fp32 master."""
    from copes.weights import (
        Perturbation,
        Subspace,
        WeightSpace,
        sigma_for_subspaces,
    )

    space = WeightSpace.from_module(model)
    sigma_k = sigma_for_subspaces(sigma, num_subspaces)
    member = Perturbation(0, seed, Subspace(11, num_subspaces, 0), 1, sigma_k)
    before = {n: t.detach().clone() for n, t in space.named_tensors()}
    space.perturb(member)
    inside = changed = 0
    realized_sq = intended_sq = dot = 0.0
    masters = space.master_state()
    for name, tensor in space.named_tensors():
        mask = space.subspace_mask(name, member.subspace)
        master = masters[name].to(torch.float32)
        after = tensor.detach().float()
        # The intended change: master + sigma_k eps minus the master, in fp32 (what an fp32
        # model would get), from the same seeds: perturb an fp32 copy.
        exact = WeightSpace([(name, master.clone())])
        exact._entries[0].offset = space._entries[space.names.index(name)].offset
        exact._entries[0].row_offset = space._entries[space.names.index(name)].row_offset
        exact.perturb(member)
        intended = (exact.named_tensors()[0][1] - master)[mask]
        realized = (after - before[name].float())[mask]
        inside += int(mask.sum())
        changed += int((realized != 0).sum())
        realized_sq += float((realized.double() ** 2).sum())
        intended_sq += float((intended.double() ** 2).sum())
        dot += float((realized.double() * intended.double()).sum())
    space.restore()
    assert all(torch.equal(t, before[n]) for n, t in space.named_tensors())  # exact restore
    return {
        "sigma": sigma,
        "num_subspaces": num_subspaces,
        "sigma_k": sigma_k,
        "coordinates_in_member": inside,
        "share_changed": changed / inside,
        "norm_ratio": (realized_sq / intended_sq) ** 0.5,
        "cosine": dot / (realized_sq * intended_sq) ** 0.5,
    }


def products(tokens: int, hidden: int = 576, inner: int = 1536) -> dict[str, dict[str, float]]:
    """GFLOP/s of a linear layer's three training products, per dtype (best of 3)."""
    out: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        w = torch.randn(inner, hidden, generator=gen).to(dtype)
        g = torch.randn(tokens, inner, generator=gen).to(dtype)
        layouts = {"forward x@W.T": (x, w.t()), "input grad g@W": (g, w),
                   "weight grad g.T@x": (g.t(), x)}  # fmt: skip
        rates = {}
        for name, (left, right) in layouts.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                torch.mm(left, right)
                best = min(best, time.perf_counter() - start)
            rates[name] = round(2 * tokens * hidden * inner / best / 1e9, 2)
        out[str(dtype).removeprefix("torch.")] = rates
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data-dir", default=str(Path(__file__).parents[1] / ".." / "shared" /
                                                  "benchmarks"))  # fmt: skip
    parser.add_argument("--batch", type=int, default=32, help="sequences generated at once")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--demonstrations", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the products timed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    from copes.agents.hf.policy import HFPolicy
    from copes.agents.loading import _matmul_seconds, native_bf16_cpu

    policies = {d: HFPolicy.from_pretrained(args.model, device="cpu", dtype=d)
                for d in ("float32", "bfloat16")}  # fmt: skip
    batch = prompts(policies["float32"], args.batch, args.demonstrations, args.data_dir)
    seconds: dict[str, list[float]] = {d: [] for d in policies}
    load = os.getloadavg()[0]
    for _ in range(args.repeats):
        for dtype, policy in policies.items():
            seconds[dtype].append(
                generation_seconds(policy.model, policy.tokenizer, batch, args.new_tokens)
            )
    tokens = args.batch * args.new_tokens
    speed = {d: tokens / min(s) for d, s in seconds.items()}
    matmul = _matmul_seconds(torch.bfloat16) / _matmul_seconds(torch.float32)
    result = {
        "model": args.model,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "native_bf16": native_bf16_cpu(),
            "torch": torch.__version__,
            "load_average_at_start": round(load, 2),
        },
        "generation": {
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "prompt_tokens_mean": sum(map(len, batch)) / len(batch),
            "demonstrations": args.demonstrations,
            "repeats": args.repeats,
            "seconds": seconds,
            "tokens_per_second": speed,
            "bf16_over_fp32_speed": speed["bfloat16"] / speed["float32"],
        },
        "matmul_bf16_over_fp32_time": matmul,
        "training_products_gflops": products(args.tokens),
        "perturbation_survival_bf16": [
            survival(policies["bfloat16"].model, sigma, k) for k in (1, 4) for sigma in SIGMAS
        ],
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
