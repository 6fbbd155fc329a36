"""The benchmark scripts: their report logic on hand-made runs, and each end to end (small)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copes.run_log import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _learning_report import markdown, run_curve, summarize  # noqa: E402


def record(method, seed, tokens, accuracy, passk=None):
    seconds, reward = [t / 100 for t in tokens], [a - 0.1 for a in accuracy]
    return {
        "spec": {"method": method, "seed": seed},
        "curve": {"tokens": tokens, "seconds": seconds, "accuracy": accuracy, "reward": reward},
        "pass_at_k": passk or {"pass@1": accuracy[-1], "pass@4": min(1.0, 2 * accuracy[-1])},
    }


def test_the_step_that_crosses_the_budget_is_credited_at_the_budget():
    curve, overshoot = run_curve(record("es", 0, [0, 600, 1200], [0.1, 0.2, 0.3]), "tokens", 1000)
    assert curve.budgets == (0, 600, 1000) and curve.accuracies == (0.1, 0.2, 0.3)
    assert overshoot == 200
    exact, none = run_curve(record("es", 0, [0, 500, 1000], [0.1, 0.2, 0.3]), "tokens", 1000)
    assert exact.budgets == (0, 500, 1000) and none == 0


def test_summary_of_hand_made_runs():
    # GRPO peaks at 500 tokens (mean 0.5 from 0.1: gain 0.4); CoPES has 0.3 by then (gain
    # 0.2: 50%) and ES 0.2 (25%). Target = base + 0.4 / 2 = 0.3: CoPES reaches it at 400,
    # ES at 1000 (2.5x).
    records = (
        [record("grpo", s, [0, 250, 500, 1000], [0.1, 0.3, 0.5, 0.4]) for s in (0, 1)]
        + [record("copes-k4", s, [0, 400, 800, 1000], [0.1, 0.3, 0.35, 0.4]) for s in (0, 1)]
        + [record("es", s, [0, 400, 1000], [0.1, 0.2, 0.3]) for s in (0, 1)]
    )
    records.append({"spec": {"method": "es", "seed": 2}, "error": "Traceback: boom"})
    out = summarize(records, ["grpo", "copes-k4", "es"], "tokens", 1000)
    assert out["reference_best_budget"] == 500 and out["target_gain"] == pytest.approx(0.2)
    methods = out["methods"]
    assert methods["grpo"]["gain_recovered"]["fraction"] == pytest.approx(1.0)
    assert methods["copes-k4"]["gain_recovered"]["fraction"] == pytest.approx(0.5)
    assert methods["es"]["gain_recovered"]["fraction"] == pytest.approx(0.25)
    assert methods["copes-k4"]["budget_to_target"]["mean_of_reached"] == 400
    assert methods["es"]["budget_to_target"]["mean_of_reached"] == 1000
    assert out["speedup_to_target"]["es/copes-k4"] == pytest.approx(2.5)
    assert methods["es"]["seeds"] == 2 and out["failed_runs"][0]["seed"] == 2
    assert methods["grpo"]["final_accuracy"]["mean"] == pytest.approx(0.4)
    assert methods["es"]["pass_at_k"]["pass@4"]["mean"] == pytest.approx(0.6)
    assert len(methods["es"]["curve"]) == len(out["grid"])
    assert methods["grpo"]["base_reward"]["mean"] == pytest.approx(0.0)
    assert methods["grpo"]["final_reward"]["mean"] == pytest.approx(0.3)  # last, not best
    table = markdown(out, "hand-made")
    assert "| copes-k4 | 2 |" in table and "es/copes-k4 = 2.50x" in table
    assert "| 0.000 [0.000, 0.000] | 0.300 [0.300, 0.300] |" in table  # GRPO: base, final reward
    # Records graded before issue 48 lack the undone-arithmetic curve: n/a, never a 0.
    assert methods["grpo"]["final_undone_arithmetic"] is None
    assert "| 0.300 [0.300, 0.300] | n/a |" in table
    for r in records[:2]:  # GRPO's seeds at their last validation: 0.25 and 0.05 refused
        r["curve"]["undone_arithmetic"] = [0.0, 0.0, 0.1, 0.25 if r["spec"]["seed"] else 0.05]
    undone = summarize(records, ["grpo", "es"], "tokens", 1000)["methods"]
    assert undone["grpo"]["final_undone_arithmetic"]["mean"] == pytest.approx(0.15)
    assert undone["es"]["final_undone_arithmetic"] is None
    # An ES seed that never reaches the target: no ratio over the seeds that happened to.
    stuck = record("es", 3, [0, 400, 1000], [0.1, 0.1, 0.1])
    partial = summarize([*records, stuck], ["grpo", "copes-k4", "es"], "tokens", 1000)
    assert partial["methods"]["es"]["budget_to_target"]["reached"] == 2
    assert partial["speedup_to_target"]["es/copes-k4"] is None
    assert "es/copes-k4 = n/a" in markdown(partial, "partial")


def run_script(*args, timeout=600):
    proc = subprocess.run(
        [sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def check_interval(entry):
    assert entry["n"] >= 1
    if entry["low"] is not None:
        assert entry["low"] <= entry["mean"] <= entry["high"]


@pytest.mark.slow
def test_learning_quick_end_to_end_resumes_a_killed_run(tmp_path, tiny_agent_dir):
    """One quick run of the three methods (budget 1,500 tokens: 2-3 steps each). It is
    killed after ES's first step and run again: ES resumes where the kill left it (its steps
    replayed, then continued), the others train; a third invocation trains nothing again,
    and another budget is refused beside the finished runs."""
    args = [BENCHMARKS / "learning.py", "--quick", "--budget", "1500", "--model",
            tiny_agent_dir, "--runs-dir", tmp_path / "runs",
            "--results-dir", tmp_path / "results"]  # fmt: skip
    log = tmp_path / "runs" / "es-seed0" / "es_log.jsonl"
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 1):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "runs" / "es-seed0" / "result.json").exists()
    run_script(*args)
    records = read_jsonl(tmp_path / "runs" / "es-seed0" / "metrics.jsonl")
    steps = [e["step"] for e in read_jsonl(log)]
    assert steps == list(range(len(steps))) and len(steps) >= 2  # replayed, then continued
    validated = [r["step"] for r in records if r["kind"] == "validation"]
    assert validated == sorted(set(validated)) and validated[0] == 0
    out = json.loads((tmp_path / "results" / "learning-quick.json").read_text())
    assert (tmp_path / "results" / "learning-quick.png").stat().st_size > 5000
    assert "| grpo |" in (tmp_path / "results" / "learning-quick.md").read_text()
    assert set(out["methods"]) == {"es", "copes-k2", "grpo"} and not out["failed_runs"]
    for name, entry in out["methods"].items():
        assert entry["seeds"] == 1 and len(entry["curve"]) == len(out["grid"])
        for point in entry["curve"]:
            check_interval(point)
            assert 0 <= point["mean"] <= 1
        for k, value in entry["pass_at_k"].items():
            assert k in ("pass@1", "pass@2") and 0 <= value["mean"] <= 1
        assert entry["pass_at_k"]["pass@1"]["mean"] <= entry["pass_at_k"]["pass@2"]["mean"]
        assert entry["overshoot_max"] >= 0
        if out["reference_best_budget"] is not None and name == "grpo":
            fraction = entry["gain_recovered"]["fraction"]
            assert fraction is None or fraction == pytest.approx(1.0)
    for spec in out["hyperparameters"].values():
        assert "learning_rate" in spec
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert [d.name for d in run_dirs] == ["copes-k2-seed0", "es-seed0", "grpo-seed0"]
    for d in run_dirs:  # at least two steps each: a curve, not a point
        assert len([r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "train"]) >= 2
    stamps = [(d / "result.json").stat().st_mtime_ns for d in run_dirs]
    again = run_script(*args)  # every run finished: nothing is trained again
    assert again.count(": done") == 3
    assert [(d / "result.json").stat().st_mtime_ns for d in run_dirs] == stamps
    other_budget = subprocess.run(
        [sys.executable, *map(str, args), "--budget", "3000"], cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert other_budget.returncode != 0 and "holds a finished run" in other_budget.stderr


@pytest.mark.slow
def test_memory_small_end_to_end(tmp_path, tiny_agent_dir):
    out_file = tmp_path / "memory.json"
    run_script(BENCHMARKS / "memory.py", "--model", tiny_agent_dir, "--lengths", "48", "96",
               "--optimizers", "es", "grpo", "--out", out_file)  # fmt: skip
    out = json.loads(out_file.read_text())
    measured = {(m["optimizer"], m["length"]): m for m in out["measured"]}
    assert set(measured) == {("es", 48), ("es", 96), ("grpo", 48), ("grpo", 96)}
    for m in measured.values():
        assert "error" not in m, m.get("error")
        assert m["peak_during_step_mib"] >= m["rss_before_step_mib"] > 50
        assert m["ru_maxrss_mib"] >= m["peak_during_step_mib"] - 1
    # GRPO holds gradients and AdamW states on top of what ES holds
    assert measured[("grpo", 96)]["step_increase_mib"] > measured[("es", 96)]["step_increase_mib"]
    plain = out["theory"]["variants"]["batch 1"]
    assert [r["seq_len"] for r in plain["rows_gib"]] == [8192, 32768, 131072]
    assert plain["claim_copes_below_one_eighth"] == [r["grpo/copes"] > 8 for r in plain["rows_gib"]]


@pytest.mark.slow
def test_es_overhead_small_end_to_end(tmp_path, tiny_agent_dir):
    out_file = tmp_path / "overhead.json"
    run_script(BENCHMARKS / "es_overhead.py", "--model", tiny_agent_dir, "--population", "4",
               "--batch-size", "2", "--steps", "1", "--subspaces", "1", "2",
               "--max-new-tokens", "32", "--out", out_file)  # fmt: skip
    out = json.loads(out_file.read_text())
    assert set(out["runs"]) == {"es", "copes-k2"}
    for run in out["runs"].values():
        assert [s["step"] for s in run["steps"]] == [0, 1]
        for s in run["steps"]:
            parts = s["generation"] + s["environment"] + s["perturb_restore"] + s["update"]
            assert 0 < parts <= s["total"] + 1e-6 and s["other"] >= -1e-6
            assert s["perturb_restore"] > 0 and s["update"] > 0 and s["generation"] > 0
            assert s["grading_summed"] > 0  # every episode ends in a graded answer or a cut
        mean = run["mean"]
        assert mean["weight_fraction"] == pytest.approx(
            (mean["perturb_restore"] + mean["update"]) / mean["total"]
        )


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_population_batch_small_end_to_end(tmp_path, tiny_agent_dir, noise):
    """float64: batched and sequential evaluation give the same rewards and episodes (the
    low-rank family too, served as adapters); with worked examples before each task and the
    raw `generate` baseline of the batched step's tokens."""
    out_file = tmp_path / "population_batch.json"
    run_script(BENCHMARKS / "population_batch.py", "--model", tiny_agent_dir, "--dtype",
               "float64", "--population-size", "4", "--tasks", "3", "--steps", "1",
               "--max-new-tokens", "32", "--rows", "0", "4", "--threads", "1",
               "--noise", noise, "--noise-rank", "2", "--demonstrations", "1",
               "--raw-generate", "--out", out_file)  # fmt: skip
    out = json.loads(out_file.read_text())
    assert out["noise"] == noise and out["noise_rank"] == (2 if noise == "lowrank" else 0)
    assert out["demonstrations"] == 1 and out["batched_over_raw"] > 0
    assert out["batched_over_mean_length"] > 0
    assert all(
        r["raw_generate_seconds"] > 0 and r["mean_length_generate_seconds"] > 0 for r in out["runs"]
    )
    assert out["rows"] == 12 and set(out["by_rows"]) == {"12", "4"}
    assert out["rewards_match"] == 1.0 and out["episodes_identical"] == 1.0
    assert out["ratio"] == out["by_rows"]["12"]["ratio"] > 0
    assert all(r["sequential_seconds"] > 0 and r["batched_seconds"] > 0 for r in out["runs"])


@pytest.mark.slow
def test_serve_overhead_small_end_to_end(tmp_path, tiny_agent_dir):
    """A small served step beside the in-process one, deterministic and as they come with 1 and
    all sessions in flight: the same rewards and episodes (float64), and every figure the JSON
    promises."""
    out_file = tmp_path / "serve_overhead.json"
    run_script(BENCHMARKS / "serve_overhead.py", "--model", tiny_agent_dir, "--dtype",
               "float64", "--population-size", "4", "--tasks", "3", "--in-flight", "1", "all",
               "--max-new-tokens", "32", "--threads", "1", "--repeats", "2",
               "--out", out_file)  # fmt: skip
    out = json.loads(out_file.read_text())
    rows = out["rows"]
    for name in ("served_deterministic_all", "served_as_they_come_1", "served_as_they_come_all"):
        row = rows[name]
        assert row["episodes_identical"] == 1.0 and row["rewards_identical"] == 1.0, name
        assert row["requests"] >= 12 and row["tokens_per_second"] > 0  # every session asked
        assert len(row["seconds_each"]) == 2 and min(row["seconds_each"]) <= row["seconds"]
        assert 0 < row["turn_latency_p50"] <= row["turn_latency_p95"]
    for name in ("in_process_batched", "in_process_sequential_members",
                 "in_process_one_at_a_time"):  # fmt: skip
        assert rows[name]["seconds"] > 0 and rows[name]["generated_tokens"] > 0
    assert set(out["ratios"]) == {"1_in_flight", "all_in_flight", "deterministic_all"}
    assert out["ratios"]["1_in_flight"]["against"] == "in_process_one_at_a_time"
    assert all(r["ratio"] > 0 for r in out["ratios"].values())


def test_weight_ops_small_end_to_end(tmp_path, tiny_agent_dir):
    """The shipped weight engine beside its two predecessors on the tiny agent: the same members
    and the same update, bit for bit, and every figure the JSON promises."""
    out_file = tmp_path / "weight_ops.json"
    run_script(BENCHMARKS / "weight_ops.py", "--model", tiny_agent_dir, "--dtype", "float32",
               "--population-size", "4", "--num-subspaces", "1", "2", "--threads", "1",
               "--out", out_file)  # fmt: skip
    out = json.loads(out_file.read_text())
    assert [r["num_subspaces"] for r in out["rows"]] == [1, 2] and out["parameters"] > 0
    for row in out["rows"]:
        assert row["members_identical"] and row["update_identical"]
        assert row["speedup_update_vs_previous"] > 0
        for engine in ("shipped", "previous", "redrawing"):
            assert len(row[engine]["perturb_restore_seconds_each"]) == 4
            assert row[engine]["update_seconds"] > 0
    assert out["worst_seconds_per_member"] > 0 and "target_met" in out


def test_a_cpu_seconds_budget_reaches_the_trainer_and_the_curves(tmp_path):
    """--budget-kind cpu-seconds: each run's own CPU seconds bound it (max_cpu_seconds), and
    its validation curve is read in CPU seconds."""
    from _learning_runs import RunSpec, curve_of, train_config

    spec = RunSpec(method="es", seed=0, settings={"optimizer": "es"}, run_dir=str(tmp_path),
                   model="tiny", env="ToolMath-v0", budget_kind="cpu-seconds",
                   budget=30)  # fmt: skip
    config = train_config(spec)
    assert config.max_cpu_seconds == 30 and config.max_seconds is None
    assert config.max_tokens is None
    rows = [{"kind": "validation", "step": s, "generated_tokens_total": 10 * s,
             "seconds_total": 2.0 * s, "cpu_seconds_total": 3.0 * s, "accuracy": 0.1 * s,
             "reward_mean": 0.0} for s in (0, 1, 2)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = curve_of(tmp_path)
    assert curve["cpu-seconds"] == [0.0, 3.0, 6.0] and curve["seconds"] == [0.0, 2.0, 4.0]
    cut, overshoot = run_curve({"curve": curve}, "cpu-seconds", 5.0)
    assert cut.budgets == (0.0, 3.0, 5.0) and overshoot == 1.0


def test_signal_of_says_what_the_steps_had_to_learn_from(tmp_path):
    """ES: a step whose members all scored alike is tied; GRPO: a step whose every group had
    zero variance is; members with a positive reward come from the seed log."""
    from _learning_runs import signal_of

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("metrics.jsonl", [{"kind": "validation", "step": 0, "accuracy": 0.0}])
    assert signal_of(tmp_path) == {}  # no step yet
    write("metrics.jsonl", [
        {"kind": "validation", "step": 0, "accuracy": 0.5, "reward_std": 9.0},
        {"kind": "train", "step": 0, "accuracy": 0.0, "reward_std": 0.0},
        {"kind": "train", "step": 1, "accuracy": 0.25, "reward_std": 0.2},
    ])  # fmt: skip
    write("es_log.jsonl", [{"step": 0, "rewards": [0.0, -0.2]}, {"step": 1, "rewards": [0.8, 0]}])
    es = signal_of(tmp_path)
    assert es == {"steps": 2, "tied_steps": 0.5, "steps_with_a_correct_answer": 0.5,
                  "train_accuracy_mean": 0.125, "reward_std_mean": 0.1,
                  "members_with_a_positive_reward": 0.25}  # fmt: skip
    (tmp_path / "es_log.jsonl").unlink()
    write("metrics.jsonl", [
        {"kind": "train", "step": 0, "accuracy": 0.0, "reward_std": 0.3,
         "zero_variance_groups": 1.0},
        {"kind": "train", "step": 1, "accuracy": 0.0, "reward_std": 0.3,
         "zero_variance_groups": 0.5},
    ])  # fmt: skip
    grpo = signal_of(tmp_path)
    assert grpo["tied_steps"] == 0.5 and "members_with_a_positive_reward" not in grpo
    # a step rebuilt from the seed log after a kill has rewards but no accuracy
    write("metrics.jsonl", [{"kind": "train", "step": 0, "reward_std": 0.0,
                             "rebuilt_from": "es_log.jsonl"}])  # fmt: skip
    write("es_log.jsonl", [])
    rebuilt = signal_of(tmp_path)
    assert rebuilt["tied_steps"] == 1.0 and rebuilt["train_accuracy_mean"] is None
    assert "members_with_a_positive_reward" not in rebuilt


def gsm8k_like(folder: Path, n: int) -> Path:
    """A GSM8K-schema train and test file (question; answer ending '#### n') of n problems."""
    (folder / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        rows = [{"question": f"What is {i} * 7 + {split == 'test'}?",
                 "answer": f"{i} * 7 = {7 * i}\n#### {7 * i + (split == 'test')}"}
                for i in range(n)]  # fmt: skip
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (folder / "gsm8k" / f"{split}.jsonl").write_text(text)
    return folder


@pytest.mark.slow
def test_real_model_quick_end_to_end_and_its_archive(tmp_path, tiny_agent_dir):
    """The real-model experiment's whole pipeline on the tiny agent, through a session's end:
    the first invocation is killed once ES's unfinished state was kept twice, and the machine
    loses --runs-dir (a fresh checkout). The next one resumes ES after the kept steps (never a
    step twice, each part's CPU recorded) and trains the rest: the held-out split of the train
    file, every method under a CPU-seconds budget in its own process, the report with protocol
    and invalid rates, peak RSS and the base model's test. A third invocation trains nothing,
    nor does one on a machine that lost the runs' folders: the finished records come back from
    the archive beside the report. (One test, not two: the pipeline is the CI's slowest.)"""
    shared = gsm8k_like(tmp_path / "shared", 140)
    args = [BENCHMARKS / "real_model.py", "--quick", "--model", tiny_agent_dir,
            "--keep-every", "0.5", "--data-dir", shared, "--runs-dir", tmp_path / "runs",
            "--results-dir", tmp_path / "results"]  # fmt: skip
    archived = tmp_path / "results" / "real_model-quick-runs"
    state = archived / "unfinished" / "es-seed0"
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:  # GRPO starts first (it cannot be archived), ES beside it
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(_lines(state / "es_log.jsonl")) < 2:
            assert proc.poll() is None, "the benchmark finished before ES's state was kept twice"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = len(_lines(state / "es_log.jsonl"))
    assert kept >= 2 and json.loads((state / "spec.json").read_text())["spec"]["method"] == "es"
    shutil.rmtree(tmp_path / "runs")  # the checkout lost every run folder

    stdout = run_script(*args)
    assert f"resumes after step {kept}" in stdout and "es seed 0: done" in stdout
    es = json.loads((tmp_path / "runs" / "es-seed0" / "result.json").read_text())
    assert es["summary"]["steps"] >= kept and len(es["machines"]) == 2
    assert all(m["torch_cpu_capability"] and m["cpu"] for m in es["machines"])
    log = read_jsonl(tmp_path / "runs" / "es-seed0" / "es_log.jsonl")
    assert [e["step"] for e in log] == list(range(es["summary"]["steps"]))  # none twice
    assert not (archived / "unfinished").exists()
    data = tmp_path / "runs" / "data" / "gsm8k"
    train = (shared / "gsm8k" / "train.jsonl").read_text().splitlines()
    assert (data / "train.jsonl").read_text().splitlines() == train[:-128]
    assert (data / "validation.jsonl").read_text().splitlines() == train[-128:]
    out = json.loads((tmp_path / "results" / "real_model-quick.json").read_text())
    assert set(out["methods"]) == {"es", "copes-k2", "copes-k4", "grpo", "lora-grpo"}
    assert not out["failed_runs"] and out["budget_kind"] == "cpu-seconds"
    assert 0 <= out["base_model_test"]["pass@1"] <= 1
    assert out["base_model_test"]["problems"] == 4
    pids = set()
    for name, run in out["runs"].items():
        assert run["cpu_seconds"] >= out["budget"] and run["steps"] >= 1, name
        for key in ("protocol_use_rate", "tool_use_rate", "invalid_rate", "validation_accuracy"):
            assert all(0 <= v <= 1 for v in run[key]), (name, key)
        assert run["peak_rss_mb"] > 100 and 0 <= run["test_pass@1"] <= 1
        assert run["signal"]["steps"] == run["steps"], name
        assert 0 <= run["signal"]["tied_steps"] <= 1
        assert ("members_with_a_positive_reward" in run["signal"]) == ("grpo" not in name)
        spec = json.loads((tmp_path / "runs" / f"{name}" / "config.json").read_text())
        assert spec["train"]["benchmark"] == "gsm8k" and spec["train"]["eval_tasks"] == 8
        pids.add(json.loads((tmp_path / "runs" / name / "result.json").read_text())["pid"])
    assert len(pids) == len(out["runs"])  # each run in its own process
    assert "| es-seed0 |" in stdout and "base model: GSM8K test pass@1" in stdout

    again = run_script(*args)
    assert "[real_model]" not in again.replace("[real_model] wrote", "")  # nothing trained
    kept_records = sorted(p.name for p in archived.iterdir())
    assert kept_records == sorted([*(f"{n}.json" for n in out["runs"]), "base-test.json"])
    for name in out["runs"]:
        shutil.rmtree(tmp_path / "runs" / name)
    shutil.rmtree(tmp_path / "runs" / "base-test")
    fresh = run_script(*args)
    assert fresh.count("restored from") == len(out["runs"]) and ": done" not in fresh
    restored = json.loads((tmp_path / "results" / "real_model-quick.json").read_text())
    assert restored["runs"] == out["runs"]
    assert restored["base_model_test"] == out["base_model_test"]


def _lines(path):
    """The whole lines of a file (a copy may end in half a line)."""
    return path.read_text().split("\n")[:-1] if path.exists() else []


def test_real_model_user_errors_are_one_line_exit_2(tmp_path):
    """A missing benchmark file or an unknown method: one line naming the fix, exit 2, and
    nothing written."""
    script = BENCHMARKS / "real_model.py"
    for extra, says in (
        (["--data-dir", tmp_path / "nowhere"], "gsm8k/train.jsonl is missing; pass --data-dir"),
        (["--methods", "es,adam"], "unknown method(s) ['adam']; choose from"),
        (["--settings-from", tmp_path / "none.json"], "not a real_model report's JSON"),
        (["--settings-from", tmp_path / "r.json", "--sweep"], "pass one of them"),
        (["--settings-from", ROOT / "pyproject.toml"], "not a real_model report's JSON"),
    ):
        proc = subprocess.run(
            [sys.executable, script, "--runs-dir", tmp_path / "runs", *extra], cwd=ROOT,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_real_model_settings_from_a_report_are_the_runs_settings(tmp_path, capsys):
    """--settings-from: a finished report's table (its sweep's choice) is what the runs
    train with, --methods picks from it; a table of unknown methods or of rows that are no
    settings is refused, and so is writing over the report it reads."""
    sys.path.insert(0, str(BENCHMARKS))
    import real_model

    chosen = {m: {**real_model.METHODS[m], "learning_rate": 1e-5} for m in ("grpo", "es")}
    report = tmp_path / "real_model.json"
    report.write_text(json.dumps({"hyperparameters": chosen}))
    args = real_model.parse_args(["--settings-from", str(report), "--methods", "grpo"])
    table = real_model.chosen_table(args)
    (spec,) = real_model.plan(table, [0], args, tmp_path, 1.0, tmp_path)
    assert spec.method == "grpo" and spec.settings == chosen["grpo"]
    for bad in ({"adam": {}}, {}, {"grpo": None}, {"grpo": {"learning_rate": 1}}):
        report.write_text(json.dumps({"hyperparameters": bad}))
        with pytest.raises(SystemExit) as stop:
            real_model.settings_from(str(report), False)
        assert stop.value.code == 2 and "not a table of copes methods" in capsys.readouterr().err
    report.write_text(json.dumps({"hyperparameters": chosen}))
    with pytest.raises(SystemExit) as stop:  # without --name it would write over its source
        real_model.main(["--settings-from", str(report), "--results-dir", str(tmp_path)])
    assert stop.value.code == 2 and "pass --name" in capsys.readouterr().err
    assert not (tmp_path / "real_model-runs").exists()


def test_readme_real_model_command_trains_the_measured_grpo_run(tmp_path):
    """The README's "Post-train a real model on your CPU" command asks for the very run whose
    figures it shows: the committed seed-0 GRPO record's spec, its own folders aside (planned
    here with the record's, since --name gives the user's run its own)."""
    import shlex

    sys.path.insert(0, str(BENCHMARKS))
    import real_model
    from _learning_runs import same_spec

    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("python benchmarks/real_model.py"))
    args = real_model.parse_args(shlex.split(line)[2:])
    args.settings_from = str(ROOT / args.settings_from)
    (spec,) = real_model.plan(real_model.chosen_table(args), args.seeds, args,
                              Path("runs/benchmarks/real_model/data"), real_model.BUDGET,
                              Path("runs/benchmarks/real_model"))  # fmt: skip
    kept = BENCHMARKS / "results" / "real_model-runs" / "grpo-seed0.json"
    record = json.loads(kept.read_text())
    assert same_spec(record, spec) and args.name != "real_model"


def test_bf16_perturbation_measures_what_rounding_swallows(tmp_path, tiny_agent_dir):
    """In float32 a member's noise arrives whole; in bfloat16 less of it moves a weight at a
    smaller sigma, and what arrives points the intended way."""
    sys.path.insert(0, str(BENCHMARKS))
    from bf16_perturbation import main

    runs = {
        dtype: main(["--model", str(tiny_agent_dir), "--dtype", dtype, "--sigmas", "1e-4",
                     "1e-2", "--out", str(tmp_path / f"{dtype}.json")])["by_sigma"]
        for dtype in ("float32", "bfloat16")
    }  # fmt: skip
    for sigma in ("0.0001", "0.01"):
        exact = runs["float32"][sigma]["all"]
        assert exact["cosine"] == pytest.approx(1.0, abs=1e-4) and exact["moved"] > 0.99
    small, large = runs["bfloat16"]["0.0001"]["all"], runs["bfloat16"]["0.01"]["all"]
    assert small["moved"] < 0.5 < large["moved"] and small["cosine"] < large["cosine"]
    assert large["cosine"] > 0.99 and large["norm_ratio"] == pytest.approx(1.0, abs=0.02)
    assert set(runs["bfloat16"]["0.01"]) >= {"norms", "all"}


def test_real_model_sweep_picks_by_accuracy_then_reward_then_default(tmp_path, monkeypatch):
    """The sweep's choice, on scripted trial outcomes (no training): the ES family's alpha
    and then sigma come from plain ES and reach both CoPES rows; a tie keeps the published
    default; a failed trial stops the sweep in one line."""
    sys.path.insert(0, str(BENCHMARKS))
    import real_model

    outcome = {  # (final validation accuracy, final validation reward) per trial
        "es-lr1": (0.01, -0.1), "es-lr10": (0.02, -0.3), "es-sigma2": (0.02, -0.2),
        "grpo-lr1": (0.0, -0.1), "grpo-lr10": (0.0, -0.1),
        "lora-grpo-lr1": (0.0, -0.2), "lora-grpo-lr10": (0.0, -0.1),
    }  # fmt: skip
    seen = []

    def scripted(specs, workers, archive, keep_every=60.0):
        seen.extend(s.method for s in specs)
        assert all(s.seed == real_model.SWEEP_SEED and s.settings["eval_every"] == 0
                   and s.passk_tasks == 0 for s in specs)  # fmt: skip
        return [{"spec": {}, "curve": {"accuracy": [0.0, outcome[s.method][0]],
                                        "reward": [0.0, outcome[s.method][1]]}}
                for s in specs]  # fmt: skip

    monkeypatch.setattr(real_model, "execute", scripted)
    args = real_model.parse_args(["--runs-dir", str(tmp_path)])
    table = real_model.method_table(False)
    archive = real_model.Archive(tmp_path / "kept", tmp_path)
    result = real_model.sweep(args, table, tmp_path, 1800.0, tmp_path, archive)
    lr_trials = ["es-lr1", "es-lr10", "grpo-lr1", "grpo-lr10", "lora-grpo-lr1", "lora-grpo-lr10"]
    assert seen == [*lr_trials, "es-sigma2"]  # the rates first, then sigma at the better one
    new = result["table"]
    for m in ("es", "copes-k2", "copes-k4"):  # alpha x 10 won on accuracy, sigma x 2 on reward
        assert new[m]["learning_rate"] == 5e-3 and new[m]["sigma"] == 2e-3, m
        assert new[m]["num_subspaces"] == table[m]["num_subspaces"]
    assert new["grpo"]["learning_rate"] == 1e-6  # a tie: the default
    assert new["lora-grpo"]["learning_rate"] == 1e-4  # equal accuracy, better reward
    assert {t["trial"] for t in result["trials"]} == set(outcome)
    outcome["grpo-lr10"] = None

    def failing(specs, workers, archive, keep_every=60.0):
        dead = {"spec": {}, "error": "Traceback ...\nRuntimeError: out of memory\n"}
        return [dead if outcome[s.method] is None else scripted([s], workers, archive)[0]
                for s in specs]  # fmt: skip

    monkeypatch.setattr(real_model, "execute", failing)
    with pytest.raises(SystemExit) as stop:
        real_model.sweep(args, table, tmp_path, 1800.0, tmp_path, archive)
    assert stop.value.code == 2


def test_real_model_starts_grpo_runs_first_but_never_two_side_by_side():
    """GRPO-family runs (not resumable from the archive) start first; a second one waits
    for the first to end (memory) while ES/CoPES runs fill the other slots."""
    sys.path.insert(0, str(BENCHMARKS))
    import real_model
    from _learning_runs import RunSpec

    def spec(method, optimizer):
        return RunSpec(method, 0, {"optimizer": optimizer}, method, "m", "e", "cpu-seconds", 1.0)

    es, k4 = spec("es", "es"), spec("copes-k4", "copes")
    grpo, lora = spec("grpo", "grpo"), spec("lora-grpo", "lora-grpo")
    assert real_model.next_run([es, k4, grpo, lora], []) is grpo
    assert real_model.next_run([es, k4, lora], [grpo]) is es
    assert real_model.next_run([lora], [grpo]) is None  # waits, the slot stays free
    assert real_model.next_run([lora], [es]) is lora
    assert real_model.next_run([es, k4], [k4]) is es
    assert real_model.next_run([], [grpo]) is None
    # lower seeds first, on one worker too: seed 0 of every method before a GRPO seed 1
    es1 = RunSpec("es", 1, {"optimizer": "es"}, "es1", "m", "e", "cpu-seconds", 1.0)
    grpo1 = RunSpec("grpo", 1, {"optimizer": "grpo"}, "grpo1", "m", "e", "cpu-seconds", 1.0)
    assert real_model.next_run([grpo1, es, es1], []) is es
    assert real_model.next_run([grpo1, es1], []) is grpo1
    assert real_model.next_run([lora, es1], [grpo]) is es1  # a later seed fills a free slot


def test_real_model_plans_seed_0_of_every_method_first_then_the_issues_three_seeds(tmp_path):
    """Without --seeds: one seed of every method, three of GRPO, ES and CoPES K = 4, every
    seed 0 before any seed 1 (a comparison cut short is whole); --seeds applies to all."""
    sys.path.insert(0, str(BENCHMARKS))
    import real_model

    args = real_model.parse_args([])
    table = real_model.method_table(False)
    runs = [(s.method, s.seed) for s in real_model.plan(table, None, args, tmp_path, 1.0,
                                                           tmp_path)]  # fmt: skip
    assert runs[:5] == [(m, 0) for m in table]
    assert sorted(runs[5:]) == sorted((m, s) for m in ("es", "copes-k4", "grpo") for s in (1, 2))
    assert [s for _, s in runs] == sorted(s for _, s in runs)
    assert all(s.run_dir == str(tmp_path / f"{s.method}-seed{s.seed}")
               for s in real_model.plan(table, [3], args, tmp_path, 1.0, tmp_path))  # fmt: skip


def test_real_model_refuses_a_changed_data_source_and_a_short_file(tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    import real_model

    shared = gsm8k_like(tmp_path / "shared", 140)
    into = tmp_path / "runs" / "data"
    real_model.held_out_data(shared, into)
    assert real_model.held_out_data(shared, into) == into  # the same files: fine
    with (shared / "gsm8k" / "train.jsonl").open("a") as f:
        f.write(json.dumps({"question": "q?", "answer": "#### 1"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        real_model.held_out_data(shared, into)
    assert stop.value.code == 2 and "other GSM8K files" in capsys.readouterr().err
    short = gsm8k_like(tmp_path / "short", 100)
    with pytest.raises(SystemExit):
        real_model.held_out_data(short, tmp_path / "other")
    assert "needs more" in capsys.readouterr().err


def test_real_model_archive_restores_only_the_spec_asked_for(tmp_path, capsys):
    """A kept record comes back into a run folder that lacks it; one trained with other
    settings is refused in one line, never silently reused."""
    sys.path.insert(0, str(BENCHMARKS))
    import real_model
    from _learning_runs import RunSpec, read_result

    runs = tmp_path / "runs"
    archive = real_model.Archive(tmp_path / "kept", runs)
    spec = RunSpec("es", 0, {"sigma": 1e-3}, str(runs / "sweep" / "es-seed0"), "m", "e",
                   "cpu-seconds", 600.0)  # fmt: skip
    record = {"spec": real_model.asdict(spec), "curve": {"accuracy": [0.1]}}
    archive.keep(spec, record)
    archive.keep(spec, {"spec": {}, "error": "boom"})  # a failure is never kept
    assert archive.path(spec.run_dir) == tmp_path / "kept" / "sweep" / "es-seed0.json"
    archive.restore([spec])
    assert read_result(spec.run_dir) == json.loads(json.dumps(record))
    other = RunSpec("es", 1, {"sigma": 2e-3}, str(runs / "es-seed1"), "m", "e", "cpu-seconds",
                    600.0)  # fmt: skip
    archive.keep(other, {"spec": {**real_model.asdict(other), "budget": 1.0}})
    with pytest.raises(SystemExit) as stop:
        archive.restore([other])
    assert stop.value.code == 2 and "other settings" in capsys.readouterr().err
    assert read_result(other.run_dir) is None
    # a record from before records kept their signal: the archive adds it from the metrics
    older = RunSpec("es", 2, {}, str(runs / "es-seed2"), "m", "e", "cpu-seconds", 600.0)
    Path(older.run_dir).mkdir(parents=True)
    row = {"kind": "train", "step": 0, "accuracy": 0.25, "reward_std": 0.0}
    (Path(older.run_dir) / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    archive.keep(older, {"spec": real_model.asdict(older)})
    kept = json.loads(archive.path(older.run_dir).read_text())
    assert kept["signal"]["tied_steps"] == 1.0 and kept["signal"]["train_accuracy_mean"] == 0.25
