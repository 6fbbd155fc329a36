"""Gymnasium tool environments: `ToolEnv`, its tools, tasks and graders."""

from copes.envs.core import ToolEnv, UnicodeText, default_instructions
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.registration import register_envs

__all__ = [
    "ToolEnv",
    "UnicodeText",
    "default_instructions",
    "register_envs",
    "tool_math_env",
    "tool_qa_env",
]
