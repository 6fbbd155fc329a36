"""Look back (issue 48): how much of the SmolLM2 comparison's validation accuracy on GSM8K was
arithmetic left undone, which the grader used to evaluate for the agent?

The comparison's runs (benchmarks/real_model.py) kept their records, not their answers or
checkpoints. What can be rebuilt is graded again here, on the same 128 held-out validation
problems, greedy, with the runs' own prompt and settings:

- the base model (step 0 of every run: 2 of 128 under the old grader);
- ES seed 2 at its best validation, step 30 (5 of 128): its weights rebuilt by replaying its
  seed log (steps 0-29, archived in git while the run was unfinished, copied to
  benchmarks/results/real_model-runs/replay/), the same replay `copes-train --resume` does.
  No other ES-family run with a gain can be rebuilt: the other seed logs archived end before
  their gains (or they had none).
- GRPO seed 2's first 3 steps (5 of 128 at its first validation), trained again with its
  settings and seed under the old rule: GRPO kept no checkpoint, and its steps sample at
  temperature 1, so on another CPU than the one that trained it (an Intel Xeon with AMX) this
  is a rerun with the same settings, not the same weights.

Each validation answer is graded twice: by the old rule (`is_equivalent`: the gold's value,
Math-Verify's semantics, what every figure before issue 48 used) and by the grader now
(`MathGrader`: a value with no arithmetic left undone). The report lists every answer the two
rules disagree on.

    python benchmarks/regrade_real_model.py --data-dir ../shared/benchmarks

Writes benchmarks/results/regrade_real_model.{json,md}. A replay on another CPU than the one
that trained rebuilds the weights up to float rounding (float32), so a greedy answer near a
tie may differ from the one the run saw: the report gives the old-rule count beside the
run's own record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _learning_* helpers

from _learning_runs import RunSpec, machine_facts, split_settings, train_config, write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "real_model-runs"
# (name, the run whose settings and seed log it uses, steps of its seed log replayed)
STATES = (
    ("base", "es-seed2", 0),
    ("es-seed2-step30", "es-seed2", 30),
    ("grpo-seed2-step3-rerun", "grpo-seed2", 3),
)


def _spec(run: str, data_dir: Path, run_dir: Path) -> RunSpec:
    record = json.loads((RUNS / f"{run}.json").read_text())
    spec = dict(record["spec"])
    spec["train"] = {**spec["train"], "data_dir": str(data_dir)}
    spec["run_dir"] = str(run_dir)
    spec["passk_ks"] = tuple(spec["passk_ks"])
    return RunSpec(**spec)


def _recorded_accuracy(run: str, steps: int) -> float:
    """The run's own validation accuracy at `steps`, as its record keeps it."""
    curve = json.loads((RUNS / f"{run}.json").read_text())["curve"]
    return curve["accuracy"][curve["steps"].index(steps)]


@contextlib.contextmanager
def old_rule():
    """The grader as it was before issue 48 (the value alone) for everything graded inside:
    what a rerun trained against then."""
    from copes.envs.rewards import math

    def value_only(pred: str, gold: str, timeout: float = 5.0) -> math.MathVerdict:
        return math.MathVerdict(correct=math.is_equivalent(pred, gold, timeout=timeout))

    grade_answer, math.grade_answer = math.grade_answer, value_only
    try:
        yield
    finally:
        math.grade_answer = grade_answer


def grade_state(name: str, run: str, steps: int, data_dir: Path) -> dict[str, Any]:
    """The validation answers of one rebuilt state, graded by the old rule and the new."""
    import torch

    from copes.envs.rewards.math import grade_answer, is_equivalent
    from copes.run_log import read_jsonl
    from copes.train import Trainer, optimizer_config

    torch.set_num_threads(int(os.environ.get("COPES_BENCH_THREADS", "2")))
    with tempfile.TemporaryDirectory() as scratch:
        spec = _spec(run, data_dir, Path(scratch) / name)
        _, overrides = split_settings(spec.settings)
        config = train_config(spec)
        trainer = Trainer(config, optimizer_config(config, **overrides))
        start = time.perf_counter()
        if steps and trainer.optimizer.replays:
            log = read_jsonl(RUNS / "replay" / f"{run}-es_log.jsonl")
            entries = [e for e in log if e["step"] < steps]
            if [e["step"] for e in entries] != list(range(steps)):
                raise SystemExit(f"{run}'s archived seed log does not hold steps 0-{steps - 1}")
            trainer.optimizer.replay(entries, trainer.policy)
        elif steps:  # GRPO: trained again, against the rule it trained against then
            with old_rule():
                for step in range(steps):
                    trainer.optimizer.step(trainer.policy, trainer.train_rollout, step)
        replay_seconds = time.perf_counter() - start
        batch = trainer.eval_rollout(trainer.policy, 0)  # the validation's tasks and draws
        trainer.close()
    tasks = {t.id: t for t in trainer.eval_rollout.tasks}
    answers = []
    for t in batch:
        prediction = t.grade.get("prediction")
        golds = tasks[t.task_id].answers
        old = prediction is not None and any(is_equivalent(prediction, g) for g in golds)
        now = [grade_answer(prediction, g) for g in golds] if prediction is not None else []
        if bool(t.correct) != any(v.correct for v in now):
            raise SystemExit(f"{name}: the env's verdict on {t.task_id} is not the new rule's")
        answers.append({
            "task_id": t.task_id, "prediction": prediction, "gold": list(golds),
            "correct_before": old, "correct_now": any(v.correct for v in now),
            "undone_arithmetic": bool(t.undone_arithmetic), "refused": t.grade.get("refused"),
            "tool_calls": t.tool_calls,
        })  # fmt: skip
    n = len(answers)
    return {
        "state": name,
        "run": run,
        "replayed_steps": steps,
        "rebuild_seconds": round(replay_seconds, 1),  # replay or retraining, wall
        "episodes": n,
        "recorded_accuracy": _recorded_accuracy(run, steps),
        "correct_before": sum(a["correct_before"] for a in answers),
        "correct_now": sum(a["correct_now"] for a in answers),
        "undone_arithmetic": sum(a["undone_arithmetic"] for a in answers),
        "refused_otherwise": sum(
            a["correct_before"] and not a["correct_now"] and not a["undone_arithmetic"]
            for a in answers
        ),
        "tool_use_rate": sum(a["tool_calls"] > 0 for a in answers) / n,
        "changed": [a for a in answers if a["correct_before"] != a["correct_now"]],
        "credited_now": [a for a in answers if a["correct_now"]],
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Look back: the SmolLM2 comparison's validation answers, graded again (issue 48)",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']['cpu']} "
        f"({result['machine']['torch_cpu_capability']}), float32.",
        "",
        "| state | steps replayed or retrained | correct of 128 in the run's record "
        "| correct now, old rule (value) | correct now, new rule | refused as undone arithmetic "
        "| tool use |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["states"]:
        lines.append(
            f"| {s['state']} | {s['replayed_steps']} | {round(s['recorded_accuracy'] * 128)} "
            f"| {s['correct_before']} | {s['correct_now']} | {s['undone_arithmetic']} "
            f"| {s['tool_use_rate']:.2f} |"
        )
    lines += ["", "Answers the two rules disagree on:", ""]
    for s in result["states"]:
        for a in s["changed"]:
            lines.append(
                f"- {s['state']}, {a['task_id']}: `{a['prediction']}` (gold {a['gold'][0]}): "
                f"{a['refused']}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="../shared/benchmarks",
                        help="folder holding gsm8k/train.jsonl and gsm8k/test.jsonl")  # fmt: skip
    parser.add_argument("--states", default=",".join(s[0] for s in STATES),
                        help="which rebuilt states to grade (comma-separated)")  # fmt: skip
    args = parser.parse_args(argv)
    from real_model import held_out_data

    chosen = [s for s in STATES if s[0] in args.states.split(",")]
    if not chosen:
        parser.error(f"--states: choose from {', '.join(s[0] for s in STATES)}")
    with tempfile.TemporaryDirectory() as data:
        data_dir = held_out_data(Path(args.data_dir), Path(data))
        states = [grade_state(name, run, steps, data_dir) for name, run, steps in chosen]
    result = {
        "command": "python benchmarks/regrade_real_model.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_facts(),
        "states": states,
    }
    write_atomic(RESULTS / "regrade_real_model.json", result)
    (RESULTS / "regrade_real_model.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
