"""copes-eval --backend vllm: the same greedy evaluation as on transformers.

Runs only where vLLM imports (CI's vLLM venv); skipped elsewhere with the reason.
"""

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in CI's vLLM venv")

from copes.evaluation.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

for _name, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
    os.environ.setdefault(_name, _value)


def test_greedy_pass_at_1_and_samples_match_the_transformers_backend(tmp_path, tiny_agent_dir):
    common = ["--model", str(tiny_agent_dir), "--benchmarks", "synthetic-math,synthetic-qa",
              "--limit", "3", "-n", "1", "--pass-k", "1", "--temperature", "0",
              "--max-new-tokens", "32", "--max-turns", "2", "--dtype", "float32",
              "--device", "cpu", "--quiet"]  # fmt: skip
    for backend in ("hf", "vllm"):
        assert main([*common, "--backend", backend, "--out", str(tmp_path / backend)]) == 0
    reports = {b: json.loads((tmp_path / b / "report.json").read_text()) for b in ("hf", "vllm")}
    for name, result in reports["hf"]["benchmarks"].items():
        assert reports["vllm"]["benchmarks"][name]["pass_at_k"] == result["pass_at_k"]
    samples = {
        b: sorted(
            (
                json.loads(line)
                for line in (tmp_path / b / "samples.jsonl").read_text().splitlines()
            ),
            key=lambda r: (r["benchmark"], r["task_id"], r["sample"]),
        )
        for b in ("hf", "vllm")
    }
    keys = ("benchmark", "task_id", "sample", "prediction", "correct", "reward", "turns",
            "tool_calls", "end_reason", "generated_tokens")  # fmt: skip
    assert len(samples["vllm"]) == len(samples["hf"]) == 6
    for ours, theirs in zip(samples["vllm"], samples["hf"], strict=True):
        assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}


def test_the_engine_gets_the_kv_space_the_batch_needs(tiny_agent_dir, monkeypatch):
    """Not a share of the host's RAM (vLLM's default on a CPU): copes' formula reaches the
    engine's own cache config (--kv-cache-gib sets the same field by hand)."""
    from transformers import AutoConfig

    from copes.agents.loading import load_policy
    from copes.agents.vllm.kv_space import cpu_kv_cache_bytes, kv_bytes_per_token

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vLLM's legacy override
    config = AutoConfig.from_pretrained(tiny_agent_dir)
    expected = cpu_kv_cache_bytes(kv_bytes_per_token(config, 4), config.max_position_embeddings, 8)
    policy = load_policy(str(tiny_agent_dir), backend="vllm", device="cpu", dtype="float32", rows=8)
    try:
        assert policy.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == expected
    finally:
        policy.close()
