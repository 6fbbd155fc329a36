"""ToolEnv: the multi-turn loop, with user-defined tools and grader."""

import time

import pytest
from gymnasium.utils.env_checker import check_env

from copes.envs.core import ToolEnv, UnicodeText
from copes.envs.rewards.graders import Grade
from copes.envs.tasks.base import Task
from copes.envs.tools.base import tool


@tool
def reverse(text: str) -> str:
    """Reverse a string."""
    return text[::-1]


@tool
def explode(text: str) -> str:
    """A tool with a bug."""
    raise RuntimeError("boom")


@tool
def shout(text: str) -> str:
    """Repeat loudly."""
    return text.upper() * 1000


def exact_grader(answer: str, task: Task) -> Grade:
    correct = answer in task.answers
    return Grade(float(correct), correct, {"prediction": answer})


TASKS = [
    Task(id=f"t{i}", question=f"Reverse the word w{i}ord.", answers=(f"dro{i}w",), kind="qa")
    for i in range(5)
]


def make_env(**kwargs):
    return ToolEnv(TASKS, [reverse, explode, shout], exact_grader, **kwargs)


def test_check_env_passes():
    check_env(make_env(), skip_render_check=False)


def test_full_episode_tool_then_correct_answer():
    env = make_env()
    obs, info = env.reset(seed=0, options={"task_id": "t3"})
    assert obs.endswith("Question: Reverse the word w3ord.")
    assert "<reverse>...</reverse>" in obs and "<answer>" in obs
    assert info["messages"] == [{"role": "user", "content": obs}]
    assert info["tools"][0]["function"]["name"] == "reverse"

    obs, reward, terminated, truncated, info = env.step("<reverse>w3ord</reverse>")
    assert (obs, reward, terminated, truncated) == ("dro3w", 0.0, False, False)
    assert info["tool_calls"] == 1 and info["action"] == "tool_call" and info["tool"] == "reverse"
    assert info["messages"][-1] == {"role": "tool", "name": "reverse", "content": "dro3w"}

    obs, reward, terminated, truncated, info = env.step("<answer>dro3w</answer>")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["end_reason"] == "answer" and info["correct"] is True
    assert info["grade"]["prediction"] == "dro3w"
    assert [m["role"] for m in info["messages"]] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<answer>again</answer>")


def test_wrong_answer_gets_zero():
    env = make_env()
    env.reset(options={"task_index": 0})
    _, reward, terminated, _, info = env.step("<answer>nope</answer>")
    assert reward == 0.0 and terminated and info["correct"] is False


def test_invalid_turns_penalty_and_truncation():
    env = make_env(max_turns=2, invalid_penalty=0.1)
    env.reset(options={"task_index": 0})
    obs, reward, terminated, truncated, info = env.step("just text")
    assert obs.startswith("Invalid action") and reward == -0.1
    assert not terminated and not truncated and info["messages"][-1]["role"] == "user"
    obs, reward, terminated, truncated, info = env.step("<reverse>abc</reverse>")
    assert truncated and not terminated and info["end_reason"] == "max_turns"


def test_tool_exception_becomes_observation():
    env = make_env()
    env.reset(seed=1)
    obs, *_ = env.step("<explode>x</explode>")
    assert "explode tool failed" in obs and "boom" in obs


def test_long_tool_output_is_truncated_with_marker():
    env = make_env(max_tool_output_chars=100)
    env.reset(seed=1)
    obs, *_ = env.step("<shout>ab</shout>")
    assert obs.startswith("ABAB") and obs.endswith("[truncated 1900 characters]")


def test_seeded_reset_is_reproducible_and_covers_tasks():
    env = make_env()
    first = [env.reset(seed=s)[1]["task_id"] for s in range(20)]
    again = [env.reset(seed=s)[1]["task_id"] for s in range(20)]
    assert first == again and len(set(first)) > 1


def test_system_prompt_and_render():
    env = make_env(system_prompt="Be brief.", render_mode="ansi")
    _, info = env.reset(seed=0)
    assert info["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "[user]" in env.render()


def test_hermes_format_episode():
    env = make_env(call_format="hermes")
    obs, _ = env.reset(options={"task_id": "t1"})
    assert "<reverse>" not in obs
    out, *_ = env.step('<tool_call>{"name": "reverse", "arguments": {"text": "w1ord"}}</tool_call>')
    assert out == "dro1w"
    assert env.step("<answer>dro1w</answer>")[1] == 1.0


def test_bad_construction_is_explained():
    with pytest.raises(ValueError, match="at least one task"):
        ToolEnv([], [reverse], exact_grader)
    with pytest.raises(ValueError, match="unique"):
        ToolEnv(TASKS, [reverse, reverse], exact_grader)
    with pytest.raises(ValueError, match="call_format"):
        ToolEnv(TASKS, [reverse], exact_grader, call_format="xml")


def test_unicode_space_admits_any_text():
    space = UnicodeText(10, seed=0)
    assert space.contains("日本語 🙂 ∑")
    assert not space.contains("x" * 11) and not space.contains(3)
    assert all(space.contains(space.sample()) for _ in range(20))


def test_tool_and_grading_time_are_reported_apart():
    def slow_grader(answer: str, task: Task) -> Grade:
        time.sleep(0.02)
        return exact_grader(answer, task)

    env = ToolEnv(TASKS, [reverse], slow_grader)
    env.reset(options={"task_index": 1})
    *_, info = env.step("<reverse>w1ord</reverse>")
    assert info["tool_seconds"] >= 0 and "grade_seconds" not in info
    *_, info = env.step("<answer>dro1w</answer>")
    assert info["grade_seconds"] >= 0.02 and info["correct"] is True


@pytest.mark.parametrize("options", ["task", [1, 2], 3])
def test_reset_options_that_are_not_a_dict_are_refused_clearly(options):
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks

    env = tool_math_env(tasks=synthetic_math_tasks("test", 2))
    try:
        with pytest.raises(TypeError, match=r"reset\(options=\.\.\.\) takes a dict"):
            env.reset(options=options)
    finally:
        env.close()


def test_episode_rules_apply_to_any_toolenv_after_it_is_built() -> None:
    """A plugin's factory that takes only tasks and call_format still runs a run's turn
    limit and invalid penalty (`Benchmark.make_env(rules=...)`); a non-ToolEnv is refused."""
    import gymnasium as gym

    from copes.envs.core import EpisodeRules, ToolEnv
    from copes.envs.rewards.graders import MathGrader
    from copes.envs.tasks.base import Task
    from copes.registry import Benchmark

    def narrow_factory(tasks, call_format="tags", grader=None):  # no max_turns, no penalty
        return ToolEnv(tasks, [], MathGrader(), call_format=call_format)

    if "copes_test/Narrow-v0" not in gym.registry:
        gym.register(id="copes_test/Narrow-v0", entry_point=narrow_factory)
    task = Task("t", "1 + 1?", ("2",), "math")
    benchmark = Benchmark("narrow-test", [task], env="copes_test/Narrow-v0", split="test")
    env = benchmark.make_env([task], rules=EpisodeRules(max_turns=2, invalid_penalty=0.3))
    assert (env.unwrapped.max_turns, env.unwrapped.invalid_penalty) == (2, 0.3)
    assert env.unwrapped.max_tool_output_chars == 4000  # not set: the env's own
    env.reset(options={"task": task})
    _, reward, terminated, truncated, info = env.step("no action here")
    assert (reward, terminated, truncated) == (-0.3, False, False)
    _, reward, terminated, truncated, info = env.step("still none")
    assert (reward, truncated, info["end_reason"]) == (-0.3, True, "max_turns")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        EpisodeRules(max_turns=0)
    from gymnasium.envs.classic_control import CartPoleEnv

    if "copes_test/NotTool-v0" not in gym.registry:
        gym.register(id="copes_test/NotTool-v0", entry_point=lambda tasks: CartPoleEnv())
    other = Benchmark("not-tool-test", [task], env="copes_test/NotTool-v0", split="test")
    with pytest.raises(ValueError, match="makes a CartPoleEnv, not a copes ToolEnv"):
        other.make_env([task], rules=EpisodeRules(max_turns=2))
