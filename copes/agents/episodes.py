"""The one episode loop: every turn of every episode, for in-process rollouts and served
sessions alike.

An episode is driven by an `EpisodeDriver`: it gives the episode's first prompt (or None: it
never starts), the limits of its next turn (or None: the sampling config's), and, after each
turn, what follows it: the ids that extend the sequence (tool output, the next assistant
header), a whole new sequence (`Reprompt`: a served conversation re-rendered), or None (the
episode is over). `copes.agents.rollout` drives episodes with environments; `copes.serve`
drives them with the sessions HTTP clients play. Nothing else runs turns.

`play_episodes` runs the drivers in one of two ways:

- **In the policy's own loop** (an `EpisodeRunner` whose `supports_episodes` is true: the
  transformers backend with its KV caches kept across turns, vLLM through its engine's
  scheduler): continuous batching; a row whose turn ends leaves, its driver's `after_turn`
  runs in a worker thread while the others keep decoding, and the row re-joins on the
  loop's schedule.
- **Turn by turn** (any other policy: a model whose cache the transformers loop cannot
  re-arrange, a scripted policy): every turn, the unfinished episodes with the same limits
  are generated in one `generate_ids` call with the turn's seed (`turn_seed`), then every
  driver's `after_turn` runs, in parallel threads.

A population served as one policy (`PopulationRows`) is told each started episode's member
and sampling stream through `assign`, in the order the loop runs them; it always runs in its
own loop.

**Two schedules** decide when an episode's turns join the batch (`EpisodeFeed.schedule`):

- ``deterministic`` (in-process rollouts, in-process harnesses): the loop starts once every
  episode has its first prompt, and a row whose turn ended re-joins on a schedule fixed by the
  tokens (after a few decode steps, waiting for its driver if slower). The tokens do not
  depend on timing, so a served step equals an in-process one bit for bit.
- ``as-they-come`` (HTTP clients): an episode joins when its first prompt arrives and a row
  re-joins as soon as what follows its turn is ready, at the next decode step; nothing waits
  for another episode's client. Each episode still samples from its own stream with its own
  member, so only the batch's composition (float rounding) can differ from the
  deterministic schedule.

Either way the loop's thread runs `Interjections` between forward passes: work for callers
outside the loop (a served policy's sessionless requests), so they never wait for it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from copes.agents.policy import Generation, Policy, SamplingConfig

Limits = tuple[tuple[str, ...], int]  # a turn's stop strings and its most new tokens
Schedule = Literal["deterministic", "as-they-come"]
SCHEDULES: tuple[Schedule, ...] = ("deterministic", "as-they-come")

# The deterministic schedule: a row whose turn ended at decode step s re-joins before step
# s + 1 + TOOL_OVERLAP_STEPS (its `after_turn`, a tool call, overlaps that many steps).
TOOL_OVERLAP_STEPS = 3


@dataclass(frozen=True)
class Reprompt:
    """What `after_turn` returns when an episode's next prompt does not extend its sequence
    (a served conversation re-rendered, not bridged): the whole new sequence. The episode's
    KV cache is dropped and it continues from these ids."""

    ids: Sequence[int]


class EpisodeDriver(Protocol):
    """One episode's side of the loop."""

    def start(self) -> list[int] | None:
        """The first prompt's ids; None when the episode does not start."""
        ...

    def limits(self) -> Limits | None:
        """Stops and length of the next turn; None: the sampling config's."""
        ...

    def after_turn(self, generation: Generation) -> Sequence[int] | Reprompt | None:
        """Take a finished turn; what follows it, or None when the episode is over."""
        ...


# What a policy's own loop calls after each turn of episode i (`EpisodeRunner`), and each
# episode's (stop strings, max new tokens) for its current turn when they differ per episode
# (a served session's request sets them; default: the sampling config's).
NextTurn = Callable[[int, "Generation"], "Sequence[int] | Reprompt | None"]
TurnLimits = Callable[[int], Limits]


def episode_stream(seed: int, index: int) -> int:
    """The sampling stream of episode `index` of a loop seeded `seed` (both backends' own
    loops; a population's member alone draws the same)."""
    from copes.seeding import derive_seed

    return derive_seed("episode-sampling", seed, index)


def episode_streams(seed: int | None, count: int) -> list[int]:
    """The streams of a loop's `count` episodes; without a seed, one draw from torch's
    global generator decides them all (as a seedless `generate` would draw)."""
    if seed is None:
        import torch

        seed = int(torch.randint(2**62, (1,)).item())
    return [episode_stream(seed, i) for i in range(count)]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a turn-by-turn loop (prompt i adds i)."""
    return seed + 1_000_003 * turn


class Interjections:
    """Work a running loop does on its own thread between forward passes, for callers outside
    it (a served policy's sessionless requests): each job runs with the model as the policy's
    own (a population's per-row weights suspended), and its caller waits on a future."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._lock = threading.Lock()
        self.wake: Callable[[], None] = lambda: None  # set by the feed of the running loop

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            self._jobs.append((job, future))
        self.wake()
        return future

    def pending(self) -> bool:
        return bool(self._jobs)

    def run(self) -> None:
        """Run every job queued so far (a job's exception goes to its caller)."""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job, future = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)


class EpisodeFeed:
    """The episodes one loop plays, as their first prompts arrive, and what wakes the loop
    when it has nothing to compute: an arrival, a driver's finished `after_turn`, an
    interjection. Episode ``i`` of the feed is the loop's episode ``i`` (its member, its
    sampling stream); `count` is how many may arrive.

    `suspend` is entered around interjections (a population: its rows' weights off)."""

    def __init__(
        self,
        count: int,
        schedule: Schedule = "deterministic",
        interjections: Interjections | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.count = count
        self.schedule = schedule
        self.interjections = interjections
        self.suspend: Callable[[], AbstractContextManager[Any]] = nullcontext
        self._arrived: deque[tuple[int, list[int]]] = deque()
        self._settled = 0  # episodes that arrived or never will
        self._signal = threading.Condition()
        self._woken = False
        self._error: BaseException | None = None  # a driver's start raised: the loop does
        if interjections is not None:
            interjections.wake = self.wake

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], **kwargs: Any) -> EpisodeFeed:
        """A feed whose every episode has arrived (episode i: prompts[i])."""
        feed = cls(len(prompts), **kwargs)
        for index, prompt in enumerate(prompts):
            feed.arrive(index, prompt)
        return feed

    @property
    def as_they_come(self) -> bool:
        return self.schedule == "as-they-come"

    def arrive(self, index: int, prompt: Sequence[int] | None) -> None:
        """Episode `index`'s first prompt (None: it never starts)."""
        with self._signal:
            if prompt is not None:
                self._arrived.append((index, list(prompt)))
            self._settled += 1
            self._woken = True
            self._signal.notify_all()

    def fail(self, error: BaseException) -> None:
        """A driver's start raised: the loop raises it at its next look."""
        with self._signal:
            self._error = self._error or error
            self._settled += 1
            self._woken = True
            self._signal.notify_all()

    def take(self) -> list[tuple[int, list[int]]]:
        """The episodes that arrived since the last call, in arrival order (raises what a
        driver's start raised)."""
        with self._signal:
            if self._error is not None:
                raise self._error
            taken = list(self._arrived)
            self._arrived.clear()
        return taken

    @property
    def open(self) -> bool:
        """Whether an episode may still arrive."""
        return self._settled < self.count

    def wake(self, *_: Any) -> None:
        with self._signal:
            self._woken = True
            self._signal.notify_all()

    def wait(self, timeout: float = 0.5) -> None:
        """Until something wakes the loop (or `timeout`), running interjections meanwhile."""
        self.interject()
        with self._signal:
            if not self._woken:
                self._signal.wait(timeout)
            self._woken = False
            if self._error is not None:
                raise self._error
        self.interject()

    def interject(self) -> None:
        """Run the interjections queued so far (between two forward passes)."""
        if self.interjections is not None and self.interjections.pending():
            with self.suspend():
                self.interjections.run()

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Until `done()` holds, running interjections meanwhile."""
        while not done():
            self.wait()


# ---------------------------------------------------------------------------------------------
# What a policy may declare to the loop: its own episode loop, a population's rows


class EpisodeRunner(Protocol):
    """An optional capability: whole multi-turn episodes in one call, in the policy's own
    continuous-batching loop (`HFPolicy`; a population policy, which serves only through
    its loop, too). The one episode loop (`copes.agents.episodes`) uses it when a policy has
    it and ``supports_episodes`` is true, and otherwise runs turn by turn with
    `generate_ids`. A row that ends its turn leaves, and re-joins when what follows it is
    ready."""

    supports_episodes: bool

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: Callable[[int, Generation], Sequence[int] | None],
        *,
        threads: int = 16,
    ) -> dict[str, float]:
        """Generate turns for every prompt until its episode ends (an `EpisodeFeed`: its
        episodes as they arrive, on its schedule, running its interjections).

        After each turn of episode ``i`` the policy calls ``next_turn(i, generation)`` (from
        worker threads, at most ``threads`` at once, never twice at once for one episode):
        it returns the token ids that follow the turn (tool output, the next assistant
        header), which the policy appends before the episode's next turn, or None when the
        episode is over. ``generation.prompt_token_ids`` is the episode's whole sequence
        before the turn. With a seed, each episode samples from its own stream derived from
        (seed, i). Returns diagnostics (seconds, forward passes, ...).
        """
        ...


class EpisodePolicy(Policy, EpisodeRunner, Protocol):
    """A `Policy` that runs whole episodes in its own loop (`EpisodeRunner`)."""


def runs_episodes(policy: Policy) -> bool:
    """Whether `policy` runs whole episodes in its own loop now (it declares
    `supports_episodes`: an `EpisodeRunner`), the one question every rollout path asks."""
    return bool(policy.supports_episodes)


class PopulationRows(EpisodeRunner, Protocol):
    """A population served as one policy: each row of the next rollout computes with its
    member (`copes.agents.hf.population.PopulationPolicy`, the vLLM LoRA population), in
    its own episode loop."""

    def assign(self, members: Sequence[int], streams: Sequence[int]) -> None:
        """Each episode's member slot and the sampling stream it has when its member runs
        alone."""
        ...


@dataclass
class LoopStats:
    """What one `play_episodes` did: its seconds, the seconds spent generating (the whole
    loop when turns overlap tool calls, else the sum of the generate calls), the summed
    seconds of the drivers' `after_turn` (they overlap in threads), the generate calls and
    the policy loop's own diagnostics."""

    seconds: float = 0.0
    generation_seconds: float = 0.0
    after_turn_seconds: float = 0.0
    generate_calls: int = 0
    engine: dict[str, float] = field(default_factory=dict)


def play_episodes(
    policy: Any,
    drivers: Sequence[EpisodeDriver],
    sampling: SamplingConfig,
    *,
    threads: int = 16,
    continuous: bool = True,
    assign: Callable[[list[int]], None] | None = None,
    schedule: Schedule = "deterministic",
    interjections: Interjections | None = None,
) -> LoopStats:
    """Run every driver's episode to its end (see the module docstring).

    `continuous` False runs turn by turn even with a policy that has its own loop (not a
    population, which serves only through its loop);
    `assign(started)` is told the indices of the drivers the loop runs as episodes 0, 1, ...,
    before anything is generated (a population's rows): with the deterministic schedule,
    the drivers that started, in order; as they come, every driver (one that never starts
    is never run). Drivers start in `threads` threads (a served session's start waits for its
    client's first request), and the loop runs `interjections` while it waits and between
    its forward passes."""
    stats = LoopStats()
    start = time.perf_counter()
    feed = EpisodeFeed(len(drivers), schedule, interjections)

    def settle(started: Future, index: int) -> None:  # a start's prompt, or its error
        error = started.exception()
        feed.fail(error) if error is not None else feed.arrive(index, started.result())

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(drivers)))) as starts:
        for index, driver in enumerate(drivers):
            starts.submit(driver.start).add_done_callback(lambda f, i=index: settle(f, i))
        if feed.as_they_come:
            active = list(drivers)
            if assign is not None:
                assign(list(range(len(drivers))))
        else:  # every episode's first prompt, then the loop, in driver order
            feed.wait_for(lambda: not feed.open)
            arrived = sorted(feed.take())
            if assign is not None and arrived:
                assign([i for i, _ in arrived])
            active = [drivers[i] for i, _ in arrived]
            feed = EpisodeFeed.of([p for _, p in arrived], interjections=interjections)
        if active:
            if (continuous or policy.serves_members) and runs_episodes(policy):
                _in_policy_loop(policy, active, feed, sampling, threads, stats)
            else:
                _turn_by_turn(policy, active, feed, sampling, threads, stats)
    stats.seconds = time.perf_counter() - start
    return stats


def _in_policy_loop(
    policy: Any,
    drivers: list[EpisodeDriver],
    feed: EpisodeFeed,
    sampling: SamplingConfig,
    threads: int,
    stats: LoopStats,
) -> None:
    """Every episode in the policy's continuous-batching loop (`generate_episodes`)."""
    next_turn, spent = _timed_after_turn(drivers)

    def turn_limits(index: int) -> Limits:
        return drivers[index].limits() or (sampling.stop, sampling.max_new_tokens)

    # Per-episode limits (served sessions) are read at every token; else the sampling's.
    per_episode = feed.as_they_come or any(driver.limits() is not None for driver in drivers)
    begin = time.perf_counter()
    engine = policy.generate_episodes(
        feed, replace(sampling, stop=()) if per_episode else sampling, next_turn,
        threads=max(1, min(threads, len(drivers))),
        **({"turn_limits": turn_limits} if per_episode else {}),
    )  # fmt: skip
    stats.generation_seconds += time.perf_counter() - begin
    stats.after_turn_seconds += sum(spent)
    stats.generate_calls += 1
    stats.engine = dict(engine)


def _timed_after_turn(
    drivers: list[EpisodeDriver],
) -> tuple[Callable[[int, Generation], Sequence[int] | Reprompt | None], list[float]]:
    """Each driver's `after_turn` (its tool calls, its grade) as both loops call it, and the
    list its seconds are appended to (from worker threads)."""
    spent: list[float] = []

    def after(index: int, generation: Generation) -> Sequence[int] | Reprompt | None:
        begin = time.perf_counter()
        following = drivers[index].after_turn(generation)
        spent.append(time.perf_counter() - begin)
        return following

    return after, spent


def _turn_by_turn(
    policy: Any,
    drivers: list[EpisodeDriver],
    feed: EpisodeFeed,
    sampling: SamplingConfig,
    threads: int,
    stats: LoopStats,
) -> None:
    """Batched calls over the episodes whose next prompt is ready, one per distinct (turn
    limits, turn number); each driver's `after_turn` in a worker thread. With the
    deterministic schedule a turn's batch waits for every unfinished episode (one call per
    turn and limits); as they come, whatever is ready is generated at once."""
    ready: dict[int, list[int]] = {}  # episode -> its next prompt
    turn_of: dict[int, int] = {}  # episode -> the turn it plays next
    pending: dict[int, tuple[Future, list[int]]] = {}  # after_turn running: (its future, seq)
    if policy.serves_members:
        raise ValueError(f"{type(policy).__name__} is a population: it runs only in its own loop")
    after, spent = _timed_after_turn(drivers)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(drivers)))) as pool:
        while True:
            feed.interject()
            for index, prompt in feed.take():
                ready[index], turn_of[index] = prompt, 0
            for index in [i for i, (future, _) in pending.items() if future.done()]:
                future, sequence = pending.pop(index)
                follow = future.result()
                if isinstance(follow, Reprompt):
                    ready[index] = list(follow.ids)
                elif follow is not None:
                    ready[index] = [*sequence, *follow]
                else:
                    continue
                turn_of[index] += 1
            if not ready or (pending and not feed.as_they_come):
                if not ready and not pending and not feed.open:
                    break
                feed.wait()
                continue
            groups: dict[tuple[Limits, int], list[int]] = {}
            for index in sorted(ready):
                limit = drivers[index].limits() or (sampling.stop, sampling.max_new_tokens)
                groups.setdefault((limit, turn_of[index]), []).append(index)
            for ((stops, length), turn), indices in groups.items():
                rows = replace(sampling, stop=stops, max_new_tokens=length)
                batch = [ready.pop(i) for i in indices]
                begin = time.perf_counter()
                if rows.seed is not None:
                    rows = replace(rows, seed=turn_seed(rows.seed, turn))
                generations = policy.generate_ids(batch, rows)
                stats.generation_seconds += time.perf_counter() - begin
                stats.generate_calls += 1
                for index, prompt, generation in zip(indices, batch, generations, strict=True):
                    future = pool.submit(after, index, generation)
                    future.add_done_callback(feed.wake)
                    pending[index] = (future, [*prompt, *generation.token_ids])
    stats.after_turn_seconds += sum(spent)
