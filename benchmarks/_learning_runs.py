"""One run of the learning benchmarks: train under a budget, then pass@k on a test split.

A run is a `copes.train.Trainer` run in its own folder plus an unbiased pass@k evaluation of
the final weights (`copes.evaluation.runner.evaluate`). `result.json`, written atomically at
the very end, marks the run as finished: a benchmark that is killed and started again skips
finished runs and resumes unfinished ones (`--resume`: ES/CoPES replay their seed log,
GRPO restarts from its last checkpoint; the pass@k samples on disk are kept).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import traceback
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"
MACHINES_FILE = "machines.jsonl"  # one line per start of the run: where each part trained

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """Everything that determines one run (method settings, seed, budget, evaluation)."""

    method: str
    seed: int
    settings: dict[str, Any]  # the method's row of the hyper-parameter table
    run_dir: str
    model: str
    env: str
    budget_kind: str  # "tokens", "seconds" (wall) or "cpu-seconds" (the run's own)
    budget: float
    train: dict[str, Any] = field(default_factory=dict)  # shared TrainConfig settings
    passk_n: int = 4
    passk_ks: tuple[int, ...] = (1, 4)
    passk_tasks: int = 32  # 0: no final test (a sweep trial, chosen by validation)
    # the final test: a registered benchmark (its files in train["data_dir"]) or, by default,
    # the env's synthetic test split; temperature 0 is greedy
    passk_benchmark: str | None = None
    passk_split: str | None = None
    passk_temperature: float = 1.0


def read_result(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RESULT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def same_spec(record: dict[str, Any], spec: RunSpec) -> bool:
    """Whether a finished run's record was trained and tested as `spec` asks (a run recorded
    before a field existed holds that field's default)."""
    defaults = {f.name: f.default for f in fields(RunSpec) if f.default is not MISSING}
    as_json = json.loads(json.dumps(defaults))
    return {**as_json, **record["spec"]} == json.loads(json.dumps(asdict(spec)))


def check_finished_runs(specs: list[RunSpec]) -> None:
    """Refuse to reuse a finished run whose settings differ from the spec asking for it."""
    for spec in specs:
        done = read_result(spec.run_dir)
        if done is not None and not same_spec(done, spec):
            raise ValueError(
                f"{spec.run_dir} holds a finished run with other settings than {spec.method} "
                f"seed {spec.seed} now has (budget, hyper-parameters or evaluation); delete that "
                "folder or pass another --runs-dir"
            )


def write_atomic(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A method's row -> (TrainConfig settings, optimizer settings); unknown keys are errors."""
    from dataclasses import fields

    from copes.optimizers.es import CoPESConfig
    from copes.optimizers.grpo import GRPOConfig
    from copes.train import TrainConfig

    train_keys = {f.name for f in fields(TrainConfig)}
    optimizer_keys = {f.name for f in fields(CoPESConfig)} | {f.name for f in fields(GRPOConfig)}
    unknown = set(settings) - train_keys - optimizer_keys
    if unknown:
        raise ValueError(
            f"unknown setting(s) {sorted(unknown)} in the method table: use copes-train flag "
            "names with underscores (copes-train --help lists them)"
        )
    train = {k: v for k, v in settings.items() if k in train_keys}
    return train, {k: v for k, v in settings.items() if k not in train_keys}


def train_config(spec: RunSpec) -> Any:
    """The run's `TrainConfig`: the budget, the method's run settings, the shared settings."""
    from copes.train import TrainConfig

    run_dir = Path(spec.run_dir)
    method_train, _ = split_settings(spec.settings)
    es = method_train["optimizer"] in ("es", "copes")
    return TrainConfig(
        **{
            "out_dir": str(run_dir),
            "model": spec.model,
            "env": spec.env,
            "steps": None,
            "max_tokens": int(spec.budget) if spec.budget_kind == "tokens" else None,
            "max_seconds": float(spec.budget) if spec.budget_kind == "seconds" else None,
            "max_cpu_seconds": float(spec.budget) if spec.budget_kind == "cpu-seconds" else None,
            # ES replays its seed log on resume, so it needs no intermediate checkpoint.
            # GRPO: at every validation (every 3 steps where it never validates mid-run)
            "checkpoint_every": 0 if es else method_train.get("eval_every") or 3,
            "keep_checkpoints": 1,
            "seed": spec.seed,
            "tensorboard": False,
            "progress": False,
            "resume": (run_dir / "config.json").exists(),
            **spec.train,
            **method_train,
        }
    )


def curve_of(run_dir: Path) -> dict[str, list[float]]:
    """The run's validations: step, generated tokens, wall and CPU seconds, accuracy, reward."""
    from copes.run_log import read_jsonl

    val = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "validation"]
    return {
        "steps": [r["step"] for r in val],
        "tokens": [r["generated_tokens_total"] for r in val],
        "seconds": [r["seconds_total"] for r in val],
        "cpu-seconds": [r.get("cpu_seconds_total", 0.0) for r in val],
        "accuracy": [r["accuracy"] for r in val],
        "reward": [r["reward_mean"] for r in val],
        "protocol_use": [r.get("protocol_use_rate") for r in val],
        "tool_use": [r.get("tool_use_rate") for r in val],
        "invalid": [r.get("invalid_rate") for r in val],
        # answers of the gold's value refused for undone arithmetic (issue 48; None before)
        "undone_arithmetic": [r.get("undone_arithmetic_rate") for r in val],
    }


def signal_of(run_dir: Path) -> dict[str, Any]:
    """What the training steps gave the optimizer to learn from, to say why a run did or did
    not gain: the share of steps whose rewards all tied (ES: every member scored alike; GRPO:
    every group had zero variance), which move no weight; the share of steps with any correct
    answer; the mean train accuracy and reward spread; for ES/CoPES the share of members with
    a positive reward (a verified answer outweighing its invalid turns). {} before a step.
    Accuracy figures count the steps that logged it: a step rebuilt from the seed log after a
    kill (`copes.run_log.rebuild_train_record`) has its rewards, not its accuracy."""
    from copes.run_log import read_jsonl

    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    if not train:
        return {}

    def tied(row: dict[str, Any]) -> bool:
        if "zero_variance_groups" in row:
            return row["zero_variance_groups"] >= 1.0
        return row["reward_std"] == 0.0

    n = len(train)
    accuracy = [r["accuracy"] for r in train if "accuracy" in r]
    signal = {
        "steps": n,
        "tied_steps": sum(map(tied, train)) / n,
        "steps_with_a_correct_answer": (
            sum(a > 0 for a in accuracy) / len(accuracy) if accuracy else None
        ),
        "train_accuracy_mean": sum(accuracy) / len(accuracy) if accuracy else None,
        "reward_std_mean": sum(r["reward_std"] for r in train) / n,
    }
    members_log = run_dir / "es_log.jsonl"
    rewards = (
        [x for entry in read_jsonl(members_log) for x in entry["rewards"]]
        if members_log.exists()
        else []
    )
    if rewards:
        signal["members_with_a_positive_reward"] = sum(x > 0 for x in rewards) / len(rewards)
    return signal


def final_test(spec: RunSpec, policy: Any, out_dir: str | Path) -> dict[str, float]:
    """Unbiased pass@k of `policy` on the spec's final test (default: the env's synthetic
    test split), with the training episodes' prompt (demonstrations, turns, tokens)."""
    from copes.agents.policy import SamplingConfig
    from copes.evaluation.runner import evaluate

    benchmark = spec.passk_benchmark or (
        "synthetic-math" if spec.env == "ToolMath-v0" else "synthetic-qa"
    )
    sampling = SamplingConfig(
        spec.train.get("max_new_tokens", 96), temperature=spec.passk_temperature, seed=spec.seed
    )
    report = evaluate(
        policy, [benchmark], n=spec.passk_n, ks=spec.passk_ks, sampling=sampling,
        limit=spec.passk_tasks, out_dir=out_dir, progress=False,
        max_turns=spec.train.get("max_turns", 4), model_name=spec.method,
        data_dir=spec.train.get("data_dir"), split=spec.passk_split,
        demonstrations=spec.train.get("demonstrations", 0),
    )  # fmt: skip
    result = report.benchmarks[benchmark]
    return {
        **{f"pass@{k}": float(v) for k, v in result.pass_at_k.items()},
        "mean@n": float(result.mean_at_n),
        "problems": result.num_problems,
        "protocol_use_rate": result.protocol_use_rate,
        "tool_use_rate": result.tool_use_rate,
        "invalid_rate": result.invalid_rate,
    }


def machine_facts() -> dict[str, Any]:
    """The CPU this process runs on, as far as it changes speed or float results (copes'
    own `machine_info` and `native_bf16_cpu`). A run spread over sessions may train its parts
    on different machines; every part says which."""
    from copes.agents.loading import native_bf16_cpu
    from copes.agents.tiny import machine_info

    info = machine_info()
    return {
        "cpu": info["cpu"],
        "torch_cpu_capability": info["cpu_capability"],
        "native_bf16": native_bf16_cpu(),
        "torch": info["torch"],
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _peak_rss_mb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB; macOS: bytes
    return peak // (1 << 20) if sys.platform == "darwin" else peak // 1024


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Train and evaluate one run (or return its stored result); never raises.

    A failure is returned as ``{"error": ...}`` (and not written), so one broken run does
    not stop the others and is retried the next time the benchmark starts.
    """
    import torch

    torch.set_num_threads(int(os.environ.get("COPES_BENCH_THREADS", "1")))
    done = read_result(spec.run_dir)
    if done is not None:
        return done
    start, load_at_start = time.perf_counter(), os.getloadavg()
    try:
        from copes.train import Trainer, optimizer_config

        config = train_config(spec)
        _, overrides = split_settings(spec.settings)
        run_dir = Path(spec.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(config, optimizer_config(config, **overrides))
        # benchmark bookkeeping beside the run (the Trainer has checked the folder: a folder
        # of another run was refused above); one line per part of a run spread over sessions
        with open(run_dir / MACHINES_FILE, "a") as out:
            out.write(json.dumps(machine_facts()) + "\n")
        summary = trainer.run()
        passk = (
            final_test(spec, trainer.policy, Path(spec.run_dir) / "passk")
            if spec.passk_tasks
            else {}
        )
        record = {
            "spec": asdict(spec),
            "summary": summary,
            "curve": curve_of(Path(spec.run_dir)),
            "signal": signal_of(Path(spec.run_dir)),
            "pass_at_k": passk,
            # this invocation only (a resumed run counts its last part); under shared cores
            # an upper bound: the load average says how shared they were
            "wall_seconds": round(time.perf_counter() - start, 1),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            # of the process that ran it: this run's own in real_model.py (a fresh process
            # per run); in learning.py the largest of the runs that process trained
            "peak_rss_mb": _peak_rss_mb(),
            "pid": os.getpid(),
            "machines": [json.loads(line) for line in (run_dir / MACHINES_FILE).open()],
        }
        write_atomic(Path(spec.run_dir) / RESULT_FILE, record)
        return record
    except Exception as exc:  # reported in the benchmark's output, retried on the next start
        logger.error("run %s seed %d failed: %s", spec.method, spec.seed, exc)
        return {"spec": asdict(spec), "error": "".join(traceback.format_exception(exc))}
