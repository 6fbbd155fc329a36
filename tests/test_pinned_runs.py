"""Short ES, CoPES, GRPO and LoRA-GRPO runs pinned to checksums recorded on main before the
optimizer-contract refactor (issue 17): the same seeds must give bit-identical weights and
the same metrics after any restructuring.

The numbers are exact float32 CPU arithmetic, so they belong to one platform (torch version,
CPU model); on another the test says so and skips. ``COPES_RECORD_PINS=1`` re-records them,
which is only right when a change is *meant* to change the numbers (say why in the commit).
"""

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from copes.cli import train_main

PINS = Path(__file__).parent / "fixtures" / "pinned_runs.json"
COMMON = [
    "--batch-size", "4", "--max-new-tokens", "32", "--max-turns", "3", "--eval-tasks", "4",
    "--eval-every", "1", "--num-train-tasks", "32", "--steps", "2", "--seed", "3",
    "--no-progress", "--report-to", "none",
]  # fmt: skip
RUNS = {
    "es": ["--optimizer", "es", "--population-size", "4", "--sigma", "0.02",
           "--learning-rate", "0.01"],
    "copes": ["--optimizer", "copes", "--population-size", "4", "--num-subspaces", "2",
              "--sigma", "0.02", "--learning-rate", "0.01"],
    "grpo": ["--optimizer", "grpo", "--group-size", "2", "--learning-rate", "1e-4",
             "--batch-size", "2"],
    "lora-grpo": ["--optimizer", "lora-grpo", "--group-size", "2", "--learning-rate", "1e-3",
                  "--batch-size", "2"],
}  # fmt: skip
METRICS = ("reward_mean", "reward_std", "accuracy", "generated_tokens")


def platform_key() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"torch {torch.__version__} | {platform.machine()} | {cpu}"


def weights_digest(checkpoint: Path) -> str:
    state = load_file(str(checkpoint / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_summary(run_dir: Path) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pick = lambda r: {k: r[k] for k in METRICS if k in r}  # noqa: E731
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    return {
        "weights_sha256": weights_digest(latest),
        "train": [pick(r) for r in records if r["kind"] == "train"],
        "validation": [pick(r) for r in records if r["kind"] == "validation"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(RUNS))
def test_the_same_seeds_give_the_pinned_weights_and_metrics(optimizer, tmp_path, tiny_agent_dir):
    torch.set_num_threads(2)
    run_dir = tmp_path / optimizer
    args = [*COMMON, *RUNS[optimizer], "--model", str(tiny_agent_dir), "--output-dir", str(run_dir)]
    assert train_main(args) == 0
    got = run_summary(run_dir)
    pins = json.loads(PINS.read_text()) if PINS.exists() else {}
    if os.environ.get("COPES_RECORD_PINS") == "1":
        pins.setdefault("platform", platform_key())
        if pins["platform"] != platform_key():
            pytest.fail(f"pins were recorded on {pins['platform']}; delete the file to re-record")
        pins.setdefault("runs", {})[optimizer] = got
        PINS.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
        return
    if pins.get("platform") != platform_key():
        pytest.skip(f"pins are for {pins.get('platform')}, this is {platform_key()}")
    assert got == pins["runs"][optimizer]
