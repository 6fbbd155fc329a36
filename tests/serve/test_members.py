"""A population served at once: sessions of different members run concurrently in one
batch, and never mix. Every reply names its session's member, and every session's tokens are
its member's in-process episode (rows computing with another member's weights would not
be), with the work handed out and the rewards taken over HTTP (ask/tell)."""

import asyncio
import threading

import httpx


def test_concurrent_members_never_mix_and_score_as_in_process(tiny_policy, make_task_rollout):
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES
    from copes.serve import EnvLoop, HttpHarness, PolicyServer, ServedEvaluator

    rollout, make_env = make_task_rollout(tasks=3)
    optimizer = CoPES(CoPESConfig(population_size=4, num_subspaces=2, sigma=0.05))
    members = optimizer.ask(0)
    local: dict[int, list] = {}
    expected = BatchedEvaluator(
        tiny_policy, rollout, 4, on_batch=lambda m, batch: local.__setitem__(m, batch)
    ).evaluate(0, members)

    server = PolicyServer(tiny_policy, rollout.sampling)
    server.start()
    evaluator = ServedEvaluator(server, HttpHarness(), tiny_policy, rollout, 4)
    seen: list[tuple[str, int, int, str]] = []  # (work model, member, reply member, reply model)
    loop = EnvLoop(make_env)

    async def client() -> None:
        from openai import AsyncOpenAI

        async with httpx.AsyncClient(base_url=server.base_url) as http:
            while not (work := (await http.post("/copes/v1/ask", json={"max_sessions": 64}))
                       .json()["work"]):  # fmt: skip
                await asyncio.sleep(0.05)

            async def one(item: dict) -> None:
                openai = AsyncOpenAI(base_url=item["base_url"], api_key="x", max_retries=0)
                post = openai.post  # what copes' env loop sends its turns with

                async def checked(*args, **kwargs):
                    reply = await post(*args, **kwargs)
                    body = reply.json()
                    member = int(item["model"].rsplit(".m", 1)[1])
                    seen.append((item["model"], member, body["copes"]["member"], body["model"]))
                    return reply

                openai.post = checked
                result = await loop(openai, item["model"], item["task"])
                answer = await http.post(f"/copes/v1/sessions/{item['session']}/reward",
                                         json=result)  # fmt: skip
                answer.raise_for_status()

            await asyncio.gather(*(one(item) for item in work))

    clients = threading.Thread(target=asyncio.run, args=(client(),))
    clients.start()
    try:
        served = evaluator.evaluate(0, members)
    finally:
        clients.join(timeout=120)
        server.stop()
    assert [r.reward for r in served] == [r.reward for r in expected]
    assert len({r.reward for r in expected}) > 1  # the members differ: mixing would show
    assert len(seen) >= 12 and {s[1] for s in seen} == {0, 1, 2, 3}
    assert all(m == got and model == sent for model, m, got, sent in seen)
    plan = rollout.population_plan(0, [m.member for m in members])
    for episode, session in zip(plan, evaluator.last_served.sessions, strict=True):
        assert session.member == episode.member
        assert session.token_ids == local[episode.member][episode.index].token_ids
