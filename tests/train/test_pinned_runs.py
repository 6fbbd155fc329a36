"""Short ES, CoPES, GRPO and LoRA-GRPO runs pinned to recorded checksums and metrics: the
same seeds must give the same weights and metrics after any restructuring, on any x86 CPU
with AVX2 (the kernel sets measured; see below).

float32 results depend on the CPU's kernels (MKL and ATen pick AVX2 or AVX-512 code, Intel
and AMD differ), so pins of float32 runs would hold on one machine only. These runs are
float64: kernels still differ in the last bits, but a greedy token decided by a 1e-16
difference never came up, so rewards, accuracies and token counts are the same everywhere,
ES/CoPES weights are exact (the update is elementwise, the noise is float32 from torch's
generator, identical on every AVX2 and AVX-512 kernel set), and GRPO's weights agree once
rounded to float32. The digest is therefore taken over the float32-rounded weights. The
pins hold under ATen's AVX2 and AVX-512 kernels and MKL's vendor-neutral path (measured,
docs/results.md; the last test here checks another set on every run); ATen's scalar
`default` set (a CPU without AVX2) draws other noise and does not match.
``COPES_RECORD_PINS=1`` re-records them, which is only right when a change is *meant* to
change the numbers (say why in the commit).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from copes.agents.tiny import machine_info
from copes.cli import train_main

PINS = Path(__file__).parents[1] / "fixtures" / "pinned_runs.json"
COMMON = [
    "--batch-size", "4", "--max-new-tokens", "32", "--max-turns", "3", "--eval-tasks", "4",
    "--eval-every", "1", "--num-train-tasks", "32", "--steps", "2", "--seed", "3",
    "--dtype", "float64", "--no-progress", "--report-to", "none",
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


def weights_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's tensors rounded to float32 (names sorted)."""
    state = load_file(str(checkpoint / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        tensor = state[name].to(torch.float32).contiguous()
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
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
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the pins were recorded
    run_dir = tmp_path / optimizer
    args = [*COMMON, *RUNS[optimizer], "--model", str(tiny_agent_dir), "--output-dir", str(run_dir)]
    try:
        assert train_main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the rest of this process keeps its own
    got = run_summary(run_dir)
    if os.environ.get("COPES_RECORD_PINS") == "1":
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins["recorded_on"] = machine_info()  # for the record only: the pins hold anywhere
        pins.setdefault("runs", {})[optimizer] = got
        PINS.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
        return
    pins = json.loads(PINS.read_text())
    assert got == pins["runs"][optimizer], f"recorded on {pins['recorded_on']}"


# Kernels other than this machine's: ATen's AVX2 code (an AVX2-only CPU's; on such a CPU it is
# the native set) and MKL's vendor-neutral code path.
OTHER_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE",
}  # fmt: skip


@pytest.mark.slow
def test_the_pins_hold_under_other_cpu_kernels(tmp_path):
    """The pinned runs again, in a fresh interpreter whose torch and MKL pick other kernels
    (they read these switches at load time), so a pin that only holds on one kernel set
    fails here instead of on the next contributor's CPU."""
    if os.environ.get("COPES_RECORD_PINS") == "1":
        pytest.skip("recording pins")
    env = {**os.environ, **OTHER_KERNELS}
    env.pop("COPES_TEST_REBUILD", None)  # the pins are the shipped agent's
    # The child is a plain one-process run: not an xdist worker, and without the options
    # (CI's --junitxml) the outer run was given through the environment.
    for name in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    capability = subprocess.run(probe, env=env, capture_output=True, text=True, check=True)
    assert capability.stdout.strip() == "AVX2"  # the switch took: the child runs other kernels
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-k", "the_same_seeds",
               "-p", "no:cacheprovider", "-p", "no:xdist",
               "--basetemp", str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout
