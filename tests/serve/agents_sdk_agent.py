"""A harness built on the OpenAI Agents SDK, unchanged: its chat-completions model pointed
at the session's client. The reward is the grader's verdict, shaped by the answer's length
(so that members differ and one ES step moves the weights even when all are wrong)."""

import os
import re

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai_agent import PROMPT

set_tracing_disabled(True)
TOOL_RUNS: list[str] = []  # what the SDK ran, for the test to see


@function_tool
def python(code: str) -> str:
    """Run Python code and return what it prints."""
    TOOL_RUNS.append(code)
    return "42"


async def episode(client, model: str, task: dict) -> float:
    agent = Agent(
        name="calculator",
        instructions=None,  # the tiny agent knows the task prompt of copes' tags format
        tools=[python],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
    )
    try:
        result = await Runner.run(agent, PROMPT + task["question"], max_turns=3)
    except MaxTurnsExceeded:
        return -1.0
    text = str(result.final_output or "")
    answers = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    correct = bool(answers) and answers[-1].strip() in task["answers"]
    return float(correct) - len(text) / 1000
