"""CoPES — cooperative parameter-subspace evolution strategies — and ES, its K = 1 case.

Source: Wang et al., "Cooperative Coevolution for Resource-Constrained Agentic LLM
Post-Training" (arXiv 2608.02391, 2026); ES as in Qiu et al. 2025, "Evolution Strategies at
Scale: LLM Fine-Tuning Beyond Reinforcement Learning".

One step with population N (`population_size`), K subspaces (`num_subspaces`), noise scale
sigma and learning rate alpha:

1. draw a fresh random partition of the coordinates into K equal subspaces S_1..S_K;
2. give each subspace N_k = N / K members; member (k, i) adds sigma_k * eps_{k,i} to the
   coordinates in S_k only, with sigma_k = sqrt(K) * sigma (same expected squared norm as a
   full-space perturbation);
3. score every perturbed model on the same task batch: r_{k,i} = mean reward;
4. standardize all N rewards jointly: r_hat = (r - mean) / std (one mean, one std);
5. g_k = (1 / N_k) * sum_i r_hat_{k,i} eps_{k,i} on S_k, and theta += alpha * sum_k P_k g_k.

With K = 1 this is Qiu et al.'s update theta += alpha * (1/N) * sum_n z_n eps_n ("learning-
rate digestion": no 1/sigma factor; alpha absorbs it). Noise is never stored: members are
(seed, subspace) pairs and the engine (`copes.weights`) regenerates the noise.
The optimizer is ask/tell: `ask(step)` names the members, `tell(step, members, rewards)`
applies the update, and `step()` does both around the rollouts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from copes.optimizers.base import (
    MemberResult,
    PopulationEvaluator,
    RolloutFn,
    StepStats,
    load_checkpoint_weights,
)
from copes.optimizers.configs import CoPESConfig, Schedule
from copes.seeding import derive_seed
from copes.weights import (
    Perturbation,
    Subspace,
    WeightSpace,
    sigma_for_subspaces,
)

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.agents.rollout import RolloutBatch


def _scheduled(base: float, kind: Schedule, step: int, total: int, final: float) -> float:
    if kind == "constant" or total <= 0:
        return base
    progress = min(step / total, 1.0)
    if kind == "linear":
        return base * (1 - (1 - final) * progress)
    return base * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


def centered_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks mapped to [-0.5, 0.5] (ties get their mean rank)."""
    if values.size < 2:
        return np.zeros_like(values, dtype=np.float64)
    order = values.argsort(kind="stable")
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.arange(values.size, dtype=np.float64)
    for value in np.unique(values):  # average ties so equal rewards get equal weight
        tie = values == value
        ranks[tie] = ranks[tie].mean()
    return ranks / (values.size - 1) - 0.5


def standardize(values: np.ndarray) -> np.ndarray:
    """z-scores; all zeros when every value is equal (no signal, no update)."""
    std = values.std()
    if std == 0 or not np.isfinite(std):
        return np.zeros_like(values, dtype=np.float64)
    return (values - values.mean()) / std


def _undone_rate(results: Sequence[MemberResult]) -> dict[str, float]:
    """The step's share of episodes refused for undone arithmetic, where every member's
    grades said (left out otherwise)."""
    from copes.agents.rollout import mean_of_said

    rate = mean_of_said(r.undone_arithmetic for r in results)
    return {} if rate is None else {"undone_arithmetic_rate": rate}


def evaluate_member(
    policy: Policy,
    rollout: RolloutFn,
    member: Perturbation,
    step: int,
    on_batch: Callable[[int, RolloutBatch], None] | None = None,
) -> MemberResult:
    """Perturb the policy's weights, roll out the member's task batch, restore (always);
    `on_batch(member, batch)` sees the trajectories (diagnostics, benchmarks)."""
    weights = policy.weights()
    start = time.perf_counter()
    weights.perturb(member)
    weight_seconds = time.perf_counter() - start
    try:
        batch = rollout(policy, step, member.member)
    finally:
        start = time.perf_counter()
        weights.restore()
        weight_seconds += time.perf_counter() - start
    if on_batch is not None:
        on_batch(member.member, batch)
    return MemberResult.of_batch(member.member, batch, weight_seconds)


class LocalEvaluator:
    """Members evaluated one after another in this process, on the policy's own weights
    (`on_batch`: as in `evaluate_member`)."""

    def __init__(
        self,
        policy: Policy,
        rollout: RolloutFn,
        on_batch: Callable[[int, RolloutBatch], None] | None = None,
    ) -> None:
        self.policy = policy
        self.rollout = rollout
        self.on_batch = on_batch

    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        from tqdm.auto import tqdm

        return [
            evaluate_member(self.policy, self.rollout, member, step, self.on_batch)
            for member in tqdm(members, desc=f"step {step} members", leave=False, disable=None)
        ]

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        return {}  # no replicas

    def close(self) -> None:
        """Nothing to release: the members ran on the policy's own weights."""


class CoPES:
    """CoPES (and ES with K = 1) as an ask/tell optimizer over a `WeightSpace`.

    A step asks for its members, has its `PopulationEvaluator` score them, and tells the
    update to the weights. The evaluator is given here, once, by whoever builds the run
    (`copes.train.build.build_evaluator`: one batch, the server, Ray actors); None evaluates
    the members one after another in this process, on the policy and rollout `step` gets.
    """

    replays = True  # a step is its seeds and rewards: the log re-applies it exactly

    def __init__(
        self, config: CoPESConfig | None = None, evaluator: PopulationEvaluator | None = None
    ) -> None:
        self.config = config or CoPESConfig()
        self.samples_per_task = self.config.samples_per_task
        self.step_count = 0
        self.evaluator = evaluator

    # ------------------------------------------------------------------ ask / tell
    def sigma_at(self, step: int) -> float:
        c = self.config
        return _scheduled(
            c.sigma, c.sigma_schedule, step, c.schedule_steps, c.schedule_final_fraction
        )

    def learning_rate_at(self, step: int) -> float:
        c = self.config
        return _scheduled(
            c.learning_rate, c.lr_schedule, step, c.schedule_steps, c.schedule_final_fraction
        )

    def ask(self, step: int) -> list[Perturbation]:
        """The N members of `step`: member m belongs to subspace m // N_k."""
        c = self.config
        partition_seed = derive_seed("partition", c.seed, step)
        sigma_k = sigma_for_subspaces(self.sigma_at(step), c.num_subspaces, c.scale_sigma)
        members = []
        for m in range(c.population_size):
            k, i = divmod(m, c.members_per_subspace)
            subspace = Subspace(partition_seed, c.num_subspaces, k)
            if c.antithetic:
                seed, sign = derive_seed("member", c.seed, step, k, i // 2), 1 - 2 * (i % 2)
            else:
                seed, sign = derive_seed("member", c.seed, step, m), 1
            members.append(Perturbation(m, seed, subspace, sign, sigma_k, c.perturbation_rank))
        return members

    def coefficients(self, rewards: Sequence[float]) -> np.ndarray:
        """r_hat_{k,i} / N_k for every member, in member order."""
        c = self.config
        r = np.asarray(rewards, dtype=np.float64)
        if r.shape != (c.population_size,):
            raise ValueError(f"expected {c.population_size} rewards, got shape {r.shape}")
        if not np.all(np.isfinite(r)):
            raise ValueError("rewards must be finite")
        groups = (
            [slice(None)]
            if c.standardization == "joint"
            else [
                slice(k * c.members_per_subspace, (k + 1) * c.members_per_subspace)
                for k in range(c.num_subspaces)
            ]
        )
        z = np.zeros_like(r)
        for group in groups:
            values = centered_ranks(r[group]) if c.rank_shaping else r[group]
            z[group] = standardize(values)
        return z / c.members_per_subspace

    def tell(
        self,
        step: int,
        members: Sequence[Perturbation],
        rewards: Sequence[float],
        weights: WeightSpace,
    ) -> np.ndarray:
        """Apply the update of `step` to `weights`; returns the coefficients used."""
        k = self.config.num_subspaces
        if weights.num_coordinates < k:
            raise ValueError(
                f"K={k} subspaces but only {weights.num_coordinates} coordinates: every "
                "subspace needs at least one"
            )
        if self.config.noise == "lowrank" and weights.num_matrix_rows < k:
            raise ValueError(
                f"K={k} subspaces but only {weights.num_matrix_rows} matrix rows: --noise "
                "lowrank partitions rows, and every subspace needs at least one"
            )
        coefficients = self.coefficients(rewards)
        weights.update(members, coefficients.tolist(), self.learning_rate_at(step))
        self.step_count = step + 1
        return coefficients

    def replay(self, entries: Sequence[dict[str, Any]], policy: Any) -> None:
        """Re-apply logged steps (their `step` and `rewards`) without any rollout; `policy`
        may also be a bare `WeightSpace`."""
        weights = policy if isinstance(policy, WeightSpace) else policy.weights()
        for entry in entries:
            step = int(entry["step"])
            self.tell(step, self.ask(step), entry["rewards"], weights)

    # ------------------------------------------------------------------ one training step
    def step(self, policy: Policy, rollout: RolloutFn, step: int | None = None) -> StepStats:
        """Evaluate every member of step `step` (default: the one after the last applied)
        on the rollout's task batch, then update."""
        step = self.step_count if step is None else step
        members = self.ask(step)
        evaluator = self.evaluator or LocalEvaluator(policy, rollout)
        results = evaluator.evaluate(step, members)
        rewards = [r.reward for r in results]
        start = time.perf_counter()
        self.tell(step, members, rewards, policy.weights())
        update_seconds = time.perf_counter() - start
        extra = evaluator.applied(step, rewards)
        stats = self.step_stats(step, members, results, update_seconds)
        stats.metrics.update(extra)
        return stats

    def step_stats(
        self,
        step: int,
        members: Sequence[Perturbation],
        results: Sequence[MemberResult],
        update_seconds: float,
    ) -> StepStats:
        """The log record of a step from its members' results (in member order)."""
        if [r.member for r in results] != [m.member for m in members]:
            raise ValueError("one result per member, in member order, is required")
        rewards = [r.reward for r in results]
        weight_seconds = sum(r.weight_seconds for r in results)
        stats = StepStats(
            generation_seconds=sum(r.generation_seconds for r in results),
            env_seconds=sum(r.env_seconds for r in results),
            optimizer_seconds=weight_seconds + update_seconds,
            generated_tokens=sum(r.generated_tokens for r in results),
        )
        r = np.asarray(rewards)
        k, nk = self.config.num_subspaces, self.config.members_per_subspace
        stats.metrics = {
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std()),
            "reward_max": float(r.max()),
            "accuracy": float(np.mean([res.accuracy for res in results])),
            **_undone_rate(results),
            "sigma": self.sigma_at(step),
            "learning_rate": self.learning_rate_at(step),
            "perturb_restore_seconds": weight_seconds,
            "update_seconds": update_seconds,
            **{f"reward_subspace_{j}": float(r[j * nk : (j + 1) * nk].mean()) for j in range(k)},
        }
        stats.log = {"step": step, "rewards": rewards, "seeds": [m.seed for m in members]}
        return stats

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": "copes", "config": asdict(self.config), "step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in fields(CoPESConfig)}
        self.config = CoPESConfig(**{k: v for k, v in state["config"].items() if k in known})
        self.step_count = int(state["step_count"])

    # ------------------------------------------------------------------ weights in and out
    def export_model(self, policy: Policy) -> Any:
        return policy.export_model()  # type: ignore[attr-defined]

    def master_state(self, policy: Policy, model: Any) -> dict[str, Any] | None:
        """The fp32 master, when the exported `model`'s dtype cannot hold it (bf16)."""
        import torch

        if all(p.dtype == torch.float32 for p in model.parameters()):
            return None
        return policy.weights().master_state()

    def load_weights(self, policy: Policy, checkpoint: Any) -> None:
        load_checkpoint_weights(policy, checkpoint)
        policy.weights().sync_from_working()

    def fingerprint(self, policy: Policy) -> str | None:
        return policy.weights().checksum()
