"""The table of optimizers: the one list the command line, the memory planner and the docs read.

Each entry names its hyper-parameter dataclass (its flags), the defaults that make it what it
is (plain ES is CoPES with K = 1 and Qiu et al.'s N = 30; LoRA-GRPO is GRPO with an
adapter), and where its algorithm lives (imported only when a run builds it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from copes.optimizers.configs import ES_DEFAULTS, CoPESConfig, GRPOConfig


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    config: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # what makes it this optimizer
    algorithm: str = ""  # "module:Class"; the class takes (config) or (config, policy)
    takes_policy: bool = False
    summary: str = ""
    # Which TrainConfig field sets the training rollouts' temperature (ES scores greedily,
    # Qiu et al.; GRPO samples), and whether it trains by gradients (a vLLM run then keeps a
    # trainable transformers copy).
    rollout_temperature: str = "es_temperature"
    gradients: bool = False

    def flags(self) -> set[str]:
        return {f.name for f in fields(self.config)}

    def make_config(self, settings: Mapping[str, Any]) -> Any:
        """Its config from `settings` (CLI flags); a setting it does not use is an error."""
        unused = sorted(set(settings) - self.flags())
        if unused:
            names = ", ".join("--" + name.replace("_", "-") for name in unused)
            raise ValueError(
                f"{names}: not a setting of --optimizer {self.name} ({self.summary}); drop "
                f"{'it' if len(unused) == 1 else 'them'} or choose the optimizer that uses it"
            )
        clash = {k: v for k, v in settings.items() if k in self.fixed and v != self.fixed[k]}
        if clash:
            name = next(iter(clash))
            raise ValueError(
                f"--optimizer {self.name} always has {name} = {self.fixed[name]!r}; drop "
                f"--{name.replace('_', '-')} (or pick another optimizer)"
            )
        return self.config(**{**self.defaults, **settings, **self.fixed})

    def build(self, config: Any, policy: Any) -> Any:
        module, _, name = self.algorithm.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(config, policy) if self.takes_policy else cls(config)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            "es", CoPESConfig, ES_DEFAULTS, algorithm="copes.optimizers.es:CoPES",
            summary="plain ES, Qiu et al. 2025",
        ),
        OptimizerSpec(
            "copes", CoPESConfig, algorithm="copes.optimizers.es:CoPES",
            summary="cooperative subspace ES",
        ),
        OptimizerSpec(
            "grpo", GRPOConfig, algorithm="copes.optimizers.grpo:GRPO", takes_policy=True,
            summary="group-relative policy gradient", rollout_temperature="temperature",
            gradients=True,
        ),
        OptimizerSpec(
            "lora-grpo", GRPOConfig, algorithm="copes.optimizers.grpo:GRPO", fixed={"lora": True},
            takes_policy=True, summary="GRPO on a LoRA adapter",
            rollout_temperature="temperature", gradients=True,
        ),
    )
}  # fmt: skip


def get_optimizer(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}"
        ) from None


def is_population(name: str) -> bool:
    """Whether `name` evaluates a population of perturbed models (ES, CoPES)."""
    return get_optimizer(name).config is CoPESConfig
