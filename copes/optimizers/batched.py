"""`BatchedEvaluator`: an ES/CoPES step's whole population in one batched rollout.

The `PopulationEvaluator` for models whose N perturbed copies fit in memory (the tiny agent
on a CPU, models up to a few billion parameters on one large GPU). Each member's weights are
built exactly as sequential evaluation builds them (the same `WeightSpace.perturb` of the
same seed and subspace, copied into a stack, then restored), all members' episodes run in
one episode loop with each row computing with its own copy (`copes.agents.hf.population`), and
the rewards go to the same `tell`. Only the rollout is batched: noise, partition and update
are untouched, and the logged seeds and rewards replay as before.

`--noise lowrank` members are served without weight copies: as per-row adapters in the
transformers episode loop (`LowRankPopulation`), or on vLLM as one LoRA adapter per member
in one engine batch (`copes.agents.vllm.population`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from copes.agents.episodes import runs_episodes
from copes.agents.hf.population import LowRankPopulation
from copes.optimizers.base import MemberResult, PopulationRollout

if TYPE_CHECKING:
    import torch

    from copes.agents.hf.policy import HFPolicy
    from copes.agents.rollout import RolloutBatch
    from copes.optimizers.perturb import Perturbation

# Of the free memory, what the stacked copies may take (the rest: KV caches, activations).
MEMORY_FRACTION = 0.8

# Why vLLM serves only low-rank members in one batch; `copes-train` (a UserError, before any
# engine starts) and `BatchedEvaluator` (a ValueError, for the Python API) both say it.
FULL_RANK_ON_VLLM = (
    "--population-eval batched on --backend vllm serves --noise lowrank members as LoRA "
    "adapters (full-rank members would need N weight copies, which vLLM does not hold): add "
    "--noise lowrank, or use --population-eval sequential"
)


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
    from copes.agents.hf.population import StackedModel

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
    """All members of a step in one batched rollout: one episode loop over stacked
    per-member weights or adapters (transformers), or one vLLM batch of per-member LoRA
    adapters (`--backend vllm --noise lowrank`, `copes.agents.vllm.population`).

    Args:
        policy: the run's `HFPolicy` (its weights are perturbed, copied and restored here)
            or `VLLMPolicy` (started with `lora_members`, `lora_rank`).
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
        from copes.agents.hf.population import PopulationPolicy, StackedModel
        from copes.agents.vllm.policy import VLLMPolicy

        if not isinstance(rollout, PopulationRollout):
            raise TypeError("the batched evaluator needs a rollout with `population` (TaskRollout)")
        self.policy = policy
        self.rollout = rollout
        self.on_batch = on_batch
        self.rank = rank
        # On vLLM the members are the engine's LoRA adapters: loaded by its workers, and
        # unloaded right after the rollout so that nothing else is served with them.
        self.on_vllm = isinstance(policy, VLLMPolicy)
        if self.on_vllm:
            from copes.agents.vllm.population import VLLMLowRankPopulation

            if not rank:
                raise ValueError(FULL_RANK_ON_VLLM)
            # vLLM sizes its LoRA buffers itself, inside --gpu-memory-utilization. The
            # engine's adapters hold the members, and the same object runs their rows.
            self.member_weights: Any = VLLMLowRankPopulation(policy, population_size, rank)
            self.population_policy: Any = self.member_weights
            return
        if not runs_episodes(policy):
            raise ValueError(
                "--population-eval batched runs members in the transformers episode loop; "
                f"{type(policy).__name__} has none (use --backend hf with a model whose KV "
                "cache the loop supports, or --population-eval sequential)"
            )
        check_population_fits(policy.model, population_size, free_bytes, rank)
        # Where the members' weights live (N stacked copies, or N rank-r adapters) and the
        # policy whose every row computes with its own member.
        self.member_weights = (
            LowRankPopulation(policy.model, policy.weights(), population_size, rank)
            if rank
            else StackedModel(policy.model, population_size)
        )
        episodes = population_size * rollout.batch_size * rollout.samples
        self.population_policy = PopulationPolicy(
            policy, self.member_weights, batch_size or episodes
        )

    def check_members(self, members: Sequence[Perturbation]) -> None:
        """A step's members must fit the population and be of its rank."""
        if len(members) > self.member_weights.members:
            raise ValueError(f"{len(members)} members but room for {self.member_weights.members}")
        if any(m.rank != self.rank for m in members):
            raise ValueError(
                f"this evaluator serves rank-{self.rank} members (0: full rank); the step asked "
                f"for ranks {sorted({m.rank for m in members})}"
            )

    def evaluate(self, step: int, members: Sequence[Perturbation]) -> list[MemberResult]:
        self.check_members(members)
        weight_seconds = self._load(members)
        try:
            batches = self.rollout.population(
                self.population_policy, step, [m.member for m in members]
            )
        finally:
            if self.on_vllm:
                self.member_weights.unload()
        results = []
        for member, batch, seconds in zip(members, batches, weight_seconds, strict=True):
            if self.on_batch is not None:
                self.on_batch(member.member, batch)
            results.append(MemberResult.of_batch(member.member, batch, seconds))
        return results

    def _load(self, members: Sequence[Perturbation]) -> list[float]:
        """Put every member into its slot; returns the seconds each took."""
        if self.on_vllm:  # the workers write the members' adapters, all in one call
            start = time.perf_counter()
            self.member_weights.load(members)
            return [(time.perf_counter() - start) / len(members)] * len(members)
        weights = self.policy.weights()
        seconds = []
        for slot, member in enumerate(members):
            start = time.perf_counter()
            if self.rank:  # the adapter: no weight change
                self.member_weights.load(slot, weights.low_rank_factors(member))
            else:
                weights.perturb(member)
                try:
                    self.member_weights.fill(slot)
                finally:
                    weights.restore()
            seconds.append(time.perf_counter() - start)
        return seconds

    def applied(self, step: int, rewards: Sequence[float]) -> dict[str, float]:
        return {}  # the stack is refilled from the updated weights next step

    def close(self) -> None:
        """Release what the population holds outside this process (vLLM's adapters)."""
        if self.on_vllm:
            self.member_weights.close()
