"""Faults a long run meets: SIGKILL at random points, torn and garbage files, a full disk.

What is guaranteed (docs/training.md, "After a crash"): a killed ES/CoPES run resumes to
bit-identical weights; a torn last line of a log is dropped; any other damaged file stops
`--resume` with one line naming it (exit 2), never a traceback and never a silent restart;
a full disk stops the run with one line, leaving `latest` on a complete checkpoint from
which the run resumes to the same weights.

Runs on the tiny Qwen2-family model (tests/families.py): a step takes well under a second,
so the kills land between and inside steps, checkpoints and log appends.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from copes.cli import train_main
from copes.run_log import read_jsonl

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.fixture(scope="module")
def argv(family_dir, tmp_path_factory):
    """One run's flags for the whole module, so the runs below can be shared: their data
    folder too (a resume is checked against the run's config)."""
    import families

    data = tmp_path_factory.mktemp("family-data")
    record = {"question": families.QUESTION, "answer": f"12*34={families.ANSWER}\n#### 408"}
    (data / "gsm8k.jsonl").write_text(json.dumps(record) + "\n")
    return [
        "--model", str(family_dir("qwen2")), "--call-format", "native", "--optimizer", "copes",
        "--benchmark", "gsm8k", "--data-dir", str(data), "--train-split", "test",
        "--eval-split", "test", "--num-train-tasks", "1", "--eval-tasks", "1",
        "--batch-size", "1", "--population-size", "2", "--num-subspaces", "2", "--sigma", "0.05",
        "--learning-rate", "0.05", "--max-turns", "3", "--max-new-tokens", "64",
        "--device", "cpu", "--no-tensorboard", "--no-progress", "--steps", str(STEPS),
        "--checkpoint-every", "2", "--eval-every", "0", "--keep-checkpoints", "2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(argv, tmp_path_factory):
    """The uninterrupted run's final weights (run once for the module)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train_main([*argv, "--out-dir", str(out)]) == 0
    return final_weights(out)


@pytest.fixture(scope="module")
def four_steps(argv, tmp_path_factory):
    """A finished 4-step run, made once; each test that damages it works on a copy."""
    out = tmp_path_factory.mktemp("four-steps") / "run"
    assert train_main([*argv, "--steps", "4", "--out-dir", str(out)]) == 0
    return out


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert latest.name == f"step-{STEPS:06d}"
    return load_file(str(latest / "model.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_sigkill_at_random_points_then_resume_is_bit_identical(argv, reference, tmp_path):
    out = tmp_path / "killed"
    rng = random.Random(20261201)
    kills = 0
    for attempt in range(12):
        command = [*argv, "--out-dir", str(out), *(["--resume"] if attempt else [])]
        proc = subprocess.Popen(
            [sys.executable, "-m", "copes.cli", *command],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        if kills < 4:
            # Kill once the run has logged a random number of further steps, after a random
            # part of a step: inside rollouts, log appends and checkpoint writes.
            logged = len(read_jsonl(out / "es_log.jsonl"))
            target = logged + rng.randint(0, 2)
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline:
                if len(read_jsonl(out / "es_log.jsonl")) >= target:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
        if proc.wait(timeout=300) == 0 and (out / "checkpoints" / "latest").exists():
            latest = (out / "checkpoints" / "latest").read_text().strip()
            if latest == f"step-{STEPS:06d}":
                break
    assert kills >= 2
    assert_same(final_weights(out), reference)
    steps = [e["step"] for e in read_jsonl(out / "es_log.jsonl")]
    assert sorted(set(steps)) == list(range(STEPS))


def damage_es_log(out: Path) -> None:
    lines = (out / "es_log.jsonl").read_text().splitlines()
    lines[1] = '{"step": 1, "rewards": [oops'
    (out / "es_log.jsonl").write_text("\n".join(lines) + "\n")


def damage_latest_pointer(out: Path) -> None:
    (out / "checkpoints" / "latest").write_text("step-000099")


def damage_checkpoint_weights(out: Path) -> None:
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    (latest / "model.safetensors").write_bytes(b"\x00garbage" * 100)


def damage_trainer_state(out: Path) -> None:
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    (latest / "trainer_state.json").write_text("{not json")


def damage_config(out: Path) -> None:
    (out / "config.json").write_bytes(b"\xff\xfe garbage")


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (damage_es_log, "es_log.jsonl line 2 is not valid JSON"),
        (damage_latest_pointer, "names step-000099"),
        (damage_checkpoint_weights, "cannot be read"),
        (damage_trainer_state, "cannot be read"),
        (damage_config, "is not a copes run config"),
    ],
)
def test_a_damaged_file_stops_resume_with_one_line_naming_it(
    argv, four_steps, tmp_path, capsys, damage, named
):
    out = tmp_path / "run"
    shutil.copytree(four_steps, out)
    damage(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train_main([*argv, "--out-dir", str(out), "--resume"]) == 2
    assert named in one_line_error(capsys)
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # a refused resume changes nothing


def test_a_torn_last_line_is_dropped_and_the_run_resumes(argv, reference, tmp_path):
    out = tmp_path / "run"
    assert train_main([*argv, "--steps", "3", "--out-dir", str(out)]) == 0
    with open(out / "es_log.jsonl", "a") as log:
        log.write('{"step": 3, "rewards": [0.1, 0.')  # killed mid-line
    with open(out / "metrics.jsonl", "a") as log:
        log.write('{"kind": "train", "st')
    assert train_main([*argv, "--out-dir", str(out), "--resume"]) == 0
    assert_same(final_weights(out), reference)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_a_full_disk_stops_the_run_with_one_line_and_it_resumes(argv, reference, tmp_path, capsys):
    disk = tmp_path / "small-disk"
    if not _tmpfs(disk, "1200k"):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        out = disk / "run"
        code = train_main([*argv, "--out-dir", str(out)])
        assert code == 2
        assert "No space left on device" in one_line_error(capsys)
        latest = (out / "checkpoints" / "latest").read_text().strip()
        assert (out / "checkpoints" / latest / "trainer_state.json").exists()  # complete
        moved = tmp_path / "moved"
        shutil.copytree(out, moved)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert train_main([*argv, "--out-dir", str(moved), "--resume"]) == 0
    assert_same(final_weights(moved), reference)
