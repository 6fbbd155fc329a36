"""Sessions: one episode of one member (or of the policy), recorded turn by turn.

A served step is a fixed set of sessions, known when the step opens (member x task x sample),
each with its own base URL ``/s/SESSION/v1``. Every request on a session is one turn; the
session keeps what the model saw and sampled in one token sequence, as an in-process rollout
does: when the new request's messages are the previous request's, the reply, and new
messages after it, the turn is *bridged* (the new messages' tokens are appended to the
sequence, copes' bridging rule in `copes.agents.chat`); otherwise it is *re-rendered* (the
conversation is encoded anew, and earlier sampled tokens are no longer in the sequence).

The HTTP side and the episode loop meet here: a request queues a `PendingTurn` and waits for
its future; the session's `SessionDriver` hands it to the one episode loop
(`copes.agents.episodes`), which generates the turn, and the driver records it and resolves
the future.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from copes.agents.episodes import Reprompt
from copes.agents.policy import Generation
from copes.serve.wire import ServeError, TurnRequest, context_error, turn_reply

ENDED = object()  # queued when a session's reward arrives: its episode is over
END_REASONS = ("answer", "max_turns", "context", "invalid")  # copes.agents.rollout.EndReason


@dataclass
class Turn:
    """One served turn, as recorded."""

    request_key: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_token_ids: list[int]  # the whole sequence before the turn
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    bridged: bool
    reply: dict[str, Any]  # the chat.completion sent back (a retry gets it again)

    def record(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "bridged": self.bridged,
            "message": self.reply["choices"][0]["message"],
        }


@dataclass
class PendingTurn:
    """A request waiting for the engine: the ids that follow the sequence (or a whole new
    one), the turn's limits, and the future its reply is set on."""

    request: TurnRequest
    ids: list[int] | Reprompt
    stops: tuple[str, ...]
    max_new_tokens: int
    future: Future = field(default_factory=Future)


class Session:
    """One episode of a served step."""

    def __init__(
        self, session_id: str, index: int, model: str, member: int | None, task: Any, step: Any
    ) -> None:
        self.id = session_id
        self.index = index  # its place in the step's episode order (and sampling stream)
        self.model = model
        self.member = member
        self.task = task
        self.step = step  # the `ServedStep` it belongs to
        self.lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.turns: list[Turn] = []
        self.inflight: PendingTurn | None = None
        self.reward: float | None = None
        self.correct: bool | None = None
        self.tool_calls: int | None = None  # as the harness counted them, when it says
        self.end_reason: str | None = None
        self.claimed_by: str | None = None  # the client it was handed to (ask/tell)
        # The episode's token record: every id, which ones were sampled, their log-probs.
        self.token_ids: list[int] = []
        self.sampled_mask: list[int] = []
        self.logprobs: list[float] = []
        self.stops: tuple[str, ...] = ()
        self.max_new_tokens = 0

    @property
    def ended(self) -> bool:
        return self.reward is not None

    # ------------------------------------------------------------------ from HTTP
    def submit(
        self,
        request: TurnRequest,
        chat: Any,
        context: int,
        default_max: int,
    ) -> Future:
        """Queue a turn (or find the recorded or in-flight one for a retried request)."""
        key = request.key()
        with self.lock:
            if self.step.failed is not None:  # nothing will generate it: say why, now
                raise self.step.failed
            if self.ended:
                raise ServeError(
                    409,
                    f"session {self.id} already has its reward; its episode is over",
                    code="session_ended",
                )
            if self.turns and self.turns[-1].request_key == key and self.inflight is None:
                done: Future = Future()
                done.set_result(self.turns[-1].reply)  # a retry: the recorded reply
                return done
            if self.inflight is not None:
                if self.inflight.request.key() == key:
                    return self.inflight.future
                raise ServeError(
                    409,
                    f"session {self.id} has a request in flight; send one "
                    "turn at a time per session",
                    code="request_in_flight",
                )
            ids, bridged_len = self._prompt(request, chat)
            limit = request.max_tokens or default_max
            total = bridged_len if isinstance(ids, Reprompt) else len(self.token_ids) + len(ids)
            if total + limit > context:
                raise context_error(total, limit, context)
            pending = PendingTurn(request, ids, request.stop, limit)
            self.inflight = pending
            self.inbox.put(pending)
            return pending.future

    def _prompt(self, request: TurnRequest, chat: Any) -> tuple[list[int] | Reprompt, int]:
        """The ids the turn's prompt adds to the sequence (bridged) or the whole new
        sequence (a first turn, or re-rendered); and the new sequence's length."""
        if not self.turns:
            ids = chat.encode_prompt(request.messages, request.tools)
            return Reprompt(ids), len(ids)
        last = self.turns[-1]
        previous = last.messages
        reply = last.reply["choices"][0]["message"]
        messages = request.messages
        new = messages[len(previous) + 1 :]
        if (
            len(messages) > len(previous) + 1
            and messages[: len(previous)] == previous
            and _same_reply(messages[len(previous)], reply)
            and not any(m["role"] == "assistant" for m in new)
            and request.tools == last.tools
        ):
            history = [*previous, {"role": "assistant", "content": reply.get("content") or ""}]
            ids = chat.encode_continuation([*history, *new], last.token_ids, request.tools)
            return ids, len(self.token_ids) + len(ids)
        ids = chat.encode_prompt(messages, request.tools)
        return Reprompt(ids), len(ids)

    def end(
        self, reward: Any, correct: Any = None, tool_calls: Any = None, end_reason: Any = None
    ) -> None:
        """The session's reward (and, optionally, for the logs: whether it was correct, how
        many tool calls the agent made, why it ended): its episode is over."""
        if end_reason is not None and end_reason not in END_REASONS:
            raise ServeError(400, f"end_reason must be one of {list(END_REASONS)} or absent",
                             param="end_reason")  # fmt: skip
        if tool_calls is not None and (
            isinstance(tool_calls, bool) or not isinstance(tool_calls, int) or tool_calls < 0
        ):
            raise ServeError(400, "tool_calls must be a count (>= 0) or absent", param="tool_calls")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ServeError(400, "reward must be a number", param="reward")
        if not math.isfinite(reward):
            raise ServeError(400, f"reward must be finite, got {reward}", param="reward")
        if correct is not None and not isinstance(correct, bool):
            raise ServeError(400, "correct must be true, false or absent", param="correct")
        with self.lock:
            if self.ended:
                raise ServeError(
                    409,
                    f"session {self.id} already has a reward ({self.reward})",
                    code="reward_exists",
                )
            if self.inflight is not None:
                raise ServeError(
                    409,
                    f"session {self.id} has a request in flight; post the reward after its reply",
                    code="request_in_flight",
                )
            self.reward = float(reward)
            self.correct = correct
            self.tool_calls = tool_calls
            self.end_reason = end_reason
            self.inbox.put(ENDED)
        self.step.session_ended()

    # ------------------------------------------------------------------ from the engine
    def take(self, deadline: float) -> PendingTurn | None:
        """The next turn to generate, or None when the episode is over (reward, or the
        step's deadline passed)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.step.failed is not None:
                return None
            try:
                item = self.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if item is ENDED:
                return None
            with self.lock:
                self.stops, self.max_new_tokens = item.stops, item.max_new_tokens
                if isinstance(item.ids, Reprompt):
                    self.token_ids = list(item.ids.ids)
                    self.sampled_mask = [0] * len(self.token_ids)
                    self.logprobs = [0.0] * len(self.token_ids)
                else:
                    self.token_ids += item.ids
                    self.sampled_mask += [0] * len(item.ids)
                    self.logprobs += [0.0] * len(item.ids)
            return item

    def finish_turn(self, pending: PendingTurn, turn: Turn) -> None:
        """Record a generated turn and send its reply."""
        with self.lock:
            self.turns.append(turn)
            self.token_ids += turn.token_ids
            self.sampled_mask += [1] * len(turn.token_ids)
            self.logprobs += turn.logprobs
            self.inflight = None
        if not pending.future.done():  # a failed step already answered it with its error
            pending.future.set_result(turn.reply)

    def fail(self, error: ServeError) -> None:
        """The step failed: a waiting request gets the error."""
        with self.lock:
            pending, self.inflight = self.inflight, None
        if pending is not None and not pending.future.done():
            pending.future.set_exception(error)

    def record(self) -> dict[str, Any]:
        """What the server recorded of this session (GET /copes/v1/sessions/ID)."""
        with self.lock:
            return {
                "session": self.id,
                "model": self.model,
                "member": self.member,
                "step": self.step.step,
                "policy_version": self.step.policy_version,
                "reward": self.reward,
                "correct": self.correct,
                "token_ids": list(self.token_ids),
                "sampled_mask": list(self.sampled_mask),
                "logprobs": list(self.logprobs),
                "turns": [t.record() for t in self.turns],
            }


def _same_reply(echoed: dict[str, Any], reply: dict[str, Any]) -> bool:
    """Whether the client's copy of an assistant turn is the one the server sent: the same
    content (or none, beside the same tool calls) and the same calls (name, arguments)."""
    if echoed.get("role") != "assistant":
        return False
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in echoed.get("tool_calls", [])
    ]
    sent = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in reply.get("tool_calls") or []
    ]
    if calls != sent:
        return False
    content = echoed.get("content") or ""
    return content == (reply.get("content") or "") or (bool(sent) and not content)


class SessionDriver:
    """A served session as an episode of the one episode loop (`EpisodeDriver`): its first
    request is the prompt, each request's stops and length are its turn's limits, and after a
    turn the reply goes back and the loop waits for the session's next request (its ids
    bridged onto the sequence, or a whole new one: `Reprompt`) or its reward (the end)."""

    def __init__(self, session: Session, deadline: float, chat: Any, call_format: str) -> None:
        self.session = session
        self.deadline = deadline
        self.chat = chat
        self.call_format = call_format
        self.pending: PendingTurn | None = None

    def start(self) -> list[int] | None:
        self.pending = self.session.take(self.deadline)
        if self.pending is None:
            return None
        ids = self.pending.ids  # a first turn is always a whole prompt
        return list(ids.ids) if isinstance(ids, Reprompt) else list(ids)

    def limits(self) -> tuple[tuple[str, ...], int]:
        assert self.pending is not None
        return self.pending.stops, self.pending.max_new_tokens

    def after_turn(self, generation: Generation) -> list[int] | Reprompt | None:
        assert self.pending is not None
        self.session.finish_turn(self.pending, self._turn(self.pending, generation))
        self.pending = self.session.take(self.deadline)
        return None if self.pending is None else self.pending.ids

    def _turn(self, pending: PendingTurn, generation: Generation) -> Turn:
        """The turn as recorded, with the reply its request gets."""
        session, request = self.session, pending.request
        if not session.turns:
            how = "first"
        else:
            how = "re-rendered" if isinstance(pending.ids, Reprompt) else "bridged"
        extra = {
            "session": session.id,
            "member": session.member,
            "step": session.step.step,
            "policy_version": session.step.policy_version,
            "prompt": how,
        }
        text = self.chat.turn_text(generation.token_ids, request.messages)
        reply, finish = turn_reply(
            request, generation, text, self.call_format, self.chat.tokenizer, extra
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
