"""The table of optimizers: the one list the command line, the memory planner and the docs read.

Each entry names its hyper-parameter dataclass (its flags), the defaults that make it what it
is (plain ES is CoPES with K = 1 and Qiu et al.'s N = 30; LoRA-GRPO is GRPO with an
adapter), and the function that builds its algorithm (which imports it only then: `--help`
and the memory planner run without torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from copes.optimizers.configs import ES_DEFAULTS, CoPESConfig, GRPOConfig

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.optimizers.base import Optimizer, PopulationEvaluator


def build_copes(
    config: CoPESConfig, policy: Policy, evaluator: PopulationEvaluator | None
) -> Optimizer:
    """ES or CoPES, its members scored by `evaluator` (None: one after another here)."""
    from copes.optimizers.es import CoPES

    return CoPES(config, evaluator)


def build_grpo(
    config: GRPOConfig, policy: Policy, evaluator: PopulationEvaluator | None
) -> Optimizer:
    """GRPO (LoRA-GRPO with `config.lora`), training `policy`'s own model; no population."""
    from copes.optimizers.grpo import GRPO

    if evaluator is not None:
        raise ValueError("GRPO trains one policy: it has no population to evaluate elsewhere")
    return GRPO(config, policy)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    config: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # what makes it this optimizer
    # builds the algorithm from (its config, the run's policy, the population evaluator)
    build: Callable[..., Any] = build_copes
    summary: str = ""
    # Whether it trains by gradients: its training rollouts sample at the run's temperature
    # (ES scores at --es-temperature, greedy by default: Qiu et al.) and a vLLM run keeps a
    # trainable transformers copy.
    gradients: bool = False

    def flags(self) -> set[str]:
        return {f.name for f in fields(self.config)}

    def make_config(self, **settings: Any) -> Any:
        """Its config: its defaults, then `settings`; a setting it does not use is an error."""
        self.refuse_unused(settings)
        config = self.config(**{**self.defaults, **settings, **self.fixed})
        self.check(config)
        return config

    def refuse_unused(self, names: Iterable[str]) -> None:
        """Settings (flags) that are not this optimizer's are an error naming them."""
        unused = sorted(set(names) - self.flags())
        if unused:
            flags = ", ".join("--" + name.replace("_", "-") for name in unused)
            raise ValueError(
                f"{flags}: not a setting of --optimizer {self.name} ({self.summary}); drop "
                f"{'it' if len(unused) == 1 else 'them'} or choose the optimizer that uses it"
            )

    def check(self, config: Any) -> None:
        """`config` is this optimizer's: its dataclass, with the values that make it this one
        (LoRA-GRPO's adapter)."""
        if not isinstance(config, self.config):
            raise ValueError(
                f"--optimizer {self.name} takes a {self.config.__name__}, got "
                f"{type(config).__name__}"
            )
        held = asdict(config)
        for name, value in self.fixed.items():
            if held[name] != value:
                raise ValueError(
                    f"--optimizer {self.name} always has {name} = {value!r}; drop "
                    f"--{name.replace('_', '-')} (or pick another optimizer)"
                )


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            "es", CoPESConfig, ES_DEFAULTS, build=build_copes,
            summary="plain ES, Qiu et al. 2025",
        ),
        OptimizerSpec(
            "copes", CoPESConfig, build=build_copes, summary="cooperative subspace ES",
        ),
        OptimizerSpec(
            "grpo", GRPOConfig, build=build_grpo, summary="group-relative policy gradient",
            gradients=True,
        ),
        OptimizerSpec(
            "lora-grpo", GRPOConfig, fixed={"lora": True}, build=build_grpo,
            summary="GRPO on a LoRA adapter", gradients=True,
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
