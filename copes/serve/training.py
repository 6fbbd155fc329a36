"""Training through the server: an ES/CoPES step's members and a GRPO (or validation) batch
served as sessions, scored by a harness.

- `ServedEvaluator` is the `PopulationEvaluator` of an ES/CoPES step: the members are loaded
  into the batched population exactly as `BatchedEvaluator` loads them (stacked copies or
  low-rank adapters), the step's sessions are opened in the in-process rollout's episode
  order with its sampling streams, and a member's reward is the mean of its sessions'
  rewards. `tell` is untouched: the update is the in-process one.
- `ServedRollout` is a `RolloutFn` for the policy itself (GRPO's groups, validation): one
  session per task sample; the recorded turns become `Trajectory`s (token ids, the mask of
  what the server sampled, the sampling log-probs) that GRPO trains on.

A `Harness` scores sessions: `InProcessHarness` runs ``async def episode(client, model, task)``
for every session at once with an `openai.AsyncOpenAI` at the session's base URL;
`HttpHarness` leaves them to clients that ask over HTTP (`/copes/v1/ask`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from copes.agents.episodes import play_episodes
from copes.agents.members import check_members
from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory
from copes.envs.tasks.base import task_to_dict
from copes.optimizers.base import MemberResult
from copes.optimizers.batched import BatchedEvaluator
from copes.serve.server import PolicyServer
from copes.serve.sessions import SessionDriver
from copes.serve.steps import ServedStep, SessionSpec

Episode = Callable[[Any, str, dict[str, Any]], Awaitable[Any]]


class Harness(Protocol):
    """Who runs a served step's episodes and posts their rewards."""

    def start(self, server: PolicyServer, served: ServedStep) -> None: ...

    def join(self) -> None: ...


class HttpHarness:
    """Clients in other processes ask for the work and post rewards (nothing to start)."""

    def start(self, server: PolicyServer, served: ServedStep) -> None:
        pass

    def join(self) -> None:
        pass


def reward_of(result: Any) -> tuple[Any, ...]:
    """An episode's return value: a number, or ``{"reward": r, "correct": bool,
    "tool_calls": n, "end_reason": ...}`` (all but the reward optional, for the logs)."""
    if isinstance(result, dict):
        keys = ("reward", "correct", "tool_calls", "end_reason")
        return tuple(result.get(k) for k in keys)
    return result, None, None, None


class InProcessHarness:
    """Every session of a step runs ``await episode(client, model, task)`` at once (in a
    thread with its own event loop), each with an `openai.AsyncOpenAI` pointed at its
    session's base URL; the returned reward is the session's. An episode that raises fails
    the step (no update)."""

    def __init__(self, episode: Episode, request_timeout: float = 600.0) -> None:
        self.episode = episode
        self.request_timeout = request_timeout
        self._thread: threading.Thread | None = None

    def start(self, server: PolicyServer, served: ServedStep) -> None:
        quiet = logging.getLogger("httpx")  # one INFO line per request otherwise
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.WARNING)
        self._thread = threading.Thread(
            target=asyncio.run,
            args=(self._run(server, served),),
            name="copes-harness",
            daemon=True,
        )
        self._thread.start()

    async def _run(self, server: PolicyServer, served: ServedStep) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import httpx
        from openai import AsyncOpenAI

        # A thread per session for the episodes' blocking work (an env step, a tool call):
        # asyncio's default pool has a handful, and a turn waiting in its queue holds the
        # whole batch's schedule.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=len(served.sessions) + 4)
        )

        async def one(session: Any) -> None:
            # One HTTP client per session: httpx's pool scans every connection per request,
            # so one pool shared by hundreds of sessions served ~110 requests/s here; one
            # each, ~680. The URL is plain http, so no TLS context is built (26 ms each).
            async with httpx.AsyncClient(verify=False, timeout=self.request_timeout) as http:
                client = AsyncOpenAI(
                    base_url=f"{server.base_url}/s/{session.id}/v1",
                    api_key=server.api_key or "copes",
                    http_client=http,
                    max_retries=2,  # a retried turn gets its recorded reply: safe
                )
                try:
                    result = await self.episode(client, session.model, task_to_dict(session.task))
                    await asyncio.to_thread(session.end, *reward_of(result))
                except Exception as exc:  # the step fails whole, with the reason
                    if served.failed is None:
                        served.fail(
                            f"the harness's episode of session {session.id} raised "
                            f"{type(exc).__name__}: {exc}"
                        )

        await asyncio.gather(*(one(s) for s in served.sessions))

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _serve_step(
    server: PolicyServer, harness: Harness, served: ServedStep, engine_policy: Any, sampling: Any
) -> dict[str, float]:
    """Run a served step to its end: the harness's episodes through the episode loop, then
    every reward. Raises `StepFailed` (and applies nothing) when it fails."""
    harness.start(server, served)
    try:
        if not isinstance(harness, HttpHarness):  # named if the step fails
            served.claim(len(served.sessions), "the in-process harness")
        drivers = [
            SessionDriver(s, served.deadline, server.chat, server.call_format)
            for s in served.sessions
        ]
        assign = None
        if engine_policy.serves_members and served.specs[0].slot is not None:
            specs = served.specs

            def assign(started: list[int]) -> None:  # each started session's member row
                rows = [specs[i] for i in started]
                engine_policy.assign([s.slot for s in rows], [s.stream or 0 for s in rows])

        # Every session waits on its client: one thread each. Sessionless requests are
        # interjected into the loop while it runs.
        with server.model_lock, server.loop_running() as interjections:
            loop = play_episodes(
                engine_policy, drivers, sampling, threads=len(drivers), assign=assign,
                schedule=server.schedule, interjections=interjections,
            )  # fmt: skip
        stats = {"seconds": loop.seconds, "generate_calls": float(loop.generate_calls),
                 **loop.engine}  # fmt: skip
        served.wait_rewards()
    finally:
        if served.failed is None and not all(s.ended for s in served.sessions):
            served.fail("the step was abandoned")
        harness.join()
    return stats


class ServedEvaluator(BatchedEvaluator):
    """An ES/CoPES step's members served as sessions of one batched population.

    Args:
        server: the `PolicyServer` over the run's policy.
        harness: who runs the episodes.
        policy, rollout, population_size, rank: as for `BatchedEvaluator` (the rollout's
            `population_plan` fixes each member's tasks, order and sampling streams).
    """

    def __init__(
        self,
        server: PolicyServer,
        harness: Harness,
        policy: Any,
        rollout: Any,
        population_size: int,
        rank: int = 0,
    ) -> None:
        super().__init__(policy, rollout, population_size, rank=rank)
        self.server = server
        self.harness = harness

    def evaluate(self, step: int, members: Sequence[Any]) -> list[MemberResult]:
        check_members(self.members, members)
        weight_seconds = self.members.load(members)
        plan = self.rollout.population_plan(step, [m.member for m in members])
        specs = [SessionSpec(e.member, e.slot, e.task, e.stream) for e in plan]
        sampling = self.rollout.sampling_of(step, members[0].member)
        served = self.server.open_step(step, specs, sampling=sampling)
        self.last_served = served  # its sessions' records, for diagnostics and tests
        try:
            stats = _serve_step(self.server, self.harness, served, self.members.policy, sampling)
        finally:
            self.server.close_step(served)
            self.members.unload()  # nothing else may be served with the members
        share = len(members)
        results = []
        for slot, member in enumerate(members):
            mine = [s for s in served.sessions if s.member == member.member]
            result = MemberResult.of(
                member.member, [s.reward for s in mine], [bool(s.correct) for s in mine],
                generation_seconds=stats["seconds"] / share, env_seconds=0.0,
                generated_tokens=sum(sum(s.sampled_mask) for s in mine),
                weight_seconds=weight_seconds[slot],
            )  # fmt: skip
            results.append(result)
        return results


class ServedRollout:
    """A `RolloutFn` of the policy served as sessions: (step, None) -> the trajectories of
    the task rollout's batch (`tasks_of`, `samples` per task), rewards from the harness."""

    def __init__(
        self, server: PolicyServer, harness: Harness, rollout: Any, purpose: str = "train"
    ) -> None:
        self.server = server
        self.harness = harness
        self.rollout = rollout
        self.purpose = purpose
        self.samples = rollout.samples
        self.batch_size = rollout.batch_size

    def __call__(self, policy: Any, step: int, member: int | None = None) -> RolloutBatch:
        if member is not None:
            raise ValueError("a served rollout serves the policy (member None)")
        tasks = self.rollout.tasks_of(step)
        specs = [SessionSpec(None, None, t) for t in tasks for _ in range(self.samples)]
        sampling = self.rollout.sampling_of(step)
        served = self.server.open_step(step, specs, purpose=self.purpose, sampling=sampling)
        start = time.perf_counter()
        try:
            stats = _serve_step(self.server, self.harness, served, policy, sampling)
        finally:
            self.server.close_step(served)
        trajectories = [trajectory_of(s) for s in served.sessions]
        return RolloutBatch(
            trajectories,
            RolloutStats(
                generation_seconds=time.perf_counter() - start,
                generated_tokens=sum(t.num_generated_tokens for t in trajectories),
                generate_calls=1,
                engine=stats,
            ),
        )

    def close(self) -> None:
        self.rollout.close()


def trajectory_of(session: Any) -> Trajectory:
    """A session's record as a `Trajectory`: the last token sequence, masked to what the
    server sampled in it, and the harness's reward."""
    mask = list(session.sampled_mask)
    calls = session.tool_calls  # as the harness counted them, else the replies' calls
    if calls is None:
        calls = sum(bool(t.reply["choices"][0]["message"].get("tool_calls")) for t in session.turns)
    last = session.turns[-1] if session.turns else None
    messages = [] if last is None else [*last.messages, last.reply["choices"][0]["message"]]
    return Trajectory(
        task_id=session.task.id,
        messages=messages,
        token_ids=list(session.token_ids),
        generated_mask=mask,
        logprobs=list(session.logprobs),
        prompt_length=mask.index(1) if 1 in mask else len(mask),
        reward=float(session.reward),
        correct=bool(session.correct),
        turns=len(session.turns),
        tool_calls=calls,
        end_reason=session.end_reason or "answer",
    )
