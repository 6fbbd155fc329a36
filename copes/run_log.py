"""Where a training run writes its numbers: JSONL, TensorBoard and a learning-curve PNG.

`metrics.jsonl` is the source of truth (one JSON object per line, with `step` and `kind`:
"train" or "validation"); TensorBoard and the PNG are views of it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from copes.jsonl import parse_json_lines

logger = logging.getLogger(__name__)


def append_jsonl(path: Path, record: dict[str, Any], sync: bool = False) -> None:
    """Append one line; with `sync`, it is on disk when this returns (survives SIGKILL)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def read_jsonl(path: Path, hint: str = "") -> list[dict[str, Any]]:
    """All records of a JSONL file this project appends to.

    A torn last line (the writer died mid-line) is ignored; a damaged line anywhere else is
    an error naming it (plus `hint`: how to recover), never silently skipped.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    complete = text[: text.rfind("\n") + 1]  # whatever follows the last newline is torn
    advice = f"only a torn last line can be skipped. {hint}".strip()
    return parse_json_lines(complete.splitlines(), path, advice)


def drop_torn_tail(path: Path) -> None:
    """Cut anything after the last newline, so appended lines start on a fresh line."""
    path = Path(path)
    if not path.exists():
        return
    with path.open("rb+") as handle:
        data = handle.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
            handle.truncate(keep)


def write_jsonl_atomic(path: Path, records: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


REBUILT_FROM = "es_log.jsonl"


def rebuild_train_record(entry: Mapping[str, Any], previous: Mapping[str, Any] | None) -> dict:
    """The train record of a step whose metrics.jsonl line was lost (torn, or never written:
    killed between the two appends), from its replay-log entry (es_log.jsonl: `step`, the
    members' `rewards`, the run's `tokens`, `seconds` and `cpu_seconds` after the step).

    Only what the entry determines: reward mean / std / max over members, computed as the
    optimizer computes them (numpy, so bit-identical), the token and second totals, and the
    step's generated tokens when the previous step's entry is there (`previous`; none is
    needed for step 0). Accuracy, per-subspace rewards, sigma, learning rate and timings are
    not in the log and are left out, never guessed. `rebuilt_from` marks the record.
    """
    import numpy as np

    rewards = np.asarray(entry["rewards"], dtype=np.float64)
    record: dict[str, Any] = {
        "kind": "train",
        "step": int(entry["step"]),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_max": float(rewards.max()),
    }
    if record["step"] == 0:
        record["generated_tokens"] = int(entry["tokens"])
    elif previous is not None and int(previous["step"]) == record["step"] - 1:
        record["generated_tokens"] = int(entry["tokens"]) - int(previous["tokens"])
    record["generated_tokens_total"] = int(entry["tokens"])
    record["seconds_total"] = float(entry["seconds"])
    if "cpu_seconds" in entry:  # logged since the CPU-seconds budget (2026-12-05)
        record["cpu_seconds_total"] = float(entry["cpu_seconds"])
    record["rebuilt_from"] = REBUILT_FROM
    return record


def _before(record: Mapping[str, Any], step: int) -> bool:
    return record.get("step", -1) < step or (
        record.get("kind") == "validation" and record.get("step") == step
    )


def _order(record: Mapping[str, Any]) -> tuple[int, int]:
    """Where the loop writes a record: the validation of step s, then the train record of s."""
    return int(record.get("step", -1)), int(record.get("kind") == "train")


class MetricsLog:
    """Appends metrics to `metrics.jsonl`, mirrors them to the reporters (`--report-to`:
    TensorBoard, wandb, trackio), redraws the curve."""

    def __init__(
        self,
        run_dir: Path,
        report_to: Sequence[str] = ("tensorboard",),
        config: Mapping[str, Any] | None = None,
        project: str = "copes",
    ) -> None:
        from copes.reporting import open_reporters

        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._reporters = open_reporters(
            list(report_to), run_dir, project=project, config=config or {}
        )

    def resume_at(self, step: int, rebuilt: Sequence[dict[str, Any]] = ()) -> None:
        """Keep what a run resumed at `step` will not recompute, and add `rebuilt` records.

        Kept: train records of steps < `step` and validations of steps <= `step` (measured
        with the very weights the run resumes with); later ones are recomputed. `rebuilt`
        records (`rebuild_train_record`) go in step order, a train record of step s after
        the validation of step s, as the loop writes them; they are mirrored to the reporters.
        """
        kept = [r for r in read_jsonl(self.path) if _before(r, step)]
        for record in rebuilt:
            at = next((i for i, r in enumerate(kept) if _order(r) > _order(record)), len(kept))
            kept.insert(at, record)
        write_jsonl_atomic(self.path, kept)
        if self._reporters and rebuilt:
            from copes.reporting import scalars

            for record in rebuilt:
                numbers = scalars(record["kind"], record)
                for reporter in self._reporters:
                    reporter.log(numbers, record["step"])

    def has(self, kind: str, step: int) -> bool:
        """Whether metrics.jsonl holds a `kind` record of `step`."""
        return any(r["kind"] == kind and r["step"] == step for r in read_jsonl(self.path))

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": step, **values}
        append_jsonl(self.path, record)
        if self._reporters:
            from copes.reporting import scalars

            numbers = scalars(kind, values)
            for reporter in self._reporters:
                reporter.log(numbers, step)

    def plot(self, x_key: str = "generated_tokens_total") -> Path | None:
        """Redraw `learning_curve.png`: training reward, validation reward and accuracy."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        records = read_jsonl(self.path)
        train = [r for r in records if r["kind"] == "train"]
        val = [r for r in records if r["kind"] == "validation"]
        if not train and not val:
            return None
        fig, ax = plt.subplots(figsize=(6.4, 4))
        if train:
            ax.plot([r.get(x_key, r["step"]) for r in train], [r["reward_mean"] for r in train],
                    label="train reward (mean over batch)", alpha=0.6)  # fmt: skip
        if val:
            ax.plot([r.get(x_key, r["step"]) for r in val], [r["accuracy"] for r in val],
                    marker="o", label="validation accuracy")  # fmt: skip
            ax.plot([r.get(x_key, r["step"]) for r in val], [r["reward_mean"] for r in val],
                    marker="s", label="validation reward")  # fmt: skip
        ax.set_xlabel(x_key.replace("_", " "))
        # Rewards dip below 0 with --invalid-penalty; keep the whole curve in view.
        lowest = min([r["reward_mean"] for r in train + val] + [0.0])
        ax.set_ylim(lowest - 0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = self.run_dir / "learning_curve.png"
        fig.savefig(out.with_suffix(".tmp.png"), dpi=100)
        plt.close(fig)
        os.replace(out.with_suffix(".tmp.png"), out)
        return out

    def close(self) -> None:
        for reporter in self._reporters:
            reporter.close()
