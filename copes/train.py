"""The training loop shared by ES, CoPES, GRPO and LoRA-GRPO.

Reads top to bottom: build the policy, the environments and the optimizer; then, until the
budget (steps, generated tokens or wall seconds) is spent: one optimizer step, its metrics,
validation every `eval_every` steps, a checkpoint every `checkpoint_every` steps. ES/CoPES
also append every step's rewards to `es_log.jsonl` (fsync'ed), so a killed run resumes from
its last checkpoint plus the log, without redoing a single rollout, bit-identically.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from copes.agents.policy import Policy, SamplingConfig
from copes.agents.rollout import RolloutBatch, RolloutStats, rollout
from copes.errors import UserError
from copes.optimizers.base import Optimizer, flag
from copes.optimizers.table import OPTIMIZERS as OPTIMIZER_TABLE
from copes.optimizers.table import get_optimizer, is_population
from copes.run_log import (
    MetricsLog,
    append_jsonl,
    drop_torn_tail,
    read_jsonl,
    rebuild_train_record,
)
from copes.seeding import derive_seed

if TYPE_CHECKING:
    from copes.agents.hf.population import PopulationPolicy

logger = logging.getLogger(__name__)

OPTIMIZERS = tuple(OPTIMIZER_TABLE)
# Settings --resume may change: the budget and bookkeeping, not what is trained or generated
# (--workers gives bit-identical weights, docs/scaling.md).
RESUMABLE_CHANGES = frozenset(
    {
        "steps", "max_tokens", "max_seconds", "resume", "progress", "tensorboard", "out_dir",
        "report_to",
        "eval_every", "checkpoint_every", "keep_checkpoints", "workers", "ray_address",
        "checksum_every", "gpu_memory_utilization", "population_eval",
        "host", "port", "api_key", "step_timeout",  # where and how long the server waits
    }
)  # fmt: skip
# Each preset env's tasks when no --benchmark is given (other envs: a benchmark registered
# with that env, `default_benchmark`).
DEFAULT_BENCHMARKS = {"ToolMath-v0": "synthetic-math", "ToolQA-v0": "synthetic-qa"}
# What the trainer itself passes to every env factory, so --env-kwargs may not set it.
TRAINER_ENV_KWARGS = ("tasks", "max_turns", "invalid_penalty", "call_format")


@dataclass
class TrainConfig:
    """Run settings (each is a `copes-train` flag); optimizer settings live in their configs."""

    optimizer: str = flag("es, copes, grpo or lora-grpo", "copes")
    env: str | None = flag(
        "Gymnasium id of a copes ToolEnv: ToolMath-v0, ToolQA-v0, or any registered id "
        "(module:Id imports module first) (default: the benchmark's env, else ToolMath-v0)",
        None,
    )
    env_kwargs: str | None = flag(
        "JSON object for the env's factory, e.g. '{\"python_timeout\": 5}'", None
    )
    model: str = flag("'tiny', a local Hugging Face folder or a hub id", "tiny")
    out_dir: str = flag("run folder: metrics, checkpoints, logs", "runs/copes")
    benchmark: str | None = flag(
        "training data: a registered benchmark (copes.registry: gsm8k, rg:<dataset>, another "
        "package's) (default: the env's synthetic tasks, or the one benchmark registered "
        "for the env)",
        None,
    )
    train_split: str | None = flag("split trained on (default: the benchmark's, train)", None)
    eval_split: str | None = flag(
        "held-out split validated on (default: the benchmark's, validation)", None
    )
    data_dir: str | None = flag("folder of local benchmark files", None)
    num_train_tasks: int = flag("tasks in the training pool (synthetic: generated)", 1000)
    steps: int | None = flag("budget: optimizer steps", 20)
    max_tokens: int | None = flag("budget: generated tokens, all rollouts included", None)
    max_seconds: float | None = flag("budget: wall-clock seconds", None)
    batch_size: int = flag("tasks per step (every ES member sees the same batch)", 16)
    same_batch: bool = flag("ES: the same task batch for every member (paper)", True)
    max_new_tokens: int = flag("longest turn in tokens", 96)
    max_turns: int = flag("turns per episode", 4)
    max_context: int | None = flag("tokens per episode (default: the model's context)", None)
    invalid_penalty: float = flag("reward of a turn with no valid action, negated (0: none)", 0.0)
    call_format: str = flag(
        "tool calls: tags (any model learns them), native (what the model's chat template "
        "teaches, found by round trip) or one of hermes, qwen-xml, llama-json, glm-xml, "
        "mistral, harmony",
        "tags",
    )
    enable_thinking: bool | None = flag(
        "reasoning models: the chat template's enable_thinking (unset: the template's default)",
        None,
    )
    chat_template_kwargs: str | None = flag(
        'JSON object of extra chat-template variables, e.g. \'{"date_string": "26 Jul 2024"}\'',
        None,
    )
    temperature: float = flag("GRPO sampling temperature (ES scores greedily, Qiu et al.)", 1.0)
    es_temperature: float = flag("ES reward-evaluation temperature (0 = greedy)", 0.0)
    top_p: float = flag("nucleus sampling for training rollouts", 1.0)
    eval_every: int = flag("validate every M steps (0: only at start and end)", 5)
    eval_tasks: int = flag("validation tasks", 64)
    eval_samples: int = flag("samples per validation task (pass@1 averaged over n)", 1)
    eval_temperature: float = flag("validation temperature (0 = greedy)", 0.0)
    checkpoint_every: int = flag("checkpoint every M steps (0: only at the end)", 10)
    keep_checkpoints: int = flag("checkpoints kept", 3)
    seed: int = flag("seed of tasks, sampling and perturbations", 0)
    eval_task_seed: int | None = flag(
        "seed that draws generated validation tasks (unset: --seed); fix it to give runs with "
        "different seeds one shared validation split",
        None,
    )
    device: str = flag("auto, cpu or cuda", "auto")
    dtype: str = flag(
        "float32, bfloat16, or float64 (CPU runs that agree across machines)", "float32"
    )
    backend: str = flag("generation backend: hf (transformers) or vllm", "hf")
    tensor_parallel_size: int = flag("vllm: GPUs one engine spans", 1)
    gpu_memory_utilization: float = flag("vllm: fraction of GPU memory the engine takes", 0.85)
    report_to: str = flag(
        "where metrics go besides metrics.jsonl: tensorboard, wandb, trackio (comma-separated) "
        "or none",
        "tensorboard",
    )
    tensorboard: bool = flag("--no-tensorboard: drop tensorboard from --report-to", True)
    progress: bool = flag("show progress bars", True)
    resume: bool = flag("continue the run in out_dir", False)
    workers: int = flag("ES: Ray actors sharing the population (0: this process, no Ray)", 0)
    ray_address: str | None = flag(
        "with --workers: Ray cluster to join, e.g. auto (unset: start one here)", None
    )
    checksum_every: int = flag("with --workers: compare replica checksums every M steps", 10)
    population_eval: str = flag(
        "ES/CoPES: how a step's members are evaluated: sequential (one after another) or "
        "batched (all at once: --backend hf over N stacked weight copies, or N adapters with "
        "--noise lowrank; --backend vllm with --noise lowrank, N LoRA adapters)",
        "sequential",
    )
    harness: str | None = flag(
        "train an agent through the OpenAI-compatible server (copes.serve): module:function "
        "(async def episode(client, model, task) -> reward, run in this process), env (copes' "
        "own env loop, through the server) or http (clients ask for work over HTTP: "
        "copes-serve) (default: none, in-process rollouts)",
        None,
    )
    host: str = flag("with --harness: address the server binds (non-loopback needs a key)",
                     "127.0.0.1")  # fmt: skip
    port: int = flag("with --harness: port the server binds (0: a free one)", 0)
    api_key: str | None = flag(
        "with --harness: the key clients must send (default: $COPES_API_KEY, else none)", None
    )
    step_timeout: float = flag(
        "with --harness: seconds a step waits for every session's reward before the run "
        "stops (no partial update)",
        1800.0,
    )

    def __post_init__(self) -> None:
        get_optimizer(self.optimizer)  # unknown names fail here, listing the table
        self._resolve_env_and_benchmark()
        from copes.reporting import parse_report_to

        parse_report_to(self.report_to)  # unknown or missing reporters fail before the run
        budgets = (self.steps, self.max_tokens, self.max_seconds)
        if all(b is None for b in budgets):
            raise ValueError("no budget: set steps, max_tokens or max_seconds")
        if any(b is not None and b <= 0 for b in budgets):
            raise ValueError(f"budgets must be positive, got steps/tokens/seconds = {budgets}")
        from copes.envs.parsing import CALL_FORMATS

        if self.call_format not in ("native", *CALL_FORMATS):
            raise ValueError(
                f"unknown call format {self.call_format!r}; choose native or one of {CALL_FORMATS}"
            )
        from copes.agents.chat import template_kwargs_for

        template_kwargs_for(self.enable_thinking, self.chat_template_kwargs)  # fails early
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"unknown backend {self.backend!r}; choose hf or vllm")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.batch_size < 1 or self.eval_tasks < 1 or self.eval_samples < 1:
            raise ValueError("batch_size, eval_tasks and eval_samples must be >= 1")
        if self.workers < 0 or self.checksum_every < 0:
            raise ValueError("workers and checksum_every must be >= 0")
        if self.workers and not is_population(self.optimizer):
            raise ValueError(
                f"--workers spreads an ES/CoPES population over Ray actors; {self.optimizer} "
                "trains in one process (use --workers 0)"
            )
        if self.harness is not None:
            self._check_harness()
        if self.population_eval not in ("sequential", "batched"):
            raise ValueError(
                f"unknown --population-eval {self.population_eval!r}; choose sequential or batched"
            )
        if self.population_eval == "batched":
            if not is_population(self.optimizer):
                raise ValueError(
                    f"--population-eval batched evaluates an ES/CoPES population; "
                    f"{self.optimizer} has none (drop the flag)"
                )
            if self.workers:
                raise ValueError(
                    "--population-eval batched runs the whole population in this process: use "
                    "--workers 0 (or --population-eval sequential)"
                )

    def _check_harness(self) -> None:
        if self.workers:
            raise ValueError("--harness serves the population from this process: use "
                             "--workers 0")  # fmt: skip
        if self.step_timeout <= 0:
            raise ValueError(f"--step-timeout must be positive, got {self.step_timeout}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is None:
            import os

            self.api_key = os.environ.get("COPES_API_KEY") or None
        from copes.serve.server import is_loopback

        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"--host {self.host} is not a loopback address: serving there "
                             "needs --api-key (or COPES_API_KEY)")  # fmt: skip
        if self.harness not in ("env", "http"):
            from copes.serve.harness import load_harness

            load_harness(self.harness)  # a bad module or function fails before the model

    def _resolve_env_and_benchmark(self) -> None:
        """Fill in the env and benchmark each other's defaults, and check both exist."""
        from copes.registry import benchmark_names, get_benchmark

        benchmark_names()  # other packages' entry points register their benchmarks and envs
        benchmark = None if self.benchmark is None else get_benchmark(self.benchmark)
        if self.env is None:
            self.env = "ToolMath-v0" if benchmark is None else benchmark.env_id
        check_env_id(self.env)
        if self.benchmark is None:
            self.benchmark = default_benchmark(self.env)
            benchmark = get_benchmark(self.benchmark)
        assert benchmark is not None
        if self.train_split is None:
            self.train_split = benchmark.train_split
        if self.eval_split is None:
            self.eval_split = benchmark.eval_split
        parse_env_kwargs(self.env_kwargs)


def public_settings(config: TrainConfig) -> dict[str, Any]:
    """A run's settings as they are written, reported and printed: the API key masked."""
    settings = asdict(config)
    if settings.get("api_key"):
        settings["api_key"] = "<set>"
    return settings


def check_env_id(env_id: str) -> None:
    """`env_id` is registered with Gymnasium (``module:Id`` imports module first)."""
    import importlib

    import gymnasium as gym

    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise ValueError(f"--env {env_id}: cannot import {module!r} ({exc})") from None
    if name not in gym.registry:
        copes_ids = sorted(i for i in gym.registry if i.startswith(("ToolMath", "ToolQA")))
        raise ValueError(
            f"unknown env {env_id!r}: not a registered Gymnasium id; copes registers "
            f"{', '.join(copes_ids[:2])} (and per-benchmark ids), other packages register "
            "theirs when imported (use module:Id)"
        )


def default_benchmark(env_id: str) -> str:
    """The tasks an env trains on without --benchmark: a preset's synthetic tasks, else the
    one benchmark registered for that env."""
    from copes.registry import iter_benchmarks

    name = env_id.rpartition(":")[2]
    if name in DEFAULT_BENCHMARKS:
        return DEFAULT_BENCHMARKS[name]
    mine = [b.name for b in iter_benchmarks() if b.env is not None and b.env_id in (env_id, name)]
    if len(mine) == 1:
        return mine[0]
    raise ValueError(
        f"--env {env_id} has no default tasks ({len(mine)} benchmarks are registered for it"
        f"{': ' + ', '.join(mine) if mine else ''}); pass --benchmark NAME"
    )


def parse_env_kwargs(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env-kwargs is not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--env-kwargs must be a JSON object, got {text!r}")
    taken = sorted(set(kwargs) & set(TRAINER_ENV_KWARGS))
    if taken:
        raise ValueError(
            f"--env-kwargs sets {', '.join(taken)}, which the trainer sets itself; use "
            "--benchmark for tasks and --max-turns, --invalid-penalty, --call-format"
        )
    return kwargs


# ---------------------------------------------------------------------- rollouts
@dataclass(frozen=True)
class PlannedEpisode:
    """One episode of a population rollout: its member's slot and index, its index among
    the member's episodes, its task, and its sampling stream (and turn-by-turn seed)."""

    slot: int
    member: int
    index: int
    task: Any
    stream: int
    seed: int | None


class TaskRollout:
    """The `RolloutFn` of a run: the trajectories of (step, member), a pure function of them.

    Step `step`'s batch is `batch_size` tasks drawn with the run's seed and the step (the same
    batch for every member by default, with common sampling draws); a member gets its own
    batch without `same_batch`. Each task is sampled `samples_per_task` times (GRPO's group).
    Keeps a pool of environments (one per concurrent episode) and reuses them every call.
    """

    def __init__(
        self,
        make_env: Callable[[], Any],
        tasks: Sequence[Any],
        batch_size: int,
        samples_per_task: int,
        sampling: SamplingConfig,
        seed: int,
        same_batch: bool = True,
        max_context: int | None = None,
    ) -> None:
        self.tasks = list(tasks)
        self.batch_size = min(batch_size, len(self.tasks))
        self.samples = samples_per_task
        self.sampling = sampling
        self.seed = seed
        self.same_batch = same_batch
        self.max_context = max_context
        self.envs = [make_env() for _ in range(self.batch_size * samples_per_task)]
        self._make_env = make_env
        self._population_envs: list[Any] = []  # `population`'s, made on first use

    def tasks_of(self, step: int, member: int | None = None) -> list[Any]:
        """The tasks `member` (None: the step's shared batch) sees at `step`."""
        draw = None if self.same_batch else member
        rng = random.Random(derive_seed("batch", self.seed, step, draw))
        return rng.sample(self.tasks, self.batch_size)

    def sampling_of(self, step: int, member: int | None = None) -> SamplingConfig:
        """The sampling of (step, member)'s episodes."""
        if self.sampling.greedy:
            return self.sampling
        # With the same batch, every member also gets the same sampling draws (common
        # random numbers): reward differences then come from the weights, not the dice.
        draws = None if self.same_batch else member
        return replace(self.sampling, seed=derive_seed("sample", self.seed, step, draws))

    def __call__(self, policy: Any, step: int, member: int | None = None) -> RolloutBatch:
        tasks = self.tasks_of(step, member)
        options = [{"task": t} for t in tasks for _ in range(self.samples)]
        envs = self.envs[: len(options)]
        sampling = self.sampling_of(step, member)
        return rollout(policy, envs, sampling, options=options, max_context=self.max_context)

    def population(
        self, policy: PopulationPolicy, step: int, members: Sequence[int]
    ) -> list[RolloutBatch]:
        """The batches of several members of `step` in one rollout: what `self(policy, step,
        m)` gives for each m, each episode with its member's weights and sampling stream.

        Episodes are interleaved task-major (task 0 of every member, then task 1, ...), so a
        batch of the episode loop holds about as many rows of every member.
        """
        plan = self.population_plan(step, members)
        per_member = self.batch_size * self.samples
        while len(self._population_envs) < len(plan):
            self._population_envs.append(self._make_env())
        options = [{"task": e.task} for e in plan]
        policy.assign([e.slot for e in plan], [e.stream for e in plan], [e.seed for e in plan])
        envs = self._population_envs[: len(options)]
        sampling = self.sampling_of(step, members[0])
        batch = rollout(policy, envs, sampling, options=options, max_context=self.max_context)
        grouped: list[list[Any]] = [[None] * per_member for _ in members]
        for episode, trajectory in zip(plan, batch, strict=True):
            grouped[episode.slot][episode.index] = trajectory
        share = len(members)
        return [
            RolloutBatch(
                trajectories,
                RolloutStats(
                    generation_seconds=batch.stats.generation_seconds / share,
                    env_seconds=batch.stats.env_seconds / share,
                    generated_tokens=sum(t.num_generated_tokens for t in trajectories),
                    generate_calls=batch.stats.generate_calls,
                ),
            )
            for trajectories in grouped
        ]

    def population_plan(self, step: int, members: Sequence[int]) -> list[PlannedEpisode]:
        """The episodes of several members of `step` in the order one episode loop runs
        them: interleaved task-major (task 0 of every member, then task 1, ...), so a batch
        holds about as many rows of every member; each with the stream it samples from when
        its member runs alone (`population`, and `copes.serve` for served steps)."""
        plans = [(self.tasks_of(step, m), self.sampling_of(step, m)) for m in members]
        episodes = []
        for j in range(self.batch_size * self.samples):
            for slot, (tasks, sampling) in enumerate(plans):
                # The stream this episode (index j) samples from when its member runs alone
                # in the episode loop; a turn-by-turn population derives it from the seed.
                seed = sampling.seed if sampling.seed is not None else self.seed
                stream = derive_seed("episode-sampling", seed, j)
                episodes.append(
                    PlannedEpisode(slot, members[slot], j, tasks[j // self.samples], stream,
                                   sampling.seed)
                )  # fmt: skip
        return episodes

    def close(self) -> None:
        for env in self.envs + self._population_envs:
            env.close()


# ---------------------------------------------------------------------- building blocks
def load_tasks_for(
    config: TrainConfig, split: str, limit: int, task_seed: int | None = None
) -> list[Any]:
    """`limit` tasks of `split`; generated benchmarks draw them with `task_seed` (default:
    the run's seed)."""
    from copes.envs.presets import load_tasks

    assert config.benchmark is not None  # resolved by TrainConfig
    seed = config.seed if task_seed is None else task_seed
    tasks = load_tasks(
        config.benchmark, split, data_dir=config.data_dir, limit=limit, task_seed=seed
    )
    if not tasks:
        raise ValueError(f"benchmark {config.benchmark!r} split {split!r} has no tasks")
    return tasks


def env_factory(config: TrainConfig, call_format: str = "tags") -> Callable[[], Any]:
    """Builds the run's environments (`gym.make` of --env with the benchmark's env kwargs,
    its grader and --env-kwargs); `call_format` is resolved (`resolve_call_format`)."""
    import gymnasium as gym

    from copes.envs.core import ToolEnv
    from copes.registry import get_benchmark

    assert config.env is not None and config.benchmark is not None  # resolved by TrainConfig
    benchmark = get_benchmark(config.benchmark)
    kwargs = dict(benchmark.env_kwargs)
    if benchmark.grader is not None:
        kwargs["grader"] = benchmark.grader
    kwargs.update(parse_env_kwargs(config.env_kwargs))
    placeholder = load_tasks_for(config, config.train_split, 1)

    def make() -> Any:
        return gym.make(
            config.env, tasks=placeholder, max_turns=config.max_turns,
            invalid_penalty=config.invalid_penalty, call_format=call_format,
            disable_env_checker=True, **kwargs,
        )  # fmt: skip

    try:
        probe = make()
    except TypeError as exc:
        reason = str(exc).split(" with kwargs")[0][:160]
        raise UserError(
            f"--env {config.env} is not a copes ToolEnv factory: it refused tasks=, max_turns=, "
            f"invalid_penalty=, call_format= or --env-kwargs ({reason})"
        ) from None
    if not isinstance(probe.unwrapped, ToolEnv):
        probe.close()
        raise UserError(
            f"--env {config.env} makes a {type(probe.unwrapped).__name__}, not a copes ToolEnv; "
            "copes-train needs ToolEnv's text turns and reset(options={'task': ...}): build "
            "your env with copes.envs.ToolEnv or a preset (tool_math_env(extra_tools=[...]))"
        )
    probe.close()
    return make


def build_policy(config: TrainConfig, lora: tuple[int, int] | None = None) -> Policy:
    """The policy of a run; with vLLM, GRPO also gets a transformers copy to train, and
    `lora` = (members, rank) starts the engine's multi-LoRA serving for a batched
    low-rank population."""
    from copes.agents.chat import template_kwargs_for

    template_kwargs = template_kwargs_for(config.enable_thinking, config.chat_template_kwargs)
    if config.backend == "vllm":
        from copes.agents.vllm.policy import VLLMPolicy

        return VLLMPolicy.from_pretrained(
            config.model, dtype=config.dtype, seed=config.seed, device=config.device,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            trainable=get_optimizer(config.optimizer).gradients,
            chat_template_kwargs=template_kwargs,
            lora_members=lora[0] if lora else 0, lora_rank=lora[1] if lora else 0,
        )  # fmt: skip
    from copes.agents.hf.policy import HFPolicy

    return HFPolicy.from_pretrained(
        config.model, device=config.device, dtype=config.dtype,
        chat_template_kwargs=template_kwargs,
    )  # fmt: skip


def build_replica_policy(config: TrainConfig, model_path: str) -> Policy:
    """A `--workers` actor's policy: the run's backend, loaded from `model_path`."""
    return build_policy(replace(config, model=model_path))


def build_optimizer(config: TrainConfig, overrides: dict[str, Any], policy: Policy) -> Optimizer:
    """The optimizer named in `config` (`copes.optimizers.table`), its config built from
    `overrides` (CLI flags); a flag it does not use is an error naming it."""
    spec = get_optimizer(config.optimizer)
    return spec.build(optimizer_config(config, overrides), policy)


def optimizer_config(config: TrainConfig, overrides: dict[str, Any]) -> Any:
    """The optimizer's own config: its table defaults, the run's seed, then the flags."""
    spec = get_optimizer(config.optimizer)
    settings = dict(overrides)
    if "seed" in spec.flags():
        settings.setdefault("seed", config.seed)
    return spec.make_config(settings)


def lora_population(config: TrainConfig, overrides: dict[str, Any]) -> tuple[int, int] | None:
    """(members, rank) the vLLM engine must serve as LoRA adapters for a batched population
    (`--backend vllm --population-eval batched`), else None; refuses full-rank members
    there, before any engine starts."""
    batched = config.population_eval == "batched" or (
        config.harness is not None and is_population(config.optimizer)  # served: batched
    )
    if not batched or config.backend != "vllm":
        return None
    opt_config = optimizer_config(config, overrides)
    if not opt_config.perturbation_rank:
        from copes.optimizers.batched import FULL_RANK_ON_VLLM

        raise UserError(FULL_RANK_ON_VLLM)
    return opt_config.population_size, opt_config.perturbation_rank


# ---------------------------------------------------------------------- the trainer
@dataclass
class Budget:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def exhausted(self, config: TrainConfig) -> bool:
        return (
            (config.steps is not None and self.steps >= config.steps)
            or (config.max_tokens is not None and self.tokens >= config.max_tokens)
            or (config.max_seconds is not None and self.seconds >= config.max_seconds)
        )


@dataclass
class Trainer:
    config: TrainConfig
    optimizer_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        self.run_dir = Path(c.out_dir)
        from copes.errors import check_device

        check_device(c.device)
        if not c.resume:  # refuse before anything is built or loaded
            self._check_fresh_run_dir()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"--out-dir {self.run_dir}: cannot create the run folder ({exc.strerror}); "
                "choose a writable folder"
            ) from None
        if not c.progress:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        # Data and env first: a missing file or a foreign env fails before the model loads.
        train_tasks = load_tasks_for(c, c.train_split, c.num_train_tasks)
        eval_tasks = load_tasks_for(c, c.eval_split, c.eval_tasks, c.eval_task_seed)
        env_factory(c)
        import torch

        torch.manual_seed(c.seed)
        self.policy = build_policy(c, lora_population(c, self.optimizer_overrides))
        self.optimizer = build_optimizer(c, self.optimizer_overrides, self.policy)
        from copes.agents.chat import resolve_call_format

        self.call_format = resolve_call_format(c.call_format, self.policy.chat)
        make_env = env_factory(c, self.call_format)
        samples = self.optimizer.samples_per_task
        temperature = getattr(c, get_optimizer(c.optimizer).rollout_temperature)
        sampling = SamplingConfig(c.max_new_tokens, temperature=temperature, top_p=c.top_p)
        make_train_rollout = partial(
            TaskRollout, make_env, train_tasks, c.batch_size, samples, sampling, c.seed,
            c.same_batch, c.max_context,
        )  # fmt: skip
        self.train_rollout = make_train_rollout()
        self._make_train_rollout = make_train_rollout  # what --workers actors build
        eval_sampling = SamplingConfig(c.max_new_tokens, temperature=c.eval_temperature)
        self.eval_rollout = TaskRollout(
            make_env, eval_tasks, len(eval_tasks), c.eval_samples, eval_sampling, c.seed + 1,
            True, c.max_context,
        )  # fmt: skip
        self.evaluator: Any = None
        self.server: Any = None
        if c.harness is not None:  # everything is served: members, GRPO groups, validation
            self._serve(sampling, eval_tasks)
        elif c.population_eval == "batched":  # N weight copies: refused now if they do not fit
            from copes.optimizers.batched import BatchedEvaluator

            opt_config = optimizer_config(c, self.optimizer_overrides)
            evaluator = BatchedEvaluator(
                self.policy, self.train_rollout, opt_config.population_size,  # type: ignore[arg-type]
                rank=opt_config.perturbation_rank,
            )  # fmt: skip
            self.optimizer.use_evaluator(evaluator)  # type: ignore[attr-defined]
            self.evaluator = evaluator
        self.budget = Budget()
        self.log: MetricsLog | None = None  # opened by run()
        self.population: Any = None  # --workers: RayPopulation, started by run()

    def _serve(self, sampling: SamplingConfig, eval_tasks: Sequence[Any]) -> None:
        """Rollouts through the OpenAI-compatible server (`copes.serve`): ES members as
        sessions of one batched population, GRPO's groups and validation as the policy's."""
        from copes.serve import HttpHarness, InProcessHarness, PolicyServer, ServedRollout
        from copes.serve.harness import EnvLoop, load_harness

        c = self.config
        if c.harness == "http":
            harness: Any = HttpHarness()
        elif c.harness == "env":
            harness = InProcessHarness(EnvLoop(env_factory(c, self.call_format)))
        else:
            harness = InProcessHarness(load_harness(c.harness))  # type: ignore[arg-type]
        self.server = PolicyServer(
            self.policy, sampling, self.call_format, c.api_key, c.step_timeout,
            max_context=c.max_context,
        )  # fmt: skip
        if is_population(c.optimizer):
            from copes.serve import ServedEvaluator

            opt_config = optimizer_config(c, self.optimizer_overrides)
            self.evaluator = ServedEvaluator(
                self.server, harness, self.policy, self.train_rollout,
                opt_config.population_size, rank=opt_config.perturbation_rank,
            )  # fmt: skip
            self.optimizer.use_evaluator(self.evaluator)  # type: ignore[attr-defined]
        else:
            self.train_rollout = ServedRollout(self.server, harness, self.train_rollout)
        self.eval_rollout = ServedRollout(self.server, harness, self.eval_rollout, "validation")

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        c = self.config
        # Accept the run before writing anything into its folder (a fresh run's folder was
        # checked, and created, before the model was loaded).
        if c.resume:
            self._check_resume_settings()
        self._write_run_config()
        from copes.reporting import parse_report_to

        reporters = [r for r in parse_report_to(c.report_to) if c.tensorboard or r != "tensorboard"]
        self.log = MetricsLog(self.run_dir, reporters, config=public_settings(self.config),
                              project="copes-train")  # fmt: skip
        if c.resume:
            self._resume()
        if self.server is not None:  # the run is accepted: serve it
            self.server.policy_version = self.budget.steps
            url = self.server.start(c.host, c.port)
            logger.info("serving the policy at %s/v1 (ask/tell: %s/copes/v1/ask)", url, url)
        start_seconds = self.budget.seconds
        clock = time.perf_counter()
        if self._validation_due() and not self.log.has("validation", self.budget.steps):
            self.validate()  # step 0, or one a kill lost: the same weights, the same draws
        bar = tqdm(
            total=c.steps, initial=self.budget.steps, desc="training", disable=not c.progress
        )
        try:
            if c.workers:  # ES/CoPES members on Ray actors (TrainConfig checks the optimizer)
                self.population = self.start_population()
                self.optimizer.use_evaluator(self.population)
            while not self.budget.exhausted(c):
                step = self.budget.steps
                stats = self.optimizer.step(self.policy, self.train_rollout, step)
                self.budget.steps += 1
                if self.server is not None:  # the weights changed: the policy's new name
                    self.server.policy_version = self.budget.steps
                self.budget.tokens += stats.generated_tokens
                self.budget.seconds = start_seconds + time.perf_counter() - clock
                if self.optimizer.replays:  # the replay log: on disk before anything else
                    entry = {
                        **stats.log,
                        "tokens": self.budget.tokens,
                        "seconds": self.budget.seconds,
                    }
                    append_jsonl(self.run_dir / "es_log.jsonl", entry, sync=True)
                self.log.log("train", step, self._train_record(stats))
                bar.update()
                bar.set_postfix(reward=f"{stats.metrics['reward_mean']:.3f}")
                done = self.budget.exhausted(c)
                if done or (c.eval_every and self.budget.steps % c.eval_every == 0):
                    self.validate()
                if done or (c.checkpoint_every and self.budget.steps % c.checkpoint_every == 0):
                    self.checkpoint()
            if self._final_checkpoint_missing():  # resumed after the last step was logged
                self.checkpoint()  # (its validation was kept, or made above)
        finally:
            bar.close()
            self.log.close()
            self.train_rollout.close()
            self.eval_rollout.close()
            if self.population is not None:
                self.population.close()
            if self.server is not None:  # clients asking over HTTP hear that it is over
                self.server.stop(linger=2.0 if self.config.harness == "http" else 0.0)
        return self.summary()

    def close(self) -> None:
        """Release the policy's engine (vLLM processes and GPU memory), if it has one."""
        if self.evaluator is not None:
            self.evaluator.close()
        self.policy.close()

    def validate(self) -> dict[str, float]:
        """pass@1 (averaged over n samples) on the held-out split, with the current weights."""
        batch = self.eval_rollout(self.policy, 0)  # step 0 always: the same tasks and draws
        n = len(batch)
        result = {
            "accuracy": sum(t.correct for t in batch) / n,
            "reward_mean": sum(t.reward for t in batch) / n,
            "tool_calls_mean": sum(t.tool_calls for t in batch) / n,
            "turns_mean": sum(t.turns for t in batch) / n,
            "invalid_rate": sum(t.end_reason == "invalid" for t in batch) / n,
            "generated_tokens_total": self.budget.tokens,
            "seconds_total": self.budget.seconds,
        }
        self.log.log("validation", self.budget.steps, result)
        self.log.plot()
        logger.info(
            "step %d validation reward %.3f accuracy %.3f (ended invalid %.3f)",
            self.budget.steps, result["reward_mean"], result["accuracy"], result["invalid_rate"],
        )  # fmt: skip
        return result

    def checkpoint(self) -> Path:
        from copes.checkpoint import save_checkpoint

        optimizer_state = self.optimizer.state_dict()
        tensors = optimizer_state.pop("optimizer_tensors", None)
        state = {"budget": asdict(self.budget), "optimizer": optimizer_state,
                 "config": public_settings(self.config)}  # fmt: skip
        model = self.optimizer.export_model(self.policy)
        master = self.optimizer.master_state(self.policy, model)  # e.g. fp32 beside bf16
        return save_checkpoint(
            self.run_dir, self.budget.steps, model, self.policy.tokenizer, state, tensors, master,
            keep=self.config.keep_checkpoints,
        )  # fmt: skip

    def _validation_due(self) -> bool:
        """Whether the loop validates at the current step: the first, every `eval_every`-th
        and the last (budget spent)."""
        steps, every = self.budget.steps, self.config.eval_every
        return (
            steps == 0 or bool(every and steps % every == 0) or self.budget.exhausted(self.config)
        )

    def _final_checkpoint_missing(self) -> bool:
        """The budget is spent but no checkpoint holds its last step (a run killed, or out of
        disk, after logging its last ES step and before checkpointing it)."""
        from copes.checkpoint import latest_checkpoint

        if not self.budget.exhausted(self.config) or self.budget.steps == 0:
            return False
        latest = latest_checkpoint(self.run_dir)
        return latest is None or latest.name != f"step-{self.budget.steps:06d}"

    def start_population(self) -> Any:
        """W Ray actors, each a replica of this policy and training rollout (no weights sent)."""
        from copes.agents.models import resolve_model_path
        from copes.distributed import RayPopulation, ReplicaSpec

        c = self.config
        if c.backend == "vllm":  # one engine per actor, tensor parallel inside it
            import torch

            on_gpu = torch.cuda.is_available() and c.device != "cpu"
            gpus = float(c.tensor_parallel_size) if on_gpu else 0.0
        else:
            gpus = 1.0 if self.policy.device.type == "cuda" else 0.0
        spec = ReplicaSpec(
            policy_factory=partial(build_replica_policy, c),
            model_path=resolve_model_path(c.model),
            rollout_factory=self._make_train_rollout,
            optimizer_state=self.optimizer.state_dict(),
            gpus_per_worker=gpus,
        )
        population = RayPopulation(spec, c.workers, self.run_dir, c.ray_address, c.checksum_every)
        return population.attach(self.policy)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        from copes.checkpoint import (
            latest_checkpoint,
            load_master_state,
            load_optimizer_tensors,
            load_state,
        )

        # A SIGKILL may leave half a line: es_log's step is then rolled out again; a torn
        # train record of a logged step is rebuilt from es_log below.
        for log in ("es_log.jsonl", "metrics.jsonl"):
            drop_torn_tail(self.run_dir / log)
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            try:
                state = load_state(checkpoint)
                self.optimizer.load_weights(self.policy, checkpoint)
                optimizer_state = dict(state["optimizer"])
                tensors = load_optimizer_tensors(checkpoint)
                master = load_master_state(checkpoint)
                budget = Budget(**state["budget"])
            except Exception as exc:  # torn, foreign or garbage files: name the checkpoint
                raise UserError(
                    f"checkpoint {checkpoint} cannot be read ({type(exc).__name__}: {exc}); "
                    "point checkpoints/latest at an earlier step-* folder (or remove it to "
                    "start from the base model plus es_log.jsonl)"
                ) from exc
            if tensors is not None:
                optimizer_state["optimizer_tensors"] = tensors
            self.optimizer.load_state_dict(optimizer_state)
            self.budget = budget
            if master is not None:
                self.policy.weights().load_master_state(master)
            logger.info("resuming from %s (step %d)", checkpoint, self.budget.steps)
        logged = read_jsonl(self.run_dir / "es_log.jsonl") if self.optimizer.replays else []
        if self.optimizer.replays:
            entries = [e for e in logged if e["step"] >= self.budget.steps]
            entries = self._contiguous(entries, self.budget.steps)
            if entries:
                self.optimizer.replay(entries, self.policy)
                last = entries[-1]
                self.budget = Budget(last["step"] + 1, last["tokens"], last["seconds"])
                logger.info("replayed %d logged steps without rollouts", len(entries))
        elif checkpoint is None:
            logger.info("no checkpoint to resume from: starting from the base model")
        self.log.resume_at(self.budget.steps, self._rebuilt_train_records(logged))

    def _rebuilt_train_records(self, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Train records of the steps before the resume point that metrics.jsonl lacks (a
        torn last line, or a kill between the es_log and metrics appends), rebuilt from
        their es_log entries; a lacking step with no entry (GRPO, whose metrics lines are
        not fsynced: an OS crash) cannot be rebuilt and is named in a warning."""
        have = {
            r["step"] for r in read_jsonl(self.run_dir / "metrics.jsonl") if r["kind"] == "train"
        }
        lacking = [s for s in range(self.budget.steps) if s not in have]
        if not lacking:
            return []
        by_step = {int(e["step"]): e for e in logged}
        rebuilt = [
            rebuild_train_record(by_step[s], by_step.get(s - 1)) for s in lacking if s in by_step
        ]
        if rebuilt:
            logger.warning(
                "metrics.jsonl lacked the train record of step(s) %s: rebuilt from es_log.jsonl "
                "(rewards, tokens, seconds; accuracy and timings are not logged there, so left "
                "out; marked rebuilt_from)", ", ".join(str(r["step"]) for r in rebuilt),
            )  # fmt: skip
        if lost := [s for s in lacking if s not in by_step]:
            logger.warning(
                "metrics.jsonl lacks the train record of step(s) %s and no es_log.jsonl entry "
                "holds them: they stay missing (their weights are in the checkpoint)",
                ", ".join(map(str, lost)),
            )
        return rebuilt

    @staticmethod
    def _contiguous(entries: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
        kept, expected = [], first
        for entry in sorted(entries, key=lambda e: e["step"]):
            if entry["step"] != expected:
                break
            kept.append(entry)
            expected += 1
        return kept

    def _check_fresh_run_dir(self) -> None:
        existing = [
            p
            for p in ("metrics.jsonl", "es_log.jsonl", "checkpoints")
            if (self.run_dir / p).exists()
        ]
        if existing:
            raise FileExistsError(
                f"{self.run_dir} already holds a run ({', '.join(existing)}); pass --resume to "
                "continue it or choose another --out-dir"
            )

    def _run_config(self) -> dict[str, Any]:
        record = {
            "train": public_settings(self.config),
            "optimizer": self.optimizer.state_dict().get("config"),
        }
        return json.loads(json.dumps(record, default=str))  # compared as it is stored

    def _check_resume_settings(self) -> None:
        """--resume must not change what is trained or generated: compare every setting
        but the budget and the bookkeeping (RESUMABLE_CHANGES) and name each difference."""
        path = self.run_dir / "config.json"
        if not path.exists():
            return
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(
                f"{path} is not a copes run config ({exc}): not a run folder?"
            ) from None
        if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
            raise UserError(
                f"{path} is not a copes run config (no 'train' settings): --resume needs a "
                "folder written by copes-train; choose another --out-dir"
            )
        record = self._run_config()
        changed = [
            f"{k}: {saved['train'].get(k)!r} -> {v!r}"
            for k, v in record["train"].items()
            if k not in RESUMABLE_CHANGES and saved["train"].get(k) != v
        ]
        old_opt, new_opt = saved.get("optimizer") or {}, record["optimizer"] or {}
        # A setting added after the run was written (e.g. --noise) had its default then.
        old_opt = {**self._optimizer_defaults(), **old_opt}
        changed += [
            f"{k}: {old_opt.get(k)!r} -> {new_opt.get(k)!r}"
            for k in sorted(set(old_opt) | set(new_opt))
            if old_opt.get(k) != new_opt.get(k)
        ]
        if changed:
            raise ValueError(
                f"--resume with settings that differ from the run in {self.run_dir}: "
                f"{'; '.join(changed)}. Resume with the original settings, or start a new run "
                "in another --out-dir"
            )

    def _optimizer_defaults(self) -> dict[str, Any]:
        """The optimizer config's defaults, as the run config stores them (JSON)."""
        config = getattr(self.optimizer, "config", None)
        if not is_dataclass(config):
            return {}
        defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
        return json.loads(json.dumps(defaults, default=str))

    def _write_run_config(self) -> None:
        path = self.run_dir / "config.json"
        if self.config.resume and path.exists():
            return  # checked equal (_check_resume_settings); the budget may have grown
        path.write_text(json.dumps(self._run_config(), indent=2))

    def _train_record(self, stats: Any) -> dict[str, Any]:
        return {
            **stats.metrics,
            "generated_tokens": stats.generated_tokens,
            "generated_tokens_total": self.budget.tokens,
            "generation_seconds": stats.generation_seconds,
            "tool_seconds": stats.env_seconds,
            "optimizer_seconds": stats.optimizer_seconds,
            "seconds_total": self.budget.seconds,
        }

    def summary(self) -> dict[str, Any]:
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        val = [r for r in records if r["kind"] == "validation"]
        return {
            "run_dir": str(self.run_dir),
            "steps": self.budget.steps,
            "generated_tokens": self.budget.tokens,
            "seconds": round(self.budget.seconds, 1),
            "validation_accuracy_first": val[0]["accuracy"] if val else None,
            "validation_accuracy_last": val[-1]["accuracy"] if val else None,
            "validation_reward_first": val[0]["reward_mean"] if val else None,
            "validation_reward_last": val[-1]["reward_mean"] if val else None,
            "checksum": self.optimizer.fingerprint(self.policy),
        }
