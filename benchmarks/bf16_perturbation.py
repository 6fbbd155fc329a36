"""How much of an ES member's noise survives bfloat16 weights, per sigma and parameter group.

A member's working weights are `bf16(w + sign * sigma * eps)` where w is already bfloat16
(`copes.weights.WeightSpace.perturb`), so a coordinate whose step is below half a
bfloat16 ulp of its weight does not move, and one that moves moves by whole ulps. This
applies one member, exactly as training does, and compares the realised change with the
intended `sigma * eps`:

- `moved`: the share of coordinates whose weight changed;
- `norm_ratio`: |realised| / |intended| (1 = all of it arrived, 0 = none);
- `cosine`: cos(realised, intended) (the direction the rewards are credited to).

Groups: embeddings, norms (1-D weights), attention and MLP matrices. Writes JSON.

    python benchmarks/bf16_perturbation.py --model smollm2-135m --sigmas 5e-4 1e-3 2e-3 4e-3
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

import torch


def group_of(name: str, tensor: torch.Tensor) -> str:
    if tensor.dim() == 1:
        return "norms"
    if "embed" in name or "lm_head" in name:
        return "embeddings"
    if "attn" in name or "attention" in name:
        return "attention"
    return "mlp"


def measure(model: torch.nn.Module, sigma: float, seed: int) -> dict[str, dict[str, float]]:
    """One member (full space, seed `seed`) at `sigma`: realised against intended, per group."""
    from copes.weights import Perturbation, WeightSpace

    space = WeightSpace.from_module(model)
    before = {n: t.detach().float().clone() for n, t in space.named_tensors()}
    space.perturb(Perturbation(member=0, seed=seed, sigma=sigma))
    sums: dict[str, dict[str, float]] = {}
    for name, tensor in space.named_tensors():
        realised = tensor.detach().float() - before[name]
        space_probe = WeightSpace([(name, before[name].clone())])  # fp32: nothing rounded away
        space_probe.perturb(Perturbation(member=0, seed=seed, sigma=sigma))
        intended = space_probe.named_tensors()[0][1] - before[name]
        g = sums.setdefault(group_of(name, tensor), dict.fromkeys(
            ("moved", "count", "dot", "realised_sq", "intended_sq"), 0.0))  # fmt: skip
        g["moved"] += float((realised != 0).sum())
        g["count"] += realised.numel()
        g["dot"] += float((realised * intended).sum())
        g["realised_sq"] += float((realised * realised).sum())
        g["intended_sq"] += float((intended * intended).sum())
    space.restore()
    total = {k: sum(g[k] for g in sums.values()) for k in next(iter(sums.values()))}
    return {name: _ratios(g) for name, g in {**sums, "all": total}.items()}


def _ratios(g: dict[str, float]) -> dict[str, float]:
    norm = (g["realised_sq"] * g["intended_sq"]) ** 0.5
    return {
        "coordinates": int(g["count"]),
        "moved": g["moved"] / g["count"],
        "norm_ratio": (g["realised_sq"] / g["intended_sq"]) ** 0.5,
        "cosine": g["dot"] / norm if norm else 0.0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sigmas", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/bf16_perturbation.json")
    args = p.parse_args(argv)
    from copes.agents.loading import load_policy

    start = time.perf_counter()
    policy = load_policy(args.model, device="cpu", dtype=args.dtype)
    by_sigma = {}
    for sigma in args.sigmas:
        by_sigma[f"{sigma:g}"] = measure(policy.model, sigma, args.seed)
        a = by_sigma[f"{sigma:g}"]["all"]
        print(f"sigma {sigma:g}: moved {a['moved']:.3f}, norm ratio {a['norm_ratio']:.3f}, "
              f"cosine {a['cosine']:.3f}", flush=True)  # fmt: skip
    result = {
        "benchmark": "bf16_perturbation",
        "command": "python benchmarks/bf16_perturbation.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        "by_sigma": by_sigma,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
