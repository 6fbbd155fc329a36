"""`evaluate` / `copes-eval` end to end on the tiny agent with fixture data: outputs, resume
after an interruption, rescore, baseline comparison; and the report renderings."""

import csv
import json
import shutil
from pathlib import Path

import pytest

from copes.agents.policy import SamplingConfig
from copes.evaluation.cli import main
from copes.evaluation.report import (
    BenchmarkResult,
    Report,
    difference,
    format_table,
    write_report,
)
from copes.evaluation.rescore import rescore
from copes.evaluation.runner import evaluate
from copes.evaluation.samples import read_samples

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
BENCHMARKS = ["gsm8k", "hotpotqa", "synthetic-math"]
LIMIT, N, BATCH = 2, 2, 3  # 4 episodes per benchmark in batches of 3 (so batches straddle)


def eval_args(model, out, data_dir, *extra):
    return [
        "--model", str(model), "--benchmarks", ",".join(BENCHMARKS), "--pass-k", "1,2",
        "-n", str(N), "--limit", str(LIMIT), "--data-dir", str(data_dir),
        "--max-new-tokens", "48", "--max-turns", "3", "--temperature", "1.0", "--top-p", "1.0",
        "--seed", "7", "--device", "cpu", "--batch-episodes", str(BATCH), "--quiet",
        "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    shutil.copy(FIXTURES / "gsm8k.jsonl", root / "gsm8k.jsonl")
    (root / "hotpotqa").mkdir()
    shutil.copy(FIXTURES / "hotpot_dev_distractor_v1.json", root / "hotpotqa" / "dev.json")
    return root


@pytest.fixture(scope="module")
def full_run(tiny_agent_dir, data_dir, tmp_path_factory):
    """One uninterrupted evaluation: (out dir, printed output, report.json)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("full")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(eval_args(tiny_agent_dir, out, data_dir)) == 0
    return out, printed.getvalue(), json.loads((out / "report.json").read_text())


def test_end_to_end_writes_every_output_and_prints_the_table(full_run):
    out, printed, data = full_run
    for name in BENCHMARKS:
        assert (out / f"pass_at_k_{name}.png").stat().st_size > 1000
        assert f"| {name}" in printed
    assert "pass@1" in printed and "pass@2" in printed and "maj@2" in printed
    report = Report.from_dict(data)
    assert report.n == N and report.ks == [1, 2]
    for name in BENCHMARKS:
        result = report.benchmarks[name]
        assert result.num_problems == LIMIT and result.n == N
        assert 0 <= result.pass_at_k[1] <= result.pass_at_k[2] <= 1
        assert 0 <= result.mean_at_n <= 1 and 0 <= result.maj_at_n <= 1
        assert result.mean_turns >= 1 and sum(result.end_reasons.values()) == LIMIT * N

    samples = read_samples(out / "samples.jsonl")
    assert len(samples) == len(BENCHMARKS) * LIMIT * N
    assert {(s["benchmark"], s["sample"]) for s in samples} == {
        (b, i) for b in BENCHMARKS for i in range(N)
    }
    first = samples[0]
    assert set(first) >= {
        "benchmark", "task_id", "sample", "prediction", "correct", "reward", "tool_calls",
        "turns", "end_reason", "generated_tokens", "gold",
    }  # fmt: skip
    assert "messages" not in first  # only with --save-messages
    # The report's numbers are the samples' numbers.
    gsm = [s for s in samples if s["benchmark"] == "gsm8k"]
    assert report.benchmarks["gsm8k"].pass_at_k[1] == pytest.approx(
        sum(s["correct"] for s in gsm) / len(gsm)
    )
    assert report.benchmarks["gsm8k"].mean_tool_calls == pytest.approx(
        sum(s["tool_calls"] for s in gsm) / len(gsm)
    )

    rows = list(csv.DictReader((out / "report.csv").open()))
    assert {r["benchmark"] for r in rows} == set(BENCHMARKS)
    assert {"pass@1", "pass@2", "mean@2", "maj@2"} <= {r["metric"] for r in rows}


def test_resume_after_interruption_generates_only_what_is_missing(
    full_run, tiny_agent_dir, data_dir, tmp_path
):
    full_out, _, full_data = full_run
    lines = (full_out / "samples.jsonl").read_text().splitlines(keepends=True)
    half = len(lines) // 2  # 6 of 12: mid-way through the second benchmark's batches
    shutil.copy(full_out / "eval_config.json", tmp_path / "eval_config.json")
    torn = lines[half][: len(lines[half]) // 2]  # the line being written when it was killed
    (tmp_path / "samples.jsonl").write_text("".join(lines[:half]) + torn)

    assert main(eval_args(tiny_agent_dir, tmp_path, data_dir)) == 0
    resumed = json.loads((tmp_path / "report.json").read_text())
    assert resumed["resumed_samples"] == half
    assert resumed["new_samples"] == len(lines) - half  # only the missing samples written
    # Whole batches are rolled out again (so they sample exactly as before): the batch that
    # was cut short and those never started; nothing already complete is rerun.
    keys = [(r["benchmark"], r["task_id"], r["sample"]) for r in map(json.loads, lines)]
    missing = set(keys[half:])
    expected = 0
    for name in BENCHMARKS:  # the full run wrote each benchmark's items in batch order
        items = [k for k in keys if k[0] == name]
        chunks = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
        expected += sum(len(c) for c in chunks if missing.intersection(c))
    assert len(missing) < expected < len(lines)  # this cut does straddle a batch
    assert resumed["generated_episodes"] == expected

    # Same samples, same report as the uninterrupted run.
    def by_key(path):
        return {(s["benchmark"], s["task_id"], s["sample"]): s for s in read_samples(path)}

    assert by_key(tmp_path / "samples.jsonl") == by_key(full_out / "samples.jsonl")
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(lines)
    assert Report.from_dict(resumed) == Report.from_dict(full_data)

    # A finished evaluation resumes to the same report without generating anything.
    assert main(eval_args(tiny_agent_dir, tmp_path, data_dir)) == 0
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["generated_episodes"] == 0 and again["new_samples"] == 0
    assert Report.from_dict(again) == Report.from_dict(full_data)


def test_rescore_reproduces_the_report_and_grades_against_the_data(full_run, tmp_path, capsys):
    full_out, _, full_data = full_run
    for name in ("samples.jsonl", "eval_config.json"):
        shutil.copy(full_out / name, tmp_path / name)
    assert main(["--rescore", "--out", str(tmp_path)]) == 0
    assert "| gsm8k" in capsys.readouterr().out
    rescored = json.loads((tmp_path / "report.json").read_text())
    assert Report.from_dict(rescored) == Report.from_dict(full_data)

    # The gold is the data's: a stored copy edited by hand is graded against the data's
    # gold again (and restored), not taken for it.
    samples = read_samples(tmp_path / "samples.jsonl")
    wrong = [s for s in samples if s["prediction"] and s["prediction"].strip() and not s["correct"]]
    if not wrong:
        pytest.skip("the tiny agent answered every sample correctly")
    target = min(wrong, key=lambda s: (s["benchmark"] != "hotpotqa", len(s["prediction"])))
    gold = target["gold"]
    target["gold"] = [target["prediction"]]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert Report.from_dict(rescore(tmp_path).to_dict()) == Report.from_dict(full_data)
    key = (target["benchmark"], target["task_id"], target["sample"])
    after = {
        (s["benchmark"], s["task_id"], s["sample"]): s
        for s in read_samples(tmp_path / "samples.jsonl")
    }
    assert after[key]["correct"] is False and after[key]["gold"] == gold


def test_baseline_is_evaluated_alongside_and_compared(tiny_agent_dir, data_dir, tmp_path, capsys):
    args = eval_args(tiny_agent_dir, tmp_path, data_dir, "--baseline", str(tiny_agent_dir))
    args[args.index("--benchmarks") + 1] = "synthetic-math"
    args.remove("--quiet")
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "episode" in captured.err  # the progress bar (tqdm, with its ETA)
    printed = captured.out
    assert "model:" in printed and "baseline:" in printed
    assert " / " in printed and "(+0.000)" in printed  # the same model: no difference
    assert (tmp_path / "baseline" / "samples.jsonl").exists()
    assert (tmp_path / "baseline" / "report.json").exists()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["difference"]["synthetic-math"]["pass@1"] == 0.0
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert {"baseline", "difference"} <= set(rows[0])


def test_ks_above_n_fail_before_anything_is_loaded(tmp_path, capsys):
    assert main(["--model", "/does/not/exist", "--pass-k", "1,8", "-n", "4",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    assert "k <= n" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"k=\[8\] with n=4"):
        evaluate(None, "gsm8k", n=4, ks=[1, 8], sampling=SamplingConfig(), out_dir=tmp_path)
    assert not (tmp_path / "samples.jsonl").exists()


def test_without_pass_k_the_default_ks_that_n_allows_are_used_and_the_rest_named(
    tiny_agent_dir, tmp_path, capsys
):
    out = tmp_path / "one"
    assert main(["--model", str(tiny_agent_dir), "--benchmarks", "synthetic-math", "--limit",
                 "2", "-n", "1", "--quiet", "--out", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "pass@k for k = 1; 4, 16 need more than n = 1 samples" in err
    report = json.loads((out / "report.json").read_text())
    assert report["ks"] == [1]


def test_unknown_benchmark_fails_with_the_known_names(tmp_path, capsys):
    assert main(["--model", "tiny", "--benchmarks", "gsm9k", "--out", str(tmp_path)]) == 2
    assert "known: gsm8k, math500" in capsys.readouterr().err


def test_vllm_backend_says_how_to_install_it(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    code = main(["--model", "tiny", "--backend", "vllm", "--benchmarks", "synthetic-math",
                 "--pass-k", "1", "-n", "1", "--out", str(tmp_path)])  # fmt: skip
    assert code == 2
    assert 'pip install -e ".[vllm]"' in capsys.readouterr().err


def test_resume_refuses_samples_of_a_different_configuration(full_run, tmp_path):
    full_out, _, _ = full_run
    for name in ("samples.jsonl", "eval_config.json"):
        shutil.copy(full_out / name, tmp_path / name)
    with pytest.raises(ValueError, match="different evaluation: sampling"):
        evaluate(
            None, "synthetic-math", n=N, ks=[1], sampling=SamplingConfig(48, 0.5),
            limit=LIMIT, out_dir=tmp_path, max_turns=3, batch_episodes=BATCH, progress=False,
        )  # fmt: skip


def test_read_samples_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = {"benchmark": "b", "task_id": "t", "sample": 0}
    path.write_text(json.dumps(good) + "\n" + '{"benchmark": "b", "ta')
    assert read_samples(path) == [good]
    path.write_text("{oops\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        read_samples(path)


def test_task_digest_covers_what_the_agent_sees_and_what_grades_it():
    from dataclasses import replace

    from copes.envs.tasks.base import Passage, Task, task_digest
    from copes.evaluation.samples import mismatch

    task = Task("q-0", "Who wrote X?", ("Ann",), "qa", (Passage("X", "Ann wrote X."),))
    digest = task_digest(task)
    assert len(digest) == 64 and digest == task_digest(replace(task))  # sha256, stable
    changes = {
        "changed": [replace(task, question="Who wrote Y?"),
                    replace(task, passages=(Passage("X", "Bob wrote X."),))],
        "gold": [replace(task, answers=("Ann", "Ann Lee")), replace(task, checks=("x",))],
    }  # fmt: skip
    record = {"task_digest": digest, "gold": ["Ann"], "checks": []}
    for why, tasks in changes.items():
        for other in tasks:
            assert task_digest(other) != digest
            assert mismatch(record, other) == why
    # The id and the metadata (solutions, levels) do not define the problem; the source (it
    # picks the QA rule) does.
    assert task_digest(replace(task, id="q-9", metadata={"level": 3})) == digest
    assert mismatch(record, replace(task, source="hotpotqa")) == "changed"
    assert mismatch(record, task) is None
    assert mismatch({"gold": ["Ann"]}, task) == "no-digest"


def test_regenerate_changed_is_refused_where_nothing_is_generated_or_resumed(tmp_path, capsys):
    for flag, named in (("--rescore", "--rescore"), ("--no-resume", "--no-resume")):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", "m", flag, "--regenerate-changed", "--out", str(tmp_path)])
        assert exit_.value.code == 2
        assert (
            f"--regenerate-changed re-generates stored samples on resume; drop it with {named}"
            in (capsys.readouterr().err)
        )


def _replace_gsm8k(data_dir: Path, root: Path, edit) -> Path:
    """A copy of `data_dir` whose gsm8k.jsonl has `edit(index, record)` applied to each."""
    copy = root / "data"
    shutil.copytree(data_dir, copy)
    lines = [json.loads(line) for line in (copy / "gsm8k.jsonl").read_text().splitlines()]
    (copy / "gsm8k.jsonl").write_text(
        "".join(json.dumps(edit(i, r)) + "\n" for i, r in enumerate(lines))
    )
    return copy


def _gsm8k_args(model, out, data_dir, *extra):
    args = eval_args(model, out, data_dir, *extra)
    args[args.index("--benchmarks") + 1] = "gsm8k"
    return args


def test_resume_refuses_samples_of_replaced_questions_and_regenerates_them_on_request(
    full_run, tiny_agent_dir, data_dir, tmp_path, capsys
):
    """The data file is replaced by one whose first question differs under the same
    index-based id (gsm8k-test-0): the stored verdicts are refused in one line naming the
    benchmark, the id and the remedies, with nothing changed; --regenerate-changed rolls the
    batch holding it out again (the batch of gsm8k-test-1's last sample is kept), giving
    exactly the samples of a fresh evaluation of the new data."""
    full_out, _, _ = full_run
    out = tmp_path / "out"
    out.mkdir()
    for name in ("samples.jsonl", "eval_config.json"):
        shutil.copy(full_out / name, out / name)
    new_data = _replace_gsm8k(
        data_dir, tmp_path, lambda i, r: {**r, "question": "Now: " + r["question"]} if i == 0 else r
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(_gsm8k_args(tiny_agent_dir, out, new_data)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (
        "gsm8k samples" in err
        and "question or passages changed for 1 task(s): gsm8k-test-0." in err
    )
    assert "--regenerate-changed" in err and "--no-resume" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # a refusal writes nothing

    assert main(_gsm8k_args(tiny_agent_dir, out, new_data, "--regenerate-changed")) == 0
    report = json.loads((out / "report.json").read_text())
    assert BATCH == 3 and LIMIT * N == 4  # batches (test-0 x2, test-1 #0) and (test-1 #1)
    assert report["generated_episodes"] == 3 and report["new_samples"] == 3
    assert report["resumed_samples"] == 1
    fresh = tmp_path / "fresh"
    assert main(_gsm8k_args(tiny_agent_dir, fresh, new_data)) == 0

    def gsm8k(path):
        return {
            (s["task_id"], s["sample"]): s for s in read_samples(path) if s["benchmark"] == "gsm8k"
        }

    assert gsm8k(out / "samples.jsonl") == gsm8k(fresh / "samples.jsonl")
    fresh_report = json.loads((fresh / "report.json").read_text())
    assert report["benchmarks"]["gsm8k"] == fresh_report["benchmarks"]["gsm8k"]
    # The old samples stay in the file (append-only) but the newest record of a key wins:
    # resuming again generates nothing and is not refused.
    assert main(_gsm8k_args(tiny_agent_dir, out, new_data)) == 0
    assert json.loads((out / "report.json").read_text())["generated_episodes"] == 0


def test_samples_without_a_digest_are_refused_by_resume_and_rescore(
    full_run, tiny_agent_dir, data_dir, tmp_path, capsys
):
    """Samples written before copes stored task digests cannot be checked against the data:
    both resume and --rescore refuse them in one line saying how to go on."""
    full_out, _, _ = full_run
    samples = read_samples(full_out / "samples.jsonl")
    for s in samples:
        del s["task_digest"]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    shutil.copy(full_out / "eval_config.json", tmp_path / "eval_config.json")
    capsys.readouterr()
    for args in (
        ["--rescore", "--out", str(tmp_path)],
        _gsm8k_args(tiny_agent_dir, tmp_path, data_dir),
    ):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "no task_digest" in err, err
        assert "--regenerate-changed" in err and "--no-resume" in err


def test_rescore_regrades_against_a_corrected_gold_and_refuses_a_changed_question(
    full_run, data_dir, tmp_path
):
    """A gold fix in the data (the question unchanged) is what --rescore is for: the stored
    predictions are re-graded against the new gold. A changed question is refused: the
    prediction answers another problem."""
    full_out, _, full_data = full_run
    for name in ("samples.jsonl", "eval_config.json"):
        shutil.copy(full_out / name, tmp_path / name)
    samples = read_samples(tmp_path / "samples.jsonl")
    # A wrong answer's gold becomes the answer (it turns correct), else a right integer
    # answer's gold moves away (it turns wrong). GSM8K's loader drops commas: none in it.
    answered = [s for s in samples if s["benchmark"] == "gsm8k" and s["prediction"]]
    wrong = [s for s in answered if not s["correct"] and "," not in s["prediction"]]
    right = [s for s in answered if s["correct"] and s["prediction"].strip().isdigit()]
    assert wrong or right, "the tiny agent gave no usable answer on gsm8k: pick another fixture"
    target = (wrong or right)[0]
    prediction = target["prediction"].strip()
    new_gold = prediction if wrong else str(int(prediction) + 1)
    index = int(target["task_id"].rsplit("-", 1)[1])

    def corrected_gold(i, record):
        return {**record, "answer": "#### " + new_gold} if i == index else record

    config = json.loads((tmp_path / "eval_config.json").read_text())
    config["data_dir"] = str(_replace_gsm8k(data_dir, tmp_path / "gold", corrected_gold))
    (tmp_path / "eval_config.json").write_text(json.dumps(config))
    report = rescore(tmp_path)
    after = {(s["task_id"], s["sample"]): s for s in read_samples(tmp_path / "samples.jsonl")
             if s["benchmark"] == "gsm8k"}  # fmt: skip
    assert after[(target["task_id"], target["sample"])]["correct"] is (new_gold == prediction)
    assert after[(target["task_id"], target["sample"])]["gold"] == [new_gold]
    # Only the target task's verdicts move: answers equal to the new gold become correct,
    # those correct under the old gold become wrong (each sample is 1/4 of pass@1).
    same = [s for s in samples if (s["benchmark"], s["task_id"]) == ("gsm8k", target["task_id"])]
    answered = [(s["correct"], (s["prediction"] or "").strip() == new_gold) for s in same]
    gained = sum(not was and now for was, now in answered)
    lost = sum(was and not now for was, now in answered)
    assert gained + lost > 0  # the target's own verdict moved
    before = Report.from_dict(full_data).benchmarks["gsm8k"].pass_at_k[1]
    assert report.benchmarks["gsm8k"].pass_at_k[1] == pytest.approx(before + (gained - lost) / 4)
    # Rescoring again is quiet and stable: the records now carry the new digest.
    assert rescore(tmp_path) == report

    config["data_dir"] = str(
        _replace_gsm8k(
            data_dir, tmp_path / "question", lambda i, r: {**r, "question": r["question"] + "?"}
        )
    )
    (tmp_path / "eval_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"cannot be re-graded.*question or passages changed"):
        rescore(tmp_path)


def test_rescore_counts_answers_refused_as_undone_arithmetic(full_run, tmp_path):
    """Issue 48: an answer of the gold's value left as arithmetic (`{g-1}+1`) earns nothing,
    and the report counts it, so a policy drifting toward the hack shows in its numbers."""
    full_out, _, _ = full_run
    shutil.copy(full_out / "eval_config.json", tmp_path / "eval_config.json")
    samples = read_samples(full_out / "samples.jsonl")
    gsm8k = [s for s in samples if s["benchmark"] == "gsm8k"]
    assert all(s["gold"][0].isdigit() for s in gsm8k)
    for record in gsm8k[:3]:  # 3 of its 4 samples: the gold's value, written as a sum
        record["prediction"] = f"{int(record['gold'][0]) - 1} + 1"
    with open(tmp_path / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in samples)
    report = rescore(tmp_path)
    result = report.benchmarks["gsm8k"]
    assert result.undone_arithmetic_rate == pytest.approx(3 / len(gsm8k))
    assert result.pass_at_k[1] <= 1 / len(gsm8k)  # only the untouched sample may be right
    regraded = [s for s in read_samples(tmp_path / "samples.jsonl") if s["benchmark"] == "gsm8k"]
    assert [s["grade"]["undone_arithmetic"] for s in regraded[:3]] == [True] * 3
    assert not any(s["correct"] for s in regraded[:3])
    qa_answered = any(s["prediction"] is not None for s in samples if s["benchmark"] == "hotpotqa")
    qa_rate = report.benchmarks["hotpotqa"].undone_arithmetic_rate
    assert qa_rate is None if qa_answered else qa_rate == 0.0  # QA graders never say
    assert "undone arith" in format_table(report)


# ---------------------------------------------------------------------- report renderings
def _result(name: str, p1: float, p4: float) -> BenchmarkResult:
    return BenchmarkResult(name, 10, 4, {1: p1, 4: p4}, p1, p1, 1.5, 2.0, 30.0, {"answer": 40})


def test_table_json_csv_and_plots_with_a_baseline(tmp_path):
    report = Report(4, [1, 4], {"gsm8k": _result("gsm8k", 0.5, 0.75)}, model="new")
    baseline = Report(4, [1, 4], {"gsm8k": _result("gsm8k", 0.25, 0.5)}, model="old")
    table = format_table(report)
    assert "| gsm8k" in table and "0.500" in table and "0.750" in table and " / " not in table
    compared = format_table(report, baseline)
    assert "model: new / baseline: old" in compared
    assert "0.500 / 0.250 (+0.250)" in compared and "0.750 / 0.500 (+0.250)" in compared
    assert difference(report, baseline)["gsm8k"]["pass@4"] == pytest.approx(0.25)

    paths = write_report(report, tmp_path, baseline)
    data = json.loads(paths["json"].read_text())
    assert data["difference"]["gsm8k"]["pass@1"] == pytest.approx(0.25)
    assert Report.from_dict(data) == report
    rows = {r["metric"]: r for r in csv.DictReader(paths["csv"].open())}
    assert float(rows["pass@1"]["value"]) == 0.5 and float(rows["pass@1"]["baseline"]) == 0.25
    assert float(rows["pass@1"]["difference"]) == pytest.approx(0.25)
    assert [p.name for p in paths["plots"]] == ["pass_at_k_gsm8k.png"]
    assert paths["plots"][0].stat().st_size > 1000


def test_rescore_counts_a_duplicated_sample_once(full_run, tmp_path):
    """`evaluate` keeps one record per (benchmark, task, sample); --rescore did not."""
    full_out, _, full_data = full_run
    shutil.copy(full_out / "eval_config.json", tmp_path / "eval_config.json")
    lines = (full_out / "samples.jsonl").read_text().splitlines()
    (tmp_path / "samples.jsonl").write_text("\n".join([*lines, lines[0], lines[0]]) + "\n")
    assert Report.from_dict(rescore(tmp_path).to_dict()) == Report.from_dict(full_data)
    assert len(read_samples(tmp_path / "samples.jsonl")) == len(lines)


def test_an_eval_config_that_is_not_an_object_is_a_one_line_error(tmp_path, capsys, tiny_agent_dir):
    (tmp_path / "eval_config.json").write_text("[1, 2]")
    code = main(["--model", str(tiny_agent_dir), "--benchmarks", "synthetic-math",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "is not an evaluation config" in err and len(err.splitlines()) == 1
