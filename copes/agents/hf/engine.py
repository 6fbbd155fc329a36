"""Whole multi-turn episodes in one continuous-batching decode loop (the HF backend's
`generate_episodes`).

Every episode keeps its KV cache from turn to turn, so a turn costs only its new tokens.
A row whose turn ends leaves the batch at once: its turn goes to `next_turn` (the rollout
steps its environment: a tool call, grading) in a worker thread while the other rows keep
decoding; the row then re-joins with the tokens that follow its turn (tool output and the
next assistant header) prefilled into its cache. Rows never wait for the longest row of a
turn, and turns of different episodes overlap with each other and with tool calls.

Determinism. With the deterministic schedule (`copes.agents.episodes.EpisodeFeed`) the
schedule depends only on the tokens: a row whose turn ended during decode step ``s``
re-joins before step ``s + 1 + TOOL_OVERLAP_STEPS``, after its `next_turn` has returned
(waiting for it if it is slower than that), never "whenever its tool happens to be done".
As they come (served HTTP clients), episodes join when their first prompt arrives and a row
re-joins at the first decode step after its `next_turn` returned: no row waits for another.
A row that waits for its `next_turn` keeps its KV cache (outside the batch) until it
re-joins or its episode ends. As they come, episodes start a few at a time, so the first
prompt of each member is remembered with its KV, and a later prompt of that member starts
from the KV of the prefix they share (the instructions and tool list) instead of prefilling
it again; its tokens can then differ from an all-at-once start only by float rounding.

Each episode samples from its own random stream (`copes.agents.sampling`), seeded by
(seed, episode index). So a seeded run is reproducible run to run on the same machine, and
an episode's tokens depend on its own stream and logits only; logits themselves can differ
in the last bits with the batch's composition (as in any batched inference), which can very
rarely flip a token, so equality across batch compositions is not guaranteed bit for bit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from copes.agents.episodes import (
    TOOL_OVERLAP_STEPS,
    EpisodeFeed,
    NextTurn,
    Reprompt,
    TurnLimits,
    episode_streams,
)
from copes.agents.hf.kv_batch import KVBatch, SlotBatch
from copes.agents.policy import FinishReason, Generation, SamplingConfig
from copes.agents.sampling import chosen_logprobs, sample_tokens, stream

# Shorter prompt prefixes shared by all new episodes are not worth a forward pass of their own.
MIN_SHARED_PREFIX = 16


@dataclass
class _Episode:
    index: int
    sequence: list[int]  # every id so far: prompt, turns, what followed each turn
    rng: torch.Generator
    feed: list[int]  # ids to prefill before the next token is chosen
    turn_ids: list[int] = field(default_factory=list)
    turn_logprobs: list[float] = field(default_factory=list)


@dataclass
class _Group:
    """Rows that left the batch after the same step, waiting for their `next_turn`."""

    ready_step: int
    episodes: list[_Episode]
    cache: KVBatch
    futures: list[Future]
    waited: float = 0.0  # seconds the loop waited for their `next_turn`s


class _StopCheck:
    """Does a turn's text contain one of the stop strings? Decodes only the turn's tail: a
    stop string of n bytes that the last token completes spans at most n tokens."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.decode = tokenizer.decode
        self.stops = tuple(stops)
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 2

    def __call__(self, ids: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.decode(ids[-self.window :], skip_special_tokens=False)
        return any(s in text for s in self.stops)


class EngineHost(Protocol):
    """What the loop reads of the policy it runs for (`HFPolicy`, `PopulationPolicy`)."""

    model: Any
    tokenizer: Any
    batch_size: int
    eos_ids: set[int]

    @property
    def device(self) -> torch.device: ...


class EpisodeEngine:
    """Runs `HFPolicy.generate_episodes` (one call = one set of episodes)."""

    def __init__(
        self,
        policy: EngineHost,
        sampling: SamplingConfig,
        next_turn: NextTurn,
        *,
        members: Sequence[int] | None = None,
        select: Callable[[Sequence[int]], None] | None = None,
        streams: Sequence[int] | None = None,
        turn_limits: TurnLimits | None = None,
    ) -> None:
        """`members`: the population member of each episode, for a `PopulationPolicy`,
        and `select`: how the loop tells its model the member of each row before every
        forward pass (both or neither); `streams`: each episode's sampling-stream seed
        (default: derived from the sampling seed and its index); `turn_limits`: each
        episode's stop strings and turn length, read at every token (default: the sampling
        config's, the same for all)."""
        if (members is None) != (select is None):
            raise ValueError("a population's episodes need both members= and select=")
        self.policy = policy
        self.select = select
        self.members = None if members is None else list(members)
        self.streams = None if streams is None else list(streams)
        self.model = policy.model
        self.sampling = sampling
        self.next_turn = next_turn
        self.stop = _StopCheck(policy.tokenizer, sampling.stop)
        self.turn_limits = turn_limits
        self._stop_checks: dict[tuple[str, ...], _StopCheck] = {}
        self.pad_id = policy.tokenizer.pad_token_id
        self.device = policy.device
        self.stats = {"forward_passes": 0, "decode_steps": 0, "prefill_tokens": 0}
        self.stats |= {"tool_wait_seconds": 0.0, "seconds": 0.0}
        # As they come: per member, the first prompt's tokens and KV (see `_start`).
        self._prompts: dict[int | None, tuple[list[int], KVBatch]] = {}
        self._fresh: set[int] = set()  # ids of the new episodes of the pending prefill

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def run(
        self, episodes: Sequence[Sequence[int]] | EpisodeFeed, threads: int
    ) -> dict[str, float]:
        """Play the feed's episodes (a list of prompts: all arrived, deterministic)."""
        start = time.perf_counter()
        feed = episodes if isinstance(episodes, EpisodeFeed) else EpisodeFeed.of(episodes)
        seeds = self.streams or episode_streams(self.sampling.seed, feed.count)
        if len(seeds) != feed.count or (self.members and len(self.members) != feed.count):
            raise ValueError("one member and one stream per prompt")
        self.feed = feed
        fresh: deque[_Episode] = deque()
        running: list[_Episode] = []  # in the order of their slots in `batch`
        self.capacity = max(1, min(self.policy.batch_size, feed.count))
        batch = SlotBatch(self.capacity, self.device)
        waiting: deque[_Group] = deque()
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            while True:
                feed.interject()  # sessionless requests, between two forward passes
                for index, prompt in feed.take():
                    if not prompt:
                        raise ValueError("every prompt needs at least one token")
                    fresh.append(_Episode(index, prompt, stream(seeds[index]), list(prompt)))
                if not (fresh or running or waiting):
                    if not feed.open:
                        break
                    feed.wait()
                    continue
                joining, parts = self._admit(waiting, fresh, len(running))
                if joining:  # prefill their prompts, or what followed their last turn
                    joined = KVBatch.concat(parts)
                    self._select(joining)
                    logits = joined.forward(self.model, [e.feed for e in joining], self.pad_id)
                    if self._fresh and self.feed.as_they_come:
                        self._remember(joining, joined, self._fresh)
                    self.stats["forward_passes"] += 1
                    self.stats["prefill_tokens"] += sum(len(e.feed) for e in joining)
                    stay, leave, futures = self._choose(joining, logits, pool)
                    if leave:
                        ready = self.stats["decode_steps"] + TOOL_OVERLAP_STEPS
                        leaving = [joining[r] for r in leave]
                        waiting.append(_Group(ready, leaving, joined.take(leave), futures))
                    if stay:
                        batch.add(joined.take(stay) if leave else joined)
                        running.extend(joining[r] for r in stay)
                if not running:
                    if not self.progressed:  # every row waits for its next turn (as they come)
                        feed.wait()
                    continue
                self._select(running)
                logits = batch.forward(self.model, [e.feed[0] for e in running])
                self.stats["forward_passes"] += 1
                self.stats["decode_steps"] += 1
                stay, leave, futures = self._choose(running, logits, pool)
                if leave:
                    ready = self.stats["decode_steps"] + TOOL_OVERLAP_STEPS
                    cache, order = batch.remove(leave)
                    waiting.append(_Group(ready, [running[r] for r in leave], cache, futures))
                    running = [running[slot] for slot in order]
        self.stats["seconds"] = time.perf_counter() - start
        return self.stats

    def _admit(
        self, waiting: deque[_Group], fresh: deque[_Episode], running: int
    ) -> tuple[list[_Episode], list[KVBatch]]:
        """Rows that join before the next decode step: continuing episodes first (see
        `_due`), then new episodes while the batch has room."""
        room = self.capacity - running
        self._fresh = set()
        joining: list[_Episode] = []
        parts: list[KVBatch] = []
        due = self._due(waiting, fresh, running, room)
        self.progressed = bool(due)  # rows re-joined or ended: the loop moved on
        for group, rows in due:
            follows = [group.futures[r].result() for r in rows]
            self.stats["tool_wait_seconds"] += group.waited
            cache = group.cache.take(rows) if len(rows) < len(group.episodes) else group.cache
            episodes = [group.episodes[r] for r in rows]
            bridged = [i for i, f in enumerate(follows) if f is not None]
            restarted = [i for i in bridged if isinstance(follows[i], Reprompt)]
            bridged = [i for i in bridged if not isinstance(follows[i], Reprompt)]
            for i in bridged:
                episode = episodes[i]
                # The turn's last token was chosen but never fed: it leads the prefill.
                episode.feed = [episode.turn_ids[-1], *follows[i]]
                episode.sequence.extend(follows[i])
                episode.turn_ids, episode.turn_logprobs = [], []
            for i in restarted:  # a new sequence: prefilled from scratch, in a fresh cache
                episode = episodes[i]
                episode.sequence = list(follows[i].ids)
                episode.feed = list(follows[i].ids)
                episode.turn_ids, episode.turn_logprobs = [], []
            if bridged:
                joining.extend(episodes[i] for i in bridged)
                parts.append(cache.take(bridged) if len(bridged) < len(rows) else cache)
            if restarted:
                joining.extend(episodes[i] for i in restarted)
                parts.append(KVBatch.empty(len(restarted), self.device))
            room -= len(bridged) + len(restarted)
        due_next = waiting and waiting[0].ready_step <= self.stats["decode_steps"]
        if due_next and not self.feed.as_they_come:
            return joining, parts  # a continuing episode waits for room: start none
        new = []
        while fresh and len(joining) + len(new) < self.capacity - running:
            new.append(fresh.popleft())
        self._fresh = {id(e) for e in new}
        if new:
            self.progressed = True
            joining.extend(new)
            parts.append(self._start(new))
        return joining, parts

    def _due(
        self, waiting: deque[_Group], fresh: deque[_Episode], running: int, room: int
    ) -> list[tuple[_Group, list[int]]]:
        """The waiting rows that re-join now, by group (each removed from `waiting`, or
        narrowed to the rest). Deterministic: whole groups whose decode step has come, in
        the order they left (the oldest one regardless when nothing else would run), after
        their `next_turn`s returned (waited for). As they come: every row whose `next_turn`
        has returned, oldest first, while there is room."""
        due: list[tuple[_Group, list[int]]] = []
        if self.feed.as_they_come:
            for group in list(waiting):
                rows = [r for r, f in enumerate(group.futures) if f.done()][: max(0, room)]
                if not rows:
                    continue
                room -= len(rows)
                rest = [r for r in range(len(group.episodes)) if r not in rows]
                taken = _Group(group.ready_step, group.episodes, group.cache, group.futures)
                due.append((taken, rows))
                if rest:
                    group.episodes = [group.episodes[r] for r in rest]
                    group.futures = [group.futures[r] for r in rest]
                    group.cache = group.cache.take(rest)
                else:
                    waiting.remove(group)
            return due
        continuing = 0  # rows of the groups taken that go on (others' episodes ended)
        while waiting and len(waiting[0].episodes) <= room - continuing:
            group = waiting[0]
            idle = not running and not continuing and not fresh
            if group.ready_step > self.stats["decode_steps"] and not idle:
                break
            waiting.popleft()
            begin = time.perf_counter()
            self.feed.wait_for(lambda g=group: all(f.done() for f in g.futures))
            group.waited = time.perf_counter() - begin
            due.append((group, list(range(len(group.episodes)))))
            continuing += sum(f.result() is not None for f in group.futures)
        return due

    def _start(self, episodes: list[_Episode]) -> KVBatch:
        """The cache of new episodes before their prefill. The prompt prefix they all share
        (chat templates open with the same instructions and tool list; GRPO's samples of a
        task share the whole prompt) is computed once and copied to every row. As they come,
        episodes arrive a few at a time, so a prompt prefix is also taken from the KV of an
        earlier prompt of the same member (`_prompts`, see `_remember`)."""
        if self.feed.as_they_come and self._prompts:
            rows = {id(e): c for e in episodes if (c := self._cached_prefix(e)) is not None}
            if rows:
                for episode in episodes:
                    if id(episode) in rows:
                        episode.feed = episode.feed[rows[id(episode)].width :]
                rest = [e for e in episodes if id(e) not in rows]
                if rest:
                    started = self._start(rest)
                    rows |= {id(e): started.take([r]) for r, e in enumerate(rest)}
                return KVBatch.concat([rows[id(e)] for e in episodes])
        prompts = [e.feed for e in episodes]
        shared = 0
        shortest = min(len(p) for p in prompts) - 1  # every row keeps a token to feed
        while shared < shortest and all(p[shared] == prompts[0][shared] for p in prompts):
            shared += 1
        if len(episodes) < 2 or shared < MIN_SHARED_PREFIX:
            return KVBatch.empty(len(episodes), self.device)
        for episode in episodes:
            episode.feed = episode.feed[shared:]
        if self.members is None:
            prefix = KVBatch.empty(1, self.device)
            prefix.forward(self.model, [prompts[0][:shared]], self.pad_id)
            self.stats["forward_passes"] += 1
            self.stats["prefill_tokens"] += shared
            return prefix.repeat(len(episodes))
        # A population: the prefix's cache differs per member, so one row per member.
        firsts: dict[int, _Episode] = {}
        for episode in episodes:
            firsts.setdefault(self.members[episode.index], episode)
        prefix = KVBatch.empty(len(firsts), self.device)
        self._select(list(firsts.values()))
        prefix.forward(self.model, [prompts[0][:shared]] * len(firsts), self.pad_id)
        self.stats["forward_passes"] += 1
        self.stats["prefill_tokens"] += shared * len(firsts)
        row_of = {member: row for row, member in enumerate(firsts)}
        return prefix.take([row_of[self.members[e.index]] for e in episodes])

    def _member(self, episode: _Episode) -> int | None:
        return None if self.members is None else self.members[episode.index]

    def _cached_prefix(self, episode: _Episode) -> KVBatch | None:
        """The KV of the longest prefix this episode's prompt shares with a remembered prompt
        of its member (its last token left to feed), when it is worth it."""
        remembered = self._prompts.get(self._member(episode))
        if remembered is None:
            return None
        tokens, cache = remembered
        prompt = episode.feed
        limit = min(len(tokens), len(prompt) - 1)
        shared = 0
        while shared < limit and tokens[shared] == prompt[shared]:
            shared += 1
        return cache.first(shared) if shared >= MIN_SHARED_PREFIX else None

    def _remember(self, joining: list[_Episode], joined: KVBatch, fresh: set[int]) -> None:
        """After a prefill: keep the KV of the first whole prompt of every member not yet
        remembered (as they come only; one row per member, for this call's weights)."""
        for row, episode in enumerate(joining):
            member = self._member(episode)
            if id(episode) in fresh and member not in self._prompts:
                self._prompts[member] = (list(episode.sequence), joined.take([row]).compact())

    def _select(self, rows: Sequence[_Episode]) -> None:
        """Tell a population's stacked model the member of each row of the next forward."""
        if self.members is not None and self.select is not None:
            self.select([self.members[e.index] for e in rows])

    # ------------------------------------------------------------------ one token per row
    def _choose(
        self, episodes: list[_Episode], logits: torch.Tensor, pool: ThreadPoolExecutor
    ) -> tuple[list[int], list[int], list[Future]]:
        """Choose every row's next token. The `next_turn` of every row whose turn ended
        starts now. Returns the rows that stay, the rows that leave and their futures."""
        tokens = sample_tokens(logits, self.sampling, [e.rng for e in episodes])
        logprobs = chosen_logprobs(logits, tokens).tolist()
        stay: list[int] = []
        leave: list[int] = []
        futures = []
        for row, (episode, token) in enumerate(zip(episodes, tokens.tolist(), strict=True)):
            episode.turn_ids.append(token)
            episode.turn_logprobs.append(logprobs[row])
            episode.feed = [token]
            reason = self._finish_reason(episode)
            if reason is None:
                stay.append(row)
                continue
            generation = Generation(
                self.policy.tokenizer.decode(episode.turn_ids, skip_special_tokens=True),
                list(episode.turn_ids),
                list(episode.turn_logprobs),
                reason,
                prompt_token_ids=list(episode.sequence),
            )
            episode.sequence.extend(episode.turn_ids)
            leave.append(row)
            future = pool.submit(self.next_turn, episode.index, generation)
            future.add_done_callback(self.feed.wake)
            futures.append(future)
        return stay, leave, futures

    def _finish_reason(self, episode: _Episode) -> FinishReason | None:
        ids = episode.turn_ids
        stop, limit = self.stop, self.sampling.max_new_tokens
        if self.turn_limits is not None:
            stops, limit = self.turn_limits(episode.index)
            stop = self._stop_checks.get(stops)
            if stop is None:
                stop = self._stop_checks[stops] = _StopCheck(self.policy.tokenizer, stops)
        if ids[-1] in self.policy.eos_ids:
            return "eos"
        if stop(ids):
            return "stop"
        if len(ids) >= limit:
            return "length"
        return None
