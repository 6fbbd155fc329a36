"""copes.integrations.trl without a training run: the environment_factory's tools are the
env's, as TRL reads them, and grading works; the rollout's task lookup refuses ambiguity."""

import gymnasium as gym
import pytest

import copes  # noqa: F401
from copes.envs.presets import load_tasks
from copes.envs.tasks.base import Task
from copes.integrations.trl import CopesRollout, environment_factory, task_dataset


def convert_mass(value: float, unit: str, to: str = "kg") -> str:
    """Convert a mass between units.

    Args:
        value: the amount
        unit: its unit, e.g. lb
        to: the unit wanted
    """
    return f"{value} {unit} in {to}"


def _without(schema, key):
    if isinstance(schema, dict):
        return {k: _without(v, key) for k, v in schema.items() if k != key}
    return schema


def test_environment_factory_exposes_the_env_tools_as_trl_reads_them():
    from transformers.utils import get_json_schema

    tasks = load_tasks("synthetic-math", "train", limit=3)
    make = lambda: gym.make("ToolMath-v0", tasks=tasks, extra_tools=[convert_mass])  # noqa: E731
    environment = environment_factory(make)()
    try:
        for schema in environment.base.tool_schemas:
            method = getattr(environment, schema["function"]["name"])
            read = get_json_schema(method)  # what TRL builds the tool prompt from
            read["function"].pop("return")
            assert _without(read, "nullable") == _without(schema, "default")
        assert environment.reset(task_id=tasks[0].id) is None
        assert environment.python(code="print(6 * 7)") == "42"
        assert environment.convert_mass(value=2, unit="lb") == "2 lb in kg"
        assert "missing required argument(s) value" in environment.convert_mass(unit="lb")
        assert environment.get_reward() == 0.0
        assert environment.answer(tasks[0].answers[0]) == "correct"
        assert environment.get_reward() == 1.0
        with pytest.raises(KeyError, match="no task 'nope'"):
            environment.reset(task_id="nope")
    finally:
        environment.env.close()


def test_dataset_rows_name_their_task_and_duplicate_prompts_are_refused():
    tasks = load_tasks("synthetic-math", "train", limit=3)
    env = gym.make("ToolMath-v0", tasks=tasks)
    rows = task_dataset(env)
    assert rows["task_id"] == [t.id for t in tasks]
    assert tasks[1].question in rows[1]["prompt"][0]["content"]
    twins = [Task("x", "1+1?", ("2",), "math"), Task("y", "1+1?", ("3",), "math")]
    rollout = CopesRollout(lambda: gym.make("ToolMath-v0", tasks=twins))
    with pytest.raises(ValueError, match="first message of 2 tasks"):
        rollout._task_ids([rollout.dataset(conversational=False)[0]["prompt"]], None)
    rollout.close()
    env.close()
