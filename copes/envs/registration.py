"""Registers the copes environments with Gymnasium.

Importing `copes` runs this, so ``gym.make("copes:ToolMath-v0")`` works from any project.
Entry points are strings: nothing heavy is imported until an env is made.
"""

from __future__ import annotations

import gymnasium as gym

MATH_BENCHMARKS = ("gsm8k", "math500", "math", "aime24", "aime25")
QA_BENCHMARKS = ("hotpotqa", "2wiki", "musique")


def register_envs() -> None:
    """Register ToolMath-v0, ToolQA-v0 and one id per benchmark (idempotent)."""
    specs = {
        "ToolMath-v0": ("copes.envs.presets:tool_math_env", {}),
        "ToolQA-v0": ("copes.envs.presets:tool_qa_env", {}),
    }
    for name in MATH_BENCHMARKS:
        specs[f"ToolMath-{name}-v0"] = ("copes.envs.presets:tool_math_env", {"benchmark": name})
    for name in QA_BENCHMARKS:
        specs[f"ToolQA-{name}-v0"] = ("copes.envs.presets:tool_qa_env", {"benchmark": name})
    for env_id, (entry_point, kwargs) in specs.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
