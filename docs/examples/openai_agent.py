"""An agent that knows nothing of copes: a calculator loop on the OpenAI client.

    copes-train --harness openai_agent:episode ...   (with this folder on PYTHONPATH)

copes calls `episode` once per session, with a client whose base URL is the session's.
The code runs unsandboxed in a subprocess: fine for arithmetic, not for untrusted models.
"""

import asyncio
import json
import re
import subprocess
import sys

PROMPT = (
    "Tools (one call per turn, then wait for the result):\n<python>...</python> Run Python "
    "code (sympy and math are imported; variables persist between calls). print() what you "
    "need to see.\nGive the final answer as <answer>...</answer>.\n\nQuestion: "
)
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code; see what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]  # fmt: skip


def run_python(code: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-I", "-c", "import math\n" + code],
                              capture_output=True, text=True, timeout=5)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "timed out"
    return (done.stdout + done.stderr)[-1000:]


async def episode(client, model: str, task: dict) -> float:
    """Reward: 1 if right, 0.1 for a well-formed answer, -0.001 per token the model wrote."""
    messages = [{"role": "user", "content": PROMPT + task["question"]}]
    written = 0
    for _ in range(4):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message, written = reply.choices[0].message, written + reply.usage.completion_tokens
        if not message.tool_calls:
            answers = re.findall(r"<answer>(.*?)</answer>", message.content or "", re.S)
            right = bool(answers) and answers[-1].strip() in task["answers"]
            return float(right) + 0.1 * bool(answers) - 0.001 * written
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            code = json.loads(call.function.arguments).get("code", "")
            output = await asyncio.to_thread(run_python, code)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return -0.001 * written
