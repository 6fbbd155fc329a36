"""Perturb + restore of one ES/CoPES member, and a step's update, on a real model: the weight
engine as shipped beside its two predecessors, side by side in one run, with the weights
compared bit for bit:

- shipped: on a CPU the step's whole partition is drawn once (int32, kept while 4 bytes x d
  <= `KEEP_PARTITION_BYTES`) and serves every member and the update; fp32 weights add in
  place (`index_add_`);
- previous (2026-12-05 to 12-07): only the current subspace's positions kept, for the next
  member of that subspace; the update draws each chunk's permutation once; gather-add-scatter;
- redrawing (before 2026-12-05): every member and every update term draws every chunk's
  permutation anew.

On a CPU drawing a permutation of 1M coordinates costs several times its noise, so with K > 1
most of a member's time went there.

    python benchmarks/weight_ops.py --model smollm2-135m      # 134.5M parameters, bfloat16
    python benchmarks/weight_ops.py --model tiny --dtype float32

Target (issue 39): perturb + restore of a member at 135M parameters well under a second.
Writes benchmarks/results/weight_ops.json (or --out).
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
from typing import Any

DEFAULT_OUT = Path(__file__).parent / "results" / "weight_ops.json"
TARGET_SECONDS = 1.0


def _gather_add_scatter(flat: Any, index: Any, values: Any) -> None:
    flat[index] = (flat[index].float() + values).to(flat.dtype)


def previous_space(named: list, **kwargs: Any) -> Any:
    """The engine of 2026-12-05: the current subspace's positions kept, gather-add-scatter."""
    from copes.weights import WeightSpace

    class Previous(WeightSpace):
        _add_at = staticmethod(_gather_add_scatter)

    return Previous(named, keep_partition_bytes=0, **kwargs)


def redrawing_space(named: list, **kwargs: Any) -> Any:
    """A `WeightSpace` that draws every chunk's permutation anew for every member and every
    update term (the engine before positions were kept)."""
    from copes.weights import WeightSpace

    class Redrawing(WeightSpace):
        _add_at = staticmethod(_gather_add_scatter)

        def _positions(self, entry, chunk, start, end, subspace, order=None):  # type: ignore[override]
            return super()._positions(entry, chunk, start, end, subspace)

        def _member_positions(self, entry, chunk, start, end, subspace):  # type: ignore[override]
            return self._positions(entry, chunk, start, end, subspace)

        def _update_positions(self, entry, chunk, start, end, subspace, orders):  # type: ignore[override]
            return self._positions(entry, chunk, start, end, subspace)

    return Redrawing(named, keep_partition_bytes=0, **kwargs)


ENGINES = {"shipped": None, "previous": previous_space, "redrawing": redrawing_space}


def time_members(space: Any, members: list) -> tuple[list[float], list[str]]:
    """Seconds of perturb + restore per member, and a digest of each member's weights."""
    import hashlib

    import torch

    seconds, digests = [], []
    for member in members:
        start = time.perf_counter()
        space.perturb(member)
        middle = time.perf_counter()
        digest = hashlib.sha256()
        for _, tensor in space.named_tensors():
            digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
        digests.append(digest.hexdigest())
        resumed = time.perf_counter()
        space.restore()
        seconds.append(middle - start + time.perf_counter() - resumed)
    return seconds, digests


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--population-size", type=int, default=16)
    parser.add_argument("--num-subspaces", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
        help="engines to time (the first is the reference of the ratios)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    load_before = list(os.getloadavg())

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from copes.agents.hf.policy import HFPolicy
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES
    from copes.weights import WeightSpace

    policy = HFPolicy.from_pretrained(args.model, device="cpu", dtype=args.dtype)
    model = policy.model
    named = [(n, p.data) for n, p in model.named_parameters() if p.is_floating_point()]
    parameters = sum(t.numel() for _, t in named)
    rows = []
    for k in args.num_subspaces:
        optimizer = CoPES(CoPESConfig(population_size=args.population_size, num_subspaces=k,
                                      sigma=args.sigma, antithetic=True, seed=0))  # fmt: skip
        members = optimizer.ask(1)
        coefficients = [0.1 * (i + 1) * (-1) ** i for i in range(len(members))]  # all non-zero
        row: dict[str, Any] = {"num_subspaces": k, "members": len(members)}
        updated = {}
        for name in args.engines:
            make = ENGINES[name] or WeightSpace
            original = {n: t.clone() for n, t in named}
            space = make(named)
            seconds, digests = time_members(space, members)
            start = time.perf_counter()
            space.update(members, coefficients, learning_rate=1e-4)
            update_seconds = time.perf_counter() - start
            updated[name] = (digests, space.checksum())
            row[name] = {
                # a step's total over its members (the first of each subspace draws, the
                # others reuse), per member
                "perturb_restore_seconds_per_member": statistics.fmean(seconds),
                "perturb_restore_seconds_each": seconds,
                "update_seconds": update_seconds,
            }
            for n, t in named:  # back to the loaded weights for the next engine
                t.copy_(original[n])
            del space
        reference, *others = args.engines
        ref = row[reference]
        per_member = "perturb_restore_seconds_per_member"
        row["members_identical"] = all(updated[o][0] == updated[reference][0] for o in others)
        row["update_identical"] = all(updated[o][1] == updated[reference][1] for o in others)
        parts = [f"K={k}: perturb+restore {ref[per_member]:.3f} s a member, update of "
                 f"{len(members)} {ref['update_seconds']:.2f} s ({reference})"]  # fmt: skip
        for other in others:
            row[f"speedup_perturb_restore_vs_{other}"] = row[other][per_member] / ref[per_member]
            row[f"speedup_update_vs_{other}"] = row[other]["update_seconds"] / ref["update_seconds"]
            parts.append(f"{other}: {row[other][per_member]:.3f} s "
                         f"({row[f'speedup_perturb_restore_vs_{other}']:.2f}x), update "
                         f"{row[other]['update_seconds']:.2f} s "
                         f"({row[f'speedup_update_vs_{other}']:.2f}x)")  # fmt: skip
        parts.append(f"identical: members {row['members_identical']}, "
                     f"update {row['update_identical']}")  # fmt: skip
        rows.append(row)
        print("; ".join(parts), flush=True)
    worst = max(r[args.engines[0]]["perturb_restore_seconds_per_member"] for r in rows)
    result = {
        "benchmark": "weight_ops",
        "command": "python benchmarks/weight_ops.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "parameters": parameters,
        "population_size": args.population_size,
        "engines": args.engines,
        "rows": rows,
        "target_seconds_per_member": TARGET_SECONDS,
        "worst_seconds_per_member": worst,
        "target_met": worst < TARGET_SECONDS,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before_after": [load_before, list(os.getloadavg())],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"worst perturb+restore a member: {worst:.3f} s (target < {TARGET_SECONDS} s: "
          f"{'met' if worst < TARGET_SECONDS else 'NOT met'}); wrote {args.out}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
