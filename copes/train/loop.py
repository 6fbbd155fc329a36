"""The training loop shared by ES, CoPES, GRPO and LoRA-GRPO: `Trainer`.

Reads top to bottom: build the policy, the environments and the optimizer; then, until the
budget (steps, generated tokens or wall seconds) is spent: one optimizer step, its metrics,
validation every `eval_every` steps, a checkpoint every `checkpoint_every` steps. ES/CoPES
also append every step's rewards to `es_log.jsonl` (fsync'ed), so a killed run resumes from
its last checkpoint plus the log, without redoing a single rollout, bit-identically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from copes.agents.policy import SamplingConfig
from copes.agents.rollout import undone_arithmetic_rate
from copes.errors import UserError
from copes.optimizers.table import get_optimizer
from copes.run_log import (
    MetricsLog,
    append_jsonl,
    read_jsonl,
)
from copes.train.build import (
    build_evaluator,
    build_optimizer,
    build_policy,
    env_factory,
    load_tasks_for,
    lora_population,
    optimizer_config,
)
from copes.train.resume import RunFolder, check_fresh_run_dir
from copes.train.settings import Budget, TrainConfig, public_settings
from copes.train.task_rollout import TaskRollout

logger = logging.getLogger(__name__)


@dataclass
class Trainer:
    """One run: built from its typed settings, then `run()`.

    Args:
        config: the run's settings.
        optimizer_settings: the optimizer's own config (`CoPESConfig`, `GRPOConfig`: parsed
            from the command line, or `copes.train.optimizer_config(config, ...)`); None: its
            table defaults with the run's seed.
    """

    config: TrainConfig
    optimizer_settings: Any = None

    def __post_init__(self) -> None:
        c = self.config
        if self.optimizer_settings is None:
            self.optimizer_settings = optimizer_config(c)
        opt_config = self.optimizer_settings
        spec = get_optimizer(c.optimizer)
        spec.check(opt_config)  # before anything is built
        if "seed" in spec.flags() and opt_config.seed != c.seed:
            raise ValueError(
                f"the optimizer's seed ({opt_config.seed}) is not the run's ({c.seed}): ES's "
                "noise and the run's tasks share one seed (copes.train.optimizer_config sets it)"
            )
        self.run_dir = Path(c.out_dir)
        from copes.errors import check_device

        check_device(c.device)
        if not c.resume:  # refuse before anything is built or loaded
            check_fresh_run_dir(self.run_dir)
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
        lora = lora_population(c, opt_config)
        rows = c.batch_size * opt_config.samples_per_task * (lora[0] if lora else 1)
        self.policy = build_policy(c, lora, max(rows, c.eval_tasks * c.eval_samples))
        from copes.agents.chat import resolve_call_format

        self.call_format = resolve_call_format(c.call_format, self.policy.chat)
        make_env = env_factory(c, self.call_format)
        sampling = SamplingConfig(
            c.max_new_tokens, temperature=c.rollout_temperature, top_p=c.top_p
        )
        make_train_rollout = partial(
            TaskRollout, make_env, train_tasks, c.batch_size, opt_config.samples_per_task,
            sampling, c.seed,
            c.same_batch, c.max_context,
        )  # fmt: skip
        self.train_rollout = make_train_rollout()
        self._make_train_rollout = make_train_rollout  # what --workers actors build
        # The worked examples every episode starts with (--demonstrations): recorded.
        self.demonstration_messages = self.train_rollout.envs[0].unwrapped.demonstration_messages
        eval_sampling = SamplingConfig(c.max_new_tokens, temperature=c.eval_temperature)
        self.eval_rollout = TaskRollout(
            make_env, eval_tasks, len(eval_tasks), c.eval_samples, eval_sampling, c.seed + 1,
            True, c.max_context,
        )  # fmt: skip
        # --harness: everything is served (members, GRPO groups, validation) by `server`.
        self.server, harness = self._server_and_harness(sampling) if c.harness else (None, None)
        served = None if self.server is None else (self.server, harness)
        # Where the members are evaluated is chosen here, once, and given to the optimizer.
        self.evaluator = build_evaluator(
            c, opt_config, self.policy, self.train_rollout, make_train_rollout, self.run_dir,
            served,
        )  # fmt: skip
        self.optimizer = build_optimizer(c, opt_config, self.policy, self.evaluator)
        self.folder = RunFolder(self.run_dir, c, self.optimizer, self.demonstration_messages)
        if self.server is not None:
            from copes.serve import ServedRollout

            if self.evaluator is None:  # GRPO: its groups are sessions of the policy
                self.train_rollout = ServedRollout(self.server, harness, self.train_rollout)
            self.eval_rollout = ServedRollout(self.server, harness, self.eval_rollout, "validation")
        self.budget = Budget()
        self.log: MetricsLog | None = None  # opened by run()

    def _server_and_harness(self, sampling: SamplingConfig) -> tuple[Any, Any]:
        """The OpenAI-compatible server over the policy (`copes.serve`) and the harness whose
        clients play its sessions: over HTTP, copes' env loop, or the user's agent."""
        from copes.serve import HttpHarness, InProcessHarness, PolicyServer
        from copes.serve.harness import EnvLoop, load_harness

        c = self.config
        if c.harness == "http":
            harness: Any = HttpHarness()
        elif c.harness == "env":
            harness = InProcessHarness(EnvLoop(env_factory(c, self.call_format)))
        else:
            harness = InProcessHarness(load_harness(c.harness))  # type: ignore[arg-type]
        server = PolicyServer(
            self.policy, sampling, self.call_format, c.api_key, c.step_timeout,
            max_context=c.max_context, request_timeout=c.request_timeout,
            schedule=c.turn_schedule or "deterministic",
        )  # fmt: skip
        return server, harness

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        c = self.config
        # Accept the run before writing anything into its folder (a fresh run's folder was
        # checked, and created, before the model was loaded).
        self.folder.accept()
        from copes.reporting import parse_report_to

        reporters = [r for r in parse_report_to(c.report_to) if c.tensorboard or r != "tensorboard"]
        self.log = MetricsLog(self.run_dir, reporters, config=public_settings(self.config),
                              project="copes-train")  # fmt: skip
        if c.resume:
            self.budget = self.folder.resume(self.policy, self.log)
        if self.server is not None:  # the run is accepted: serve it
            self.server.policy_version = self.budget.steps
            url = self.server.start(c.host, c.port)
            logger.info("serving the policy at %s/v1 (ask/tell: %s/copes/v1/ask)", url, url)
        if self._validation_due() and not self.log.has("validation", self.budget.steps):
            self.validate()  # step 0, or one a kill lost: the same weights, the same draws
        clock = _TrainingClock(self.budget)
        bar = tqdm(
            total=c.steps, initial=self.budget.steps, desc="training", disable=not c.progress
        )
        try:
            while not self.budget.exhausted(c):
                step = self.budget.steps
                # Served: no sessionless request sees the weights while the step changes them
                with self.server.model_lock if self.server else nullcontext():
                    stats = self.optimizer.step(self.policy, self.train_rollout, step)
                    self.budget.steps += 1
                    if self.server is not None:  # the weights changed: the policy's new name
                        self.server.policy_version = self.budget.steps
                self.budget.tokens += stats.generated_tokens
                clock.read()
                if self.optimizer.replays:  # the replay log: on disk before anything else
                    entry = {
                        **stats.log,
                        "tokens": self.budget.tokens,
                        "seconds": self.budget.seconds,
                        "cpu_seconds": self.budget.cpu_seconds,
                    }
                    append_jsonl(self.run_dir / "es_log.jsonl", entry, sync=True)
                self.log.log("train", step, self._train_record(stats))
                bar.update()
                bar.set_postfix(reward=f"{stats.metrics['reward_mean']:.3f}")
                done = self.budget.exhausted(c)
                # Bookkeeping is off the budget's clocks: a budget buys training, and methods
                # that validate or checkpoint at other spacings still get equal training time.
                with clock.paused():
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
            if self.evaluator is not None:  # the run is over: Ray actors, engine adapters
                self.evaluator.close()
            if self.server is not None:  # clients asking over HTTP hear that it is over
                self.server.stop(linger=2.0 if self.config.harness == "http" else 0.0)
        return self.summary()

    def close(self) -> None:
        """Release the evaluator (Ray actors, vLLM adapters) and the policy's engine (vLLM
        processes and GPU memory), where they hold any."""
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
            # as copes-eval defines them: any tool call or an answer read; any tool call
            "protocol_use_rate": sum(t.tool_calls > 0 or t.end_reason == "answer" for t in batch)
            / n,
            "tool_use_rate": sum(t.tool_calls > 0 for t in batch) / n,
            "generated_tokens_total": self.budget.tokens,
            "seconds_total": self.budget.seconds,
            "cpu_seconds_total": self.budget.cpu_seconds,
        }
        # answers of the gold's value refused for arithmetic left undone (issue 48), where
        # the grader says (math); a policy drifting toward leaving its calculation shows here
        undone = undone_arithmetic_rate(batch)
        if undone is not None:
            result["undone_arithmetic_rate"] = undone
        self.log.log("validation", self.budget.steps, result)
        self.log.plot()
        logger.info(
            "step %d validation reward %.3f accuracy %.3f (ended invalid %.3f%s)",
            self.budget.steps, result["reward_mean"], result["accuracy"], result["invalid_rate"],
            "" if undone is None else f", refused as undone arithmetic {undone:.3f}",
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

    def _train_record(self, stats: Any) -> dict[str, Any]:
        return {
            **stats.metrics,
            "generated_tokens": stats.generated_tokens,
            "generated_tokens_total": self.budget.tokens,
            "generation_seconds": stats.generation_seconds,
            "tool_seconds": stats.env_seconds,
            "optimizer_seconds": stats.optimizer_seconds,
            "seconds_total": self.budget.seconds,
            "cpu_seconds_total": self.budget.cpu_seconds,
        }

    def summary(self) -> dict[str, Any]:
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        val = [r for r in records if r["kind"] == "validation"]
        return {
            "run_dir": str(self.run_dir),
            "steps": self.budget.steps,
            "generated_tokens": self.budget.tokens,
            "seconds": round(self.budget.seconds, 1),
            "cpu_seconds": round(self.budget.cpu_seconds, 1),
            "validation_accuracy_first": val[0]["accuracy"] if val else None,
            "validation_accuracy_last": val[-1]["accuracy"] if val else None,
            "validation_reward_first": val[0]["reward_mean"] if val else None,
            "validation_reward_last": val[-1]["reward_mean"] if val else None,
            "validation_undone_arithmetic_last": (  # older logs (before issue 48) lack it
                val[-1].get("undone_arithmetic_rate") if val else None
            ),
            "checksum": self.optimizer.fingerprint(self.policy),
        }


class _TrainingClock:
    """The budget's wall and CPU seconds, counting training steps only: from the last
    `read()` to the end of `paused()` (logging, validation, checkpoints) is left out, and a
    resumed run counts on from what its budget already holds."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._base = (budget.seconds, budget.cpu_seconds)
        self._start = (time.perf_counter(), time.process_time())

    def read(self) -> None:
        self.budget.seconds = self._base[0] + time.perf_counter() - self._start[0]
        self.budget.cpu_seconds = self._base[1] + time.process_time() - self._start[1]

    @contextmanager
    def paused(self) -> Iterator[None]:
        try:
            yield
        finally:
            self._base = (self.budget.seconds, self.budget.cpu_seconds)
            self._start = (time.perf_counter(), time.process_time())
