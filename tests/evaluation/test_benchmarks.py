"""The evaluation registry on the fixture files of every benchmark (real schemas)."""

import shutil
from pathlib import Path

import pytest

from copes.envs.tasks.base import Task
from copes.registry import benchmark_names, get_benchmark, resolve_benchmarks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
# Fixture file -> where a data dir keeps it (docs/evaluation.md: <name>.<ext> or <name>/<split>.*)
DATA_DIR_LAYOUT = {
    "aime24.jsonl": "aime24.jsonl",
    "aime25.jsonl": "aime25.jsonl",
    "gsm8k.jsonl": "gsm8k.jsonl",
    "math500.jsonl": "math500.jsonl",
    "hotpot_dev_distractor_v1.json": "hotpotqa/dev.json",
    "2wiki_dev.json": "2wiki.json",
    "musique_ans_v1.0_dev.jsonl": "musique/validation.jsonl",
}
FILE_BACKED = ["aime24", "aime25", "gsm8k", "math500", "hotpotqa", "2wiki", "musique"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for fixture, target in DATA_DIR_LAYOUT.items():
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / fixture, root / target)
    return root


def test_registry_names_every_benchmark():
    builtin = {*FILE_BACKED, "synthetic-math", "synthetic-qa"}
    assert builtin <= set(benchmark_names())
    for name in builtin:
        benchmark = get_benchmark(name)
        assert benchmark.name == name
        assert benchmark.env_id == ("ToolMath-v0" if benchmark.kind == "math" else "ToolQA-v0")
        assert (benchmark.source is None) == benchmark.generated == name.startswith("synthetic")


@pytest.mark.parametrize("name", FILE_BACKED)
def test_file_backed_benchmark_loads_from_data_dir_and_grades_gold_as_correct(name, data_dir):
    benchmark = get_benchmark(name)
    tasks = benchmark.load_tasks(data_dir=data_dir)
    assert len(tasks) >= 3
    assert all(t.kind == benchmark.kind for t in tasks)
    assert len({t.id for t in tasks}) == len(tasks)
    assert len(benchmark.load_tasks(data_dir=data_dir, limit=2)) == 2

    # The benchmark's own environment grades its gold answer as correct, a wrong one not.
    env = benchmark.make_env(tasks, max_turns=2)
    try:
        task = tasks[0]
        env.reset(options={"task": task})
        *_, info = env.step(f"<answer>{task.answers[0]}</answer>")
        assert info["correct"] is True and info["end_reason"] == "answer"
        env.reset(options={"task": task})
        *_, info = env.step("<answer>certainly not the answer 123456789</answer>")
        assert info["correct"] is False
    finally:
        env.close()


@pytest.mark.parametrize("name", ["synthetic-math", "synthetic-qa"])
def test_synthetic_benchmarks_are_generated_and_ignore_data_dir(name, tmp_path):
    benchmark = get_benchmark(name)
    tasks = benchmark.load_tasks(data_dir=tmp_path, limit=3)  # empty dir: not read
    assert len(tasks) == 3 and all(t.kind == benchmark.kind for t in tasks)
    assert tasks == benchmark.load_tasks(limit=3)  # the same tasks on every call
    env = benchmark.make_env(tasks)
    try:
        env.reset(options={"task": tasks[1]})
        *_, info = env.step(f"<answer>{tasks[1].answers[0]}</answer>")
        assert info["correct"] is True
    finally:
        env.close()


def test_missing_local_file_is_an_error_not_a_trip_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="no local files for benchmark 'gsm8k'"):
        get_benchmark("gsm8k").load_tasks(data_dir=tmp_path)


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark 'gsm9k'; known: gsm8k, math500, "):
        get_benchmark("gsm9k")
    with pytest.raises(ValueError, match="synthetic-qa"):
        resolve_benchmarks("gsm8k,nope")


def test_resolve_benchmarks():
    assert [b.name for b in resolve_benchmarks(" gsm8k, hotpotqa,")] == ["gsm8k", "hotpotqa"]
    assert resolve_benchmarks([get_benchmark("aime24"), "2wiki"])[1].name == "2wiki"
    with pytest.raises(ValueError, match="listed twice"):
        resolve_benchmarks("gsm8k,gsm8k")
    with pytest.raises(ValueError, match="no benchmarks given"):
        resolve_benchmarks("")


def test_graders_and_vote_normalization():
    math, qa = get_benchmark("math500"), get_benchmark("hotpotqa")
    task = Task("t", "?", ("\\frac{1}{2}",), "math")
    assert math.make_grader()("0.5", task).correct
    assert math.normalize("\\dfrac{1}{2}") == math.normalize("\\frac12")
    qa_task = Task("q", "?", ("The Eiffel Tower",), "qa")
    grade = qa.make_grader()("eiffel tower", qa_task)
    assert grade.correct and grade.reward == 1.0
    partial = qa.make_grader()("the tower", qa_task)
    assert not partial.correct and 0 < partial.reward < 1  # reward = F1, correct = EM
    assert qa.normalize("The  Eiffel Tower!") == "eiffel tower"
