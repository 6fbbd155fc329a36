"""A run's settings: `TrainConfig` (every flag of copes-train, checked before anything is
built), what may change on `--resume`, and the env/benchmark defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from copes.optimizers.configs import flag
from copes.optimizers.table import OPTIMIZERS as OPTIMIZER_TABLE
from copes.optimizers.table import get_optimizer, is_population

OPTIMIZERS = tuple(OPTIMIZER_TABLE)
# Settings --resume may change: the budget and bookkeeping, not what is trained or generated
# (--workers gives bit-identical weights, docs/scaling.md).
RESUMABLE_CHANGES = frozenset(
    {
        "steps", "max_tokens", "max_seconds", "max_cpu_seconds", "resume", "progress",
        "tensorboard", "out_dir", "report_to",
        "eval_every", "checkpoint_every", "keep_checkpoints", "workers", "ray_address",
        "checksum_every", "gpu_memory_utilization", "kv_cache_gib", "population_eval",
        "host", "port", "api_key", "step_timeout", "request_timeout",  # the server's waits
    }
)  # fmt: skip
# Each preset env's tasks when no --benchmark is given (other envs: a benchmark registered
# with that env, `default_benchmark`).
DEFAULT_BENCHMARKS = {"ToolMath-v0": "synthetic-math", "ToolQA-v0": "synthetic-qa"}


@dataclass
class TrainConfig:
    """Run settings (each is a `copes-train` flag); optimizer settings live in their configs."""

    _argument_group_name: ClassVar[str] = "run"

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
    out_dir: str = flag("run folder: metrics, checkpoints, logs", "runs/copes", ("--output-dir",))
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
    max_seconds: float | None = flag(
        "budget: wall-clock seconds of training steps (validation and checkpoints excluded)", None
    )
    max_cpu_seconds: float | None = flag(
        "budget: the run's own CPU seconds of training steps (user + system, all its threads; "
        "other work on the machine's cores does not count, so runs sharing a machine get "
        "equal budgets; validation and checkpoints excluded)",
        None,
    )
    batch_size: int = flag("tasks per step (every ES member sees the same batch)", 16)
    same_batch: bool = flag("ES: the same task batch for every member (paper)", True)
    max_new_tokens: int = flag("longest turn in tokens", 96)
    max_turns: int = flag("turns per episode", 4)
    max_context: int | None = flag("tokens per episode (default: the model's context)", None)
    invalid_penalty: float = flag("reward of a turn with no valid action, negated (0: none)", 0.0)
    demonstrations: int = flag(
        "worked examples of the call protocol played as earlier turns before every task "
        "(0-2; prompt, never trained on: copes.envs.demonstrations)",
        0,
    )
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
        "float32, bfloat16, float16, float64 (CPU runs that agree across machines) or auto "
        "(GPU: bf16; CPU: bf16 only where the CPU has native bf16 and it measured faster)",
        "float32",
    )
    backend: str = flag("generation backend: hf (transformers) or vllm", "hf")
    tensor_parallel_size: int = flag("vllm: GPUs one engine spans", 1)
    gpu_memory_utilization: float = flag("vllm: fraction of GPU memory the engine takes", 0.85)
    kv_cache_gib: float | None = flag(
        "vllm: GiB for the KV cache (default on a CPU: what the batch needs, copes.agents"
        ".vllm.kv_space; on a GPU: vLLM's share of --gpu-memory-utilization)",
        None,
    )
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
    request_timeout: float = flag(
        "with --harness: seconds a request waits for its reply before an HTTP 504 says why",
        600.0,
    )
    turn_schedule: str | None = flag(
        "with --harness: when served turns join the batch: as-they-come (each at the next "
        "decode step; any client, sequential or concurrent) or deterministic (a step starts "
        "once every session has sent its first request; tokens equal in-process rollouts "
        "bit for bit) (default: as-they-come with --harness http, else deterministic)",
        None,
    )

    def __post_init__(self) -> None:
        get_optimizer(self.optimizer)  # unknown names fail here, listing the table
        self._resolve_env_and_benchmark()
        from copes.reporting import parse_report_to

        parse_report_to(self.report_to)  # unknown or missing reporters fail before the run
        budgets = (self.steps, self.max_tokens, self.max_seconds, self.max_cpu_seconds)
        if all(b is None for b in budgets):
            raise ValueError("no budget: set steps, max_tokens, max_seconds or max_cpu_seconds")
        if any(b is not None and b <= 0 for b in budgets):
            raise ValueError(
                f"budgets must be positive, got steps/tokens/seconds/CPU seconds = {budgets}"
            )
        from copes.envs.parsing import CALL_FORMATS

        if self.call_format not in ("native", *CALL_FORMATS):
            raise ValueError(
                f"unknown call format {self.call_format!r}; choose native or one of {CALL_FORMATS}"
            )
        from copes.agents.chat import template_kwargs_for

        template_kwargs_for(self.enable_thinking, self.chat_template_kwargs)  # fails early
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"unknown backend {self.backend!r}; choose hf or vllm")
        if self.backend == "hf":  # `auto` becomes the dtype it picks here, which is recorded
            from copes.agents.loading import resolve_dtype

            self.dtype = resolve_dtype(self.dtype, self.device)
        else:
            from copes.agents.loading import check_dtype

            check_dtype(self.dtype)
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"--kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if not 0 <= self.demonstrations <= 2:
            raise ValueError(
                f"--demonstrations must be 0, 1 or 2 (the worked examples copes has), got "
                f"{self.demonstrations}"
            )
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
        elif self.turn_schedule is not None:
            raise ValueError("--turn-schedule sets how served turns are batched: add --harness")
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

    @property
    def rollout_temperature(self) -> float:
        """The training rollouts' temperature: a gradient method (GRPO) samples at
        `temperature`; ES scores its members at `es_temperature` (greedy by default, Qiu et
        al.)."""
        return self.temperature if get_optimizer(self.optimizer).gradients else self.es_temperature

    def _check_harness(self) -> None:
        if self.workers:
            raise ValueError("--harness serves the population from this process: use "
                             "--workers 0")  # fmt: skip
        if self.step_timeout <= 0:
            raise ValueError(f"--step-timeout must be positive, got {self.step_timeout}")
        if self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout}")
        from copes.agents.episodes import SCHEDULES

        if self.turn_schedule is None:
            self.turn_schedule = "as-they-come" if self.harness == "http" else "deterministic"
        if self.turn_schedule not in SCHEDULES:
            raise ValueError(
                f"--turn-schedule {self.turn_schedule!r}: expected one of {', '.join(SCHEDULES)}"
            )
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
        from copes.registry import parse_env_kwargs

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


@dataclass
class Budget:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the process's user + system time (`time.process_time`)

    def exhausted(self, config: TrainConfig) -> bool:
        return (
            (config.steps is not None and self.steps >= config.steps)
            or (config.max_tokens is not None and self.tokens >= config.max_tokens)
            or (config.max_seconds is not None and self.seconds >= config.max_seconds)
            or (config.max_cpu_seconds is not None and self.cpu_seconds >= config.max_cpu_seconds)
        )
