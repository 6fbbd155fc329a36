"""The benchmarks' published files, read as they are (`../shared/benchmarks`, SOURCES.md):
every file, its counts, stable ids, and every gold graded right against itself and wrong
when changed. Skipped, naming the path, only where the shared folder is absent."""

from __future__ import annotations

import hashlib
import json
import re
import time
from fractions import Fraction
from pathlib import Path

import gymnasium as gym
import pytest

from copes.envs.rewards.graders import MathGrader, QAGrader
from copes.envs.rewards.math import extract_answer
from copes.envs.rewards.qa import benchmark_qa_rule
from copes.registry import get_benchmark

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "benchmarks"
pytestmark = pytest.mark.skipif(
    not (SHARED / "SOURCES.md").is_file(), reason=f"the shared benchmark files are absent: {SHARED}"
)

# (benchmark, split, records, first id, last id): SOURCES.md's counts; ids as copes makes them.
FILES = [
    ("gsm8k", None, 1319, "gsm8k-test-0", "gsm8k-test-1318"),
    ("gsm8k", "train", 7473, "gsm8k-train-0", "gsm8k-train-7472"),
    ("math500", None, 500, "test/precalculus/807.json", "test/geometry/615.json"),
    ("aime24", None, 30, "60", "89"),
    ("aime25", None, 30, "0", "29"),
    ("hotpotqa", None, 7405, "hotpotqa-validation-0", "hotpotqa-validation-7404"),
    ("hotpotqa", "dev500", 500, "hotpotqa-dev500-1", "hotpotqa-dev500-500"),
    ("2wiki", "dev500", 500, "2wiki-dev500-1", "2wiki-dev500-500"),
    ("musique", "dev500", 500, "musique-dev500-1", "musique-dev500-500"),
]


def load(name: str, split: str | None):
    return get_benchmark(name).load_tasks(split=split, data_dir=SHARED)


def test_the_staged_files_are_the_recorded_bytes() -> None:
    table = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \| ([\d,]+) \| `([0-9a-f]{64})` \|$",
                       (SHARED / "SOURCES.md").read_text(), re.MULTILINE)  # fmt: skip
    assert len(table) == 9
    for name, _records, size, sha256 in table:
        data = (SHARED / name).read_bytes()
        assert len(data) == int(size.replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == sha256, name


@pytest.mark.parametrize(("name", "split", "count", "first", "last"), FILES)
def test_every_file_loads_whole_with_stable_unique_ids(name, split, count, first, last) -> None:
    tasks = load(name, split)
    assert len(tasks) == count
    ids = [t.id for t in tasks]
    assert len(set(ids)) == count and (ids[0], ids[-1]) == (first, last)
    assert [t.id for t in load(name, split)] == ids  # the same ids on every load
    assert all(t.source == name and t.answers and t.question.strip() for t in tasks)
    kind = get_benchmark(name).kind
    assert all(t.kind == kind for t in tasks)
    if kind == "qa":  # question/answer files: open-domain, nothing to search in the task
        assert all(t.passages == () for t in tasks)


def test_the_default_splits_read_the_staged_files() -> None:
    assert len(load("aime24", None)) == 30  # Qwen's test.jsonl; the hub's only split is train
    with pytest.raises(FileNotFoundError, match="it holds split 'dev500'"):
        load("2wiki", None)  # only the 500-question sample is staged: --split dev500


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime24", "aime25"])
def test_every_math_gold_grades_right_as_written_and_wrong_plus_one(name) -> None:
    grader = MathGrader()
    for task in load(name, None):
        gold = task.answers[0]
        written = [f"<answer>{gold}</answer>", f"so the answer is $\\boxed{{{gold}}}$."]
        if re.fullmatch(r"\d{4,}", gold):  # thousands separators, as models write them
            written.append(f"<answer>{int(gold):,}</answer>")
        for text in written:
            assert grader(extract_answer(text), task).correct, (task.id, text)
        assert not grader(f"{gold}+1", task).correct, task.id


def _answered(env, index: int, answer: str) -> dict:
    """ToolMath's verdict, through the public env, on `answer` to its task `index`."""
    env.reset(options={"task_index": index})
    _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
    assert terminated and reward == float(info["correct"])
    return info


# The last calculator step of a GSM8K solution (`<<9*2=18>>`) whose result is the gold.
_CALCULATOR_STEP = re.compile(r"<<([^=<>]+)=([^<>]+)>>")


def test_gsm8k_the_solutions_last_calculator_step_unevaluated_earns_nothing() -> None:
    """Issue 48: `9*2` for 18 was credited on 363 of the first 400 GSM8K test problems (every
    one whose last calculator step computes the gold's value with an operator); no answer of
    them earns it now, each is counted as undone arithmetic, and the step's result itself is
    still credited."""
    env = gym.make("copes:ToolMath-v0", benchmark="gsm8k", data_dir=SHARED, limit=400)
    tried = 0
    for index, task in enumerate(env.unwrapped.tasks):
        steps = _CALCULATOR_STEP.findall(task.metadata["solution"])
        if not steps or Fraction(steps[-1][1].strip()) != Fraction(task.answers[0]):
            continue
        expression = steps[-1][0].strip()
        if not re.search(r"[-+*/^]", expression.lstrip("-")):  # `<<125=125>>`: nothing to do
            continue
        tried += 1
        info = _answered(env, index, expression)
        assert not info["correct"] and info["grade"]["undone_arithmetic"], (task.id, expression)
        assert _answered(env, index, steps[-1][1].strip())["correct"], task.id
    env.close()
    assert tried == 363


@pytest.mark.parametrize("name", ["aime24", "aime25", "math500"])
def test_an_integer_gold_written_as_a_sum_earns_nothing(name) -> None:
    """Issue 48: `{g-1}+1` for an integer gold g was credited on all 30 AIME 2024, 30 AIME
    2025 and 293 MATH-500 problems with a plain-integer gold."""
    env = gym.make("copes:ToolMath-v0", benchmark=name, data_dir=SHARED)
    integers = [(i, t) for i, t in enumerate(env.unwrapped.tasks) if t.answers[0].isdigit()]
    for index, task in integers:
        info = _answered(env, index, f"{int(task.answers[0]) - 1}+1")
        assert not info["correct"] and info["grade"]["undone_arithmetic"], task.id
    env.close()
    assert len(integers) == {"aime24": 30, "aime25": 30, "math500": 293}[name]


@pytest.mark.parametrize(("name", "split"), [("hotpotqa", None), *[(n, "dev500") for n in
                                             ("hotpotqa", "2wiki", "musique")]])  # fmt: skip
def test_every_qa_gold_grades_right_with_its_rule_and_wrong_when_changed(name, split) -> None:
    grader = QAGrader(metric="em", rule=benchmark_qa_rule(name))
    for task in load(name, split):
        gold = task.answers[0]
        assert grader(gold, task).correct, task.id
        assert not grader(f"{gold} plus one", task).correct, task.id


def test_open_domain_files_without_a_corpus_are_refused_before_the_model_loads(
    tiny_agent_dir, tmp_path, capsys
) -> None:
    from copes.evaluation.cli import main as eval_main

    start = time.monotonic()
    flags = ["--model", str(tiny_agent_dir), "--benchmarks", "musique", "--split", "dev500",
             "--data-dir", str(SHARED), "--out", str(tmp_path / "e")]  # fmt: skip
    status = eval_main(flags)
    err = capsys.readouterr().err
    assert status == 2 and "open-domain questions need a corpus" in err, err
    assert len(err.strip().splitlines()) == 1 and time.monotonic() - start < 30


def test_copes_eval_reads_the_qa_files_over_a_corpus_index(tiny_agent_dir, tmp_path) -> None:
    from copes.envs.retrieval.cli import main as index_main
    from copes.evaluation.cli import main as eval_main

    # A small corpus that holds the answer to the first question of each file.
    passages = [
        {"id": f"p{i}", "contents": f'"{t.answers[0]}"\n{t.question} {t.answers[0]}.'}
        for i, t in enumerate(load(n, "dev500")[0] for n in ("hotpotqa", "2wiki", "musique"))
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    assert index_main(["build", str(corpus), str(tmp_path / "index"), "--quiet"]) == 0
    out = tmp_path / "eval"
    flags = ["--model", str(tiny_agent_dir), "--benchmarks", "hotpotqa,2wiki,musique",
             "--split", "dev500", "--data-dir", str(SHARED), "--limit", "2", "-n", "1",
             "--pass-k", "1", "--max-new-tokens", "32", "--max-turns", "2", "--device", "cpu",
             "--quiet", "--out", str(out), "--env-kwargs",
             json.dumps({"corpus_index": str(tmp_path / "index")})]  # fmt: skip
    assert eval_main(flags) == 0
    config = json.loads((out / "eval_config.json").read_text())
    assert config["split"] == "dev500"
    assert config["task_ids"]["2wiki"] == ["2wiki-dev500-1", "2wiki-dev500-2"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["benchmark"] for s in samples}) == ["2wiki", "hotpotqa", "musique"]
    assert eval_main(["--rescore", "--out", str(out)]) == 0  # grading needs no corpus
    # Each benchmark's env grades with its official rule (picked by the tasks' source).
    for name in ("hotpotqa", "2wiki", "musique"):
        grader = get_benchmark(name).make_grader(load(name, "dev500")[:2])
        assert grader.grader.rule == benchmark_qa_rule(name)
