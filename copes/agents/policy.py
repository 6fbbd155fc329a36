"""The policy interface every optimizer drives and every evaluation samples from.

A policy turns token-id prompts into sampled continuations (with their log-probs) and
exposes its weights to the optimizers. Conversations are turned into token ids by the
policy's `ChatFormat` (copes.agents.chat), so multi-turn rollouts can grow one token
sequence turn by turn and never re-encode what the model generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from copes.agents.chat import ChatFormat

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
    `ChatFormat` (its chat template), then one batched `generate_ids` call; and the
    capabilities a plain policy declares (none: it is told otherwise by its backend)."""

    chat: ChatFormat
    supports_episodes: bool = False
    serves_members: bool = False
    trainable: bool = False

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

    `copes.weights.WeightSpace` (transformers, one process) and
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


class Policy(Protocol):
    """What optimizers, rollouts, evaluations and the trainer need from a model backend.

    What a policy can do beyond generating is declared, never probed: `supports_episodes`
    (whole episodes in its own loop: `copes.agents.episodes.EpisodeRunner`),
    `serves_members` (a population: each row computes with its own member, told by
    `assign`: `PopulationRows`), `trainable` (GRPO trains it: `TrainablePolicy`).
    """

    chat: ChatFormat  # conversation <-> token ids, with the model's chat template
    tokenizer: Any  # saved with every checkpoint
    supports_episodes: bool
    serves_members: bool
    trainable: bool

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
