"""Scripted full episodes of ToolMath-v0 and ToolQA-v0 with their real tools and graders."""

import gymnasium as gym
import pytest

import copes  # noqa: F401
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

FIXTURES = "tests/fixtures/benchmarks"


@pytest.fixture(scope="module")
def math_task():
    return synthetic_math_tasks("test", 1, seed=3)[0]


@pytest.fixture(scope="module")
def qa_task():
    return synthetic_qa_tasks("test", 1, seed=3)[0]


def test_toolmath_episode_correct_and_wrong(math_task):
    env = gym.make("copes:ToolMath-v0", tasks=[math_task])
    obs, info = env.reset(seed=0)
    assert math_task.question in obs and "<python>" in obs
    obs, reward, terminated, truncated, info = env.step(
        f"<python>{math_task.metadata['solution_code']}</python>"
    )
    assert obs.strip() == math_task.answers[0] and reward == 0.0
    assert not terminated and not truncated
    assert info["tool"] == "python" and info["tool_calls"] == 1
    _, reward, terminated, _, info = env.step(f"<answer>{obs.strip()}</answer>")
    assert reward == 1.0 and terminated and info["correct"]

    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("<answer>-1</answer>")
    assert reward == 0.0 and terminated and not info["correct"]
    env.close()


def test_toolmath_boxed_answer_and_variables_persist(math_task):
    env = tool_math_env(tasks=[math_task])
    env.reset(seed=0)
    code = math_task.metadata["solution_code"].replace("print(", "result = (")
    env.step(f"<python>{code}</python>")
    obs, *_ = env.step("<python>print(result)</python>")
    assert obs.strip() == math_task.answers[0]
    _, reward, *_ = env.step(rf"So the answer is \boxed{{{obs.strip()}}}.")
    assert reward == 1.0
    env.close()


def test_toolqa_episode_correct_and_wrong(qa_task):
    env = gym.make("copes:ToolQA-v0", tasks=[qa_task])
    obs, _ = env.reset(seed=0)
    assert "<search>" in obs
    hops = qa_task.metadata["hops"]
    obs, reward, *_ = env.step(f"<search>{hops[0]['query']}</search>")
    assert hops[0]["answer"] in obs and reward == 0.0
    obs, *_ = env.step(f"<search>{hops[1]['query']}</search>")
    assert qa_task.answers[0] in obs
    _, reward, terminated, _, info = env.step(f"<answer>{qa_task.answers[0]}</answer>")
    assert reward == 1.0 and terminated and info["grade"]["em"] == 1.0

    env.reset(seed=0)
    _, reward, _, _, info = env.step("<answer>Nobody Inparticular</answer>")
    assert reward == 0.0 and info["grade"]["f1"] == 0.0
    env.close()


def test_hermes_format_with_real_tools(math_task):
    env = tool_math_env(tasks=[math_task], call_format="hermes")
    _, info = env.reset(seed=0)
    assert info["tools"][0]["function"]["name"] == "python"
    import json

    call = json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
    obs, *_ = env.step(f"<tool_call>{call}</tool_call>")
    assert obs.strip() == "42"
    env.close()


def test_benchmark_ids_load_local_files():
    env = gym.make("copes:ToolMath-gsm8k-v0", data_dir=FIXTURES)
    obs, info = env.reset(seed=0)
    assert obs and info["task_id"]
    env.close()
    env = gym.make("copes:ToolQA-hotpotqa-v0", source=f"{FIXTURES}/hotpot_dev_distractor_v1.json")
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step("<search>the</search>")  # any query: the pool search runs
    assert obs
    env.close()


def test_wrong_task_kind_and_open_corpus_need_are_explained(math_task, qa_task):
    with pytest.raises(ValueError, match="grades math tasks"):
        tool_math_env(tasks=[qa_task])
    with pytest.raises(ValueError, match="corpus_index"):
        tool_qa_env(benchmark="flashrag-hotpotqa", source=f"{FIXTURES}/flashrag_hotpotqa_dev.jsonl")
