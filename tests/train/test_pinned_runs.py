"""Short ES, CoPES, GRPO and LoRA-GRPO runs pinned to recorded checksums and metrics: the
same seeds must give the same weights and metrics after any restructuring, on any x86 CPU
with AVX2 (the kernel sets measured; see below).

float32 results depend on the CPU's kernels (MKL and ATen pick AVX2 or AVX-512 code, Intel
and AMD differ), so pins of float32 runs would hold on one machine only. These runs are
float64: kernels still differ in the last bits, but a greedy token decided by a 1e-16
difference never came up, so rewards, accuracies and token counts are the same everywhere,
ES/CoPES weights are exact (the update is elementwise, the noise is float32 from torch's
generator, identical on every AVX2 and AVX-512 kernel set), and GRPO's weights agree once
rounded to float32 where MKL computes the same bits. MKL does not on every CPU by default:
on an Intel Xeon with AVX-512 and AMX its own dispatch gave GRPO and LoRA-GRPO other float64
weights than on the AMD EPYC that recorded them (metrics equal; 2026-12-07), whatever
`MKL_CBWR=AVX2` or ATen/oneDNN's kernel switches said. So each run is played in a child
process under MKL's conditional numerical reproducibility mode (`MKL_CBWR=COMPATIBLE`, read
when MKL loads: the same results on every CPU MKL supports), and the digest is taken over the
float32-rounded weights. The pins hold natively and under ATen's AVX2 kernels (the last test
here checks that set on every run); ATen's scalar `default` set (a CPU without AVX2) draws
other noise and does not match.
``COPES_RECORD_PINS=1`` re-records them (with ``-n 0``: the four runs write one file), which
is only right when a change is *meant* to change the numbers (say why in the commit).
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


# MKL's reproducible mode, read when MKL loads (so in a fresh process): see the docstring.
REPRODUCIBLE_MKL = {"MKL_CBWR": "COMPATIBLE"}
# ATen's AVX2 code (an AVX2-only CPU's; on such a CPU it is the native set) and MKL's and
# oneDNN's AVX2 limits: the kernels of another CPU than this one.
OTHER_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
}  # fmt: skip
CHILD = """
import sys, torch
from copes.cli import train_main
torch.set_num_threads(2)  # as the pins were recorded
print(torch.backends.cpu.get_cpu_capability())
sys.exit(train_main(sys.argv[1:]))
"""


def run_pinned(optimizer: str, run_dir: Path, model: Path, kernels: dict[str, str]) -> dict:
    """One pinned run in a fresh interpreter whose torch and MKL read `kernels` at load time;
    returns its summary (weights digest and metrics)."""
    env = {**os.environ, **REPRODUCIBLE_MKL, **kernels}
    args = [*COMMON, *RUNS[optimizer], "--model", str(model), "--output-dir", str(run_dir)]
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    capability = done.stdout.splitlines()[0]
    if kernels.get("ATEN_CPU_CAPABILITY") == "avx2":
        assert capability == "AVX2"  # the switch took: the child ran other kernels
    return run_summary(run_dir)


def check_against_pins(optimizer: str, got: dict) -> None:
    pins = json.loads(PINS.read_text())
    assert got == pins["runs"][optimizer], f"recorded on {pins['recorded_on']}"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(RUNS))
def test_the_same_seeds_give_the_pinned_weights_and_metrics(optimizer, tmp_path):
    from copes.agents.tiny import ensure_tiny_agent

    got = run_pinned(optimizer, tmp_path / optimizer, ensure_tiny_agent(), {})
    if os.environ.get("COPES_RECORD_PINS") == "1":
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins["recorded_on"] = machine_info()  # for the record only: the pins hold anywhere
        pins.setdefault("runs", {})[optimizer] = got
        PINS.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
        return
    check_against_pins(optimizer, got)


@pytest.mark.slow
def test_the_pins_hold_under_other_cpu_kernels(tmp_path):
    """The pinned runs again under ATen's AVX2 kernels (they read the switch at load time),
    so a pin that only holds on one kernel set fails here instead of on the next
    contributor's CPU."""
    if os.environ.get("COPES_RECORD_PINS") == "1":
        pytest.skip("recording pins")
    from copes.agents.tiny import ensure_tiny_agent

    for optimizer in RUNS:  # the shipped agent's pins, also under COPES_TEST_REBUILD
        check_against_pins(
            optimizer,
            run_pinned(optimizer, tmp_path / optimizer, ensure_tiny_agent(), OTHER_KERNELS),
        )
