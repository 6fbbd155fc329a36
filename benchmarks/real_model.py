"""The paper's experiment on a real pretrained LM, on a CPU: ES vs CoPES vs GRPO post-training
SmolLM2-135M-Instruct on GSM8K with its Python calculator, at equal CPU seconds.

Every method trains the same model (float32, two worked examples played as earlier turns, the
tool protocol of copes' envs) on real GSM8K train problems under the same budget of the run's
own CPU seconds (`copes-train --max-cpu-seconds`: robust to other work on the cores; the budget
counts training steps, not validation). Validation: 128 GSM8K train problems held out of the
training pool (the last 128 of the file), greedy, at the start and every few steps. The end of
every run: greedy pass@1 on the first 256 GSM8K test problems, the same prompt. The report
(benchmarks/results/real_model[-NAME].{json,png,md}) gives per method the validation curve
against CPU seconds, protocol-use and invalid rates, tokens, peak RSS, and each ES method's
share of GRPO's gain at GRPO's best validation point (the paper's measure; copes/evaluation/
curves.py), with the base model's GSM8K test pass@1 beside the final checkpoints'.

    python benchmarks/real_model.py --sweep       # the sweep (seed 100), then every SEEDS run
    python benchmarks/real_model.py --sweep --seeds 0       # the sweep, then seed 0 of each
    python benchmarks/real_model.py --methods grpo --seeds 0 --name my-grpo \
        --settings-from benchmarks/results/real_model.json  # one run of yours, the sweep's choice
    python benchmarks/real_model.py --quick                 # CI smoke: the tiny agent, seconds

Why float32 and not bfloat16: the comparison is spread over sessions, and sessions get
different machines. On one with native bf16 (avx512_bf16) bf16 generation was 2.5x faster
than fp32; on one without (AVX2 only, 2026-12-07) torch's bf16 matrix products run 7x
(forward) to 69x (a backward's input gradient) slower than fp32 (real_model_dtype.py), and a
GRPO step of the bf16 sweep took 4,300 CPU seconds (benchmarks/results/real_model-bf16-runs/).
float32 is fast everywhere, the same dtype on every machine a run resumes on, and holds an ES
member's perturbation exactly (bf16 rounding keeps a cosine of 0.96 of it at sigma 1e-3).

Why GSM8K and not the synthetic tasks: measured before any training (docs/results.md), the base
model's sampled pass@4 is 0/32 on synthetic ToolMath and 1/32 on GSM8K train, so real problems
are the only ones with any reward to learn from, and they are what the final test measures.

Runs live in --runs-dir, one folder each, each trained in a fresh process (its peak RSS is its
own); a killed benchmark started again with the same arguments resumes the unfinished runs
(`--resume`: ES/CoPES replay their seed log, GRPO restarts from its last checkpoint) and reads
the finished ones back, so a long comparison is spread over sessions without losing a step.
Every finished run's record (and the base model's test) is also kept beside the report, in
benchmarks/results/NAME-runs/ (a few kB each, committed): a machine that loses --runs-dir
(a fresh checkout) restores them from there instead of training them again. An unfinished
ES/CoPES run's settings and seed log are copied there every --keep-every seconds, so it
resumes after its last logged step even there (replayed on that machine's CPU: the weights
equal the first machine's up to its float rounding); each part of a run records its CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import resource
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _learning_* helpers

from _learning_report import summarize, write_outputs
from _learning_runs import (
    MACHINES_FILE,
    RESULT_FILE,
    RunSpec,
    check_finished_runs,
    read_result,
    run_one,
    same_spec,
    signal_of,
    write_atomic,
)

REPLAYED = ("es", "copes")  # optimizers whose run resumes from its seed log, no checkpoint
HELD_OUT = 128  # the last GSM8K train problems: the validation set, never trained on

# ---------------------------------------------------------------------- hyper-parameters
# fmt: off
# One row per method; every key is a copes-train flag. The rows start from the published
# defaults (ES: Qiu et al.'s sigma 1e-3 and alpha 5e-4, shared/PAPER.md; GRPO: group 8 and
# TRL's learning rate 1e-6; LoRA-GRPO: rank 16 at 1e-5), then `--sweep` sets them (below).
# N = 8 with antithetic pairs keeps one mirrored pair per subspace at K = 4 (N_k = 2); batch 4
# tasks, so a step of any method rolls out 32 episodes (ES: 8 members x 4; GRPO: 4 tasks x 8).
# Validation every 3 GRPO steps (about 9 fit the budget: 4-5 curve points, GRPO's best among
# them is the paper's reference) and every 6 ES steps (30 or so fit: 6-7 points).
ES = {"population_size": 8, "sigma": 1e-3, "learning_rate": 5e-4, "antithetic": True,
      "eval_every": 6}
# micro-batches of 4 trajectories: at 8, one GRPO run's backward peaked at 12.5 GB of RSS and
# two side by side were killed for memory on a 24 GB machine (2026-12-05).
GRPO = {"group_size": 8, "micro_batch_size": 4, "temperature": 1.0, "eval_every": 3}
METHODS: dict[str, dict[str, Any]] = {
    "es":        {"optimizer": "es",        **ES, "num_subspaces": 1},
    "copes-k2":  {"optimizer": "copes",     **ES, "num_subspaces": 2},
    "copes-k4":  {"optimizer": "copes",     **ES, "num_subspaces": 4},
    "grpo":      {"optimizer": "grpo",      **GRPO, "learning_rate": 1e-6},
    "lora-grpo": {"optimizer": "lora-grpo", **GRPO, "learning_rate": 1e-5},
}
# The sweep (`--sweep`), sized to 2 cores: every trial a third of the budget on seed 100, never
# a reported seed, validated at its start and end only. GRPO and LoRA-GRPO: learning rate x
# {1, 10}. The ES family shares one row (alpha, sigma), swept on plain ES (K = 1), which
# favours the baseline, not CoPES: alpha x {1, 10}, then sigma x 2 at the better alpha; CoPES
# keeps its own sqrt(K) sigma scaling. The best final validation accuracy wins, ties broken by
# the final validation reward (the trained objective, penalties included), then by the
# published default. The trials and the table used are written to the JSON ("sweep").
SWEEP_LR_FACTORS = (1.0, 10.0)
SWEEP_SIGMA_FACTORS = (2.0,)
SWEEP_SEED = 100
SWEPT = {"es": ("es", "copes-k2", "copes-k4"), "grpo": ("grpo",), "lora-grpo": ("lora-grpo",)}

# Shared settings of every run. invalid_penalty: -0.2 per turn with neither a closed tool call
# nor an answer (copes' shaping for models that have not learnt the protocol; every method
# gets it). 3 turns: a call, its result read, an answer, with one turn to spare.
TRAIN = {"model": "smollm2-135m", "dtype": "float32", "demonstrations": 2,
         "benchmark": "gsm8k", "train_split": "train", "eval_split": "validation",
         "batch_size": 4, "max_new_tokens": 96, "max_turns": 3, "eval_tasks": HELD_OUT,
         "num_train_tasks": 7473 - HELD_OUT, "invalid_penalty": 0.2}
FINAL = {"passk_benchmark": "gsm8k", "passk_split": "test", "passk_tasks": 256, "passk_n": 1,
         "passk_ks": (1,), "passk_temperature": 0.0}
# The runs without --seeds (issue 39): one seed of every method, three of GRPO, ES and CoPES
# K = 4. Every method's seed 0 comes first (`plan`), so a comparison cut short is whole.
SEEDS = {"es": (0, 1, 2), "copes-k2": (0,), "copes-k4": (0, 1, 2), "grpo": (0, 1, 2),
         "lora-grpo": (0,)}
BUDGET = 1800.0  # CPU seconds per run (one thread: 30 minutes of one core)
QUICK = {"model": "tiny", "budget": 6.0, "train": {"batch_size": 2, "max_new_tokens": 32,
         "eval_tasks": 8, "num_train_tasks": 40, "demonstrations": 0, "dtype": "float32"},
         "final": {"passk_tasks": 4}, "eval_every": 2}
# fmt: on


def held_out_data(shared: Path, into: Path) -> Path:
    """A data folder whose gsm8k/ holds the train file split in two: train (all but the last
    `HELD_OUT` problems) and validation (those). The published file is read, never changed;
    the test file is copied as it is. Returns the folder (rewritten only where it differs)."""
    source = shared / "gsm8k" / "train.jsonl"
    test = shared / "gsm8k" / "test.jsonl"
    for path in (source, test):
        if not path.is_file():
            fail(
                f"{path} is missing; pass --data-dir with the benchmarks' files "
                "(gsm8k/train.jsonl and gsm8k/test.jsonl, see docs/evaluation.md)"
            )
    lines = source.read_text().splitlines(keepends=True)
    if len(lines) <= HELD_OUT:
        fail(f"{source} has {len(lines)} problems; the experiment holds out the last {HELD_OUT} "
             "for validation and trains on the rest, so it needs more")  # fmt: skip
    digests = {"train.jsonl": file_digest(source), "test.jsonl": file_digest(test)}
    record = into / "source.json"
    if record.exists() and json.loads(record.read_text())["sha256"] != digests:
        fail(
            f"{into} was split from other GSM8K files than {shared / 'gsm8k'} holds now, and "
            "the runs beside it trained on those; pass another --runs-dir (or delete that one)"
        )
    parts = {"train.jsonl": lines[:-HELD_OUT], "validation.jsonl": lines[-HELD_OUT:],
             "test.jsonl": test.read_text().splitlines(keepends=True)}  # fmt: skip
    folder = into / "gsm8k"
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        text = "".join(part)
        path = folder / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    record.write_text(json.dumps({"source": str(shared / "gsm8k"), "sha256": digests}, indent=2))
    return into


def fail(message: str) -> NoReturn:
    """A user error: one line on stderr, exit status 2."""
    print(f"real_model.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def _run_logged(spec: RunSpec) -> dict[str, Any]:
    """`run_one` with the trainer's log lines (every validation) on stderr, named by run:
    a run takes most of an hour, and its progress should show."""
    import logging

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {spec.method} seed {spec.seed}: %(message)s"
    )
    for noisy in ("httpx", "copes.envs.tasks.builtin", "copes.agents.gguf"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return run_one(spec)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def method_table(quick: bool) -> dict[str, dict[str, Any]]:
    table = {m: dict(s) for m, s in METHODS.items()}
    if quick:
        for settings in table.values():
            settings["eval_every"] = QUICK["eval_every"]
            if "population_size" in settings:
                settings["population_size"] = 2 * settings.get("num_subspaces", 1)
            else:
                settings["group_size"] = settings["micro_batch_size"] = 2
    return table


def chosen_table(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The methods to run and their settings: the published defaults (--quick: shrunk) or
    those of --settings-from, cut to --methods (in its order)."""
    if args.settings_from:
        table = settings_from(args.settings_from, args.sweep)
    else:
        table = method_table(args.quick)
    if args.methods:
        wanted = args.methods.split(",")
        unknown = [m for m in wanted if m not in table]
        if unknown:
            fail(f"unknown method(s) {unknown}; choose from {list(table)}")
        table = {m: table[m] for m in wanted}
    return table


def settings_from(report: str, sweep: bool) -> dict[str, dict[str, Any]]:
    """The method table a finished report trained with (after its sweep, if it had one)."""
    if sweep:
        fail("--settings-from and --sweep both choose the hyper-parameters: pass one of them")
    try:
        table = json.loads(Path(report).read_text())["hyperparameters"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--settings-from {report}: not a real_model report's JSON ({exc}); pass the "
             "--out of a finished run, e.g. benchmarks/results/real_model.json")  # fmt: skip
    rows_ok = (
        isinstance(table, dict)
        and table
        and all(
            m in METHODS and isinstance(row, dict) and "optimizer" in row
            for m, row in table.items()
        )
    )
    if not rows_ok:
        fail(f"--settings-from {report}: its hyperparameters are not a table of copes methods "
             f"({', '.join(METHODS)}); pass a real_model report")  # fmt: skip
    return table


def plan(
    table: dict[str, dict[str, Any]],
    seeds: list[int] | None,
    args: argparse.Namespace,
    data_dir: Path,
    budget: float,
    runs_dir: Path,
    test: bool = True,
) -> list[RunSpec]:
    train = {**TRAIN, "data_dir": str(data_dir)}
    final = dict(FINAL)
    model = TRAIN["model"]
    if args.quick:
        train.update(QUICK["train"])
        final.update(QUICK["final"])
        model = QUICK["model"]
    if not test:
        final["passk_tasks"] = 0
    del train["model"]
    runs = [(m, seed) for m in table for seed in (seeds or SEEDS.get(m, (0,)))]
    runs.sort(key=lambda run: run[1])  # by seed (stable: the table's order within a seed)
    return [
        RunSpec(
            method=m,
            seed=seed,
            settings=table[m],
            run_dir=str(runs_dir / f"{m}-seed{seed}"),
            model=args.model or model,
            env="ToolMath-v0",
            budget_kind="cpu-seconds",
            budget=budget,
            train=train,
            **final,
        )
        for m, seed in runs
    ]


class Archive:
    """Runs kept beside the report (`NAME-runs/`, committed with it), keyed by the run's
    folder under --runs-dir, for a checkout that has lost --runs-dir (a fresh clone, another
    machine): a finished run's record (`<run>.json`), restored instead of training again, and
    an unfinished ES/CoPES run's state (`unfinished/<run>/`: its settings, metrics and seed
    log, a few kB), copied every `keep_every` seconds while it trains and restored into an
    empty run folder, from which `--resume` replays the logged steps and trains on. GRPO's
    state is its checkpoint (weights and AdamW moments, 1.6 GB in float32): not kept, so a
    GRPO run must finish where it started. Only state of the very spec asked for is used."""

    # metrics before es_log: the trainer appends a step to es_log first, so the copy's
    # es_log holds every step its metrics do (a step only es_log holds is rebuilt on resume)
    STATE = ("config.json", "metrics.jsonl", "es_log.jsonl", MACHINES_FILE)

    def __init__(self, folder: Path, runs_dir: Path) -> None:
        self.folder, self.runs_dir = folder, runs_dir

    def _key(self, run_dir: str | Path) -> str:
        return Path(run_dir).relative_to(self.runs_dir).as_posix()

    def path(self, run_dir: str | Path) -> Path:
        return self.folder / (self._key(run_dir) + ".json")

    def unfinished(self, run_dir: str | Path) -> Path:
        return self.folder / "unfinished" / self._key(run_dir)

    def restore(self, specs: list[RunSpec]) -> None:
        for spec in specs:
            kept, state = self.path(spec.run_dir), self.unfinished(spec.run_dir)
            if read_result(spec.run_dir) is not None:
                continue
            if kept.exists():
                record = json.loads(kept.read_text())
                self._check(record, spec, kept, "a finished run")
                write_atomic(Path(spec.run_dir) / RESULT_FILE, record)
                print(f"[real_model] {spec.method} seed {spec.seed}: restored from {kept}")
            elif state.is_dir() and not (Path(spec.run_dir) / "config.json").exists():
                self._check(json.loads((state / "spec.json").read_text()), spec, state,
                            "an unfinished run")  # fmt: skip
                Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
                for name in self.STATE:
                    if (state / name).exists():
                        shutil.copyfile(state / name, Path(spec.run_dir) / name)
                log = state / "es_log.jsonl"
                steps = log.read_text().count("\n") if log.exists() else 0  # whole lines
                print(f"[real_model] {spec.method} seed {spec.seed}: restored from {state}; "
                      f"resumes after step {steps}", flush=True)  # fmt: skip

    @staticmethod
    def _check(record: dict[str, Any], spec: RunSpec, where: Path, what: str) -> None:
        if not same_spec(record, spec):
            fail(
                f"{where} holds {what} with other settings than {spec.method} seed "
                f"{spec.seed} now has; delete it (and its report) or pass another --name"
            )

    def keep_state(self, spec: RunSpec) -> None:
        """Copy an unfinished ES/CoPES run's state (each file replaced atomically)."""
        run_dir = Path(spec.run_dir)
        if spec.settings.get("optimizer") not in REPLAYED:
            return
        if not (run_dir / "config.json").exists() or read_result(run_dir) is not None:
            return
        state = self.unfinished(run_dir)
        state.mkdir(parents=True, exist_ok=True)
        write_atomic(state / "spec.json", {"spec": asdict(spec)})
        for name in self.STATE:
            if (run_dir / name).exists():
                part = state / f".{name}.part"
                shutil.copyfile(run_dir / name, part)
                os.replace(part, state / name)

    def keep(self, spec: RunSpec, record: dict[str, Any]) -> None:
        if "error" not in record:
            # a run finished before records kept their signal: read it from its metrics
            if "signal" not in record and (signal := _signal(record)):
                record = {**record, "signal": signal}
            write_atomic(self.path(spec.run_dir), record)
            state = self.unfinished(spec.run_dir)
            shutil.rmtree(state, ignore_errors=True)
            for parent in state.parents:  # no empty unfinished/ folders left to commit
                if parent == self.folder or not parent.is_dir() or any(parent.iterdir()):
                    break
                parent.rmdir()


def execute(
    specs: list[RunSpec], workers: int, archive: Archive, keep_every: float = 60.0
) -> list[dict[str, Any]]:
    """Every run in a fresh process (`max_tasks_per_child=1`: its peak RSS is its own),
    `workers` at a time in the order `next_run` picks, one thread each; finished runs are
    read back (from --runs-dir, or restored from the archive) and every finished run is
    archived, unfinished ES/CoPES runs' state every `keep_every` seconds."""
    archive.restore(specs)
    try:
        check_finished_runs(specs)
    except ValueError as exc:
        fail(str(exc))
    todo = [s for s in specs if read_result(s.run_dir) is None]
    records = {s.run_dir: read_result(s.run_dir) for s in specs if s not in todo}
    for spec in specs:
        if spec not in todo:
            archive.keep(spec, records[spec.run_dir])
    if todo:
        context = multiprocessing.get_context("spawn")
        # a fresh process per run where Python has max_tasks_per_child (3.11+); on 3.10 the
        # workers are reused and a run's peak RSS is the largest of its process's runs
        fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
        try:
            with ProcessPoolExecutor(workers, mp_context=context, **fresh) as pool:
                pending, running = list(todo), {}
                while pending or running:
                    while len(running) < workers:
                        spec = next_run(pending, list(running.values()))
                        if spec is None:
                            break
                        pending.remove(spec)
                        running[pool.submit(_run_logged, spec)] = spec
                    done, _ = wait(running, timeout=keep_every, return_when=FIRST_COMPLETED)
                    for future in done:
                        spec = running.pop(future)
                        record = future.result()
                        state = "FAILED" if "error" in record else "done"
                        print(f"[real_model] {spec.method} seed {spec.seed}: {state}", flush=True)
                        records[spec.run_dir] = record
                        archive.keep(spec, record)
                    for spec in running.values():
                        archive.keep_state(spec)
        except BrokenProcessPool:  # (a multiprocessing.Pool would wait forever here)
            fail(
                "a run's process died (killed: out of memory? see dmesg); every finished "
                "step is kept: start the same command again, with --workers 1 if memory is short"
            )
    return [records[s.run_dir] for s in specs]


def next_run(pending: list[RunSpec], running: list[RunSpec]) -> RunSpec | None:
    """The run to start in a free slot (None: leave it free for now). GRPO-family runs first,
    because their state is not archived and they must finish in the session they start in,
    but never two side by side: in float32 each peaked at 10-13 GB of RSS (the sweep,
    2026-12-07), and two do not fit in 24 GB; an ES/CoPES run (9 GB) goes beside one. Lower
    seeds first: a GRPO-family run jumps the queue only within the lowest pending seed, so
    every method's seed 0 starts before any seed 1 run, on any number of workers; an ES/CoPES
    run of a later seed fills a slot that would otherwise wait."""

    def heavy(spec: RunSpec) -> bool:
        return spec.settings.get("optimizer") not in REPLAYED

    if not pending:
        return None
    lowest = min(s.seed for s in pending)
    if not any(heavy(s) for s in running):
        first = next((s for s in pending if heavy(s) and s.seed == lowest), None)
        if first is not None:
            return first
    light = [s for s in pending if not heavy(s)]
    return min(light, key=lambda s: s.seed) if light else None  # min keeps the first of equals


def _score(record: dict[str, Any]) -> tuple[float, float]:
    if "error" in record:
        return (-1.0, -1.0)
    return (record["curve"]["accuracy"][-1], record["curve"]["reward"][-1])


def _check_trials(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A failed trial stops the sweep: choosing without it would pick another table than a
    later invocation (which retries it) and strand the runs trained with this one."""
    failed = [name for name, record in results.items() if "error" in record]
    if failed:
        last = results[failed[0]]["error"].strip().splitlines()[-1][:200]
        fail(f"sweep trial(s) {failed} failed ({last}); fix the cause and start again "
             "(finished trials are kept)")  # fmt: skip
    return results


def _round(value: float) -> float:
    return float(f"{value:.6g}")  # 1e-05, not 9.999999999999999e-06, in the JSON and flags


def _trial(method: str, name: str, settings: dict[str, Any], record: dict[str, Any]) -> dict:
    accuracy, reward = _score(record)
    return {"method": method, "trial": name, "settings": settings,
            "final_accuracy": accuracy, "final_reward": reward}  # fmt: skip


def sweep(
    args: argparse.Namespace, table: dict[str, dict[str, Any]], data_dir: Path, budget: float,
    runs_dir: Path, archive: Archive,
) -> dict[str, Any]:  # fmt: skip
    """The rows of `table` as SWEPT sets them: learning rates x SWEEP_LR_FACTORS, then (ES)
    sigma x SWEEP_SIGMA_FACTORS at the better rate; a third of the budget each, seed
    SWEEP_SEED, chosen by validation (no final test). Returns the new table and every trial."""

    def trials(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        rows = {n: {**r, "eval_every": 0} for n, r in rows.items()}  # start and end only
        specs = plan(rows, [SWEEP_SEED], args, data_dir, budget / 3, runs_dir / "sweep", False)
        records = execute(specs, args.workers, archive, args.keep_every)
        return {s.method: r for s, r in zip(specs, records, strict=True)}

    swept = [m for m in SWEPT if m in table or any(t in table for t in SWEPT[m])]
    base = {m: method_table(args.quick)[m] for m in swept}
    rows = {
        f"{m}-lr{f:g}": {**base[m], "learning_rate": _round(base[m]["learning_rate"] * f)}
        for m in swept
        for f in SWEEP_LR_FACTORS
    }
    results = trials(rows)
    _check_trials(results)
    chosen, log = {}, []
    for m in swept:  # max() keeps the first of equals: factor 1, the published default
        names = [f"{m}-lr{f:g}" for f in SWEEP_LR_FACTORS]
        log += [_trial(m, n, rows[n], results[n]) for n in names]
        chosen[m] = max(names, key=lambda n: _score(results[n]))
    sigma_rows = {
        f"{m}-sigma{f:g}": {**rows[chosen[m]], "sigma": _round(rows[chosen[m]]["sigma"] * f)}
        for m in swept
        if "sigma" in base[m]
        for f in SWEEP_SIGMA_FACTORS
    }
    results.update(_check_trials(trials(sigma_rows)))
    rows.update(sigma_rows)
    for name in sigma_rows:
        m = name.rsplit("-sigma", 1)[0]
        log.append(_trial(m, name, rows[name], results[name]))
        if _score(results[name]) > _score(results[chosen[m]]):
            chosen[m] = name
    new = dict(table)
    for m in swept:
        keys = ("learning_rate", "sigma")
        for target in SWEPT[m]:
            if target in new:
                new[target] = {**new[target], **{k: rows[chosen[m]][k] for k in keys
                                                 if k in rows[chosen[m]]}}  # fmt: skip
    return {"table": new, "chosen": chosen, "trials": log, "seed": SWEEP_SEED,
            "budget": budget / 3}  # fmt: skip


def base_model_test(
    args: argparse.Namespace, data_dir: Path, runs_dir: Path, archive: Archive
) -> dict[str, Any]:
    """The base model's greedy pass@1 on the final test, with the runs' prompt and settings
    (kept in runs_dir/base-test and the archive, reused only for the same model, prompt and
    test)."""
    out = runs_dir / "base-test"
    done = out / "result.json"
    spec = plan({"base": {}}, [0], args, data_dir, 0.0, runs_dir)[0]
    identity = json.loads(json.dumps({**asdict(spec), "budget": None, "run_dir": None}))
    for path in (done, archive.path(out)):
        stored = json.loads(path.read_text()) if path.exists() else {}
        if stored.get("spec") == identity:
            write_atomic(archive.path(out), stored)
            return stored["result"]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            result = pool.submit(_evaluate_base, spec, str(out)).result()
        except Exception as exc:  # a --model that does not load, a killed process: one line
            fail(f"the base model's test failed: {type(exc).__name__}: {str(exc)[:300]}")
    for path in (done, archive.path(out)):
        write_atomic(path, {"spec": identity, "result": result})
    return result


def _evaluate_base(spec: RunSpec, out: str) -> dict[str, Any]:
    import torch
    from _learning_runs import final_test

    from copes.agents.loading import load_policy

    torch.set_num_threads(int(os.environ.get("COPES_BENCH_THREADS", "1")))
    policy = load_policy(spec.model, device="cpu", dtype=spec.train.get("dtype"))
    return final_test(spec, policy, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI smoke: the tiny agent, seconds")
    p.add_argument("--model", help="override the model (default: smollm2-135m; quick: tiny)")
    p.add_argument("--methods", help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="seeds of every method (default: SEEDS, three of GRPO, ES and CoPES "
        "K = 4, one of the others; --quick: 0)",
    )
    p.add_argument("--budget", type=float, help=f"CPU seconds per run (default {BUDGET:g})")
    p.add_argument("--sweep", action="store_true", help="run the sweep, then use its table")
    p.add_argument("--settings-from", metavar="REPORT.json",
                   help="use the hyper-parameters a finished report used (its sweep's choice, "
                   "e.g. benchmarks/results/real_model.json) instead of sweeping; with --name, "
                   "a run of your own")  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument(
        "--keep-every",
        type=float,
        default=60.0,
        help="seconds between copies of unfinished ES/CoPES runs into the archive",
    )
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" /
                   "benchmarks"), help="the benchmarks' files (holding gsm8k/)")  # fmt: skip
    p.add_argument("--runs-dir", help="default: runs/benchmarks/<name>")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--name", help="output file stem (default: real_model[-quick])")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("COPES_BENCH_THREADS", "1")
    table = chosen_table(args)
    if args.workers < 1:
        fail(f"--workers must be >= 1, got {args.workers}")
    if args.budget is not None and not args.budget > 0:
        fail(f"--budget must be > 0 CPU seconds, got {args.budget:g}")
    if not args.keep_every > 0:
        fail(f"--keep-every must be > 0 seconds, got {args.keep_every:g}")
    if args.seeds is None and args.quick:
        args.seeds = [0]
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        fail(f"--seeds {' '.join(map(str, args.seeds))} names a seed twice")
    name = args.name or ("real_model-quick" if args.quick else "real_model")
    report = Path(args.results_dir) / f"{name}.json"
    if args.settings_from and Path(args.settings_from).resolve() == report.resolve():
        fail(f"--settings-from {args.settings_from} is the report this run writes; pass --name "
             "for a run of your own")  # fmt: skip
    runs_dir = Path(args.runs_dir or f"runs/benchmarks/{name}")
    budget = args.budget if args.budget is not None else QUICK["budget"] if args.quick else BUDGET
    shared = Path(args.data_dir)
    data_dir = held_out_data(shared, runs_dir / "data")
    archive = Archive(Path(args.results_dir) / f"{name}-runs", runs_dir)
    start = time.perf_counter()
    tuning = sweep(args, table, data_dir, budget, runs_dir, archive) if args.sweep else None
    if tuning:
        table = tuning["table"]
    specs = plan(table, args.seeds, args, data_dir, budget, runs_dir)
    records = execute(specs, args.workers, archive, args.keep_every)
    base = base_model_test(args, data_dir, runs_dir, archive)
    summary = summarize(records, list(table), "cpu-seconds", budget)
    runs = {f"{r['spec']['method']}-seed{r['spec']['seed']}": run_facts(r) for r in records}
    meta = {
        "benchmark": "real_model",
        "command": "python benchmarks/real_model.py " + " ".join(argv or sys.argv[1:]),
        "model": records[0]["spec"]["model"] if records else None,
        "seeds": {m: sorted({s.seed for s in specs if s.method == m}) for m in table},
        "budget_kind": "cpu-seconds",
        "hyperparameters": table,
        "sweep": tuning,
        "settings_from": args.settings_from,
        "train_settings": plan(table, [0], args, data_dir, budget, runs_dir)[0].train,
        "final_test": {**FINAL, **(QUICK["final"] if args.quick else {})},
        "data": {
            "train_file": str(shared / "gsm8k" / "train.jsonl"),
            "train_file_sha256": file_digest(shared / "gsm8k" / "train.jsonl"),
            "held_out": f"the last {HELD_OUT} problems of the train file",
        },
        "base_model_test": base,
        "runs": runs,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads_per_run": int(os.environ["COPES_BENCH_THREADS"]),
            "workers": args.workers,
        },
        "wall_seconds": round(time.perf_counter() - start, 1),  # this invocation
        "peak_rss_mb_of_this_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }
    title = f"GSM8K with a calculator, {Path(meta['model'] or '').name}, equal CPU seconds"
    paths = write_outputs(summary, meta, Path(args.results_dir), name, title)
    print(paths["md"].read_text())
    print(runs_table(runs, base))
    print(f"[real_model] wrote {', '.join(str(p) for p in paths.values())}")
    return {**meta, **summary}


def run_facts(record: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers beside its curve: rates at the last validation, resources, test."""
    if "error" in record:
        return {"error": record["error"][-400:]}
    curve = record["curve"]
    return {
        "steps": record["summary"]["steps"],
        "cpu_seconds": record["summary"]["cpu_seconds"],
        "generated_tokens": record["summary"]["generated_tokens"],
        "validation_accuracy": [curve["accuracy"][0], curve["accuracy"][-1]],
        "protocol_use_rate": [curve["protocol_use"][0], curve["protocol_use"][-1]],
        "tool_use_rate": [curve["tool_use"][0], curve["tool_use"][-1]],
        "invalid_rate": [curve["invalid"][0], curve["invalid"][-1]],
        # graded before issue 48 (records without it): n/a, not 0
        "undone_arithmetic_rate": [
            (curve.get("undone_arithmetic") or [None])[0],
            (curve.get("undone_arithmetic") or [None])[-1],
        ],
        "peak_rss_mb": record.get("peak_rss_mb"),
        "load_average": [record.get("load_average_at_start"), record.get("load_average_at_end")],
        "test_pass@1": record["pass_at_k"].get("pass@1"),
        "signal": _signal(record),
        # every part of the run (one per session it trained in): which CPU trained it
        "cpus": [m["cpu"] + f" ({m['torch_cpu_capability']})" for m in record.get("machines", [])],
    }


def _signal(record: dict[str, Any]) -> dict[str, Any]:
    """What the run's steps had to learn from (`signal_of`): kept in its record since
    2026-12-07; read from its metrics where an older record lacks it and they are here."""
    if "signal" in record:
        return record["signal"]
    run_dir = Path(record["spec"]["run_dir"])
    return signal_of(run_dir) if (run_dir / "metrics.jsonl").exists() else {}


def _value(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def runs_table(runs: dict[str, dict[str, Any]], base: dict[str, Any]) -> str:
    lines = [
        f"base model: GSM8K test pass@1 {_value(base.get('pass@1'))}",
        "| run | steps | tokens | val acc (first -> last) | undone arithmetic | protocol use "
        "| tool use | invalid | peak RSS MB | test pass@1 | tied steps "
        "| steps with a correct answer |",
        "|---|---:|---:|---|---|---|---|---|---:|---:|---:|---:|",
    ]

    def pair(first_last: list[float | None]) -> str:
        return f"{_value(first_last[0])} -> {_value(first_last[1])}"

    for name, r in runs.items():
        if "error" in r:
            lines.append(f"| {name} | FAILED | | | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['steps']} | {r['generated_tokens']:,} "
            f"| {pair(r['validation_accuracy'])} "
            f"| {pair(r.get('undone_arithmetic_rate', [None, None]))} "
            f"| {pair(r['protocol_use_rate'])} | {pair(r['tool_use_rate'])} "
            f"| {pair(r['invalid_rate'])} "
            f"| {r['peak_rss_mb']} | {_value(r['test_pass@1'])} "
            f"| {_value(r['signal'].get('tied_steps'))} "
            f"| {_value(r['signal'].get('steps_with_a_correct_answer'))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
