"""`copes-train` (es, copes, grpo) and `copes-eval` on a tiny trained model of every real
family (tests/families.py), with the model's native tool-call format: the tool really runs,
and the memorized episode scores (1 for the answer, -0.1 for the invalid turn)."""

import json

import pytest

from copes.cli import train_main
from copes.evaluation.cli import main as eval_main

FAMILY_NAMES = ["qwen2", "qwen3", "qwen3_moe", "qwen3_5", "llama", "gemma3"]

pytestmark = pytest.mark.slow


def families_module():
    import families

    return families


@pytest.fixture
def data_dir(family_data_dir):
    return family_data_dir


def model_flags(family_dir, name):
    families = families_module()
    family = families.FAMILIES[name]
    flags = ["--model", str(family_dir(name)), "--call-format", family.call_formats[1]]
    if family.template_kwargs:
        flags += ["--chat-template-kwargs", json.dumps(family.template_kwargs)]
    return flags


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("optimizer", ["es", "copes", "grpo"])
def test_copes_train_runs_a_step_on_each_family(family_dir, data_dir, tmp_path, name, optimizer):
    out = tmp_path / "run"
    extra = {
        "es": ["--population-size", "2", "--sigma", "1e-4"],
        "copes": ["--population-size", "2", "--num-subspaces", "2", "--sigma", "1e-4"],
        "grpo": ["--group-size", "2", "--learning-rate", "1e-6", "--temperature", "1.0"],
    }[optimizer]
    code = train_main(
        [
            *model_flags(family_dir, name), "--optimizer", optimizer, "--env", "ToolMath-v0",
            "--benchmark", "gsm8k", "--data-dir", str(data_dir), "--train-split", "test",
            "--eval-split", "test", "--num-train-tasks", "1", "--eval-tasks", "1",
            "--batch-size", "1", "--steps", "1", "--max-turns", "3", "--max-new-tokens", "64",
            "--invalid-penalty", "0.1", "--device", "cpu", "--out-dir", str(out),
            "--no-tensorboard", "--no-progress", *extra,
        ]
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if r.get("kind") == "validation"]
    assert [r for r in records if r.get("kind") == "train"], records
    first = validations[0]
    assert first["accuracy"] == 1.0 and first["reward_mean"] == pytest.approx(0.9), first


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_copes_eval_scores_the_native_tool_episode(family_dir, data_dir, tmp_path, name):
    out = tmp_path / "eval"
    code = eval_main(
        [
            *model_flags(family_dir, name), "--benchmarks", "gsm8k", "--data-dir", str(data_dir),
            "--pass-k", "1", "-n", "1", "--temperature", "0", "--max-turns", "3",
            "--max-new-tokens", "64", "--device", "cpu", "--out", str(out), "--quiet",
            "--save-messages",
        ]
    )  # fmt: skip
    assert code == 0
    [sample] = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sample["correct"], sample
    tool_messages = [m for m in sample["messages"] if m["role"] == "tool"]
    assert [m["content"].strip() for m in tool_messages] == ["408"]  # the sandbox ran it
