"""--report-to: every record reaches each reporter (tensorboard and trackio, for real, offline);
an unknown or missing reporter is a one-line error before anything runs."""

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from copes.cli import train_main
from copes.evaluation.cli import main as eval_main


def _trackio_steps(trackio_dir, project, run):
    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        rows = db.execute(
            "select step, metrics from metrics where run_name = ? order by id", (run,)
        ).fetchall()
    return [(step, json.loads(metrics)) for step, metrics in rows]


@pytest.mark.slow
def test_train_and_eval_report_to_tensorboard_and_trackio(tmp_path, tiny_agent_dir):
    pytest.importorskip("trackio")
    trackio_dir = tmp_path / "trackio"
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir), "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "run-a"
    done = subprocess.run([
        sys.executable, "-m", "copes.cli", "--model", str(tiny_agent_dir), "--optimizer", "es",
        "--population-size", "2", "--steps", "2", "--batch-size", "2", "--eval-tasks", "2",
        "--eval-every", "1", "--max-new-tokens", "24", "--max-turns", "2", "--no-progress",
        "--report-to", "tensorboard,trackio", "--output-dir", str(run_dir),
    ], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    logged = _trackio_steps(trackio_dir, "copes-train", "run-a")
    train = [(s, m) for s, m in logged if "train/reward_mean" in m]
    validation = [s for s, m in logged if "validation/accuracy" in m]
    assert [s for s, _ in train] == [0, 1] and validation == [0, 1, 2]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "train")
    assert train[0][1]["train/reward_mean"] == pytest.approx(first["reward_mean"])
    assert any((run_dir / "tensorboard").iterdir())

    out = tmp_path / "eval-a"
    done = subprocess.run([
        sys.executable, "-m", "copes.evaluation.cli", "--model", str(tiny_agent_dir),
        "--limit", "2", "-n", "2", "--pass-k", "1,2", "--max-new-tokens", "24", "--quiet",
        "--report-to", "trackio", "--output-dir", str(out),
    ], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ((step, metrics),) = _trackio_steps(trackio_dir, "copes-eval", "eval-a")
    report = json.loads((out / "report.json").read_text())["benchmarks"]["synthetic-math"]
    assert step == 0 and metrics["synthetic-math/pass@2"] == pytest.approx(report["pass_at_k"]["2"])


def test_unknown_or_missing_reporters_fail_first(tmp_path, capsys):
    assert train_main(["--report-to", "comet", "--output-dir", str(tmp_path / "r")]) == 2
    assert "--report-to comet: unknown" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    if importlib.util.find_spec("wandb") is None:
        assert eval_main(["--model", "tiny", "--report-to", "wandb", "--out", str(tmp_path)]) == 2
        assert "needs the wandb package: pip install wandb" in capsys.readouterr().err
