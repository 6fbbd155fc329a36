"""Whole multi-turn episodes through vLLM's own scheduler (the vLLM backend's
`generate_episodes`).

Every turn of every episode is one request of the engine (`EngineRequests`), and the engine
batches whatever requests it holds at each step (continuous batching). A row whose turn ends
leaves at once: its turn goes to `next_turn` (the rollout steps its environment: a tool call,
grading) in a worker thread while the engine keeps decoding the other rows, and its next
turn is added as a new request with the whole sequence so far. With prefix caching (on by
default) that request reads the demonstrations and the conversation so far from the cache;
only what followed the turn (tool output, the next assistant header) and the last partial
block are computed again. Rows never wait for the longest row of a turn.

Determinism. With the deterministic schedule (`copes.agents.episodes.EpisodeFeed`) a row
whose turn ended at engine step ``s`` is added again before step ``s + 1 +
TOOL_OVERLAP_STEPS``, after its `next_turn` returned (waiting for it if slower), in the order
the rows ended: the requests an engine step sees depend only on the tokens. Where the engine
core runs in copes' process (`VLLMPolicy.from_pretrained`'s default on a CPU) that fixes
every step's batch, so a run is reproducible bit for bit and a served step equals an
in-process one; vLLM's engine process (its default on a GPU) takes requests as they reach it,
so there the batch, and so the float rounding, can vary from run to run. As they come
(served HTTP clients), episodes start when their first prompt arrives and a row's next turn
is added as soon as its `next_turn` returned.

Seeds. Episode i samples from the stream `episode_stream(seed, i)` (the
transformers loop's), or the stream a population assigns it (its member's); its turn t is the
request seeded ``derive_seed("turn", stream, t)``. vLLM draws each seeded request's tokens
from its own generator, so an episode's tokens depend on its stream and its logits only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from copes.agents.episodes import (
    TOOL_OVERLAP_STEPS,
    EpisodeFeed,
    NextTurn,
    Reprompt,
    TurnLimits,
    episode_streams,
)
from copes.agents.policy import SamplingConfig
from copes.agents.vllm.requests import EngineRequests, generation_of, request_params
from copes.seeding import derive_seed


class RequestHost(Protocol):
    """What the loop reads of the policy it runs for (`VLLMPolicy`)."""

    tokenizer: Any
    requests: EngineRequests


@dataclass
class _Episode:
    index: int
    sequence: list[int]  # every id so far: prompt, turns, what followed each turn
    stream: int
    turn: int = 0


@dataclass
class _Ended:
    """A row whose turn ended at engine step `step`, while its `next_turn` runs."""

    step: int
    episode: _Episode
    future: Future


class EngineEpisodes:
    """Runs one `generate_episodes` call on a vLLM engine.

    Args:
        host: the `VLLMPolicy` (its tokenizer and its engine's requests).
        sampling: every turn's sampling (stops and length unless `turn_limits`).
        next_turn: called after each turn of episode i (`EpisodeRunner`).
        streams: each episode's sampling stream (default: from the seed and its index).
        adapters: each episode's `LoRARequest` (a population's member; default: none).
        turn_limits: each episode's (stops, length) of its current turn (served sessions).
    """

    def __init__(
        self,
        host: RequestHost,
        sampling: SamplingConfig,
        next_turn: NextTurn,
        *,
        streams: Sequence[int] | None = None,
        adapters: Sequence[Any] | None = None,
        turn_limits: TurnLimits | None = None,
    ) -> None:
        self.host = host
        self.requests = host.requests
        self.sampling = sampling
        self.next_turn = next_turn
        self.streams = None if streams is None else list(streams)
        self.adapters = None if adapters is None else list(adapters)
        self.turn_limits = turn_limits
        self.stats = {"engine_steps": 0, "requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self.stats |= {"tool_wait_seconds": 0.0, "seconds": 0.0}

    def run(
        self, episodes: Sequence[Sequence[int]] | EpisodeFeed, threads: int
    ) -> dict[str, float]:
        """Play the feed's episodes (a list of prompts: all arrived, deterministic)."""
        start = time.perf_counter()
        feed = episodes if isinstance(episodes, EpisodeFeed) else EpisodeFeed.of(episodes)
        streams = self.streams or episode_streams(self.sampling.seed, feed.count)
        count = feed.count
        if len(streams) != count or (self.adapters is not None and len(self.adapters) != count):
            raise ValueError("one stream (and adapter) per episode")
        self.feed = feed
        running: dict[str, _Episode] = {}  # request id -> its episode
        ended: deque[_Ended] = deque()  # in the order their turns ended
        try:
            with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                while True:
                    feed.interject()  # sessionless requests, between two engine steps
                    for index, prompt in feed.take():
                        episode = _Episode(index, list(prompt), streams[index])
                        running[self._add(episode)] = episode
                    for episode in self._rejoining(ended, idle=not running):
                        running[self._add(episode)] = episode
                    if running:
                        self._step(running, ended, pool)
                    elif not ended:
                        if not feed.open:
                            break
                        feed.wait()
                    elif feed.as_they_come:
                        feed.wait()  # every row waits for its client
        finally:
            self.requests.abort(running)  # the loop raised: nothing of it stays in the engine
        self.stats["seconds"] = time.perf_counter() - start
        return self.stats

    def _add(self, episode: _Episode) -> str:
        """Queue the episode's next turn as a request of the engine."""
        limits = self.turn_limits(episode.index) if self.turn_limits is not None else None
        stop, length = limits if limits is not None else (None, None)
        seed = derive_seed("turn", episode.stream, episode.turn)
        params = request_params(self.sampling, seed, stop, length)
        adapter = None if self.adapters is None else self.adapters[episode.index]
        self.stats["requests"] += 1
        return self.requests.add(episode.sequence, params, adapter)

    def _step(
        self, running: dict[str, _Episode], ended: deque[_Ended], pool: ThreadPoolExecutor
    ) -> None:
        """One engine step; every turn it finished goes to its `next_turn` (in a thread)."""
        self.requests.step()
        self.stats["engine_steps"] += 1
        for request_id, output in self.requests.take_finished(running):
            episode = running.pop(request_id)
            prompt = episode.sequence
            self.stats["prompt_tokens"] += len(prompt)
            self.stats["cached_tokens"] += output.num_cached_tokens or 0
            generation = generation_of(self.host.tokenizer, list(prompt), output.outputs[0])
            episode.sequence = [*prompt, *generation.token_ids]
            future = pool.submit(self.next_turn, episode.index, generation)
            future.add_done_callback(self.feed.wake)
            ended.append(_Ended(self.stats["engine_steps"], episode, future))

    def _rejoining(self, ended: deque[_Ended], idle: bool) -> list[_Episode]:
        """The rows whose next turn is added now (removed from `ended`; those whose episode
        is over are dropped). Deterministic: every row whose turn ended at least
        TOOL_OVERLAP_STEPS steps ago, in the order they ended, its `next_turn` waited for
        (when nothing else runs, the oldest step's rows at once). As they come: every row
        whose `next_turn` has returned."""
        if self.feed.as_they_come:
            due = [row for row in ended if row.future.done()]
        else:
            now = self.stats["engine_steps"]
            due = [row for row in ended if row.step + TOOL_OVERLAP_STEPS <= now]
            if idle and not due and ended:
                due = [row for row in ended if row.step == ended[0].step]
            begin = time.perf_counter()
            for row in due:
                self.feed.wait_for(row.future.done)
            self.stats["tool_wait_seconds"] += time.perf_counter() - begin
        joining = []
        for row in due:
            ended.remove(row)
            follow = row.future.result()
            if follow is None:
                continue
            episode = row.episode
            if isinstance(follow, Reprompt):  # a new sequence: the prefix cache reuses what it can
                episode.sequence = list(follow.ids)
            else:
                episode.sequence.extend(follow)
            episode.turn += 1
            joining.append(episode)
        return joining


__all__ = ["EngineEpisodes"]
