"""Low-rank members as adapters: which module serves each matrix, and PEFT adapter files.

A low-rank member's delta of matrix W is A B^T (`WeightSpace.low_rank_factors`: A is
rows x r with sign and sigma folded in, B is cols x r). It can be served without forming
W + A B^T, by every module that computes with W: a Linear adds ``A (B^T x)``, an Embedding
adds ``A[token] B^T``, and an LM head tied to the embedding gets the same factors.
`adapter_targets` finds those modules in a transformers model (a meta-device skeleton is
enough) and refuses matrices no plain Linear/Embedding computes with, whose adapter would
be wrong. `write_peft_adapter` stores one member in PEFT's LoRA layout, the format vLLM's
multi-LoRA serving loads (and `peft.PeftModel.from_pretrained`, which the tests use to check
the layout against the in-place member):

- Linear ``m``: ``lora_A.weight`` = B^T (r x in), ``lora_B.weight`` = A (out x r);
- Embedding ``m``: ``lora_embedding_A`` = A^T (r x vocab), ``lora_embedding_B`` = B (dim x r);
- ``lora_alpha = r``, so PEFT's scale alpha / r is 1 and the delta is exactly A B^T.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

AdapterKind = Literal["linear", "embedding"]
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class AdapterTarget:
    """Module `module` computes with matrix `matrix` (an HF parameter name) as a `kind`."""

    matrix: str
    module: str
    kind: AdapterKind


def _plain_kind(module: torch.nn.Module) -> AdapterKind | None:
    """'linear' / 'embedding' for modules whose forward is torch's own; None otherwise."""
    cls = type(module)
    if isinstance(module, torch.nn.Linear) and cls.forward is torch.nn.Linear.forward:
        return "linear"
    if isinstance(module, torch.nn.Embedding) and cls.forward is torch.nn.Embedding.forward:
        return "embedding"
    return None


def adapter_targets(model: torch.nn.Module) -> list[AdapterTarget]:
    """Every (matrix, module) pair an adapter of a low-rank member must cover, in module
    order; a tied weight gets one target per module using it. Raises ValueError naming a
    perturbed matrix that no plain Linear/Embedding computes with."""
    matrices = {
        id(p): n for n, p in model.named_parameters() if p.is_floating_point() and p.dim() >= 2
    }
    targets: list[AdapterTarget] = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None or id(weight) not in matrices:
            continue
        kind = _plain_kind(module)
        if kind is None:
            raise ValueError(
                f"--noise lowrank cannot serve {name} ({type(module).__name__}) as an adapter: "
                "its forward is not a plain Linear/Embedding; use --population-eval sequential"
            )
        targets.append(AdapterTarget(matrices[id(weight)], name, kind))
    if missing := sorted(set(matrices.values()) - {t.matrix for t in targets}):
        raise ValueError(
            f"--noise lowrank cannot serve {missing[0]} as an adapter: no Linear or Embedding "
            "uses it (e.g. fused MoE experts); use --population-eval sequential"
        )
    return targets


def peft_tensors(
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], targets: Sequence[AdapterTarget]
) -> dict[str, torch.Tensor]:
    """One member's factors (`WeightSpace.low_rank_factors(..., full=True)`) under PEFT's
    LoRA names, on the CPU."""
    tensors = {}
    for target in targets:
        a, b = (t.detach().to("cpu") for t in factors[target.matrix])
        key = f"base_model.model.{target.module}"
        if target.kind == "embedding":
            tensors[f"{key}.lora_embedding_A"] = a.T.contiguous()
            tensors[f"{key}.lora_embedding_B"] = b.contiguous()
        else:
            tensors[f"{key}.lora_A.weight"] = b.T.contiguous()
            tensors[f"{key}.lora_B.weight"] = a.contiguous()
    return tensors


def write_peft_adapter(
    folder: str | Path,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    targets: Sequence[AdapterTarget],
    rank: int,
) -> Path:
    """Write one member as a PEFT LoRA adapter folder (weights + config); returns it."""
    from safetensors.torch import save_file

    if missing := sorted({t.matrix for t in targets} - set(factors)):
        raise ValueError(f"no factors for {missing[0]}: the member does not cover the targets")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(factors, targets), str(folder / ADAPTER_WEIGHTS))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,  # scale alpha / r = 1: the delta is A B^T exactly
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({t.module.rsplit(".", 1)[-1] for t in targets}),
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return folder


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterTarget",
    "adapter_targets",
    "peft_tensors",
    "write_peft_adapter",
]
