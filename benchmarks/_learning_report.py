"""The learning benchmark's report: curves over seeds, the paper's numbers, JSON + PNG + table.

All statistics come from `copes.evaluation.curves` (tested there on known curves); this
module turns finished runs into curves, applies them, and renders the results.

Budget accounting: the trainer stops at the first step that reaches the budget B, so every
run's last step crosses B (by less than one step: N x batch episodes for ES/CoPES, G x batch
for GRPO). That last step's validation is credited at B; its overshoot is reported per run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copes.evaluation.curves import (
    Curve,
    best_checkpoint_budget,
    budget_to_target,
    gain_recovered,
    mean_curve,
    mean_gain_until,
    t_interval,
)

REFERENCE = "grpo"  # the method whose gain the paper measures the others against
GRID_POINTS = 41


def run_curve(record: dict[str, Any], kind: str, budget: float) -> tuple[Curve, float]:
    """A finished run's validation curve in `kind` ("tokens"/"seconds"/"cpu-seconds"), cut at
    `budget`.

    Returns the curve and the overshoot of the run's last step beyond the budget.
    """
    xs, accuracy = record["curve"][kind], record["curve"]["accuracy"]
    overshoot = max(0.0, xs[-1] - budget)
    points = [(min(x, budget), a) for x, a in zip(xs, accuracy, strict=True) if x <= budget]
    if xs[-1] > budget:  # the step that crossed the budget: credited at the budget
        points.append((budget, accuracy[-1]))
    return Curve(tuple(p[0] for p in points), tuple(p[1] for p in points)), overshoot


def summarize(
    records: Sequence[dict[str, Any]],
    methods: Sequence[str],
    kind: str,
    budget: float,
    *,
    target: float | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Every number of the report, per method, from the finished runs' records."""
    curves: dict[str, list[Curve]] = {m: [] for m in methods}
    overshoot: dict[str, list[float]] = {m: [] for m in methods}
    passk: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    rewards: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    runs_of: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for record in records:
        method = record["spec"]["method"]
        if method not in curves or "error" in record:
            continue
        runs_of[method].append(record)
        curve, over = run_curve(record, kind, budget)
        curves[method].append(curve)
        overshoot[method].append(over)
        passk[method].append(record.get("pass_at_k", {}))
        reward = record["curve"].get("reward")  # the trained objective (penalties included)
        if reward:
            rewards[method].append((reward[0], reward[-1]))
    present = [m for m in methods if curves[m]]
    grid = [budget * i / (GRID_POINTS - 1) for i in range(GRID_POINTS)]
    reference = curves.get(REFERENCE) or []
    star = best_checkpoint_budget(reference) if reference else None
    reference_gain = mean_gain_until(reference, star) if reference else None
    # Each seed validates on its own tasks, so bases differ by seed: the default target is a
    # gain (half of GRPO's) over each seed's own base; --target-accuracy is absolute.
    target_gain = None
    if target is None and reference_gain is not None and reference_gain > 0:
        target_gain = 0.5 * reference_gain
    out: dict[str, Any] = {
        "budget_kind": kind,
        "budget": budget,
        "confidence": confidence,
        "interval_method": "Student-t over seeds (curves, accuracy, pass@k); percentile "
        "bootstrap over seeds, 2000 resamples (fraction of GRPO's gain)",
        "reference": REFERENCE if reference else None,
        "reference_best_budget": star,
        "reference_gain": reference_gain,
        "target_accuracy": target,
        "target_gain": target_gain,
        "grid": grid,
        "methods": {},
    }
    for m in present:
        cs = curves[m]
        entry: dict[str, Any] = {
            "seeds": len(cs),
            "curve": [i.as_dict() for i in mean_curve(cs, grid, confidence)],
            "base_accuracy": t_interval([c.base for c in cs], confidence).as_dict(),
            "final_accuracy": t_interval([c.at(budget) for c in cs], confidence).as_dict(),
            "best_accuracy": t_interval([c.best_until(budget) for c in cs], confidence).as_dict(),
            "overshoot_max": max(overshoot[m]),
            # answers refused as undone arithmetic at the last validation (issue 48); None
            # where a run was graded before it or its grader does not say
            "final_undone_arithmetic": _final_undone(runs_of[m], confidence),
            **{
                key: t_interval([r[i] for r in rewards[m]], confidence).as_dict()
                if rewards[m]
                else None
                for i, key in enumerate(("base_reward", "final_reward"))
            },
            "pass_at_k": {
                k: t_interval([p[k] for p in passk[m] if k in p], confidence).as_dict()
                for k in sorted({k for p in passk[m] for k in p})
                if k.startswith("pass@")
            },
        }
        if reference:
            entry["gain_recovered"] = gain_recovered(cs, reference, confidence=confidence).as_dict()
        if target is not None:
            entry["budget_to_target"] = budget_to_target(cs, target)
        elif target_gain is not None:
            entry["budget_to_target"] = budget_to_target(cs, target_gain, gain=True)
        out["methods"][m] = entry
    out["speedup_to_target"] = _speedups(out["methods"])
    out["failed_runs"] = [
        {"method": r["spec"]["method"], "seed": r["spec"]["seed"], "error": r["error"][-400:]}
        for r in records
        if "error" in r
    ]
    return out


def _final_undone(records: list[dict[str, Any]], confidence: float) -> dict[str, Any] | None:
    last = [(r["curve"].get("undone_arithmetic") or [None])[-1] for r in records]
    if not last or any(v is None for v in last):
        return None
    return t_interval(last, confidence).as_dict()


def _speedups(methods: dict[str, Any]) -> dict[str, float | None]:
    """ES's budget to the target divided by each CoPES variant's (the paper: 7x).

    Only where both reached the target in every seed: a mean over the seeds that did reach
    it would compare different subsets of seeds (None otherwise)."""

    def budget(entry: dict[str, Any]) -> float | None:
        t = entry.get("budget_to_target") or {}
        return t.get("mean_of_reached") if t and t["reached"] == t["seeds"] else None

    es = budget(methods.get("es", {}))
    return {
        f"es/{m}": es / mine if es and (mine := budget(entry)) else None
        for m, entry in methods.items()
        if m.startswith("copes")
    }


# ---------------------------------------------------------------------- renderings
def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _interval(entry: dict[str, Any]) -> str:
    if entry["low"] is None:
        return f"{entry['mean']:.3f}"
    return f"{entry['mean']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def _target(summary: dict[str, Any]) -> str:
    if summary["target_accuracy"] is not None:
        return f"accuracy {summary['target_accuracy']:.3f}"
    if summary.get("target_gain") is not None:
        return f"each seed's base + {summary['target_gain']:.3f} (half of GRPO's gain)"
    return "n/a"


def markdown(summary: dict[str, Any], title: str) -> str:
    """The report as a markdown table (what docs/results.md quotes)."""
    kind, star = summary["budget_kind"], summary["reference_best_budget"]
    ks = sorted({k for e in summary["methods"].values() for k in e["pass_at_k"]})
    lines = [
        f"### {title}",
        "",
        f"Budget: {summary['budget']:,.0f} {kind} per run. Intervals: {summary['confidence']:.0%}, "
        f"{summary['interval_method']}. GRPO's best validation checkpoint: {_fmt(star, 0)} "
        f"{kind}. Target: {_target(summary)}.",
        "",
        *(
            [
                "GRPO did not improve on its base model within the budget: there is no gain "
                "to recover, so the fractions (and the default target) are undefined (n/a).",
                "",
            ]
            if summary.get("reference_gain") is not None and summary["reference_gain"] <= 0
            else []
        ),
        "| method | seeds | base acc | final acc | best acc | gain recovered at B* | "
        f"{kind} to target (reached) | base reward | final reward | final undone arith | "
        + " | ".join(ks)
        + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(ks),
    ]
    for m, e in summary["methods"].items():
        g = e.get("gain_recovered") or {}
        frac = _fmt(g.get("fraction"), 2)
        if g.get("low") is not None:
            frac += f" [{g['low']:.2f}, {g['high']:.2f}]"
        t = e.get("budget_to_target") or {}
        reach = f"{_fmt(t.get('mean_of_reached'), 0)} ({t.get('reached', 0)}/{e['seeds']})"
        cells = [_interval(e["pass_at_k"][k]) if k in e["pass_at_k"] else "n/a" for k in ks]
        rewards = [
            _interval(e[k]) if e.get(k) else "n/a"
            for k in ("base_reward", "final_reward", "final_undone_arithmetic")
        ]
        lines.append(
            f"| {m} | {e['seeds']} | {_interval(e['base_accuracy'])} | "
            f"{_interval(e['final_accuracy'])} | {_interval(e['best_accuracy'])} | {frac} | "
            f"{reach} | " + " | ".join(rewards + cells) + " |"
        )
    has_target = summary["target_accuracy"] is not None or summary.get("target_gain") is not None
    if summary["speedup_to_target"] and has_target:
        lines += ["", "Budget to target, ES / CoPES (n/a: one of the two missed the target "
                  "in some seed): " + ", ".join(f"{k} = {_fmt(v, 2)}x" if v else f"{k} = n/a"
                  for k, v in summary["speedup_to_target"].items())]  # fmt: skip
    if summary["failed_runs"]:
        lines += ["", f"Failed runs: {[(r['method'], r['seed']) for r in summary['failed_runs']]}"]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Mean validation accuracy against budget, one line per method, shaded t-interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = summary["grid"]
    for m, e in summary["methods"].items():
        mean = [p["mean"] for p in e["curve"]]
        (line,) = ax.step(
            grid,
            mean,
            where="post",
            label=f"{m} ({e['seeds']} seed{'s' if e['seeds'] > 1 else ''})",
        )
        if all(p["low"] is not None for p in e["curve"]):
            ax.fill_between(
                grid, [p["low"] for p in e["curve"]], [p["high"] for p in e["curve"]],
                step="post", alpha=0.15, color=line.get_color(),
            )  # fmt: skip
    if summary["reference_best_budget"] is not None:
        ax.axvline(summary["reference_best_budget"], ls=":", c="grey", label="GRPO best (B*)")
    highest = max((p["high"] or p["mean"]) for e in summary["methods"].values() for p in e["curve"])
    ax.set_ylim(0, min(1.0, max(0.1, 1.1 * highest)))
    ax.set_xlabel(f"training budget ({summary['budget_kind']})")
    ax.set_ylabel("validation accuracy (pass@1)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    summary: dict[str, Any], meta: dict[str, Any], results_dir: Path, name: str, title: str
) -> dict[str, Path]:
    """`<name>.json`, `<name>.png` and `<name>.md` in `results_dir`."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: results_dir / f"{name}.{ext}" for ext in ("json", "png", "md")}
    paths["json"].write_text(json.dumps({**meta, **summary}, indent=2))
    plot(summary, paths["png"], title)
    paths["md"].write_text(markdown(summary, title))
    return paths
