"""`BatchedEvaluator`: an ES/CoPES step's whole population in one batched rollout.

The `PopulationEvaluator` for models whose N perturbed copies fit in memory (the tiny agent
on a CPU, models up to a few billion parameters on one large GPU). Each member's weights are
built exactly as sequential evaluation builds them (the same `WeightSpace.perturb` of the
same seed and subspace, copied into a stack, then restored), all members' episodes run in
one episode loop with each row computing with its own copy (`copes.agents.population`), and
the rewards go to the same `tell`. Only the rollout is batched: noise, partition and update
are untouched, and the logged seeds and rewards replay as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from copes.agents.population import LowRankPopulation
from copes.optimizers.es import MemberResult

if TYPE_CHECKING:
    import torch

    from copes.agents.hf import HFPolicy
    from copes.agents.rollout import RolloutBatch
    from copes.optimizers.perturb import Perturbation

# Of the free memory, what the stacked copies may take (the rest: KV caches, activations).
MEMORY_FRACTION = 0.8


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device` (CUDA: the driver's count; CPU: MemAvailable)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not on Linux: ask psutil (a transformers/accelerate dependency)

    return int(psutil.virtual_memory().available)


def check_population_fits(
    model: Any, members: int, free_bytes: int | None = None, rank: int = 0
) -> tuple[int, int]:
    """(bytes the N copies, or with `rank` > 0 the N members' low-rank factors, need; bytes
    free); raises ValueError when they do not fit."""
    from copes.agents.population import StackedModel

    if rank:
        need = LowRankPopulation.bytes_needed(model, members, rank)
        what = f"{members} members' rank-{rank} factors"
    else:
        need, what = StackedModel.bytes_needed(model, members), f"{members} copies of the weights"
    device = next(model.parameters()).device
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    if need > MEMORY_FRACTION * free:
        gib = 1024**3
        raise ValueError(
            f"--population-eval batched holds {what} "
            f"({need / gib:.2f} GiB) but {device.type} has {free / gib:.2f} GiB free (at most "
            f"{MEMORY_FRACTION:.0%} of it may go to them); use --population-eval sequential "
            "or a smaller --population-size"
        )
    return need, free


class BatchedEvaluator:
    """All members of a step in one episode loop over stacked per-member weights.

    Args:
        policy: the run's `HFPolicy` (its weights are perturbed, copied and restored here).
        rollout: the run's `TaskRollout` (its `population` method runs the members).
        population_size: N, the stack's depth (checked against the free memory now).
        rank: 0 for the paper's full-rank members (N stacked weight copies); r > 0 for
            `--noise lowrank` members, served as N rank-r adapters on the model's own weights.
        batch_size: rows of the episode loop (default: every episode of every member).
        on_batch: called with (member, its trajectories) after each step's rollout.
    """

    def __init__(
        self,
        policy: HFPolicy,
        rollout: Any,
        population_size: int,
        batch_size: int | None = None,
        free_bytes: int | None = None,
        on_batch: Callable[[int, RolloutBatch], None] | None = None,
        rank: int = 0,
    ) -> None:
        from copes.agents.population import PopulationPolicy, StackedModel

        if not hasattr(rollout, "population"):
            raise TypeError("the batched evaluator needs a rollout with `population` (TaskRollout)")
        if not getattr(policy, "supports_episodes", False):
            raise ValueError(
                "--population-eval batched runs members in the transformers episode loop; "
                f"{type(policy).__name__} has none (use --backend hf with a model whose KV "
                "cache the loop supports, or --population-eval sequential)"
            )
        check_population_fits(policy.model, population_size, free_bytes, rank)
        self.policy = policy
        self.rollout = rollout
        self.on_batch = on_batch
        self.rank = rank
        self.stacked: StackedModel | LowRankPopulation = (
            LowRankPopulation(policy.model, policy.weights(), population_size, rank)
            if rank
            else StackedModel(policy.model, population_size)
        )
        episodes = population_size * rollout.batch_size * rollout.samples
        self.population = PopulationPolicy(policy, self.stacked, batch_size or episodes)

    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        if len(members) > self.stacked.members:
            raise ValueError(f"{len(members)} members but room for {self.stacked.members}")
        if any(m.rank != self.rank for m in members):
            raise ValueError(
                f"this evaluator serves rank-{self.rank} members (0: full rank); the step asked "
                f"for ranks {sorted({m.rank for m in members})}"
            )
        weights = self.policy.weights()
        weight_seconds = []
        for slot, member in enumerate(members):
            start = time.perf_counter()
            if isinstance(self.stacked, LowRankPopulation):  # the adapter: no weight change
                self.stacked.load(slot, weights.low_rank_factors(member))
            else:
                weights.perturb(member)
                try:
                    self.stacked.fill(slot)
                finally:
                    weights.restore()
            weight_seconds.append(time.perf_counter() - start)
        batches = self.rollout.population(self.population, step, [m.member for m in members])
        results = []
        for member, batch, seconds in zip(members, batches, weight_seconds, strict=True):
            if self.on_batch is not None:
                self.on_batch(member.member, batch)
            results.append(MemberResult.of(member.member, batch, seconds))
        return results

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        return {}  # the stack is refilled from the updated weights next step
