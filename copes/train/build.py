"""The run's parts from its settings: tasks, the env factory, the policy (transformers or
vLLM, LoRA when GRPO trains adapters), the population evaluator and the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from copes.agents.policy import Policy
from copes.errors import UserError
from copes.optimizers.base import Optimizer, PopulationEvaluator
from copes.optimizers.table import get_optimizer, is_population
from copes.train.settings import (
    TrainConfig,
)


def load_tasks_for(
    config: TrainConfig, split: str, limit: int, task_seed: int | None = None
) -> list[Any]:
    """`limit` tasks of `split` (`Benchmark.load_tasks`); generated benchmarks draw them with
    `task_seed` (default: the run's seed)."""
    from copes.registry import get_benchmark

    assert config.benchmark is not None  # resolved by TrainConfig
    seed = config.seed if task_seed is None else task_seed
    tasks = get_benchmark(config.benchmark).load_tasks(
        split=split, limit=limit, data_dir=config.data_dir, seed=seed
    )
    if not tasks:
        raise ValueError(f"benchmark {config.benchmark!r} split {split!r} has no tasks")
    return tasks


def env_factory(config: TrainConfig, call_format: str = "tags") -> Callable[[], Any]:
    """Builds the run's environments: --env (default: the benchmark's) by
    `Benchmark.make_env`, with the benchmark's env kwargs and grader, --env-kwargs and
    --demonstrations, and the run's episode rules set on each; `call_format` is resolved
    (`resolve_call_format`). One env is built now, so a factory that refuses what the run
    gives it fails before the model loads."""
    from copes.envs.core import EpisodeRules
    from copes.registry import get_benchmark, parse_env_kwargs

    assert config.env is not None and config.benchmark is not None  # resolved by TrainConfig
    benchmark = get_benchmark(config.benchmark)
    kwargs = parse_env_kwargs(config.env_kwargs)
    if config.demonstrations:  # only then: an env without the option still runs without it
        kwargs["demonstrations"] = config.demonstrations
    rules = EpisodeRules(max_turns=config.max_turns, invalid_penalty=config.invalid_penalty)
    placeholder = load_tasks_for(config, config.train_split, 1)

    def make() -> Any:
        return benchmark.make_env(
            placeholder, env_id=config.env, rules=rules, call_format=call_format, **kwargs
        )

    try:
        make().close()
    except TypeError as exc:
        reason = str(exc).split(" with kwargs")[0][:160]
        given = ", ".join(["tasks=", "call_format=", *(f"{k}=" for k in kwargs)])
        raise UserError(
            f"--env {config.env} is not a copes ToolEnv factory: it refused what the run gives "
            f"it ({given}): {reason}"
        ) from None
    return make


def build_policy(
    config: TrainConfig, lora: tuple[int, int] | None = None, rows: int | None = None
) -> Policy:
    """The policy of a run (`copes.agents.loading.load_policy`); with vLLM, GRPO also gets a
    transformers copy to train, and `lora` = (members, rank) starts the engine's multi-LoRA
    serving for a batched low-rank population; `rows`: the episodes it plays at once (what
    its KV cache is sized for on a CPU)."""
    from copes.agents.chat import template_kwargs_for
    from copes.agents.loading import load_policy

    return load_policy(
        config.model, backend=config.backend, device=config.device, dtype=config.dtype,
        seed=config.seed, chat_template_kwargs=template_kwargs_for(
            config.enable_thinking, config.chat_template_kwargs
        ),
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        trainable=get_optimizer(config.optimizer).gradients,
        lora_members=lora[0] if lora else 0, lora_rank=lora[1] if lora else 0,
        kv_cache_gib=config.kv_cache_gib, rows=rows,
    )  # fmt: skip


def build_replica_policy(config: TrainConfig, model_path: str) -> Policy:
    """A `--workers` actor's policy: the run's backend, loaded from `model_path`."""
    return build_policy(replace(config, model=model_path))


def build_evaluator(
    config: TrainConfig,
    opt_config: Any,
    policy: Policy,
    train_rollout: Any,
    make_train_rollout: Callable[[], Any],
    run_dir: str | Path,
    served: tuple[Any, Any] | None = None,
) -> PopulationEvaluator | None:
    """Where an ES/CoPES run's members are evaluated, chosen once: sessions of the server
    (`served` = (server, harness): --harness), one batch (--population-eval batched), W Ray
    actors (--workers W, started on the first step), or None (one after another here).
    None for GRPO, which has no population."""
    if not is_population(config.optimizer):
        return None
    size, rank = opt_config.population_size, opt_config.perturbation_rank
    if served is not None:
        from copes.serve import ServedEvaluator

        server, harness = served
        return ServedEvaluator(server, harness, policy, train_rollout, size, rank=rank)
    if config.population_eval == "batched":  # N weight copies: refused now if they do not fit
        from copes.optimizers.batched import BatchedEvaluator

        return BatchedEvaluator(policy, train_rollout, size, rank=rank)  # type: ignore[arg-type]
    if config.workers:
        return ray_population(config, opt_config, policy, make_train_rollout, run_dir)
    return None


def ray_population(
    config: TrainConfig,
    opt_config: Any,
    policy: Policy,
    make_train_rollout: Callable[[], Any],
    run_dir: str | Path,
) -> PopulationEvaluator:
    """W Ray actors, each a replica of this run's policy and training rollout (no weights
    sent: each builds its own from the model and replays the seed log)."""
    from copes.agents.models import resolve_model_path
    from copes.distributed import RayPopulation, ReplicaSpec

    if config.backend == "vllm":  # one engine per actor, tensor parallel inside it
        import torch

        on_gpu = torch.cuda.is_available() and config.device != "cpu"
        gpus = float(config.tensor_parallel_size) if on_gpu else 0.0
    else:
        gpus = 1.0 if policy.device.type == "cuda" else 0.0  # type: ignore[attr-defined]
    spec = ReplicaSpec(
        policy_factory=partial(build_replica_policy, config),
        model_path=resolve_model_path(config.model),
        rollout_factory=make_train_rollout,
        optimizer_config=opt_config,
        gpus_per_worker=gpus,
    )
    return RayPopulation(
        spec, policy, config.workers, run_dir, config.ray_address, config.checksum_every
    )


def build_optimizer(
    config: TrainConfig,
    optimizer: Any,
    policy: Policy,
    evaluator: PopulationEvaluator | None = None,
) -> Optimizer:
    """The optimizer named in `config` (`copes.optimizers.table`) from its own config
    (`optimizer_config`, or the command line's), scoring its population with `evaluator`
    (`build_evaluator`)."""
    spec = get_optimizer(config.optimizer)
    spec.check(optimizer)
    return spec.build(optimizer, policy, evaluator)


def optimizer_config(config: TrainConfig, **settings: Any) -> Any:
    """The run's optimizer config for the Python API: its table defaults (plain ES's N = 30,
    K = 1), the run's seed, then `settings`; a setting it does not use is an error."""
    spec = get_optimizer(config.optimizer)
    if "seed" in spec.flags():
        settings.setdefault("seed", config.seed)
    return spec.make_config(**settings)


def lora_population(config: TrainConfig, optimizer: Any) -> tuple[int, int] | None:
    """(members, rank) the vLLM engine must serve as LoRA adapters for a batched population
    (`--backend vllm --population-eval batched`), else None; refuses full-rank members
    there, before any engine starts."""
    batched = config.population_eval == "batched" or (
        config.harness is not None and is_population(config.optimizer)  # served: batched
    )
    if not batched or config.backend != "vllm":
        return None
    if not optimizer.perturbation_rank:
        from copes.agents.vllm.population import FULL_RANK_ON_VLLM

        raise UserError(FULL_RANK_ON_VLLM)
    return optimizer.population_size, optimizer.perturbation_rank
