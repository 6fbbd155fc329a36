"""The rollout function the optimizers call: a step's task batch and sampling seeds are a
pure function of (run seed, step, member), so every member and every resume sees the same
episodes (`TaskRollout`; `population_plan` for a batched or served population)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from copes.agents.episodes import episode_stream
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import RolloutBatch, RolloutStats, rollout
from copes.seeding import derive_seed

if TYPE_CHECKING:
    from copes.agents.hf.population import PopulationPolicy


@dataclass(frozen=True)
class PlannedEpisode:
    """One episode of a population rollout: its member's slot and index, its index among
    the member's episodes, its task, and its sampling stream."""

    slot: int
    member: int
    index: int
    task: Any
    stream: int


class TaskRollout:
    """The `RolloutFn` of a run: the trajectories of (step, member), a pure function of them.

    Step `step`'s batch is `batch_size` tasks drawn with the run's seed and the step (the same
    batch for every member by default, with common sampling draws); a member gets its own
    batch without `same_batch`. Each task is sampled `samples_per_task` times (GRPO's group).
    Keeps a pool of environments (one per concurrent episode) and reuses them every call.
    """

    def __init__(
        self,
        make_env: Callable[[], Any],
        tasks: Sequence[Any],
        batch_size: int,
        samples_per_task: int,
        sampling: SamplingConfig,
        seed: int,
        same_batch: bool = True,
        max_context: int | None = None,
    ) -> None:
        self.tasks = list(tasks)
        self.batch_size = min(batch_size, len(self.tasks))
        self.samples = samples_per_task
        self.sampling = sampling
        self.seed = seed
        self.same_batch = same_batch
        self.max_context = max_context
        self.envs = [make_env() for _ in range(self.batch_size * samples_per_task)]
        self._make_env = make_env
        self._population_envs: list[Any] = []  # `population`'s, made on first use

    def tasks_of(self, step: int, member: int | None = None) -> list[Any]:
        """The tasks `member` (None: the step's shared batch) sees at `step`."""
        draw = None if self.same_batch else member
        rng = random.Random(derive_seed("batch", self.seed, step, draw))
        return rng.sample(self.tasks, self.batch_size)

    def sampling_of(self, step: int, member: int | None = None) -> SamplingConfig:
        """The sampling of (step, member)'s episodes."""
        if self.sampling.greedy:
            return self.sampling
        # With the same batch, every member also gets the same sampling draws (common
        # random numbers): reward differences then come from the weights, not the dice.
        draws = None if self.same_batch else member
        return replace(self.sampling, seed=derive_seed("sample", self.seed, step, draws))

    def __call__(self, policy: Any, step: int, member: int | None = None) -> RolloutBatch:
        tasks = self.tasks_of(step, member)
        options = [{"task": t} for t in tasks for _ in range(self.samples)]
        envs = self.envs[: len(options)]
        sampling = self.sampling_of(step, member)
        return rollout(policy, envs, sampling, options=options, max_context=self.max_context)

    def population(
        self, policy: PopulationPolicy, step: int, members: Sequence[int]
    ) -> list[RolloutBatch]:
        """The batches of several members of `step` in one rollout: what `self(policy, step,
        m)` gives for each m, each episode with its member's weights and sampling stream.

        Episodes are interleaved task-major (task 0 of every member, then task 1, ...), so a
        batch of the episode loop holds about as many rows of every member.
        """
        plan = self.population_plan(step, members)
        per_member = self.batch_size * self.samples
        while len(self._population_envs) < len(plan):
            self._population_envs.append(self._make_env())
        options = [{"task": e.task} for e in plan]

        def assign(started: list[int]) -> None:  # the rows of the episodes that start
            rows = [plan[i] for i in started]
            policy.assign([e.slot for e in rows], [e.stream for e in rows])

        envs = self._population_envs[: len(options)]
        sampling = self.sampling_of(step, members[0])
        batch = rollout(
            policy, envs, sampling, options=options, max_context=self.max_context, assign=assign
        )
        grouped: list[list[Any]] = [[None] * per_member for _ in members]
        for episode, trajectory in zip(plan, batch, strict=True):
            grouped[episode.slot][episode.index] = trajectory
        share = len(members)
        return [
            RolloutBatch(
                trajectories,
                RolloutStats(
                    generation_seconds=batch.stats.generation_seconds / share,
                    env_seconds=batch.stats.env_seconds / share,
                    generated_tokens=sum(t.num_generated_tokens for t in trajectories),
                    generate_calls=batch.stats.generate_calls,
                ),
            )
            for trajectories in grouped
        ]

    def population_plan(self, step: int, members: Sequence[int]) -> list[PlannedEpisode]:
        """The episodes of several members of `step` in the order one episode loop runs
        them: interleaved task-major (task 0 of every member, then task 1, ...), so a batch
        holds about as many rows of every member; each with the stream it samples from when
        its member runs alone (`population`, and `copes.serve` for served steps)."""
        plans = [(self.tasks_of(step, m), self.sampling_of(step, m)) for m in members]
        episodes = []
        for j in range(self.batch_size * self.samples):
            for slot, (tasks, sampling) in enumerate(plans):
                # The stream this episode (index j) samples from when its member runs alone
                # in the episode loop (either backend's).
                seed = sampling.seed if sampling.seed is not None else self.seed
                stream = episode_stream(seed, j)
                episodes.append(
                    PlannedEpisode(slot, members[slot], j, tasks[j // self.samples], stream)
                )
        return episodes

    def close(self) -> None:
        for env in self.envs + self._population_envs:
            env.close()
