"""A package outside copes registers its env (a plain-function tool) and its benchmark through
an entry point; copes-train (CoPES) trains on it, copes-eval evaluates it, and TRL's
GRPOTrainer trains the same env through copes.integrations.trl (issue 16's "done means")."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).parent / "fixtures" / "plugin"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """The plugin 'installed': its package and dist-info (with the entry point) on the path."""
    root = tmp_path / "site"
    shutil.copytree(PLUGIN, root)
    monkeypatch.syspath_prepend(str(root))
    from copes import registry

    registry._load_entry_points.cache_clear()
    yield root
    registry._load_entry_points.cache_clear()
    registry._REGISTRY.pop("units", None)
    sys.modules.pop("copes_units_demo", None)


def run(module, args, site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip


def test_the_entry_point_registers_the_benchmark_and_its_env(site):
    from copes.registry import benchmark_names, get_benchmark

    assert "units" in benchmark_names()
    units = get_benchmark("units")
    tasks = units.load_tasks(limit=3)
    assert [t.id for t in tasks] == ["units-5", "units-10", "units-15"]
    assert tasks[0].question == "How many kilograms is 625 g?" and tasks[0].answers == ("0.625",)
    env = units.make_env(tasks)
    first, info = env.reset(options={"task": tasks[0]})
    assert "convert_mass" in first and '"value": number' in first  # the tags prompt's schema
    assert [s["function"]["name"] for s in info["tools"]] == ["python", "convert_mass"]
    observation, *_ = env.step('<convert_mass>{"value": 625, "unit": "g"}</convert_mass>')
    assert observation == "0.625 kg"
    *_, info = env.step("<answer>0.625</answer>")
    assert info["correct"]
    env.close()


@pytest.mark.slow
def test_copes_train_and_copes_eval_run_on_the_plugin_benchmark(site, tmp_path, tiny_agent_dir):
    run_dir = tmp_path / "run"
    done = run("copes.cli", [
        "--optimizer", "copes", "--benchmark", "units", "--model", str(tiny_agent_dir),
        "--steps", "1", "--batch-size", "4", "--population-size", "4", "--num-subspaces", "2",
        "--eval-tasks", "4", "--max-new-tokens", "32", "--max-turns", "2",
        "--output-dir", str(run_dir), "--no-progress", "--no-tensorboard",
    ], site)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((run_dir / "config.json").read_text())["train"]
    assert (config["env"], config["train_split"], config["eval_split"]) == (
        "copes_units_demo/Units-v0",
        "train",
        "test",
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [0]
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()

    out = tmp_path / "eval"
    done = run("copes.evaluation.cli", [
        "--model", str(checkpoint), "--benchmarks", "units", "--limit", "3", "-n", "2",
        "--pass-k", "1,2", "--max-new-tokens", "32", "--output-dir", str(out), "--quiet",
    ], site)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {(s["benchmark"], s["task_id"]) for s in samples} == {
        ("units", "units-5"),
        ("units", "units-10"),
        ("units", "units-15"),
    }


@pytest.mark.slow
def test_trl_grpo_trainer_trains_the_plugin_env_through_copes_rollout(
    site, tmp_path, tiny_agent_dir
):
    trl = pytest.importorskip("trl")
    import gymnasium as gym
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from copes.integrations.trl import CopesRollout, copes_reward
    from copes.registry import get_benchmark

    demo = importlib.import_module("copes_units_demo")
    demo.register()
    tasks = get_benchmark("units").load_tasks(split="train", limit=4)
    rollout = CopesRollout(
        lambda: gym.make(demo.ENV_ID, tasks=tasks, max_turns=2), max_new_tokens=32
    )
    seen = []

    def length_bonus(completions, copes_reward=(), **fields):
        # Rewards that vary within a group, so the step has a gradient whatever the tiny agent
        # answers; copes' own reward rides along in the same fields.
        seen.append(list(copes_reward))
        return [len(str(c)) / 1000 for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=4,
        max_steps=1, learning_rate=1e-3, report_to="none", use_cpu=True, logging_steps=1,
        save_strategy="no", seed=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[copes_reward, length_bonus], args=args,
        train_dataset=rollout.dataset(conversational=False),
        processing_class=AutoTokenizer.from_pretrained(tiny_agent_dir), rollout_func=rollout,
    )  # fmt: skip
    calls = []
    original = rollout.__call__

    def spy(prompts, trainer):
        result = original(prompts, trainer)
        calls.append(result)
        return result

    trainer.rollout_func = spy
    trainer.train()
    rollout.close()
    assert calls, "TRL never called the copes rollout"
    out = calls[0]
    assert len(out["completion_ids"]) == 4 and seen[0] == out["copes_reward"]
    eos = set(trainer.eos_token_ids)
    for ids, mask, reason in zip(
        out["completion_ids"], out["env_mask"], out["copes_end_reason"], strict=True
    ):
        assert len(ids) == len(mask) and sum(mask) > 0
        if reason == "answer":  # answered episodes are not "clipped"
            assert ids[-1] in eos
        elif reason != "invalid":  # out of turns or context after a tool output: clipped
            assert ids[-1] not in eos
        else:  # out of turns on an invalid turn: it ends on what the model sampled last
            assert mask[-1] == 1
    clipped = trainer.state.log_history[0]["completions/clipped_ratio"]
    assert clipped == sum(ids[-1] not in eos for ids in out["completion_ids"]) / 4
    changed = [k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())]
    assert changed, "the GRPO step did not change the weights"
