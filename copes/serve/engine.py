"""A served step's sessions run as the episodes of the policy's own episode loop, or turn by
turn for policies without one (vLLM).

Each session is one episode of `generate_episodes` (the population's, for ES members: every
row computes with its member's weights; the policy's, for GRPO and validation). The loop's
`next_turn` hands a finished turn to its session (which replies to the waiting request) and
then waits for the session's next request (its ids bridged onto the sequence, or a whole new
sequence: `Reprompt`) or for its reward (the episode is over). Episodes keep their KV caches
across turns and rows re-join on the loop's deterministic schedule, so a harness that is
copes' own env loop gets the in-process rollout's tokens exactly.

Turn by turn (`run_session_turns`; vLLM, whose engine schedules rows itself): every turn
waits until each unfinished session has sent its request, then generates all of them in one
batch, as the in-process turn-by-turn rollout does (`copes.agents.rollout._run_turns`): a
population's rows each with its member's adapter and per-turn seed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from copes.agents.hf.engine import Reprompt
from copes.agents.policy import Generation, PopulationRows, SamplingConfig, TurnPopulation
from copes.agents.rollout import turn_seed
from copes.serve.sessions import PendingTurn, Session, Turn
from copes.serve.steps import ServedStep
from copes.serve.wire import turn_reply


def run_sessions(
    engine_policy: Any, served: ServedStep, sampling: SamplingConfig, chat: Any, call_format: str
) -> dict[str, float]:
    """Generate every turn of every session of `served` until all episodes are over.

    `engine_policy` is an `EpisodePolicy` (a `PopulationPolicy` already assigned its rows'
    members and streams, or the policy itself, whose streams follow `sampling.seed`).
    Returns the loop's diagnostics.
    """
    active: list[Session] = []
    current: list[PendingTurn] = []
    for session in served.sessions:  # every first request, in episode order
        first = session.take(served.deadline)
        if first is not None:
            active.append(session)
            current.append(first)
    if not active:
        return {"seconds": 0.0}
    if isinstance(engine_policy, PopulationRows) and served.specs[0].slot is not None:
        specs = [served.specs[s.index] for s in active]
        engine_policy.assign([s.slot for s in specs], [s.stream for s in specs])

    def limits(index: int) -> tuple[tuple[str, ...], int]:
        session = active[index]
        return session.stops, session.max_new_tokens

    def next_turn(index: int, generation: Generation) -> list[int] | Reprompt | None:
        session, pending = active[index], current[index]
        session.finish_turn(pending, _turn(session, pending, generation, chat, call_format))
        following = session.take(served.deadline)
        if following is None:
            return None
        current[index] = following
        return following.ids

    prompts = [list(p.ids.ids) for p in current]  # a first turn is always a whole prompt
    start = time.perf_counter()
    stats = engine_policy.generate_episodes(
        prompts, replace(sampling, stop=()), next_turn, threads=len(active), turn_limits=limits
    )
    stats = dict(stats)
    stats["seconds"] = time.perf_counter() - start
    return stats


def run_session_turns(
    policy: Any, served: ServedStep, sampling: SamplingConfig, chat: Any, call_format: str
) -> dict[str, float]:
    """Every session of `served`, turn by turn: one batched call per turn (and per distinct
    (stop strings, length) among the turn's requests) over the unfinished sessions.

    `policy` is a population with `generate_turn` (assigned here its rows' slots and
    seeds) or a plain policy (`generate_ids`, its seed varied per turn as in-process)."""
    current: dict[int, PendingTurn] = {}
    for session in served.sessions:
        first = session.take(served.deadline)
        if first is not None:
            current[session.index] = first
    population = isinstance(policy, TurnPopulation)
    if population:
        specs = served.specs
        policy.assign(
            [s.slot for s in specs], [s.stream or 0 for s in specs], [s.seed for s in specs]
        )
    start = time.perf_counter()
    calls, turn = 0, 0
    while current:
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        for index, pending in current.items():
            groups.setdefault((pending.stops, pending.max_new_tokens), []).append(index)
        for (stops, limit), indices in groups.items():
            rows = replace(sampling, stop=stops, max_new_tokens=limit)
            prompts = [list(served.sessions[i].token_ids) for i in indices]
            if population:
                generations = policy.generate_turn(prompts, rows, indices, turn)
            else:
                if rows.seed is not None:
                    rows = replace(rows, seed=turn_seed(rows.seed, turn))
                generations = policy.generate_ids(prompts, rows)
            calls += 1
            for index, generation in zip(indices, generations, strict=True):
                session, pending = served.sessions[index], current[index]
                session.finish_turn(pending, _turn(session, pending, generation, chat, call_format))
        following = {}
        for index in sorted(current):
            nxt = served.sessions[index].take(served.deadline)
            if nxt is not None:
                following[index] = nxt
        current = following
        turn += 1
    return {"seconds": time.perf_counter() - start, "generate_calls": float(calls)}


def _turn(
    session: Session, pending: PendingTurn, generation: Generation, chat: Any, call_format: str
) -> Turn:
    request = pending.request
    if not session.turns:
        how = "first"
    else:
        how = "re-rendered" if isinstance(pending.ids, Reprompt) else "bridged"
    served = session.step
    extra = {
        "session": session.id,
        "member": session.member,
        "step": served.step,
        "policy_version": served.policy_version,
        "prompt": how,
    }
    text = chat.turn_text(generation.token_ids, request.messages)
    reply, finish = turn_reply(request, generation, text, call_format, chat.tokenizer, extra)
    return Turn(
        request_key=request.key(),
        messages=request.messages,
        tools=request.tools,
        prompt_token_ids=list(generation.prompt_token_ids),
        token_ids=list(generation.token_ids),
        logprobs=list(generation.logprobs),
        finish_reason=finish,
        bridged=how == "bridged",
        reply=reply,
    )
