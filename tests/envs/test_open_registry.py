"""The open registry: tasks from dicts, files and Datasets; answer checks; register_benchmark."""

import json

import gymnasium as gym
import pytest

import copes  # noqa: F401  (registers the env ids)
from copes.envs.presets import tool_math_env
from copes.envs.rewards.checks import lowest_terms, register_answer_check
from copes.envs.tasks.base import Task
from copes.envs.tasks.records import as_tasks
from copes.registry import Benchmark, get_benchmark, register_benchmark, resolve_benchmarks

ROWS = [
    {"uid": "a", "problem": "Simplify 92/524.", "solution": "23/131", "level": 2},
    {"uid": "b", "problem": "What is 2+3?", "solution": "5", "level": 1},
]
COLUMNS = {"id": "uid", "question": "problem", "answers": "solution"}


def test_dicts_jsonl_and_datasets_give_the_same_tasks(tmp_path):
    import datasets

    from_dicts = as_tasks(ROWS, kind="math", columns=COLUMNS, source="mine")
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    from_file = as_tasks(str(path), kind="math", columns=COLUMNS)  # source: the file's name
    dataset = datasets.Dataset.from_list(ROWS)
    from_dataset = as_tasks(dataset, kind="math", columns=COLUMNS, source="mine")
    assert from_dicts == from_file == from_dataset
    assert [t.id for t in from_dicts] == ["a", "b"]
    assert from_dicts[1].answers == ("5",) and from_dicts[0].metadata == {"level": 2}
    # default column names, and ids made from the source and split when there are none
    plain = as_tasks([{"question": "1+1?", "answer": 2}], kind="math", source="mine")
    assert plain[0].id == "mine-train-0" and plain[0].answers == ("2",)


def test_bad_records_say_what_to_map():
    with pytest.raises(KeyError, match=r"columns=\{'question'"):
        as_tasks([{"problem": "1+1?", "answer": "2"}], kind="math")
    with pytest.raises(KeyError, match="no column 'prob'"):
        as_tasks(ROWS, kind="math", columns={"question": "prob"})
    with pytest.raises(ValueError, match="unknown task fields"):
        as_tasks(ROWS, kind="math", columns={"query": "problem"})
    with pytest.raises(TypeError, match="wrap it in a list"):
        as_tasks(ROWS[0], kind="math")


def test_presets_and_gym_make_take_records_with_a_column_mapping():
    env = gym.make("ToolMath-v0", tasks=ROWS, columns=COLUMNS)
    first, _ = env.reset(options={"task_id": "b"})
    assert "What is 2+3?" in first
    *_, info = env.step("<answer>5</answer>")
    assert info["correct"]
    env.close()


def test_lowest_terms_check_fails_an_equal_but_unreduced_fraction():
    assert lowest_terms("23/131", None) and lowest_terms("\\frac{23}{131}", None)
    assert lowest_terms("-3/4", None) and lowest_terms("7", None)
    assert not lowest_terms("92/524", None) and not lowest_terms("4/2", None)
    task = Task("f", "Simplify 92/524 to lowest terms.", ("23/131",), "math",
                checks=("lowest-terms",))  # fmt: skip
    env = tool_math_env(tasks=[task])
    for answer, correct in (("92/524", False), ("23/131", True), ("\\frac{23}{131}", True)):
        env.reset(options={"task": task})
        _, reward, *_, info = env.step(f"<answer>{answer}</answer>")
        assert (info["correct"], reward) == (correct, float(correct)), answer
        if not correct:  # against a reduced gold, an unreduced fraction is arithmetic undone
            assert info["grade"]["undone_arithmetic"]
    # The check asks for the form whatever the gold's: a gold written unreduced takes itself
    # without the check, and only the reduced fraction with it.
    unreduced = Task("g", "?", ("92/524",), "math")
    checked = Task("h", "?", ("92/524",), "math", checks=("lowest-terms",))
    env = tool_math_env(tasks=[unreduced, checked])
    for task, correct in ((unreduced, True), (checked, False)):
        env.reset(options={"task": task})
        info = env.step("<answer>92/524</answer>")[-1]
        assert info["correct"] is correct
        if not correct:
            assert info["grade"]["failed_checks"] == ["lowest-terms"]
    env.reset(options={"task": checked})
    assert env.step("<answer>23/131</answer>")[-1]["correct"]


def test_checks_are_named_and_registrable():
    with pytest.raises(ValueError, match=r"unknown answer checks \['no-such'\]"):
        tool_math_env(tasks=[Task("t", "?", ("1",), "math", checks=("no-such",))])
    register_answer_check("even", lambda answer, task: int(answer) % 2 == 0, replace=True)
    task = Task("t", "An even number above 1?", ("2",), "math", checks=("even",))
    env = tool_math_env(tasks=[task], grader=lambda answer, task: int(answer) > 1)
    env.reset()
    assert env.step("<answer>4</answer>")[-1]["correct"]
    env.reset()
    assert not env.step("<answer>3</answer>")[-1]["correct"]
    with pytest.raises(ValueError, match="already registered"):
        register_answer_check("even", lambda answer, task: True)


def test_register_benchmark_from_a_folder_of_splits_with_checks(tmp_path):
    folder = tmp_path / "fractions"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(
            json.dumps({"id": f"{split}-0", "question": "Reduce 2/4.", "answer": "1/2"}) + "\n"
        )
    try:
        register_benchmark("fractions-demo", folder, kind="math", checks=("lowest-terms",))
        bench = get_benchmark("fractions-demo")
        assert [t.id for t in bench.load_tasks(split="train")] == ["train-0"]
        (task,) = bench.load_tasks()  # the evaluation split: test
        assert task.checks == ("lowest-terms",)
        grader = bench.make_grader()
        assert grader("1/2", task).correct and not grader("2/4", task).correct
        with pytest.raises(ValueError, match="already registered"):
            register_benchmark("fractions-demo", folder, kind="qa")
        assert resolve_benchmarks("fractions-demo,gsm8k")[0] is bench
    finally:
        from copes import registry

        registry._REGISTRY.pop("fractions-demo", None)


def test_a_one_split_source_is_never_reused_as_another_split():
    bench = Benchmark("one-file", ROWS, columns=COLUMNS, split="test")
    assert len(bench.load_tasks()) == 2
    with pytest.raises(ValueError, match=r"holds one split \('test'\), not 'train'"):
        bench.load_tasks(split="train")


def test_module_prefix_imports_the_module_first(tmp_path, monkeypatch):
    (tmp_path / "my_bench_mod.py").write_text(
        "from copes.registry import register_benchmark\n"
        "register_benchmark('mod-bench', [{'question': '1+1?', 'answer': '2'}], split='test')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert get_benchmark("my_bench_mod:mod-bench").name == "mod-bench"
        with pytest.raises(ValueError, match="registered no 'other'"):
            get_benchmark("my_bench_mod:other")
        with pytest.raises(ValueError, match="cannot import 'no_such_mod'"):
            get_benchmark("no_such_mod:x")
    finally:
        from copes import registry

        registry._REGISTRY.pop("mod-bench", None)


def test_a_broken_entry_point_is_reported_not_fatal(monkeypatch, caplog):
    from importlib import metadata

    from copes import registry

    class Broken:
        value = "nowhere:register"

        def load(self):
            raise ImportError("boom")

    monkeypatch.setattr(metadata, "entry_points", lambda group: [Broken()])
    registry._load_entry_points.cache_clear()
    try:
        assert "gsm8k" in registry.benchmark_names()
        assert "nowhere:register" in caplog.text and "boom" in caplog.text
    finally:
        registry._load_entry_points.cache_clear()
