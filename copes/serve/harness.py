"""Harnesses: the episode functions a served step runs, and how `--harness` finds one.

``--harness module:function`` names ``async def episode(client, model, task) -> float``
(or a dict: docs/serving.md): `client` is an `openai.AsyncOpenAI` whose base URL is the
session's, `model` the session's model name, `task` the task as JSON
(`copes.envs.tasks.base.task_to_dict`). ``--harness env`` is copes' own environment loop run
through the server (`EnvLoop`): the reference harness, whose episodes equal in-process
rollouts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from copes.agents.rollout import stop_strings
from copes.envs.tasks.base import task_from_dict


def load_harness(spec: str) -> Callable[..., Any]:
    """``module:function`` -> the async episode function; ValueError with the fix."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"--harness {spec!r}: expected module:function (e.g. my_agent:episode) or env"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"--harness {spec!r}: cannot import {module_name} ({exc}); is it on PYTHONPATH?"
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise ValueError(f"--harness {spec!r}: {module_name} has no {attribute}")
    call = type(function).__call__  # an instance with an async __call__ counts too
    if not (inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)):
        raise ValueError(
            f"--harness {spec!r}: {attribute} must be an async function "
            "`async def episode(client, model, task) -> float`"
        )
    return function


class EnvLoop:
    """copes' own episode loop as a harness: a `ToolEnv` from `make_env`, its messages sent
    to the server each turn (with the call format's stop strings), its verdict returned.

    An in-process rollout ends an episode whose next turn would not fit the context with
    reward 0; here the server refuses that turn (context_length_exceeded) and the loop
    ends the same way.
    """

    def __init__(self, make_env: Callable[[], Any], pool: int = 0) -> None:
        self.make_env = make_env
        self._free: list[Any] = [make_env() for _ in range(pool)]

    async def __call__(self, client: Any, model: str, task: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        import httpx
        import openai

        env = self._free.pop() if self._free else self.make_env()
        try:
            _, info = await asyncio.to_thread(env.reset, options={"task": task_from_dict(task)})
            tools = info.get("tools") if info.get("call_format", "tags") != "tags" else None
            stops = list(stop_strings(info))
            total = 0.0
            while True:
                request: dict[str, Any] = {"model": model, "messages": info["messages"]}
                if tools:  # the env parses the call itself: the text as the model wrote it
                    request["tools"], request["tool_choice"] = tools, "none"
                if stops:
                    request["stop"] = stops
                try:
                    # The client's own transport and errors, without building the SDK's typed
                    # request and reply objects (the SDK's heaviest part): the JSON as sent.
                    reply = await client.post(
                        "/chat/completions", body=request, cast_to=httpx.Response
                    )
                except openai.BadRequestError as exc:
                    if getattr(exc, "code", None) == "context_length_exceeded":
                        return {"reward": 0.0, "correct": False, "end_reason": "context",
                                "tool_calls": info.get("tool_calls", 0)}  # fmt: skip
                    raise
                text = reply.json()["choices"][0]["message"]["content"] or ""
                _, reward, terminated, truncated, info = await asyncio.to_thread(env.step, text)
                total += float(reward)
                if terminated or truncated:  # the verdict, and what the logs count
                    reason = info.get("end_reason", "max_turns")
                    if reason == "max_turns" and info.get("action") == "invalid":
                        reason = "invalid"
                    return {"reward": total, "correct": bool(info.get("correct", False)),
                            "tool_calls": info["tool_calls"], "end_reason": reason}  # fmt: skip
        finally:
            self._free.append(env)
