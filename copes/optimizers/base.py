"""What every optimizer shares: the rollout callback it is given and the stats it returns.

An optimizer step asks the trainer's `RolloutFn` for trajectories under the current (or a
perturbed) policy and changes the policy's weights. ES/CoPES call it once per population
member with the member's index (the trainer decides which tasks each member sees: the same
batch for all members by default); GRPO calls it once with ``member=None`` and gets
`group_size` samples per task, grouped by `Trajectory.task_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.agents.rollout import RolloutBatch


class RolloutFn(Protocol):
    def __call__(self, policy: Policy, member: int | None = None) -> RolloutBatch: ...


@dataclass
class StepStats:
    """What one optimizer step did: scalar metrics for the log, and where time went."""

    metrics: dict[str, float] = field(default_factory=dict)
    generation_seconds: float = 0.0
    env_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    generated_tokens: int = 0
    log: dict[str, Any] = field(default_factory=dict)  # replayable record (ES: seeds, rewards)


class Optimizer(Protocol):
    def step(self, policy: Policy, rollout: RolloutFn) -> StepStats: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def flag(help: str, default: Any) -> Any:
    """A config dataclass field that is also a `copes-train` flag with this help text."""
    return field(default=default, metadata={"help": help})
