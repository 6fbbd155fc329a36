"""An evaluation's results and their renderings: a table, report.json, report.csv, plots.

`Report` holds per-benchmark `BenchmarkResult`s (pass@k for each k, mean@n, maj@n, tool use).
With a baseline report every rendering shows both values and the difference (model minus
baseline), and each plot gets the baseline as a second line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class BenchmarkResult:
    """The metrics of one benchmark: means over its problems of per-problem metrics.

    `pass_at_k[k]` is the unbiased pass@k (Chen et al. 2021) on `correct` (math: the gold's
    value with no arithmetic left undone; QA: exact match; a benchmark with its own scorer,
    like reasoning-gym's: a full score of 1); `mean_at_n` is the mean reward of all samples
    (math: accuracy; QA: token F1; reasoning-gym: its score, partial credit included);
    `maj_at_n` is the accuracy of the majority-voted answer.
    Over all samples: `protocol_use_rate` is the share that used the call protocol at all (a
    tool call, or a final answer the env read), `tool_use_rate` the share with a tool call,
    `invalid_rate` the share that ended on a turn with neither; `undone_arithmetic_rate` the
    share of answers of the gold's value refused for arithmetic left undone (issue 48: `79 *
    86` for 6794), the mark of a policy that learns to leave the grader its calculation.
    """

    benchmark: str
    num_problems: int
    n: int
    pass_at_k: dict[int, float]
    mean_at_n: float
    maj_at_n: float
    mean_tool_calls: float
    mean_turns: float
    mean_generated_tokens: float
    end_reasons: dict[str, int]
    # Reports written before these were measured lack them (None).
    protocol_use_rate: float | None = None
    tool_use_rate: float | None = None
    invalid_rate: float | None = None
    undone_arithmetic_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkResult:
        data = dict(data)
        data["pass_at_k"] = {int(k): float(v) for k, v in data["pass_at_k"].items()}
        return cls(**data)


@dataclass
class Report:
    """Per-benchmark results of one evaluation (and, not compared, how the run went)."""

    n: int
    ks: list[int]
    benchmarks: dict[str, BenchmarkResult]
    model: str | None = None
    generated_episodes: int = field(default=0, compare=False)  # rolled out by this call
    new_samples: int = field(default=0, compare=False)  # written by this call
    resumed_samples: int = field(default=0, compare=False)  # found on disk
    seconds: float = field(default=0.0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["benchmarks"] = {name: r.to_dict() for name, r in self.benchmarks.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        data = dict(data)
        data["benchmarks"] = {
            name: BenchmarkResult.from_dict(r) for name, r in data["benchmarks"].items()
        }
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------- metrics by name
def metric_values(result: BenchmarkResult) -> dict[str, float]:
    """The reported metrics of one benchmark by display name, in table order."""
    values: dict[str, float] = {"problems": float(result.num_problems)}
    values.update({f"pass@{k}": v for k, v in result.pass_at_k.items()})
    values[f"mean@{result.n}"] = result.mean_at_n
    values[f"maj@{result.n}"] = result.maj_at_n
    values["tool calls"] = result.mean_tool_calls
    values["turns"] = result.mean_turns
    values["gen tokens"] = result.mean_generated_tokens
    rates = {
        "protocol use": result.protocol_use_rate,
        "tool use": result.tool_use_rate,
        "invalid": result.invalid_rate,
        "undone arith": result.undone_arithmetic_rate,
    }
    for name, value in rates.items():
        if value is not None:
            values[name] = value
    return values


def difference(report: Report, baseline: Report) -> dict[str, dict[str, float]]:
    """model - baseline for every metric both reports have, per shared benchmark."""
    diffs: dict[str, dict[str, float]] = {}
    for name, result in report.benchmarks.items():
        if name not in baseline.benchmarks:
            continue
        ours, theirs = metric_values(result), metric_values(baseline.benchmarks[name])
        diffs[name] = {m: ours[m] - theirs[m] for m in ours if m in theirs}
    return diffs


def _fmt(metric: str, value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if metric == "problems":
        return f"{value:+.0f}" if signed else f"{value:.0f}"
    if metric in ("tool calls", "turns", "gen tokens"):
        return f"{value:+.2f}" if signed else f"{value:.2f}"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


# ---------------------------------------------------------------------- table
def format_table(report: Report, baseline: Report | None = None) -> str:
    """A Markdown table, benchmarks x metrics (pass@k for each k, mean@n, maj@n, tool use).

    With `baseline`, each cell reads ``model / baseline (difference)``.
    """
    rows = {name: metric_values(r) for name, r in report.benchmarks.items()}
    columns: list[str] = []
    for values in rows.values():
        columns.extend(m for m in values if m not in columns)
    header = ["benchmark", *columns]
    body = []
    for name, values in rows.items():
        cells = [name]
        base = (
            metric_values(baseline.benchmarks[name])
            if baseline and name in baseline.benchmarks
            else None
        )
        for metric in columns:
            value = values.get(metric)
            if baseline is None:
                cells.append(_fmt(metric, value))
                continue
            other = None if base is None else base.get(metric)
            diff = None if value is None or other is None else value - other
            cells.append(
                f"{_fmt(metric, value)} / {_fmt(metric, other)} ({_fmt(metric, diff, True)})"
            )
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    lines = []
    if baseline is not None:
        lines.append(
            f"model: {report.model or 'model'} / baseline: {baseline.model or 'baseline'} "
            "(difference)"
        )
    lines += [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line(cells) for cells in body]
    return "\n".join(lines)


# ---------------------------------------------------------------------- files
def write_json(report: Report, path: str | Path, baseline: Report | None = None) -> Path:
    """report.json: the report's fields, plus `baseline` and `difference` when compared."""
    data = report.to_dict()
    if baseline is not None:
        data["baseline"] = baseline.to_dict()
        data["difference"] = difference(report, baseline)
    path = Path(path)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_csv(report: Report, path: str | Path, baseline: Report | None = None) -> Path:
    """report.csv, one row per (benchmark, metric): value[, baseline, difference]."""
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["benchmark", "metric", "value"] + (["baseline", "difference"] if baseline else [])
        )
        for name, result in report.benchmarks.items():
            base = None
            if baseline is not None and name in baseline.benchmarks:
                base = metric_values(baseline.benchmarks[name])
            for metric, value in metric_values(result).items():
                row: list[Any] = [name, metric, value]
                if baseline is not None:
                    other = None if base is None else base.get(metric)
                    row += ["" if other is None else other, "" if other is None else value - other]
                writer.writerow(row)
    return path


def plot_pass_at_k(
    report: Report, out_dir: str | Path, baseline: Report | None = None
) -> list[Path]:
    """One PNG per benchmark, pass@k against k (the baseline as a second line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths = []
    for name, result in report.benchmarks.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        series = [(report.model or "model", result)]
        if baseline is not None and name in baseline.benchmarks:
            series.append((baseline.model or "baseline", baseline.benchmarks[name]))
        for (label, r), style in zip(series, ("o-", "s--"), strict=False):
            ks = sorted(r.pass_at_k)
            ax.plot(ks, [r.pass_at_k[k] for k in ks], style, label=label)
        ks = sorted(result.pass_at_k)
        if len(ks) > 1 and ks[-1] / ks[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_title(f"{name}: {result.num_problems} problems, n={result.n}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"pass_at_k_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(
    report: Report, out_dir: str | Path, baseline: Report | None = None
) -> dict[str, Any]:
    """report.json, report.csv and the plots into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "json": write_json(report, out / "report.json", baseline),
        "csv": write_csv(report, out / "report.csv", baseline),
        "plots": plot_pass_at_k(report, out, baseline),
    }
