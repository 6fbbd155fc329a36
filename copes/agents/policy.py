"""The policy interface every optimizer drives and every evaluation samples from.

A policy turns token-id prompts into sampled continuations (with their log-probs) and
exposes its weights to the optimizers. Conversations are turned into token ids by the
policy's `ChatFormat` (copes.agents.chat), so multi-turn rollouts can grow one token
sequence turn by turn and never re-encode what the model generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from copes.agents.chat import ChatFormat
    from copes.agents.episodes import EpisodeFeed

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one turn.

    Attributes:
        max_new_tokens: longest turn, in tokens.
        temperature: 0 means greedy decoding (ES evaluates rewards greedily, Qiu et al.).
        top_p, top_k: nucleus / top-k filtering (1.0 / 0 disable them).
        stop: strings that end the turn (the end of a tool call or answer); kept in the text.
        seed: makes sampling reproducible; None draws from the global generator.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled turn.

    `token_ids` are exactly the ids the model produced (an end-of-turn token included when it
    produced one); `logprobs[i]` is log p(token_ids[i] | prompt, token_ids[:i]) under the
    model's own distribution (temperature 1, no filtering), the quantity GRPO's ratio uses.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_token_ids: list[int] = field(default_factory=list)


class ChatGeneration:
    """`Policy.generate` for every backend: the conversation through the policy's own
    `ChatFormat` (its chat template), then one batched `generate_ids` call."""

    chat: ChatFormat

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        raise NotImplementedError

    def generate(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingConfig,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[Generation]:
        prompts = [self.chat.encode_prompt(c, tools) for c in conversations]
        return self.generate_ids(prompts, sampling)


class Weights(Protocol):
    """The parameters ES/CoPES perturb and update, wherever a backend keeps them.

    `copes.optimizers.perturb.WeightSpace` (transformers, one process) and
    `copes.agents.vllm.weights.VLLMWeights` (every vLLM worker, on its shards) implement it
    with the same noise, bit for bit.
    """

    num_coordinates: int
    num_matrix_rows: int  # rows of the 2-D+ tensors: what --noise lowrank partitions

    def perturb(self, perturbation: Any) -> None: ...

    def restore(self) -> None:
        """Back to the master weights, bit-exact."""
        ...

    def update(
        self, perturbations: Sequence[Any], coefficients: Sequence[float], lr: float
    ) -> None: ...

    def subspace_sizes(self, partition_seed: int, num_subspaces: int) -> list[int]: ...

    def checksum(self) -> str: ...

    def master_state(self) -> dict[str, Any]: ...

    def load_master_state(self, state: dict[str, Any]) -> None: ...

    def sync_from_working(self) -> None:
        """Master <- working weights, after something else changed them."""
        ...

    def memory_bytes(self) -> int: ...


@runtime_checkable
class Policy(Protocol):
    """What optimizers, rollouts, evaluations and the trainer need from a model backend."""

    chat: ChatFormat  # conversation <-> token ids, with the model's chat template
    tokenizer: Any  # saved with every checkpoint

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        """Continue each token-id prompt once; one batched call."""
        ...

    def generate(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingConfig,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[Generation]:
        """Continue each conversation with one assistant turn (chat template applied)."""
        ...

    def weights(self) -> Weights:
        """The parameters ES/CoPES perturb, wherever the backend keeps them."""
        ...

    def export_model(self) -> Any:
        """The live weights as a transformers model, for `save_pretrained`."""
        ...

    def load_weights(self, state: dict[str, Any]) -> None:
        """Replace the live weights with HF-named tensors (e.g. a checkpoint's)."""
        ...

    def close(self) -> None:
        """Release engines, processes and device memory (a no-op where there are none)."""
        ...

    @property
    def max_context(self) -> int:
        """Longest token sequence (prompt + generation) the model accepts."""
        ...

    @property
    def dtype(self) -> Any:
        """The torch dtype the model computes in (recorded with what it generates)."""
        ...


@runtime_checkable
class TrainablePolicy(Policy, Protocol):
    """A policy whose weights gradient methods (GRPO) train: a torch module they own.

    `trainable_model` is the module to train; `set_trainable_model` installs a wrapped one
    (peft's LoRA model) that generation then uses; `weights_changed` says an update changed
    its parameters, so a backend that generates from a copy (vLLM) reloads it.
    """

    @property
    def trainable_model(self) -> Any: ...

    def set_trainable_model(self, model: Any) -> None: ...

    def weights_changed(self) -> None: ...


@runtime_checkable
class EpisodeRunner(Protocol):
    """An optional capability: whole multi-turn episodes in one call, in the policy's own
    continuous-batching loop (`HFPolicy`; a population policy, which serves only through
    its loop, too). The one episode loop (`copes.agents.episodes`) uses it when a policy has
    it and ``supports_episodes`` is true, and otherwise runs turn by turn with
    `generate_ids`. A row that ends its turn leaves, and re-joins when what follows it is
    ready."""

    supports_episodes: bool

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: Callable[[int, Generation], Sequence[int] | None],
        *,
        threads: int = 16,
    ) -> dict[str, float]:
        """Generate turns for every prompt until its episode ends (an `EpisodeFeed`: its
        episodes as they arrive, on its schedule, running its interjections).

        After each turn of episode ``i`` the policy calls ``next_turn(i, generation)`` (from
        worker threads, at most ``threads`` at once, never twice at once for one episode):
        it returns the token ids that follow the turn (tool output, the next assistant
        header), which the policy appends before the episode's next turn, or None when the
        episode is over. ``generation.prompt_token_ids`` is the episode's whole sequence
        before the turn. With a seed, each episode samples from its own stream derived from
        (seed, i). Returns diagnostics (seconds, forward passes, ...).
        """
        ...


@runtime_checkable
class EpisodePolicy(Policy, EpisodeRunner, Protocol):
    """A `Policy` that runs whole episodes in its own loop (`EpisodeRunner`)."""


def runs_episodes(policy: Any) -> bool:
    """Whether `policy` runs whole episodes in its own loop now (an `EpisodeRunner` whose
    `supports_episodes` is true): the typed test every rollout path asks."""
    return isinstance(policy, EpisodeRunner) and bool(policy.supports_episodes)


@runtime_checkable
class PopulationRows(Protocol):
    """A population served as one policy: each row of the next rollout computes with its
    member (`copes.agents.hf.population.PopulationPolicy`, the vLLM LoRA population)."""

    def assign(
        self,
        members: Sequence[int],
        streams: Sequence[int],
        seeds: Sequence[int | None] | None = None,
    ) -> None:
        """Each episode's member slot, its episode-loop stream, its turn-by-turn seed."""
        ...


@runtime_checkable
class TurnPopulation(PopulationRows, Protocol):
    """A population that runs turn by turn (vLLM schedules rows itself): one call per turn
    over the unfinished episodes, each row sampling as its member alone would."""

    def generate_turn(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        episodes: Sequence[int],
        turn: int,
    ) -> list[Generation]: ...
