"""The optimizers' hyper-parameters: plain dataclasses, each field a `copes-train` flag.

Kept apart from the algorithms (which need torch) so that the command line, the memory
planner and the docs read them without importing torch: ``copes-train --help`` is fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Schedule = Literal["constant", "linear", "cosine"]


def flag(help: str, default: Any, aliases: tuple[str, ...] = ()) -> Any:
    """A config dataclass field that is also a `copes-train` flag with this help text (and
    other names, `aliases`), as `transformers.HfArgumentParser` reads it. A list default is
    given to each instance as its own copy."""
    metadata: dict[str, Any] = {"help": help}
    if aliases:
        metadata["aliases"] = list(aliases)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class CoPESConfig:
    """CoPES hyper-parameters (each is a `copes-train` flag). Defaults: the paper's best K=4."""

    _argument_group_name: ClassVar[str] = "ES / CoPES (--optimizer es or copes)"

    population_size: int = flag("N: perturbed models per step (paper ablations: 40)", default=40)
    num_subspaces: int = flag("K: subspaces per step (paper's best: 4; 1 = plain ES)", default=4)
    sigma: float = flag("sigma: full-space noise scale (Qiu et al.: 1e-3)", default=1e-3)
    learning_rate: float = flag("alpha: step size, no 1/sigma factor (Qiu: 5e-4)", default=5e-4)
    scale_sigma: bool = flag("use sigma_k = sqrt(K) * sigma (paper); off = ablation", default=True)
    standardization: Literal["joint", "per_subspace"] = flag(
        "one mean/std over all N rewards (paper) or per subspace (ablation)", default="joint"
    )
    antithetic: bool = flag("mirrored pairs +eps/-eps inside each subspace", default=False)
    rank_shaping: bool = flag(
        "centered ranks instead of raw rewards before z-scoring", default=False
    )
    sigma_schedule: Schedule = flag(
        "sigma over training: constant, linear or cosine decay", default="constant"
    )
    lr_schedule: Schedule = flag(
        "alpha over training: constant, linear or cosine decay", default="constant"
    )
    schedule_steps: int = flag("steps over which schedules decay (0: no decay)", default=0)
    schedule_final_fraction: float = flag("value at the end of a decay, as a fraction", default=0.1)
    noise: Literal["full", "lowrank"] = flag(
        "noise family: full (the paper's Gaussian on every coordinate) or lowrank (rank-r per "
        "matrix, EGGROLL-style; subspaces partition each matrix's rows; 1-D tensors fixed)",
        default="full",
    )
    noise_rank: int = flag("r of --noise lowrank: each member's delta is rank r per matrix", 1)
    seed: int = flag("seed of every perturbation and partition", default=0)
    chunk_size: int = flag("coordinates per chunk of noise (bounds extra memory)", default=1 << 20)

    def __post_init__(self) -> None:
        n, k = self.population_size, self.num_subspaces
        if n < 2:
            raise ValueError(f"population_size must be >= 2 (rewards are standardized), got {n}")
        if k < 1:
            raise ValueError(f"num_subspaces must be >= 1, got {k}")
        if n % k:
            raise ValueError(
                f"population_size N={n} must be divisible by num_subspaces K={k}: each subspace "
                f"gets N/K members (try N={k * max(1, round(n / k))})"
            )
        if self.antithetic and (n // k) % 2:
            raise ValueError(f"antithetic pairs need an even N/K, got N/K = {n // k}")
        if self.standardization == "per_subspace" and n // k < 2:
            raise ValueError("per-subspace standardization needs at least 2 members per subspace")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.standardization not in ("joint", "per_subspace"):
            raise ValueError(
                f"standardization must be joint or per_subspace: {self.standardization!r}"
            )
        for name, value in (
            ("sigma_schedule", self.sigma_schedule),
            ("lr_schedule", self.lr_schedule),
        ):
            if value not in ("constant", "linear", "cosine"):
                raise ValueError(f"{name} must be constant, linear or cosine")
        if not 0 <= self.schedule_final_fraction <= 1:
            raise ValueError("schedule_final_fraction must be in [0, 1]")
        if self.noise not in ("full", "lowrank"):
            raise ValueError(f"noise must be full or lowrank, got {self.noise!r}")
        if self.noise_rank < 1:
            raise ValueError(f"noise_rank must be >= 1, got {self.noise_rank}")

    @property
    def perturbation_rank(self) -> int:
        """Rank of every member's noise per matrix (0: full rank)."""
        return self.noise_rank if self.noise == "lowrank" else 0

    @property
    def members_per_subspace(self) -> int:
        return self.population_size // self.num_subspaces

    @property
    def samples_per_task(self) -> int:
        """Trajectories of each task a step rolls out: ES scores each member on a task once."""
        return 1


# Plain ES is CoPES with one subspace and Qiu et al.'s population (sigma and alpha agree).
ES_DEFAULTS: dict[str, Any] = {"population_size": 30, "num_subspaces": 1}


def es_config(**overrides: Any) -> CoPESConfig:
    """Plain ES with Qiu et al.'s defaults: N = 30, K = 1, sigma = 1e-3, alpha = 5e-4."""
    return CoPESConfig(**{**ES_DEFAULTS, **overrides})


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fields that decide what is built at construction: a saved state must agree on them.
_STRUCTURAL = ("lora", "lora_rank", "lora_alpha", "lora_target_modules", "gradient_checkpointing")


@dataclass
class GRPOConfig:
    """GRPO hyper-parameters (each is a `copes-train` flag)."""

    _argument_group_name: ClassVar[str] = "GRPO / LoRA-GRPO (--optimizer grpo or lora-grpo)"

    group_size: int = flag("G: samples per task; advantages are relative to the group", default=8)
    learning_rate: float = flag(
        "AdamW step size; 1e-6 is usual for full-parameter 1-7B models (LoRA: ~1e-5..1e-4)",
        default=1e-6,
    )
    clip_epsilon: float = flag("eps: ratio clipped to [1 - eps, 1 + eps_high]", default=0.2)
    clip_epsilon_high: float | None = flag(
        "eps_high for DAPO-style asymmetric clipping (e.g. 0.28); None = clip_epsilon",
        default=None,
    )
    kl_beta: float = flag(
        "beta: weight of the k3 KL to a frozen copy of the initial model (0 = no reference)",
        default=0.0,
    )
    scale_rewards: Literal["group", "none"] = flag(
        "group: A = (r - mean) / (std + 1e-4) per task; none: A = r - mean (Dr. GRPO)",
        default="group",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] = flag(
        "token_mean: mean over all generated tokens of the batch; sequence_mean: per sequence",
        default="token_mean",
    )
    max_grad_norm: float = flag("clip the global gradient norm to this (0 = no clipping)", 1.0)
    micro_batch_size: int = flag(
        "trajectories per forward/backward; gradients accumulate over the batch", default=4
    )
    updates_per_batch: int = flag(
        "optimizer steps on each rollout batch (PPO epochs; old log-probs = rollout's)", 1
    )
    weight_decay: float = flag("AdamW decoupled weight decay", default=0.0)
    adam_betas: list[float] = flag("AdamW (beta1, beta2)", default=[0.9, 0.999])
    gradient_checkpointing: bool = flag("recompute activations in backward (less memory)", False)
    lora: bool = flag("train a LoRA adapter (peft) instead of every weight", default=False)
    lora_rank: int = flag("LoRA rank r", default=16)
    lora_alpha: float = flag("LoRA alpha (the update is scaled by alpha / r)", default=32.0)
    lora_dropout: float = flag("dropout on the LoRA input", default=0.0)
    lora_target_modules: list[str] = flag(
        "module names that get an adapter (attention and MLP projections)",
        default=list(LORA_TARGETS),
    )

    def __post_init__(self) -> None:
        self.adam_betas = [float(b) for b in self.adam_betas]
        self.lora_target_modules = list(self.lora_target_modules)
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages are relative to the group), got "
                f"{self.group_size}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
        if self.clip_epsilon_high is not None and not self.clip_epsilon_high > 0:
            raise ValueError(
                f"clip_epsilon_high must be > 0 (or None to use clip_epsilon), got "
                f"{self.clip_epsilon_high}"
            )
        if not self.kl_beta >= 0:
            raise ValueError(f"kl_beta must be >= 0 (0 = no KL term), got {self.kl_beta}")
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(f"scale_rewards must be 'group' or 'none', got {self.scale_rewards!r}")
        if self.loss_aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(
                "loss_aggregation must be 'token_mean' or 'sequence_mean', got "
                f"{self.loss_aggregation!r}"
            )
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 = no clipping): {self.max_grad_norm}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be >= 1, got {self.updates_per_batch}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name the modules that get an adapter")

    @property
    def samples_per_task(self) -> int:
        """Trajectories of each task a step rolls out: the group advantages compare."""
        return self.group_size

    @property
    def clip_high(self) -> float:
        return self.clip_epsilon if self.clip_epsilon_high is None else self.clip_epsilon_high
