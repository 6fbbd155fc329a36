"""copes-train end to end on the tiny agent: artifacts, resume after SIGKILL, clear errors."""

import json
import os
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

FAST = [
    "--batch-size", "4", "--max-new-tokens", "48", "--eval-tasks", "8", "--eval-every", "2",
    "--num-train-tasks", "50", "--no-progress", "--no-tensorboard",
]  # fmt: skip
ES_FAST = [*FAST, "--optimizer", "copes", "--population-size", "4", "--num-subspaces", "2",
           "--sigma", "0.02", "--learning-rate", "0.01"]  # fmt: skip


@pytest.fixture
def tiny(tiny_agent_dir):
    return ["--model", str(tiny_agent_dir)]


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def test_copes_train_writes_every_artifact(tmp_path, tiny):
    out = tmp_path / "run"
    code = train_main([*ES_FAST, *tiny, "--steps", "2", "--out-dir", str(out), "--tensorboard",
                       "--checkpoint-every", "1"])  # fmt: skip
    assert code == 0
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in train] == [0, 1] and [r["step"] for r in val] == [0, 2]
    for key in ("reward_mean", "reward_std", "accuracy", "generation_seconds", "tool_seconds",
                "optimizer_seconds", "generated_tokens", "undone_arithmetic_rate"):  # fmt: skip
        assert key in train[0]
    for r in val:  # every validation episode either answered, ran out of turns or went invalid
        assert 0.0 <= r["invalid_rate"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0
        assert 0.0 <= r["undone_arithmetic_rate"] <= 1.0 - r["accuracy"]
        assert 0.0 <= r["tool_use_rate"] <= r["protocol_use_rate"] <= 1.0
    assert [e["step"] for e in read_jsonl(out / "es_log.jsonl")] == [0, 1]
    assert len(read_jsonl(out / "es_log.jsonl")[0]["rewards"]) == 4
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert latest.name == "step-000002"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(latest) is not None  # a normal HF folder
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["budget"]["steps"] == 2 and state["optimizer"]["config"]["num_subspaces"] == 2
    assert json.loads((out / "config.json").read_text())["train"]["optimizer"] == "copes"


def run_cli(args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "copes.cli", *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.slow
def test_es_resume_after_sigkill_is_bit_identical(tmp_path, tiny):
    args = [*ES_FAST, *tiny, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "0"]
    reference = tmp_path / "reference"
    assert train_main([*args, "--out-dir", str(reference)]) == 0

    killed = tmp_path / "killed"
    proc = run_cli([*args, "--out-dir", str(killed)])
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once step 2 is logged but before the run ends
        if len(read_jsonl(killed / "es_log.jsonl")) >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(read_jsonl(killed / "es_log.jsonl")) < 4
    with open(killed / "es_log.jsonl", "a") as log:  # as if killed in the middle of a line
        log.write('{"step": 3, "rewa')
    assert train_main([*args, "--out-dir", str(killed), "--resume"]) == 0

    final_ref = weights_of(reference / "checkpoints" / "step-000004")
    final_res = weights_of(killed / "checkpoints" / "step-000004")
    assert final_ref.keys() == final_res.keys()
    assert all(torch.equal(final_ref[k], final_res[k]) for k in final_ref)
    assert [e["rewards"] for e in read_jsonl(killed / "es_log.jsonl")] == [
        e["rewards"] for e in read_jsonl(reference / "es_log.jsonl")
    ]


@pytest.fixture(scope="module")
def es_reference(tiny_agent_dir, tmp_path_factory):
    """An uninterrupted 2-step CoPES run (checkpoint and validation at the end only)."""
    args = [*ES_FAST, "--model", str(tiny_agent_dir), "--steps", "2", "--checkpoint-every", "0",
            "--eval-every", "0"]  # fmt: skip
    reference = tmp_path_factory.mktemp("es-reference")
    assert train_main([*args, "--out-dir", str(reference)]) == 0
    return args, reference


@pytest.mark.parametrize("lost", ["torn", "never written"])
def test_a_lost_train_record_is_rebuilt_from_es_log_and_a_lost_validation_remade(
    tmp_path, es_reference, lost, caplog
):
    """Killed while appending step 1's train record (a torn last line of metrics.jsonl), or
    between the es_log.jsonl and metrics.jsonl appends (no line at all): --resume replays
    es_log and writes that record rebuilt from it, with the reward numbers and totals of the
    original bit for bit, marked, and without what es_log does not hold; the final
    validation the kill prevented is made with the same weights and draws: equal to the
    uninterrupted run's."""
    import logging
    import shutil

    args, reference = es_reference
    records = read_jsonl(reference / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records] == [
        ("validation", 0), ("train", 0), ("train", 1), ("validation", 2),
    ]  # fmt: skip

    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    shutil.rmtree(killed / "checkpoints")  # killed before the final checkpoint
    lines = (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
    torn = lines[2][: len(lines[2]) // 2] if lost == "torn" else ""
    (killed / "metrics.jsonl").write_text("".join(lines[:2]) + torn)
    with caplog.at_level(logging.WARNING, logger="copes.train"):
        assert train_main([*args, "--out-dir", str(killed), "--resume"]) == 0
    assert "train record of step(s) 1: rebuilt from es_log.jsonl" in caplog.text

    resumed = read_jsonl(killed / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in resumed] == [(r["kind"], r["step"]) for r in records]
    original, rebuilt = records[2], resumed[2]
    assert rebuilt["rebuilt_from"] == "es_log.jsonl"
    for key in ("reward_mean", "reward_std", "reward_max", "generated_tokens",
                "generated_tokens_total", "seconds_total", "cpu_seconds_total"):  # fmt: skip
        assert rebuilt[key] == original[key], key
    assert not {"accuracy", "sigma", "generation_seconds", "tool_seconds"} & set(rebuilt)
    assert resumed[:2] == records[:2] and resumed[3] == records[3]  # the remade validation
    final_ref = weights_of(reference / "checkpoints" / "step-000002")
    final_res = weights_of(killed / "checkpoints" / "step-000002")
    assert all(torch.equal(final_ref[k], final_res[k]) for k in final_ref)


def test_a_cpu_seconds_budget_ends_the_run_and_resume_keeps_counting(tmp_path, tiny):
    """--max-cpu-seconds: the run's own CPU time (every thread's), logged with every record;
    the run ends at the first step that reaches it, and --resume with a larger budget goes on
    from the CPU seconds already spent."""
    out = tmp_path / "run"
    args = [*ES_FAST, *tiny, "--steps", "10000", "--eval-every", "0", "--out-dir", str(out)]
    assert train_main([*args, "--max-cpu-seconds", "2"]) == 0
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    spent = [r["cpu_seconds_total"] for r in train]
    assert spent == sorted(spent) and spent[-1] >= 2 and (len(spent) == 1 or spent[-2] < 2)
    assert len(train) < 10000  # a step costs CPU seconds, not the step budget
    final = out / "checkpoints" / f"step-{len(train):06d}"
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["budget"]["cpu_seconds"] == spent[-1]
    # a budget above what was spent: at least one more step, however slow a step is on this
    # machine's load (CI once took over 2 CPU-s for the first)
    budget = round(spent[-1] + 2.0, 3)
    assert train_main([*args, "--max-cpu-seconds", str(budget), "--resume"]) == 0
    more = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert more[: len(train)] == train and len(more) > len(train)
    assert more[len(train)]["cpu_seconds_total"] > spent[-1]
    assert more[-1]["cpu_seconds_total"] >= budget > more[-2]["cpu_seconds_total"]


def test_validation_and_checkpoints_are_off_the_budget_clocks(tmp_path, tiny, monkeypatch):
    """A budget buys training steps: a slow validation adds nothing to seconds_total or
    cpu_seconds_total, so methods that validate at other spacings get the same training
    time. The validation here moves the trainer's wall and CPU clocks on by an hour each
    (a clock shim, not a real hour), so a leak is unmistakable on any load."""
    import types

    from copes.train import loop
    from copes.train.loop import Trainer

    hour = [0.0]
    clocks = types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + hour[0],
        process_time=lambda: time.process_time() + hour[0],
    )
    monkeypatch.setattr(loop, "time", clocks)
    validate = Trainer.validate

    def slow_validate(self):
        hour[0] += 3600.0
        return validate(self)

    monkeypatch.setattr(Trainer, "validate", slow_validate)
    out = tmp_path / "run"
    assert train_main([*ES_FAST, *tiny, "--steps", "2", "--eval-every", "1",
                       "--out-dir", str(out)]) == 0  # fmt: skip
    assert hour[0] == 3 * 3600.0  # the shim was the trainer's clock, three validations ran
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in val] == [0, 1, 2]  # two of them between or after the steps
    for key in ("seconds_total", "cpu_seconds_total"):
        step_1, both = train[0][key], train[1][key]
        assert 0 < step_1 < both < 600, (key, step_1, both)  # no validation's hour inside
    assert [r["seconds_total"] for r in val[1:]] == [r["seconds_total"] for r in train]


def test_errors_are_clear(tmp_path, tiny, capsys):
    assert train_main(["--optimizer", "adam"]) == 2
    assert "unknown optimizer" in capsys.readouterr().err
    assert train_main(["--env", "NoSuchEnv-v0"]) == 2
    assert "unknown env 'NoSuchEnv-v0'" in capsys.readouterr().err
    assert train_main(["--env", "CartPole-v1"]) == 2
    assert "--env CartPole-v1 has no default tasks" in capsys.readouterr().err
    out = str(tmp_path / "cartpole")
    assert (
        train_main(["--env", "CartPole-v1", "--benchmark", "synthetic-math", "--out-dir", out]) == 2
    )
    assert "not a copes ToolEnv" in capsys.readouterr().err
    assert train_main(["--env-kwargs", '{"max_turns": 2}']) == 2
    assert "--max-turns" in capsys.readouterr().err
    assert train_main(["--steps", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    assert train_main(["--model", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "r")]) == 2
    assert "could not load model" in capsys.readouterr().err
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\nnot json\n')
    code = train_main([*tiny, "--benchmark", "gsm8k", "--data-dir", str(bad),
                       "--out-dir", str(tmp_path / "r2")])  # fmt: skip
    assert code == 2
    assert "gsm8k.jsonl" in capsys.readouterr().err


def test_existing_run_needs_resume(tmp_path, tiny, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    assert train_main([*ES_FAST, *tiny, "--steps", "1", "--out-dir", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_config_file_and_dry_run(tmp_path, tiny, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("optimizer: es\npopulation-size: 6\nsteps: 3\n")
    assert train_main(["--config", str(config), *tiny, "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["train"]["optimizer"] == "es"
    assert (plan["optimizer"]["population_size"], plan["optimizer"]["num_subspaces"]) == (6, 1)
    memory = plan["memory_bytes"]
    assert {"es", "copes", "grpo", "lora-grpo"} <= set(memory)
    assert memory["grpo"]["optimizer_states"] > 0 == memory["copes"]["optimizer_states"]
    assert memory["copes"]["total"] > 0
    toml = tmp_path / "run.toml"
    toml.write_text('optimizer = "grpo"\nsteps = 2\nbogus = 1\n')
    with pytest.raises(SystemExit):
        train_main(["--config", str(toml), "--dry-run"])


GRPO_FAST = [*FAST, "--group-size", "2", "--learning-rate", "1e-4", "--batch-size", "2",
             "--micro-batch-size", "4"]  # fmt: skip


@pytest.mark.parametrize("optimizer", ["grpo", "lora-grpo"])
def test_grpo_runs_and_resumes_from_its_last_checkpoint(tmp_path, tiny, optimizer):
    out = tmp_path / optimizer
    base = [*GRPO_FAST, *tiny, "--optimizer", optimizer, "--out-dir", str(out),
            "--checkpoint-every", "1", "--eval-every", "0"]  # fmt: skip
    assert train_main([*base, "--steps", "1"]) == 0
    first = json.loads((out / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert first["optimizer"]["step_count"] == 1
    assert train_main([*base, "--steps", "2", "--resume"]) == 0
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [0, 1]  # resumed at step 1, not from scratch
    val = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "validation"]
    assert val == [0, 1, 2]  # step 1's, made with the weights resumed from, is kept
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["optimizer"]["step_count"] == 2 and state["budget"]["steps"] == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-000002")
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged, plain HF


@pytest.mark.parametrize("same_batch", [True, False])
def test_es_members_share_tasks_and_sampling_draws_with_the_same_batch(tiny_policy, same_batch):
    """Common random numbers: with `same_batch`, sampled (T > 0) ES members see the same
    tasks and the same draws, so identical weights give identical rewards; without it, each
    member gets its own tasks."""
    from copes.agents.policy import SamplingConfig
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks
    from copes.train import TaskRollout

    tasks = synthetic_math_tasks("train", 40, seed=5)
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0)
    make_env = lambda: tool_math_env(tasks=tasks[:1])  # noqa: E731
    rollouts = TaskRollout(make_env, tasks, 4, 1, sampling, 7, same_batch=same_batch)
    try:
        first, second = (rollouts(tiny_policy, 3, member=m) for m in (0, 1))
    finally:
        rollouts.close()
    if same_batch:
        assert [(t.messages, t.reward) for t in first] == [(t.messages, t.reward) for t in second]
    else:
        assert [t.messages[0] for t in first] != [t.messages[0] for t in second]


def test_eval_task_seed_fixes_the_validation_split_across_seeds():
    from copes.train import TrainConfig, load_tasks_for

    def validation(seed, eval_task_seed=None):
        config = TrainConfig(seed=seed, eval_task_seed=eval_task_seed)
        return [t.question for t in load_tasks_for(config, "validation", 8, config.eval_task_seed)]

    assert validation(0) != validation(1)  # by default the split follows --seed
    assert validation(0, eval_task_seed=7) == validation(1, eval_task_seed=7)


@pytest.mark.slow
def test_resume_accepts_a_setting_added_since_at_its_default_and_refuses_a_change(
    tmp_path, tiny, capsys
):
    """A run written before --noise existed resumes (its noise was the default, full);
    asking for --noise lowrank on resume changes what is trained: refused, named."""
    out = tmp_path / "run"
    args = [*ES_FAST, *tiny, "--eval-every", "0", "--out-dir", str(out)]
    assert train_main([*args, "--steps", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    for key in ("noise", "noise_rank"):
        del config["optimizer"][key]
    (out / "config.json").write_text(json.dumps(config))
    assert train_main([*args, "--steps", "1", "--resume", "--noise", "lowrank"]) == 2
    assert "noise: 'full' -> 'lowrank'" in capsys.readouterr().err
    assert train_main([*args, "--steps", "2", "--resume"]) == 0
    assert [e["step"] for e in read_jsonl(out / "es_log.jsonl")] == [0, 1]


@pytest.mark.parametrize(
    ("optimizer", "flags"),
    [
        ("es", ["--population-size", "4", "--sigma", "0.02", "--learning-rate", "0.01"]),
        ("copes", ES_FAST[ES_FAST.index("--population-size") :]),
        ("grpo", ["--group-size", "2"]),
        ("lora-grpo", ["--group-size", "2"]),
    ],
)
def test_every_optimizer_trains_in_bfloat16_on_the_cpu(tmp_path, tiny, optimizer, flags):
    from copes.agents.hf.policy import HFPolicy

    out = tmp_path / optimizer
    args = [*FAST, *flags, *tiny, "--optimizer", optimizer, "--steps", "2", "--eval-every", "0",
            "--dtype", "bfloat16", "--device", "cpu", "--out-dir", str(out)]  # fmt: skip
    assert train_main(args) == 0
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    weights = weights_of(latest)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    base = HFPolicy.from_pretrained(tiny[1], device="cpu", dtype="bfloat16").model.state_dict()
    changed = [n for n, t in weights.items() if n in base and not torch.equal(t, base[n])]
    assert changed  # two steps moved the bf16 weights
    if optimizer in ("es", "copes"):  # the fp32 master is kept beside the bf16 weights
        master = load_file(str(latest / "es_master.safetensors"))
        assert {t.dtype for t in master.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["train"]["dtype"] == "bfloat16"


def test_dtype_auto_records_the_dtype_it_picked(tmp_path, tiny, monkeypatch):
    import copes.agents.loading as loading

    monkeypatch.setattr(loading, "cpu_auto_dtype", lambda: ("bfloat16", "a test's CPU"))
    out = tmp_path / "auto"
    args = [*ES_FAST, *tiny, "--steps", "1", "--eval-every", "0", "--dtype", "auto",
            "--device", "cpu", "--out-dir", str(out)]  # fmt: skip
    assert train_main(args) == 0
    assert json.loads((out / "config.json").read_text())["train"]["dtype"] == "bfloat16"
    monkeypatch.setattr(loading, "cpu_auto_dtype", lambda: ("float32", "another CPU"))
    resumed = train_main([*args, "--resume", "--steps", "2"])
    assert resumed == 2  # auto picks float32 there: the run's dtype would change


def test_demonstrations_are_prompt_recorded_and_checked_on_resume(tmp_path, tiny):
    out = tmp_path / "demo"
    args = [*ES_FAST, *tiny, "--steps", "1", "--eval-every", "0", "--demonstrations", "2",
            "--out-dir", str(out)]  # fmt: skip
    assert train_main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["demonstrations"] == 2
    messages = config["demonstrations"]["messages"]
    assert [m["role"] for m in messages][:4] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "<python>print(37 * 48 - 259)</python>"
    assert messages[2]["content"] == "1517"  # the sandbox really ran it
    assert train_main([*args, "--resume", "--steps", "2"]) == 0
    assert train_main([*args, "--resume", "--steps", "3", "--demonstrations", "1"]) == 2
