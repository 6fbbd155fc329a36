"""A served step's sessions run as the episodes of the policy's own episode loop.

Each session is one episode of `generate_episodes` (the population's, for ES members: every
row computes with its member's weights; the policy's, for GRPO and validation). The loop's
`next_turn` hands a finished turn to its session (which replies to the waiting request) and
then waits for the session's next request (its ids bridged onto the sequence, or a whole new
sequence: `Reprompt`) or for its reward (the episode is over). Episodes keep their KV caches
across turns and rows re-join on the loop's deterministic schedule, so a harness that is
copes' own env loop gets the in-process rollout's tokens exactly.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from copes.agents.hf_engine import Reprompt
from copes.agents.policy import Generation, SamplingConfig
from copes.serve.sessions import PendingTurn, Session, Turn
from copes.serve.steps import ServedStep
from copes.serve.wire import assistant_message, chat_completion, token_logprobs


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
    if hasattr(engine_policy, "assign") and served.specs[0].slot is not None:
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


def _turn(
    session: Session, pending: PendingTurn, generation: Generation, chat: Any, call_format: str
) -> Turn:
    request = pending.request
    text = chat.prefill + generation.text
    message, call_reason = assistant_message(text, request.tools, call_format, request.parse_tools)
    finish = "length" if generation.finish_reason == "length" else call_reason or "stop"
    if not session.turns:
        how = "first"
    else:
        how = "re-rendered" if isinstance(pending.ids, Reprompt) else "bridged"
    served = session.step
    reply = chat_completion(
        session.model,
        message,
        finish,
        len(generation.prompt_token_ids),
        len(generation.token_ids),
        token_logprobs(chat.tokenizer, generation.token_ids, generation.logprobs)
        if request.logprobs
        else None,
        {
            "session": session.id,
            "member": session.member,
            "step": served.step,
            "policy_version": served.policy_version,
            "prompt": how,
        },
    )
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
