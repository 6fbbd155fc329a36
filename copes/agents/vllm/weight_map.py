"""Hugging Face parameter names -> views into a vLLM model's fused, sharded tensors.

vLLM fuses Hugging Face tensors (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, Qwen3.5's
linear-attention `in_proj_qkv` + `in_proj_z` into the four-part `in_proj_qkvz`, MoE experts into
`w13_weight` / `w2_weight`), pads the vocabulary and shards everything by tensor parallelism.
ES/CoPES perturb Hugging Face names and shapes (`copes.weights`), so every HF
parameter is mapped to a *view* of the engine tensor that holds it and the `Shard` of the
full HF tensor that view is.

The names come from vLLM's own mapping, not from a table of ours: the `hf_to_vllm_mapper`
(a `WeightsMapper`: renames, prefixes, and the `orig_to_new_stacked` parts of fused tensors)
of the model and of every submodule on the parameter's path, applied to names relative to
that submodule, as vLLM's `AutoWeightsLoader` does when it loads a checkpoint; the
`packed_modules_mapping` serves older models without stacked mappers. A map that reads
vLLM's structure can still be wrong, so it is never trusted: `VLLMPolicy` compares every view
with the weight the HF model holds (a sha256 per tensor) before a run starts, and refuses to
start naming the tensors that differ (`copes.agents.vllm.VLLMPolicy.check_weight_map`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from copes.weights import Shard

Layout = Sequence[tuple[str, Sequence[int]]]  # HF parameter names and full shapes, HF order

# transformers >= 5 keeps MoE experts fused in memory ([experts, 2 * intermediate, hidden] for
# gate and up, [experts, hidden, intermediate] for down), the layout of vLLM's fused experts.
_FUSED_EXPERTS = {
    "experts.gate_up_proj": ("experts.routed_experts.w13_weight", "experts.w13_weight"),
    "experts.down_proj": ("experts.routed_experts.w2_weight", "experts.w2_weight"),
}


class UnsupportedWeight(KeyError):
    """An HF tensor this module cannot map onto the engine's tensors (named in the message)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def vllm_name(model: torch.nn.Module, hf_name: str) -> tuple[str, Any]:
    """(vLLM parameter name, part of a fused parameter or None) of an HF parameter name.

    The part is ``"q"``/``"k"``/``"v"`` of a QKV layer, an index of a merged layer, or a
    tuple of consecutive indices (one HF tensor filling several parts, as Qwen3.5's
    ``in_proj_qkv`` fills parts 0-2 of ``in_proj_qkvz``).
    """
    modules = dict(model.named_modules())
    name, part = hf_name, None
    seen: set[int] = set()
    prefix = ""
    while True:
        module = modules.get(prefix[:-1] if prefix else "")
        mapper = getattr(module, "hf_to_vllm_mapper", None) if module is not None else None
        usable = mapper is not None and hasattr(mapper, "_map_name_with_shard")
        if usable and id(mapper) not in seen:
            seen.add(id(mapper))
            mapped = mapper._map_name_with_shard(name[len(prefix) :])
            if mapped is None:
                raise UnsupportedWeight(
                    f"vLLM's {type(model).__name__} drops HF weight {hf_name!r}"
                )
            name = prefix + mapped[0]
            part = mapped[1] if mapped[1] is not None else part
        rest = name[len(prefix) :]
        if "." not in rest:
            break
        prefix += rest.split(".", 1)[0] + "."
    if part is None:  # models that describe their fused layers only by packed_modules_mapping
        for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
            if parts == [fused]:  # the HF tensor is the fused one already (Phi-3's qkv_proj)
                continue
            for index, piece in enumerate(parts):
                if f".{piece}." in name:
                    part = "qkv"[index] if fused == "qkv_proj" else index
                    return name.replace(f".{piece}.", f".{fused}.", 1), part
    return name, part


def _parts(part: Any) -> list[Any]:
    return list(part) if isinstance(part, (tuple, list)) else [part]


def _rows(module: Any, part: Any, hf_name: str) -> tuple[int, int, int]:
    """(local row offset, row count, global row start in the HF tensor) of one HF tensor's
    part(s) in a fused column layer."""
    rank, size = module.tp_rank, module.tp_size
    if isinstance(module, QKVParallelLinear):
        q = module.num_heads * module.head_size
        k = module.num_kv_heads * module.head_size
        v = module.num_kv_heads * module.v_head_size
        kv_rank = rank // module.num_kv_head_replicas
        return {"q": (0, q, rank * q), "k": (q, k, kv_rank * k), "v": (q + k, v, kv_rank * v)}[part]
    if isinstance(module, MergedColumnParallelLinear):
        sizes = [s // size for s in module.output_sizes]
        parts = _parts(part)
        if parts != list(range(parts[0], parts[0] + len(parts))):
            raise UnsupportedWeight(f"{hf_name}: fused parts {parts} are not consecutive")
        if len(parts) > 1 and size > 1:
            raise UnsupportedWeight(
                f"{hf_name} fills parts {parts} of one fused vLLM tensor; under tensor "
                f"parallelism ({size} ranks) its rows are not one block on a rank: run "
                "this model with tensor_parallel_size=1"
            )
        count = sum(sizes[p] for p in parts)
        return sum(sizes[: parts[0]]), count, rank * count
    raise UnsupportedWeight(f"{hf_name}: {type(module).__name__} has no fused part {part!r}")


def _locate(
    module: Any, param: torch.Tensor, part: Any, full_shape: tuple[int, ...], hf_name: str
) -> tuple[torch.Tensor, Shard | None]:
    """The view of `param` that holds (part of) an HF tensor, and which part it is."""
    data, rows = param.data, full_shape[0]
    if part is not None:
        offset, count, start = _rows(module, part, hf_name)
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
        raise UnsupportedWeight(
            f"engine tensor for HF weight {hf_name!r} of shape {full_shape} is "
            f"{tuple(view.shape)} (expected {tuple(expected)}); this layer layout is not supported"
        )
    return view, shard


def _fused_experts(params: dict[str, torch.Tensor], name: str) -> str | None:
    """The vLLM tensor of an HF fused-experts tensor (whole, on a single rank), if any."""
    for suffix, candidates in _FUSED_EXPERTS.items():
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return next((base + c for c in candidates if base + c in params), None)
    return None


def _lora_base(name: str) -> str:
    """Where vLLM's LoRA layers (`enable_lora=True`) keep a wrapped layer's own parameter:
    `layer.weight` becomes `layer.base_layer.weight`."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.base_layer.{leaf}"


def hf_views(
    model: torch.nn.Module, layout: Layout
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Shard]]:
    """HF-named views into `model`'s (a vLLM model's) tensors, in `layout` order, and the
    shards of the full HF tensors that they are. Raises `UnsupportedWeight` naming the first
    HF tensor it cannot place."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    views, shards = [], {}
    for hf_name, shape in layout:
        name, part = vllm_name(model, hf_name)
        if name not in params and (experts := _fused_experts(params, name)) is not None:
            module = modules[experts.rsplit(".", 1)[0]]
            if getattr(module, "tp_size", 1) > 1 or getattr(module, "ep_size", 1) > 1:
                raise UnsupportedWeight(
                    f"{hf_name}: fused MoE experts under tensor or expert parallelism are not "
                    "mapped; run this model with tensor_parallel_size=1"
                )
            name = experts
        if name not in params and (wrapped := _lora_base(name)) in params:
            name = wrapped  # an engine serving LoRA adapters wraps the layer
        if name not in params:
            raise UnsupportedWeight(
                f"HF weight {hf_name!r} maps to {name!r}, which vLLM's {type(model).__name__} "
                "does not have; copes maps the names vLLM's own weight mappers give "
                "(hf_to_vllm_mapper, packed_modules_mapping)"
            )
        module = modules[name.rsplit(".", 1)[0]]
        fused = isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear))
        if fused and part is None and getattr(module, "tp_size", 1) > 1:
            raise UnsupportedWeight(
                f"{hf_name} is a whole fused tensor; under tensor parallelism its rows are not "
                "one block on a rank: run this model with tensor_parallel_size=1"
            )
        view, shard = _locate(module, params[name], part, tuple(shape), hf_name)
        partial = shard is not None and tuple(shard.local_shape) != tuple(shape)
        if partial and getattr(module, "tp_size", 1) == 1:
            # One rank holds every coordinate: a view of fewer rows would leave the others
            # unperturbed and unchecked (the map check compares views only).
            raise UnsupportedWeight(
                f"HF weight {hf_name!r} {tuple(shape)} maps to only {shard.local_shape} of "
                f"vLLM's {name!r}; refusing a map that would leave coordinates out"
            )
        views.append((hf_name, view))
        if shard is not None:
            shards[hf_name] = shard
    return views, shards


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes: equal iff bit-identical (same dtype and shape)."""
    data = tensor.detach().contiguous().cpu()
    hasher = hashlib.sha256(str((tuple(data.shape), str(data.dtype))).encode())
    hasher.update(data.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


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
