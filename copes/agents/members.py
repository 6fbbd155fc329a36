"""A step's population served at once: what a backend declares so that ES/CoPES can batch
its members without knowing which backend it is.

A policy that can run N members in one rollout declares `member_batch` (`ServesMembers`);
the batch it returns holds the members' weights (stacked copies or rank-r adapters on
transformers, LoRA adapters in the vLLM engine) and the policy view whose rows compute each
with its own member. `copes.optimizers.batched.BatchedEvaluator` only loads members, runs the
rollout and unloads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from copes.weights import Perturbation


class MemberBatch(Protocol):
    """Up to `members` members of rank `rank` (0: full rank), served by `policy` together."""

    members: int
    rank: int

    @property
    def policy(self) -> Any:
        """What the rollout drives: a population policy (`assign`, then its episode loop),
        each row with its member's weights."""
        ...

    def load(self, members: Sequence[Perturbation]) -> list[float]:
        """Slots 0..len(members)-1 <- these members; the seconds each took."""
        ...

    def unload(self) -> None:
        """After the rollout: nothing else is served with the members."""
        ...

    def close(self) -> None:
        """Release what the batch holds outside this process."""
        ...


class ServesMembers(Protocol):
    """A policy that serves a step's members in one batch (`--population-eval batched`)."""

    def member_batch(
        self, members: int, rank: int, rows: int, free_bytes: int | None = None
    ) -> MemberBatch:
        """A batch of `members` rank-`rank` members whose rollout runs `rows` episodes at once
        (`free_bytes`: the memory to check them against, default what the device has free).
        Raises ValueError when this policy cannot serve them (say why and what to use)."""
        ...


def check_members(batch: MemberBatch, members: Sequence[Perturbation]) -> None:
    """A step's members must fit the batch and be of its rank."""
    if len(members) > batch.members:
        raise ValueError(f"{len(members)} members but room for {batch.members}")
    if any(m.rank != batch.rank for m in members):
        raise ValueError(
            f"this population serves rank-{batch.rank} members (0: full rank); the step asked "
            f"for ranks {sorted({m.rank for m in members})}"
        )
