"""`BatchedEvaluator`: an ES/CoPES step's whole population in one batched rollout.

For models whose N members fit in memory at once (the tiny agent on a CPU, models up to a
few billion parameters on one large GPU). The policy serves the members (`member_batch`,
declared by the backends: `copes.agents.members`): N stacked weight copies or N rank-r
adapters in the transformers episode loop, or N LoRA adapters in one vLLM batch. Each
member's weights are built exactly as sequential evaluation builds them, all members'
episodes run in one rollout with each row computing with its own member, and the rewards go
to the same `tell`. Only the rollout is batched: noise, partition and update are untouched,
and the logged seeds and rewards replay as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from copes.agents.members import check_members
from copes.optimizers.base import MemberResult, PopulationRollout

if TYPE_CHECKING:
    from copes.agents.members import ServesMembers
    from copes.agents.rollout import RolloutBatch
    from copes.weights import Perturbation


class BatchedEvaluator:
    """All members of a step in one batched rollout, served by the policy's `member_batch`.

    Args:
        policy: the run's policy; it must declare `member_batch` (`ServesMembers`: the
            transformers and vLLM policies), which refuses members it cannot serve.
        rollout: the run's `TaskRollout` (its `population` method runs the members).
        population_size: N, the batch's slots (checked against the free memory now).
        rank: 0 for the paper's full-rank members; r > 0 for `--noise lowrank` members.
        batch_size: rows of the episode loop (default: every episode of every member).
        free_bytes: the memory to check the members against (default: what is free).
        on_batch: called with (member, its trajectories) after each step's rollout.
    """

    def __init__(
        self,
        policy: ServesMembers,
        rollout: PopulationRollout,
        population_size: int,
        batch_size: int | None = None,
        free_bytes: int | None = None,
        on_batch: Callable[[int, RolloutBatch], None] | None = None,
        rank: int = 0,
    ) -> None:
        self.rollout = rollout
        self.on_batch = on_batch
        episodes = population_size * rollout.batch_size * rollout.samples
        rows = batch_size or episodes
        self.members = policy.member_batch(population_size, rank, rows, free_bytes)

    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        check_members(self.members, members)
        weight_seconds = self.members.load(members)
        try:
            batches = self.rollout.population(
                self.members.policy, step, [m.member for m in members]
            )
        finally:
            self.members.unload()  # nothing else is served with the members
        results = []
        for member, batch, seconds in zip(members, batches, weight_seconds, strict=True):
            if self.on_batch is not None:
                self.on_batch(member.member, batch)
            results.append(MemberResult.of_batch(member.member, batch, seconds))
        return results

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        return {}  # the members are rebuilt from the updated weights next step

    def close(self) -> None:
        """Release what the population holds outside this process (vLLM's adapters)."""
        self.members.close()
