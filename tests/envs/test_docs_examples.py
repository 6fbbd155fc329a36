"""The worked examples in docs/ run as written."""

import re
from pathlib import Path

import gymnasium as gym
from gymnasium.utils.env_checker import check_env

import copes  # noqa: F401  (registers the ids)

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_adding_a_tool_example_runs():
    blocks = [b for b in python_blocks((DOCS / "envs.md").read_text()) if "@tool" in b]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/envs.md", "exec"), namespace)  # asserts inside the example
    tool = namespace["convert_length"]
    assert tool.parameters["required"] == ["value", "from_unit", "to_unit"]
    assert tool(value=1, from_unit="mi", to_unit="km") == "1.60934 km"
    assert tool(value=1, from_unit="parsec", to_unit="km").startswith("Error")


def test_registered_envs_pass_check_env():
    for env_id in ("copes:ToolMath-v0", "copes:ToolQA-v0"):
        env = gym.make(env_id)
        check_env(env.unwrapped)
        env.close()
