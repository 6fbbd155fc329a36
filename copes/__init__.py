"""copes: post-train tool-using LLM agents without backpropagation.

``import copes`` registers the Gymnasium environments (ToolMath-v0, ToolQA-v0, ...).
"""

from copes.envs.registration import register_envs

__version__ = "0.1.0"

register_envs()
