"""An ask/tell client: play a served run's work from another process, with at most K sessions
in flight (1: one episode at a time, the commonest agent shape).

    import asyncio
    from copes.serve.client import ask_tell
    asyncio.run(ask_tell("http://127.0.0.1:8000", episode, in_flight=4))

`episode(client, model, task)` is the same function `--harness module:function` runs (an
`openai.AsyncOpenAI` at the session's base URL, the session's model name, the task as JSON);
it returns a reward or ``{"reward": r, "correct": ..., "tool_calls": ..., "end_reason": ...}``.
The server admits every turn as it comes (`--turn-schedule as-they-come`, copes-serve's default),
so any `in_flight` works; concurrency only makes a step faster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Episode = Callable[[Any, str, dict[str, Any]], Awaitable[Any]]


class RunFailed(RuntimeError):
    """The server stopped the run because a step failed (its reason)."""


async def ask_tell(
    url: str,
    episode: Episode,
    *,
    in_flight: int = 1,
    sessions: int | None = None,
    name: str = "copes-ask-tell",
    api_key: str | None = None,
    timeout: float = 600.0,
    poll: float = 0.05,
) -> dict[str, float]:
    """Ask for work and play it until the server says the run is done (or, with `sessions`,
    once that many sessions were played); returns the reward posted for each session.
    Raises `RunFailed` with the server's reason when a step failed."""
    import httpx
    from openai import AsyncOpenAI

    from copes.serve.training import reward_of

    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    posted: dict[str, float] = {}
    running: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers) as http:

        async def play(work: dict[str, Any]) -> None:
            # Its own connection: one pool shared by many sessions is slow (docs/serving.md).
            async with httpx.AsyncClient(verify=False, timeout=timeout) as own:
                client = AsyncOpenAI(base_url=work["base_url"], api_key=api_key or "none",
                                     http_client=own, max_retries=2)  # fmt: skip
                result = await episode(client, work["model"], work["task"])
            reward, correct, tool_calls, end_reason = reward_of(result)
            body = {"reward": reward, "correct": correct, "tool_calls": tool_calls,
                    "end_reason": end_reason}  # fmt: skip
            answer = await http.post(
                f"/copes/v1/sessions/{work['session']}/reward",
                json={k: v for k, v in body.items() if v is not None},
            )
            answer.raise_for_status()
            posted[work["session"]] = float(reward)

        asked_for = 0
        try:
            while sessions is None or asked_for < sessions:
                if len(running) >= in_flight:
                    done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # an episode that raised stops the client
                    continue
                room = in_flight - len(running)
                if sessions is not None:
                    room = min(room, sessions - asked_for)
                ask = {"max_sessions": room, "client": name}
                reply = await http.post("/copes/v1/ask", json=ask)
                reply.raise_for_status()
                asked = reply.json()
                if asked["done"]:
                    if asked.get("error"):
                        raise RunFailed(asked["error"])
                    break
                if not asked["work"]:  # between steps, or every session is taken
                    await asyncio.sleep(min(poll, asked.get("retry_after", poll)))
                    continue
                for work in asked["work"]:
                    running.add(asyncio.create_task(play(work)))
                asked_for += len(asked["work"])
            for task in running:
                await task
        finally:
            for task in running:
                task.cancel()
    return posted
