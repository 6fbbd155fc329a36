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


def test_gym_make_with_namespace_needs_no_prior_import():
    import subprocess
    import sys

    code = (
        "import gymnasium as gym\n"
        "env = gym.make('copes:ToolMath-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "assert 'Question:' in obs and info['task_id'].startswith('synthetic-math-train')\n"
        "env.close()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
