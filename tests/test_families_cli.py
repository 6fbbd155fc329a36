"""`copes-train` (es, copes, grpo) and `copes-eval` on a tiny trained model of every real
family (tests/families.py), in tags and with `--call-format native` (resolved by round trip;
hermes for the families whose template round-trips none): the tool really runs, and the
memorized episode scores (1 for the answer, -0.1 for the invalid turn)."""

import json

import pytest

from copes.cli import train_main
from copes.evaluation.cli import main as eval_main

FAMILY_NAMES = [
    "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "llama", "gemma3",
    "llama3_1", "mistral_nemo", "gpt_oss", "phi4_mini", "granite3_3", "glm4_5", "r1_distill",
]  # fmt: skip

pytestmark = pytest.mark.slow


def families_module():
    import families

    return families


@pytest.fixture
def data_dir(family_data_dir):
    return family_data_dir


def model_flags(family_dir, name, call_format="native"):
    families = families_module()
    family = families.FAMILIES[name]
    call_format = family.cli_call_format if call_format == "native" else call_format
    flags = ["--model", str(family_dir(name)), "--call-format", call_format]
    if family.template_kwargs:
        flags += ["--chat-template-kwargs", json.dumps(family.template_kwargs)]
    return flags


# The call format is the rollouts', not the optimizer's: ES and CoPES read only the rewards
# of the same episodes (CoPES is ES with subspaces), so ES in tags would repeat CoPES in tags
# and runs natively only; GRPO, which trains on the tokens, runs in both.
RUNS = [("native", "es"), ("native", "copes"), ("native", "grpo"), ("tags", "copes"),
        ("tags", "grpo")]  # fmt: skip


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize(("call_format", "optimizer"), RUNS)
def test_copes_train_runs_a_step_on_each_family(
    family_dir, data_dir, tmp_path, name, optimizer, call_format
):
    out = tmp_path / "run"
    extra = {
        "es": ["--population-size", "2", "--sigma", "1e-4"],
        "copes": ["--population-size", "2", "--num-subspaces", "2", "--sigma", "1e-4"],
        "grpo": ["--group-size", "2", "--learning-rate", "1e-6", "--temperature", "1.0"],
    }[optimizer]
    code = train_main(
        [
            *model_flags(family_dir, name, call_format), "--optimizer", optimizer,
            "--env", "ToolMath-v0",
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
@pytest.mark.parametrize("call_format", ["native", "tags"])
def test_copes_eval_scores_the_native_tool_episode(
    family_dir, data_dir, tmp_path, name, call_format
):
    out = tmp_path / "eval"
    code = eval_main(
        [
            *model_flags(family_dir, name, call_format), "--benchmarks", "gsm8k",
            "--data-dir", str(data_dir),
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


@pytest.mark.parametrize("name", ["phi4_mini", "granite3_3", "r1_distill", "gemma3"])
def test_native_is_refused_in_one_line_where_no_format_round_trips(
    family_dir, data_dir, tmp_path, capsys, name
):
    """Templates that render no structured call copes can parse back are refused, naming
    what to use, and nothing is written."""
    out = tmp_path / "run"
    code = train_main(
        [
            "--model", str(family_dir(name)), "--call-format", "native", "--optimizer", "es",
            "--env", "ToolMath-v0", "--benchmark", "gsm8k", "--data-dir", str(data_dir),
            "--train-split", "test", "--num-train-tasks", "1", "--steps", "1",
            "--device", "cpu", "--out-dir", str(out), "--no-tensorboard", "--no-progress",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "use --call-format tags" in err[0] and "Traceback" not in err[0]
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_dry_run_plans_every_family(family_dir, capsys, name):
    """`--dry-run` plans each family's model from its config alone (meta device): the count
    is the built model's, layer types and experts are reported."""
    from transformers import AutoModelForCausalLM

    folder = family_dir(name)
    assert train_main(["--model", str(folder), "--optimizer", "copes", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert plan["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    config = families_module().FAMILIES[name].config
    if types := config.get("layer_types"):
        assert plan["model"]["layer_types"] == {t: types.count(t) for t in set(types)}
    moe = any(k in config for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    assert ("experts" in plan["model"]) == moe
    if moe:
        assert plan["model"]["active_parameters"] < plan["model"]["parameters"]
    assert plan["memory_bytes"]
