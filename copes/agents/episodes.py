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
  transformers backend): continuous batching with KV caches kept across turns; a row whose
  turn ends leaves, its driver's `after_turn` runs in a worker thread while the others keep
  decoding, and the row re-joins on the loop's deterministic schedule.
- **Turn by turn** (any other policy, e.g. vLLM, whose engine schedules rows itself): every
  turn, the unfinished episodes with the same limits are generated in one batched call (a
  population's `generate_turn`: each row with its member; else `generate_ids` with the
  turn's seed, `turn_seed`), then every driver's `after_turn` runs, in parallel threads.

A population served as one policy (`PopulationRows`) is told each started episode's member,
stream and seed through `assign`, in the order the loop runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from copes.agents.policy import Generation, SamplingConfig, TurnPopulation, runs_episodes

Limits = tuple[tuple[str, ...], int]  # a turn's stop strings and its most new tokens


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


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a turn-by-turn loop (prompt i adds i)."""
    return seed + 1_000_003 * turn


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
) -> LoopStats:
    """Run every driver's episode to its end (see the module docstring).

    `continuous` False runs turn by turn even with a policy that has its own loop;
    `assign(started)` is called with the indices of the drivers that started, in the
    order the loop runs them, before anything is generated (a population's rows)."""
    stats = LoopStats()
    start = time.perf_counter()
    started, prompts = [], []
    for index, driver in enumerate(drivers):
        prompt = driver.start()
        if prompt is not None:
            started.append(index)
            prompts.append(list(prompt))
    if started:
        if assign is not None:
            assign(started)
        active = [drivers[i] for i in started]
        if continuous and runs_episodes(policy):
            _in_policy_loop(policy, active, prompts, sampling, threads, stats)
        else:
            _turn_by_turn(policy, active, prompts, sampling, threads, stats)
    stats.seconds = time.perf_counter() - start
    return stats


def _in_policy_loop(
    policy: Any,
    drivers: list[EpisodeDriver],
    prompts: list[list[int]],
    sampling: SamplingConfig,
    threads: int,
    stats: LoopStats,
) -> None:
    """Every episode in the policy's continuous-batching loop (`generate_episodes`)."""
    spent: list[float] = []  # appended from worker threads

    def next_turn(index: int, generation: Generation) -> Sequence[int] | Reprompt | None:
        begin = time.perf_counter()
        following = drivers[index].after_turn(generation)
        spent.append(time.perf_counter() - begin)
        return following

    limits = [driver.limits() for driver in drivers]
    per_episode = any(limit is not None for limit in limits)

    def turn_limits(index: int) -> Limits:
        return drivers[index].limits() or (sampling.stop, sampling.max_new_tokens)

    begin = time.perf_counter()
    engine = policy.generate_episodes(
        prompts, replace(sampling, stop=()) if per_episode else sampling, next_turn,
        threads=max(1, min(threads, len(drivers))),
        **({"turn_limits": turn_limits} if per_episode else {}),
    )  # fmt: skip
    stats.generation_seconds += time.perf_counter() - begin
    stats.after_turn_seconds += sum(spent)
    stats.generate_calls += 1
    stats.engine = dict(engine)


def _turn_by_turn(
    policy: Any,
    drivers: list[EpisodeDriver],
    prompts: list[list[int]],
    sampling: SamplingConfig,
    threads: int,
    stats: LoopStats,
) -> None:
    """One batched call per turn (and per distinct turn limits) over the unfinished
    episodes, then their drivers' `after_turn` in parallel threads."""
    sequences: dict[int, list[int]] = dict(enumerate(prompts))
    population = isinstance(policy, TurnPopulation)
    turn = 0
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(drivers)))) as pool:
        while sequences:
            groups: dict[Limits, list[int]] = {}
            for index in sequences:
                limit = drivers[index].limits() or (sampling.stop, sampling.max_new_tokens)
                groups.setdefault(limit, []).append(index)
            generated: dict[int, Generation] = {}
            for (stops, length), indices in groups.items():
                rows = replace(sampling, stop=stops, max_new_tokens=length)
                batch = [sequences[i] for i in indices]
                begin = time.perf_counter()
                if population:  # each row samples as its member alone would
                    generations = policy.generate_turn(batch, rows, indices, turn)
                else:
                    if rows.seed is not None:
                        rows = replace(rows, seed=turn_seed(rows.seed, turn))
                    generations = policy.generate_ids(batch, rows)
                stats.generation_seconds += time.perf_counter() - begin
                stats.generate_calls += 1
                generated.update(zip(indices, generations, strict=True))
            order = sorted(generated)
            begin = time.perf_counter()
            turns = [(drivers[i], generated[i]) for i in order]
            follows = list(pool.map(lambda pair: pair[0].after_turn(pair[1]), turns))
            stats.after_turn_seconds += time.perf_counter() - begin
            following: dict[int, list[int]] = {}
            for index, follow in zip(order, follows, strict=True):
                if isinstance(follow, Reprompt):
                    following[index] = list(follow.ids)
                elif follow is not None:
                    following[index] = [*sequences[index], *generated[index].token_ids, *follow]
            sequences = following
            turn += 1
