"""copes' GRPO next to TRL's GRPOTrainer: step time, peak memory and learning, same shape.

Both sides train the same model on the same tasks with the same GRPO settings (group size
G, tasks per step B, learning rate, eps = 0.2, beta = 0, token-mean loss, group-std
advantages, grad-norm clip 1.0, constant learning rate, one update per batch) and the *same*
rollout engine: copes' multi-turn episodes, which TRL receives through
`copes.integrations.trl.CopesRollout`. So the comparison isolates the trainer (loss,
backward, optimizer, bookkeeping) and checks that copes' GRPO learns like the GRPO the field
uses. Each side runs in its own process (peak RSS = that process's ru_maxrss), then both are
validated by the same greedy copes rollout on one fixed validation split (the same tasks for
every seed, so seeds are comparable).

    python benchmarks/trl_grpo_baseline.py                    # tiny agent, 20 steps, 3 seeds
    python benchmarks/trl_grpo_baseline.py --steps 30 --model <folder>

Writes benchmarks/results/trl_grpo_baseline.json (or --out): per side the mean step time
(first step excluded: warm-up), peak RSS, validation accuracy before and after; and the
ratios copes / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = {"batch_size": 8, "group_size": 8, "max_new_tokens": 64, "max_turns": 3}


def _model_dir(model: str) -> str:
    if model != "tiny":
        return model
    from copes.agents.tiny import ensure_tiny_agent

    return str(ensure_tiny_agent(progress=False))


VALIDATION_SEED = 0  # one validation split for every seed and both sides


def _validation_tasks(args: argparse.Namespace) -> list[Any]:
    from copes.envs.presets import load_tasks

    return load_tasks(
        "synthetic-math", "validation", limit=args.eval_tasks, task_seed=VALIDATION_SEED
    )


def _validate(model: Any, tokenizer: Any, args: argparse.Namespace) -> float:
    """Greedy accuracy on the fixed validation tasks, by copes' own rollout."""
    import gymnasium as gym

    import copes  # noqa: F401
    from copes.agents.hf import HFPolicy
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout

    tasks = _validation_tasks(args)
    envs = [gym.make("ToolMath-v0", tasks=tasks, max_turns=SHAPE["max_turns"]) for _ in tasks]
    was_training = model.training
    try:
        episodes = rollout(
            HFPolicy(model, tokenizer), envs, SamplingConfig(SHAPE["max_new_tokens"], 0.0),
            options=[{"task": t} for t in tasks],
        )  # fmt: skip
    finally:
        model.train(was_training)
        for env in envs:
            env.close()
    return sum(e.correct for e in episodes) / len(episodes)


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import gymnasium as gym
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import copes  # noqa: F401
    from copes.envs.presets import load_tasks
    from copes.integrations.trl import CopesRollout, copes_reward

    torch.manual_seed(args.seed)
    path = _model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    before = _validate(model, tokenizer, args)
    tasks = load_tasks("synthetic-math", "train", limit=args.train_tasks, task_seed=args.seed)
    rollout = CopesRollout(
        lambda: gym.make("ToolMath-v0", tasks=tasks, max_turns=SHAPE["max_turns"]),
        max_new_tokens=SHAPE["max_new_tokens"],
    )
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=SHAPE["batch_size"] * SHAPE["group_size"],
            num_generations=SHAPE["group_size"], max_steps=args.steps,
            learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
            beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", max_grad_norm=1.0,
            num_iterations=1, temperature=1.0, top_p=1.0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.999, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, seed=args.seed, disable_tqdm=True,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, reward_funcs=copes_reward, args=config, processing_class=tokenizer,
            train_dataset=rollout.dataset(conversational=False), rollout_func=rollout,
        )  # fmt: skip
        trainer.train()
    rollout.close()
    logs = [r for r in trainer.state.log_history if "step_time" in r]
    return {
        "step_seconds": [r["step_time"] for r in logs],
        "train_reward": [r["reward"] for r in logs],
        "validation_accuracy_before": before,
        "validation_accuracy_after": _validate(model, tokenizer, args),
    }


def run_copes(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from copes.run_log import read_jsonl
    from copes.train import TrainConfig, Trainer, optimizer_config

    path = _model_dir(args.model)
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            optimizer="grpo", model=path, out_dir=str(Path(out) / "run"), steps=args.steps,
            batch_size=SHAPE["batch_size"], max_new_tokens=SHAPE["max_new_tokens"],
            max_turns=SHAPE["max_turns"], num_train_tasks=args.train_tasks,
            eval_every=0, eval_tasks=8, checkpoint_every=0, seed=args.seed,  # its own, unused
            progress=False, report_to="none", temperature=1.0,
        )  # fmt: skip
        grpo = optimizer_config(
            config, group_size=SHAPE["group_size"], learning_rate=args.learning_rate,
            micro_batch_size=SHAPE["batch_size"] * SHAPE["group_size"],
        )  # fmt: skip
        trainer = Trainer(config, grpo)
        tokenizer = AutoTokenizer.from_pretrained(path)
        before = _validate(trainer.policy.model, tokenizer, args)
        try:
            trainer.run()
            latest = Path(out) / "run" / "checkpoints"
            model = AutoModelForCausalLM.from_pretrained(latest / (latest / "latest").read_text())
        finally:
            trainer.close()
        train = [r for r in read_jsonl(Path(out) / "run" / "metrics.jsonl") if r["kind"] == "train"]
    totals = [r["seconds_total"] for r in train]
    return {
        "step_seconds": [b - a for a, b in zip([0.0, *totals], totals, strict=False)],
        "train_reward": [r["reward_mean"] for r in train],
        "validation_accuracy_before": before,
        "validation_accuracy_after": _validate(model, tokenizer, args),
    }


def _side(name: str, argv: list[str]) -> dict[str, Any]:
    """Run one side in a fresh process; its result plus the process's peak RSS."""
    done = subprocess.run(
        [sys.executable, __file__, "--side", name, *argv], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--train-tasks", type=int, default=200)
    p.add_argument("--eval-tasks", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # one side's seed
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--side", choices=("copes", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/trl_grpo_baseline.json")
    args = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.side is not None:
        import torch

        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        result = run_copes(args) if args.side == "copes" else run_trl(args)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return result
    load_before = os.getloadavg()
    start = time.perf_counter()
    per_seed: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        passed = [
            "--model", args.model, "--steps", str(args.steps), "--learning-rate",
            str(args.learning_rate), "--train-tasks", str(args.train_tasks), "--eval-tasks",
            str(args.eval_tasks), "--seed", str(seed),
        ]  # fmt: skip
        sides = {name: _side(name, passed) for name in ("copes", "trl")}
        for side in sides.values():
            steady = side["step_seconds"][1:] or side["step_seconds"]  # step 0: warm-up
            side["mean_step_seconds"] = sum(steady) / len(steady)
            side["gain"] = side["validation_accuracy_after"] - side["validation_accuracy_before"]
        per_seed[str(seed)] = sides
    import transformers
    import trl

    def mean(side: str, key: str) -> float:
        return sum(s[side][key] for s in per_seed.values()) / len(per_seed)

    summary = {
        side: {
            key: mean(side, key)
            for key in (
                "mean_step_seconds",
                "peak_rss_mib",
                "validation_accuracy_before",
                "validation_accuracy_after",
                "gain",
            )
        }
        for side in ("copes", "trl")
    }
    result = {
        "benchmark": "trl_grpo_baseline",
        "command": "python benchmarks/trl_grpo_baseline.py "
        + " ".join(a for a in (argv if argv is not None else sys.argv[1:])),
        "shape": {
            **SHAPE,
            "steps": args.steps,
            "learning_rate": args.learning_rate,
            "eval_tasks": args.eval_tasks,
        },
        "seeds": per_seed,
        "mean_over_seeds": summary,
        "step_time_ratio_copes_over_trl": summary["copes"]["mean_step_seconds"]
        / summary["trl"]["mean_step_seconds"],
        "peak_rss_ratio_copes_over_trl": summary["copes"]["peak_rss_mib"]
        / summary["trl"]["peak_rss_mib"],
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_seconds": time.perf_counter() - start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, side in summary.items():
        print(
            f"{name:5s}  step {side['mean_step_seconds']:.2f} s  peak RSS "
            f"{side['peak_rss_mib']:.0f} MiB  validation accuracy "
            f"{side['validation_accuracy_before']:.3f} -> {side['validation_accuracy_after']:.3f}"
            f" (mean of {len(per_seed)} seeds)"
        )
    print(f"copes / TRL: step time {result['step_time_ratio_copes_over_trl']:.2f}, "
          f"peak RSS {result['peak_rss_ratio_copes_over_trl']:.2f}; wrote {args.out}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
