"""What every optimizer shares: the rollout callback it is given and the stats it returns.

An optimizer step asks the trainer's `RolloutFn` for trajectories under the current (or a
perturbed) policy and changes the policy's weights. ES/CoPES call it once per population
member with the member's index (the trainer decides which tasks each member sees: the same
batch for all members by default); GRPO calls it once with ``member=None`` and gets
`group_size` samples per task, grouped by `Trajectory.task_id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.agents.rollout import RolloutBatch
    from copes.weights import Perturbation


class RolloutFn(Protocol):
    """The trajectories of (step, member): which tasks and sampling seeds follow from them
    alone (no call-order state). `member` is an ES member's index, None for a step's shared
    batch (GRPO: `samples_per_task` samples of each task, set where the rollout is built)."""

    def __call__(self, policy: Policy, step: int, member: int | None = None) -> RolloutBatch: ...


class PopulationRollout(RolloutFn, Protocol):
    """A rollout that also runs several members' batches of a step in one rollout of a
    population policy (`copes.train.task_rollout.TaskRollout`)."""

    batch_size: int
    samples: int

    def population(self, policy: Any, step: int, members: Sequence[int]) -> list[RolloutBatch]: ...


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
    """All the trainer knows of an optimizer (`copes.train` never asks which one runs).

    `samples_per_task`: trajectories per task in a step's batch (GRPO's group; ES: 1).
    `replays`: whether a step's `StepStats.log` re-applies the step without rollouts (ES:
    seeds and rewards); the trainer then fsyncs every record before anything else, and a
    resume hands the records after the last checkpoint to `replay`.
    """

    samples_per_task: int
    replays: bool

    def step(self, policy: Policy, rollout: RolloutFn, step: int) -> StepStats:
        """Step number `step` (the trainer's counter, the only one)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export_model(self, policy: Policy) -> Any:
        """The trained model as a plain transformers model, for `save_pretrained`."""
        ...

    def master_state(self, policy: Policy, model: Any) -> dict[str, Any] | None:
        """Weights the exported `model` cannot hold exactly (ES: the fp32 master of a bf16
        model), saved beside it; None when there are none."""
        ...

    def load_weights(self, policy: Policy, checkpoint: Path) -> None:
        """A checkpoint's weights into the live policy (before `load_state_dict`)."""
        ...

    def replay(self, records: Sequence[dict[str, Any]], policy: Policy) -> None:
        """Re-apply logged steps (only called when `replays`)."""
        ...

    def fingerprint(self, policy: Policy) -> str | None:
        """A checksum of the trained state that replicas must agree on (None: none kept)."""
        ...


@dataclass
class MemberResult:
    """One evaluated member: its reward (mean over its task batch) and where the time went.

    Small and picklable, so a replica in another process returns this instead of trajectories.
    """

    member: int
    reward: float
    accuracy: float
    generation_seconds: float = 0.0
    env_seconds: float = 0.0
    generated_tokens: int = 0
    weight_seconds: float = 0.0  # perturb + restore
    # Share of episodes refused for arithmetic left undone (issue 48); None where the grades
    # do not say (rewards from an outside harness).
    undone_arithmetic: float | None = None

    @classmethod
    def of(
        cls,
        member: int,
        rewards: Sequence[float],
        correct: Sequence[bool],
        *,
        generation_seconds: float,
        env_seconds: float,
        generated_tokens: int,
        weight_seconds: float,
        undone_arithmetic: float | None = None,
    ) -> MemberResult:
        """The result of `member` from its episodes' rewards and verdicts: the member's
        reward is their mean (0 for no episodes), its accuracy the share correct."""
        return cls(
            member=member,
            reward=float(np.mean(rewards)) if len(rewards) else 0.0,
            accuracy=float(np.mean(correct)) if len(correct) else 0.0,
            generation_seconds=generation_seconds,
            env_seconds=env_seconds,
            generated_tokens=generated_tokens,
            weight_seconds=weight_seconds,
            undone_arithmetic=undone_arithmetic,
        )

    @classmethod
    def of_batch(cls, member: int, batch: RolloutBatch, weight_seconds: float) -> MemberResult:
        """`of` a rollout batch (its trajectories and stats)."""
        from copes.agents.rollout import undone_arithmetic_rate

        return cls.of(
            member, [t.reward for t in batch], [t.correct for t in batch],
            generation_seconds=batch.stats.generation_seconds,
            env_seconds=batch.stats.env_seconds,
            generated_tokens=batch.stats.generated_tokens, weight_seconds=weight_seconds,
            undone_arithmetic=undone_arithmetic_rate(list(batch)),
        )  # fmt: skip


class PopulationEvaluator(Protocol):
    """Where an ES/CoPES step's members are evaluated: one after another in this process
    (`LocalEvaluator`), all in one batch (`copes.optimizers.batched.BatchedEvaluator`), as
    served sessions (`copes.serve.ServedEvaluator`) or on Ray actors
    (`copes.distributed.RayPopulation`). Chosen where a run is built and given to the
    optimizer when it is constructed."""

    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        """One result per member, in member order."""
        ...

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        """The update of `step` was applied here: bring replicas along; extra metrics."""
        ...

    def close(self) -> None:
        """Release what it holds outside this process (actors, engine adapters)."""
        ...


def load_checkpoint_weights(policy: Policy, checkpoint: Path) -> None:
    """A checkpoint folder's transformers weights into the live policy."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    policy.load_weights(loaded.state_dict())  # type: ignore[attr-defined]
