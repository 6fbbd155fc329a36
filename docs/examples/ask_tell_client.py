"""Ask/tell from another process: take a served step's work, run an agent on each session
at once, post one reward per session; until the run is over.

    copes-serve --port 8000 ... &
    python docs/examples/ask_tell_client.py http://127.0.0.1:8000
"""

import asyncio
import sys

import httpx
from openai import AsyncOpenAI
from openai_agent import episode


async def main(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while True:
            asked = (await http.post("/copes/v1/ask", json={"max_sessions": 1024})).json()
            if asked["done"]:
                return
            if not asked["work"]:  # between steps: ask again soon
                await asyncio.sleep(asked["retry_after"])
                continue

            async def one(work: dict) -> None:
                # Its own connection (a pool shared by hundreds of sessions is slow); plain
                # http, so no TLS context to build.
                async with httpx.AsyncClient(verify=False, timeout=600) as own:
                    client = AsyncOpenAI(base_url=work["base_url"], api_key="none", http_client=own)
                    reward = await episode(client, work["model"], work["task"])
                answer = await http.post(f"/copes/v1/sessions/{work['session']}/reward",
                                         json={"reward": reward})  # fmt: skip
                answer.raise_for_status()

            await asyncio.gather(*(one(w) for w in asked["work"]))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
