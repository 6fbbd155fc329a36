"""`HFPolicy`: the transformers backend (CPU or GPU, fp32 or bf16).

Batched sampling over left-padded prompts with `model.generate`, stop strings, seeded
sampling, and per-token log-probs of what was generated under the model's own distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from copes.agents.chat import ChatFormat
from copes.agents.hf.kv_batch import supports_kv_batch
from copes.agents.models import resolve_model_path
from copes.agents.policy import ChatGeneration, FinishReason, Generation, SamplingConfig

if TYPE_CHECKING:
    from copes.agents.episodes import EpisodeFeed
    from copes.agents.hf.population import HFMemberBatch
    from copes.weights import WeightSpace

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    # CPU runs that must agree across machines: float64 results differ between CPU kernels
    # only far below any greedy decision (tests/train/test_pinned_runs.py).
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFPolicy(ChatGeneration):
    """A transformers causal LM and its tokenizer behind the `Policy` interface.

    Args:
        model: a causal LM (eval mode is set here; gradients are the optimizer's business).
        tokenizer: its tokenizer, with a chat template.
        batch_size: prompts per `generate` call; larger batches are split.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 64,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos_ids = self._collect_eos_ids()
        self.chat = ChatFormat(
            tokenizer, end_of_turn_ids=self.eos_ids, template_kwargs=chat_template_kwargs
        )
        self._weights: WeightSpace | None = None
        self._episodes_checked: tuple[Any, bool] = (None, False)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 64,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> HFPolicy:
        """Load from a hub id, a local Hugging Face folder, or `tiny` (the embedded agent).

        `chat_template_kwargs` go to the chat template (e.g. ``{"enable_thinking": False}``).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(name_or_path)
        looks_local = path.startswith((".", "/", "~")) or Path(path).is_absolute()
        if looks_local and not Path(path).expanduser().exists():
            raise FileNotFoundError(
                f"could not load model {name_or_path!r}: no such folder. Pass a folder with "
                "config.json + weights + tokenizer files, a hub id, or 'tiny'."
            )
        torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        except OSError as exc:
            raise FileNotFoundError(
                f"could not load model {name_or_path!r}: not a local Hugging Face folder, and the "
                f"hub could not provide it ({exc}). Pass a folder with config.json + weights + "
                "tokenizer files, a reachable hub id, or 'tiny'."
            ) from exc
        model.to(resolve_device(device))
        return cls(
            model, tokenizer, batch_size=batch_size, chat_template_kwargs=chat_template_kwargs
        )

    # ------------------------------------------------------------------ Policy API
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 4096))

    trainable = True  # GRPO trains `model` in place
    serves_members = False

    @property
    def supports_episodes(self) -> bool:
        """Whether `generate_episodes` can run this model: it needs a plain full-attention KV
        cache (other caches, e.g. sliding-window, make `rollout` go turn by turn). Checked
        again whenever `model` is replaced (GRPO wraps it with a LoRA adapter)."""
        model, supported = self._episodes_checked
        if model is not self.model:
            supported = supports_kv_batch(self.model)
            self._episodes_checked = (self.model, supported)
        return supported

    def weights(self) -> WeightSpace:
        from copes.weights import WeightSpace

        if self._weights is None:
            self._weights = WeightSpace.from_module(self.model)
        return self._weights

    def member_batch(
        self, members: int, rank: int, rows: int, free_bytes: int | None = None
    ) -> HFMemberBatch:
        """A step's members in this model's episode loop (`ServesMembers`): N stacked copies,
        or N rank-`rank` adapters; refused when they do not fit in `free_bytes`."""
        from copes.agents.hf.population import HFMemberBatch

        return HFMemberBatch(self, members, rank, rows, free_bytes)

    def export_model(self) -> Any:
        """The transformers model to `save_pretrained` in a checkpoint: the live one."""
        return self.model

    # ------------------------------------------------------------------ TrainablePolicy
    @property
    def trainable_model(self) -> Any:
        return self.model  # generation and training share the one module

    def set_trainable_model(self, model: Any) -> None:
        self.model = model
        self._weights = None  # a WeightSpace views the parameters of the module it was built on

    def weights_changed(self) -> None:
        """Nothing to do: generation reads the trained module itself."""

    def close(self) -> None:
        """Nothing to release: the model is an ordinary module in this process."""

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the live weights with HF-named tensors (e.g. a checkpoint's)."""
        result = self.model.load_state_dict(state, strict=False)
        if result.unexpected_keys or [k for k in result.missing_keys if "lm_head" not in k]:
            raise RuntimeError(f"weights do not match the model: {result}")

    @torch.no_grad()
    def generate_ids(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        results: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            seed = None if sampling.seed is None else sampling.seed + start
            results.extend(self._generate_batch(chunk, sampling, seed))
        return results

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: Callable[[int, Generation], Any],
        *,
        threads: int = 16,
        turn_limits: Any = None,
    ) -> dict[str, float]:
        """Run whole multi-turn episodes in one continuous-batching loop, keeping each
        episode's KV cache across turns (`copes.agents.hf.engine`; `EpisodePolicy`;
        `turn_limits` and `next_turn` returning a `Reprompt`: served sessions)."""
        from copes.agents.hf.engine import EpisodeEngine

        if not self.supports_episodes:
            raise NotImplementedError(
                f"{type(self.model).__name__} keeps a KV cache the episode loop cannot "
                "re-arrange (sliding-window, linear-attention or encoder-decoder); use "
                "generate_ids turn by turn (rollout does when supports_episodes is False)"
            )
        engine = EpisodeEngine(self, sampling, next_turn, turn_limits=turn_limits)
        return engine.run(prompts, threads)

    # ------------------------------------------------------------------ internals
    def _collect_eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        config_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(config_eos, int):
            ids.add(config_eos)
        elif config_eos:
            ids.update(config_eos)
        return {i for i in ids if i is not None}

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int | None
    ) -> list[Generation]:
        from transformers import GenerationConfig

        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at `width`
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=sampling.top_k if not sampling.greedy else None,
            stop_strings=list(sampling.stop) or None,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=config,
                tokenizer=self.tokenizer,
            )
        new_tokens = out.sequences[:, width:]
        # Raw (unprocessed) logits per step -> log p of the chosen token, one step at a time
        # so no (batch, steps, vocab) tensor is ever built.
        chosen = torch.stack(
            [
                torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None])[:, 0]
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        ).cpu()
        new_tokens = new_tokens.cpu()
        return [
            self._finish(list(prompt), new_tokens[row].tolist(), chosen[row].tolist(), sampling)
            for row, prompt in enumerate(prompts)
        ]

    def _finish(
        self, prompt: list[int], ids: list[int], logprobs: list[float], sampling: SamplingConfig
    ) -> Generation:
        """Cut one row at its real end (eos or stop string) and describe why it ended."""
        reason: FinishReason = "length"
        end = len(ids)
        for i, token in enumerate(ids):
            if token in self.eos_ids:
                end, reason = i + 1, "eos"
                break
        if reason != "eos" and sampling.stop:
            stop_end = self._stop_string_end(ids[:end], sampling.stop)
            if stop_end is not None:
                end, reason = stop_end, "stop"
        ids = ids[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text, ids, logprobs[:end], reason, prompt_token_ids=prompt)

    def _stop_string_end(self, ids: list[int], stops: Sequence[str]) -> int | None:
        """Fewest leading tokens whose text contains a stop string (None if none does)."""
        decode = self.tokenizer.decode
        if not any(s in decode(ids, skip_special_tokens=False) for s in stops):
            return None
        low, high = 1, len(ids)
        while low < high:  # the property "prefix contains a stop string" is monotone
            mid = (low + high) // 2
            if any(s in decode(ids[:mid], skip_special_tokens=False) for s in stops):
                high = mid
            else:
                low = mid + 1
        return low
