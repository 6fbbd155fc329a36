"""`VLLMLowRankPopulation`: a step's low-rank members served as LoRA adapters in one vLLM batch.

The vLLM counterpart of `copes.agents.hf.population.LowRankPopulation`. Each member of a
`--noise lowrank` step becomes a PEFT LoRA adapter (`copes.agents.adapters`) written by the
engine's rank-0 worker from the member's seed, on the device the in-place member and the
update draw it on; every episode's rows then carry its member's `LoRARequest`, and vLLM's
multi-LoRA kernels (Punica) compute ``W x + A_m (B_m^T x)`` for all members in one batch on the
unperturbed weights. The episodes run in the engine's continuous batching (the policy's
`generate_episodes`), each with its member's adapter and the sampling stream its member's
rollout alone gives it, so sampled episodes match too, not only greedy ones.

Every step's adapters get new names and ids: vLLM caches adapters by id and keys prefix
blocks by adapter name, so a reused one could serve the last step's member. Right after the
step's rollout (`BatchedEvaluator` calls `unload`) the adapters are removed from the engine,
their slots zeroed and their folders deleted, before the base model serves anything else.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from copes.agents.adapters import adapter_targets
from copes.agents.members import check_members
from copes.agents.vllm.scratch import scratch_dir

if TYPE_CHECKING:
    from copes.agents.chat import ChatFormat
    from copes.agents.episodes import EpisodeFeed, NextTurn, TurnLimits
    from copes.agents.policy import Generation, SamplingConfig
    from copes.weights import Perturbation


# Why vLLM serves only low-rank members in one batch; `copes-train` (a UserError, before any
# engine starts) and `VLLMPolicy.member_batch` (a ValueError, for the Python API) both say it.
FULL_RANK_ON_VLLM = (
    "--population-eval batched on --backend vllm serves --noise lowrank members as LoRA "
    "adapters (full-rank members would need N weight copies, which vLLM does not hold): add "
    "--noise lowrank, or use --population-eval sequential"
)


class AdapterHost(Protocol):
    """What the LoRA population reads of the engine's policy (`VLLMPolicy`): declared here so
    that the policy builds its populations without an import circle."""

    llm: Any  # the vllm.LLM
    chat: ChatFormat
    tokenizer: Any

    @property
    def max_context(self) -> int: ...

    def skeleton(self) -> Any: ...

    def weights(self) -> Any: ...

    def new_adapter_id(self) -> int: ...

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: NextTurn,
        *,
        threads: int = 16,
        turn_limits: TurnLimits | None = None,
        streams: Sequence[int] | None = None,
        adapters: Sequence[Any] | None = None,
    ) -> dict[str, float]: ...


def adapter_bytes(skeleton: Any, targets: Sequence[Sequence[str]], rank: int) -> int:
    """Bytes of one member's adapter file: (rows + cols) x r fp32 factors per target (an
    upper bound: factors in bfloat16 take half)."""
    per_rank = 0
    for matrix, _, _ in targets:
        shape = skeleton.get_parameter(matrix).shape
        per_rank += shape[0] + shape[1:].numel()
    return 4 * rank * per_rank


def lora_capacity(policy: AdapterHost) -> tuple[int, int]:
    """(adapters one batch may hold, their largest rank) of the policy's engine; (0, 0)
    when it was started without LoRA."""
    config = policy.llm.llm_engine.vllm_config.lora_config
    if config is None:
        return 0, 0
    return int(config.max_loras), int(config.max_lora_rank)


class VLLMLowRankPopulation:
    """Up to `members` rank-`rank` members of a step, one LoRA adapter each, as a policy
    that `TaskRollout.population` drives (`assign`, then one episode loop).

    Args:
        policy: a `VLLMPolicy` started with `lora_members >= members`, `lora_rank >= rank`.
        members: adapters served at once (the population size N).
        rank: the members' rank r (`--noise-rank`).
    """

    supports_episodes = True  # in the engine's continuous batching, a row with its adapter
    serves_members = True
    trainable = False

    def __init__(self, policy: AdapterHost, members: int, rank: int) -> None:
        slots, max_rank = lora_capacity(policy)
        if slots < members or max_rank < rank:
            raise ValueError(
                f"the vLLM engine serves {slots} LoRA adapter(s) of rank <= {max_rank}, but "
                f"{members} members of rank {rank} need one each: start it with "
                f"VLLMPolicy.from_pretrained(..., lora_members={members}, lora_rank={rank})"
            )
        self.base, self.members, self.rank = policy, members, rank
        policy.weights()  # the workers' weight space: it draws the members' factors
        self.targets = [[t.matrix, t.module, t.kind] for t in adapter_targets(policy.skeleton())]
        self.chat, self.tokenizer = policy.chat, policy.tokenizer
        # Shared memory when it has room, as for weight files: a step writes every member.
        step_bytes = members * adapter_bytes(policy.skeleton(), self.targets, rank)
        self._folder = Path(tempfile.mkdtemp(prefix="copes-adapters-", dir=scratch_dir(step_bytes)))
        weakref.finalize(self, shutil.rmtree, self._folder, True)  # also when never closed
        self._adapters: list[Any] = []  # LoRARequest of each slot
        self._owners: list[int] = []
        self._streams: list[int] = []

    @property
    def max_context(self) -> int:
        return self.base.max_context

    @property
    def policy(self) -> VLLMLowRankPopulation:
        return self  # the engine's adapters hold the members, and this object runs their rows

    def load(self, members: Sequence[Perturbation]) -> list[float]:
        """Slots 0..len(members)-1 <- these members' adapters (the last step's are dropped);
        the workers write them all in one call, so each member is given an equal share of its
        seconds."""
        from vllm.lora.request import LoRARequest

        from copes.agents.vllm.worker import encode_perturbation

        check_members(self, members)
        start = time.perf_counter()
        self.unload()
        ids = [self.base.new_adapter_id() for _ in members]
        folders = [str(self._folder / f"member-{ident}") for ident in ids]
        encoded = [encode_perturbation(member) for member in members]
        written = self.base.llm.collective_rpc(
            "copes_write_adapters", args=(encoded, folders, self.targets)
        )[0]  # rank 0's folders: one round trip for the whole step
        self._adapters = [
            LoRARequest(f"copes-member-{ident}", ident, folder)
            for ident, folder in zip(ids, written, strict=True)
        ]
        return [(time.perf_counter() - start) / len(members)] * len(members)

    def unload(self) -> None:
        """Drop the loaded adapters from the engine (their slots zeroed: see
        `CopesWorkerExtension.copes_clear_adapter_slots`) and their folders from disk."""
        if not self._adapters:
            return
        engine = self.base.llm.llm_engine
        loaded = set(engine.list_loras())
        for adapter in self._adapters:
            if adapter.lora_int_id in loaded:
                engine.remove_lora(adapter.lora_int_id)
            shutil.rmtree(adapter.lora_path, ignore_errors=True)
        self._adapters = []
        self.base.llm.collective_rpc("copes_clear_adapter_slots")

    def assign(self, members: Sequence[int], streams: Sequence[int]) -> None:
        """Each episode's slot and the sampling stream its member's rollout alone gives it
        (`TaskRollout.population`)."""
        if len(streams) != len(members):
            raise ValueError("one member and one stream per episode")
        if any(not 0 <= m < len(self._adapters) for m in members):
            raise ValueError(f"episodes assigned to slots {sorted(set(members))}; loaded: "
                             f"{len(self._adapters)} (call load() first)")  # fmt: skip
        self._owners, self._streams = list(members), list(streams)

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: NextTurn,
        *,
        threads: int = 16,
        turn_limits: TurnLimits | None = None,
    ) -> dict[str, float]:
        """The assigned episodes in the engine's continuous batching, each row with its
        member's adapter and stream."""
        count = len(prompts) if isinstance(prompts, Sequence) else prompts.count
        if count != len(self._owners):
            raise ValueError(
                f"{count} episodes but {len(self._owners)} assigned members: call assign() "
                "before each rollout"
            )
        return self.base.generate_episodes(
            prompts, sampling, next_turn, threads=threads, turn_limits=turn_limits,
            streams=self._streams, adapters=[self._adapters[m] for m in self._owners],
        )  # fmt: skip

    def generate_ids(self, *args: Any, **kwargs: Any) -> list[Generation]:
        raise NotImplementedError("a population is served through its episode loop only")

    def close(self) -> None:
        self.unload()
        shutil.rmtree(self._folder, ignore_errors=True)


__all__ = ["FULL_RANK_ON_VLLM", "VLLMLowRankPopulation", "adapter_bytes", "lora_capacity"]
