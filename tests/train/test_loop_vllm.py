"""copes-train with --backend vllm on the tiny agent: the same run as on transformers.

Runs only where vLLM imports (CI's vLLM venv); skipped elsewhere with the reason.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in CI's vLLM venv")

from copes.cli import parse_train_args, train_main
from copes.run_log import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

for _name, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
    os.environ.setdefault(_name, _value)

# GRPO's run: the warm start scores 0 here, so it checks the wiring; the update itself is
# compared with varying rewards in tests/agents/test_vllm.py.
FAST = [
    "--env", "ToolQA-v0", "--batch-size", "2", "--max-new-tokens", "32", "--max-turns", "2",
    "--eval-tasks", "2", "--eval-every", "0", "--num-train-tasks", "20", "--no-progress",
    "--no-tensorboard", "--checkpoint-every", "1", "--dtype", "float32", "--device", "cpu",
]  # fmt: skip


def latest(out):
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text()


def test_a_lowrank_copes_run_batched_on_vllm_and_resumed_ends_with_the_transformers_runs_weights(
    tmp_path, tiny_agent_dir, capsys
):
    """copes-train on vLLM with its population batched as N LoRA adapters in one engine
    batch (`--noise lowrank --population-eval batched`), stopped after step 1 and resumed
    (the master loaded back into the engine), logs the rewards of the sequential
    transformers run and ends on its checksum and checkpoint bytes. On ToolMath the tiny
    agent's members score differently, so the comparison has something to compare. The
    full-rank family on vLLM through copes-train: tests/agents/test_vllm_families.py."""
    copes = [
        "--env", "ToolMath-v0", "--batch-size", "4", "--max-new-tokens", "48",
        "--max-turns", "2", "--invalid-penalty", "0.2", "--eval-tasks", "2",
        "--eval-every", "0", "--num-train-tasks", "20", "--no-progress", "--no-tensorboard",
        "--checkpoint-every", "1", "--dtype", "float32", "--device", "cpu",
        "--model", str(tiny_agent_dir), "--optimizer", "copes", "--population-size", "4",
        "--num-subspaces", "2", "--noise", "lowrank", "--noise-rank", "4", "--sigma", "0.05",
        "--learning-rate", "0.05",
    ]  # fmt: skip
    hf, vllm = tmp_path / "hf", tmp_path / "vllm"
    batched = ["--backend", "vllm", "--population-eval", "batched", "--out-dir", str(vllm)]
    runs = {
        "hf": [["--backend", "hf", "--steps", "2", "--out-dir", str(hf)]],
        "vllm": [[*batched, "--steps", "1"], [*batched, "--steps", "2", "--resume"]],
    }
    summaries = {}
    for backend, commands in runs.items():
        for extra in commands:
            assert train_main([*copes, *extra]) == 0
        out = capsys.readouterr().out  # the summary is the last thing printed
        summaries[backend] = json.loads(out[out.rindex('{\n  "run_dir"') :])
    assert summaries["vllm"]["steps"] == summaries["hf"]["steps"] == 2
    rewards = [e["rewards"] for e in read_jsonl(vllm / "es_log.jsonl")]
    assert rewards == [e["rewards"] for e in read_jsonl(hf / "es_log.jsonl")]
    assert len({r for step in rewards for r in step}) > 1  # the members differ
    assert summaries["vllm"]["checksum"] == summaries["hf"]["checksum"]
    ours, theirs = (
        load_file(str(latest(vllm) / "model.safetensors")),
        load_file(str(latest(hf) / "model.safetensors")),
    )
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(latest(vllm)) is not None


def test_grpo_on_vllm_trains_the_transformers_copy_and_syncs_the_engine(tmp_path, tiny_agent_dir):
    from copes.agents.vllm.policy import hf_state_dict
    from copes.agents.vllm.worker import expected_digest
    from copes.train import Trainer

    grpo = [*FAST, "--model", str(tiny_agent_dir), "--optimizer", "grpo", "--steps", "1",
            "--group-size", "2", "--learning-rate", "1e-3", "--backend", "vllm",
            "--out-dir", str(tmp_path / "grpo")]  # fmt: skip
    config, optimizer, _ = parse_train_args(grpo)
    trainer = Trainer(config, optimizer)
    try:
        trainer.run()
        policy = trainer.policy
        policy.sync_trainable()
        state = {n: t.to(policy.engine_dtype) for n, t in hf_state_dict(policy.model).items()}
        expected = [
            expected_digest(state, policy.layout, s, policy.engine_dtype)
            for s in policy.rank_shards
        ]
        assert policy.engine_digest() == expected
        saved = load_file(str(latest(tmp_path / "grpo") / "model.safetensors"))
        for name, tensor in state.items():
            assert torch.equal(saved[name], tensor), name
    finally:
        trainer.close()
