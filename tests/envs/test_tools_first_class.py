"""Tools as other projects write them: plain and async functions, zero-argument calls,
argument schemas in the tags prompt, jsonschema validation, OpenAI-format messages."""

import asyncio

import pytest

from copes.envs.presets import tool_math_env
from copes.envs.tasks.base import Task

TASK = Task(id="t", question="What time is it?", answers=("12",), kind="math")


def convert_mass(value: float, from_unit: str, to_unit: str = "kg") -> str:
    """Convert a mass between units.

    Args:
        value: the number to convert.
        from_unit: g or kg.
    """
    factor = {"g": 0.001, "kg": 1.0}
    return f"{value * factor[from_unit] / factor[to_unit]:g} {to_unit}"


async def clock() -> str:
    """The time of day."""
    await asyncio.sleep(0)
    return "12:00"


def total(values: list[int]) -> str:
    """Add integers.

    Args:
        values: the integers.
    """
    return str(sum(values))


def env_with(call_format="tags"):
    env = tool_math_env(
        tasks=[TASK], extra_tools=[convert_mass, clock, total], call_format=call_format
    )
    first, info = env.reset(options={"task": TASK})
    return env, first, info


def test_plain_and_async_functions_are_tools_and_their_arguments_are_in_the_prompt():
    env, first, info = env_with()
    try:
        assert (
            '<convert_mass>{"value": number, "from_unit": string, "to_unit": string (optional)}'
            "</convert_mass> Convert a mass between units." in first
        )
        assert "<clock></clock> The time of day." in first
        assert "<python>...</python>" in first  # one argument: the tag's content
        names = [t["function"]["name"] for t in info["tools"]]
        assert names == ["python", "convert_mass", "clock", "total"]
        obs, *_ = env.step('<convert_mass>{"value": 500, "from_unit": "g"}</convert_mass>')
        assert obs == "0.5 kg"
        obs, *_ = env.step("<clock></clock>")  # zero arguments; an async function, awaited
        assert obs == "12:00"
    finally:
        env.close()


def test_an_async_tool_is_awaited_inside_a_running_event_loop():
    async def step_from_async_code():
        env, _, _ = env_with()
        try:
            return env.step("<clock></clock>")[0]
        finally:
            env.close()

    assert asyncio.run(step_from_async_code()) == "12:00"


@pytest.mark.parametrize(
    ("turn", "fragment"),
    [
        ('<total>{"values": [1, "a"]}</total>', "argument 'values' of tool 'total' must be"),
        ('<convert_mass>{"value": 1, "from_unit": "g", "x": 2}</convert_mass>', "unknown argument"),
        ('<convert_mass>{"from_unit": "g"}</convert_mass>', "missing required argument(s) value"),
        ("<weather>Paris</weather>", "unknown tool 'weather' (available: python, convert_mass"),
    ],
)
def test_bad_calls_are_observations_that_name_the_problem(turn, fragment):
    env, _, _ = env_with()
    try:
        obs, _, _, _, info = env.step(turn)
        assert info["action"] == "invalid" and fragment in obs, obs
        assert info["tools"]  # the schemas ride along on every step
    finally:
        env.close()


def test_native_calls_are_openai_tool_calls_with_ids():
    env, _, _ = env_with("hermes")
    try:
        turn = 'Let me check.\n<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
        obs, _, _, _, info = env.step(turn)
        assert obs == "12:00"
        assistant, reply = info["messages"][-2:]
        assert assistant == {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": {}}}
            ],
        }
        assert reply["role"] == "tool" and reply["tool_call_id"] == "call_1"
    finally:
        env.close()


def test_something_that_is_not_a_tool_is_refused_clearly():
    with pytest.raises(TypeError, match="is not a tool: pass a function"):
        tool_math_env(tasks=[TASK], extra_tools=[42])


def test_gym_make_takes_a_grader_function():
    """`gym.make(..., grader=fn)` raised "got multiple values for argument 'grader'"."""
    import gymnasium as gym

    def lowest_terms(answer, task):  # a per-task rule the symbolic grader cannot know
        return answer.strip() == task.answers[0]

    task = Task(id="f", question="Simplify 92/524.", answers=("23/131",), kind="math")
    env = gym.make("copes:ToolMath-v0", tasks=[task], grader=lowest_terms)
    try:
        env.reset(options={"task": task})
        assert env.step("<answer>92/524</answer>")[1] == 0.0  # equal, but not in lowest terms
        env.reset(options={"task": task})
        assert env.step("<answer>23/131</answer>")[1] == 1.0
    finally:
        env.close()
