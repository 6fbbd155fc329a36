"""A run's folder, and resuming it: a fresh run refuses a folder that holds one; the run's
settings are written to config.json once accepted; `--resume` must not change what is trained
or generated (every difference named), and continues from the latest checkpoint plus the
es_log.jsonl steps after it (replayed without rollouts, bit-identically), rebuilding train
records a kill left out of metrics.jsonl."""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from copes.errors import UserError
from copes.optimizers.table import get_optimizer
from copes.run_log import MetricsLog, drop_torn_tail, read_jsonl, rebuild_train_record
from copes.train.settings import RESUMABLE_CHANGES, Budget, TrainConfig, public_settings

if TYPE_CHECKING:
    from copes.agents.policy import Policy
    from copes.optimizers.base import Optimizer

logger = logging.getLogger(__name__)


class RunFolder:
    """A run's folder (`--out-dir`) and its settings: refused when it holds another run,
    accepted (config.json written) only once the run is checked, resumed from.

    Args:
        run_dir: the folder.
        config: the run's settings.
        optimizer: the run's optimizer (its config is recorded; a resume loads its state).
        demonstration_messages: the played worked examples every episode starts with.
    """

    def __init__(
        self,
        run_dir: Path,
        config: TrainConfig,
        optimizer: Optimizer,
        demonstration_messages: list[dict[str, Any]],
    ) -> None:
        self.run_dir = run_dir
        self.config = config
        self.optimizer = optimizer
        self.demonstration_messages = demonstration_messages

    def accept(self) -> None:
        """Check a `--resume` against the folder's settings, then write config.json: before
        this nothing is written into the folder."""
        if self.config.resume:
            self._check_resume_settings()
        path = self.run_dir / "config.json"
        if self.config.resume and path.exists():
            return  # checked equal; the budget may have grown
        path.write_text(json.dumps(self._run_config(), indent=2))

    def resume(self, policy: Policy, log: MetricsLog) -> Budget:
        """Load the latest checkpoint into `policy` and the optimizer, replay the logged
        steps after it, rebuild the train records a kill left out of `log`; the budget the
        run continues with."""
        from copes.checkpoint import (
            latest_checkpoint,
            load_master_state,
            load_optimizer_tensors,
            load_state,
        )

        # A SIGKILL may leave half a line: es_log's step is then rolled out again; a torn
        # train record of a logged step is rebuilt from es_log below.
        for name in ("es_log.jsonl", "metrics.jsonl"):
            drop_torn_tail(self.run_dir / name)
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            try:
                state = load_state(checkpoint)
                self.optimizer.load_weights(policy, checkpoint)
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
            if master is not None:
                policy.weights().load_master_state(master)
            logger.info("resuming from %s (step %d)", checkpoint, budget.steps)
        else:
            budget = Budget()
        logged = read_jsonl(self.run_dir / "es_log.jsonl") if self.optimizer.replays else []
        if self.optimizer.replays:
            entries = [e for e in logged if e["step"] >= budget.steps]
            entries = self._contiguous(entries, budget.steps)
            if entries:
                self.optimizer.replay(entries, policy)
                last = entries[-1]
                budget = Budget(last["step"] + 1, last["tokens"], last["seconds"],
                                last.get("cpu_seconds", 0.0))  # fmt: skip
                logger.info("replayed %d logged steps without rollouts", len(entries))
        elif checkpoint is None:
            logger.info("no checkpoint to resume from: starting from the base model")
        log.resume_at(budget.steps, self._rebuilt_train_records(budget, logged))
        return budget

    def _rebuilt_train_records(
        self, budget: Budget, logged: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Train records of the steps before the resume point that metrics.jsonl lacks (a
        torn last line, or a kill between the es_log and metrics appends), rebuilt from
        their es_log entries; a lacking step with no entry (GRPO, whose metrics lines are
        not fsynced: an OS crash) cannot be rebuilt and is named in a warning."""
        have = {
            r["step"] for r in read_jsonl(self.run_dir / "metrics.jsonl") if r["kind"] == "train"
        }
        lacking = [s for s in range(budget.steps) if s not in have]
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

    def _run_config(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "train": public_settings(self.config),
            "optimizer": self.optimizer.state_dict().get("config"),
        }
        if self.demonstration_messages:  # the examples as played, so a resume checks them
            from copes.envs.demonstrations import transcript_digest

            record["demonstrations"] = {
                "sha256": transcript_digest(self.demonstration_messages),
                "messages": self.demonstration_messages,
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
        # A setting added after the run was written (e.g. --demonstrations) had its default.
        old_train = {**self._train_defaults(), **saved["train"]}
        changed = [
            f"{k}: {old_train.get(k)!r} -> {v!r}"
            for k, v in record["train"].items()
            if k not in RESUMABLE_CHANGES and old_train.get(k) != v
        ]
        old_demo, new_demo = saved.get("demonstrations") or {}, record.get("demonstrations") or {}
        if old_demo.get("sha256") != new_demo.get("sha256"):
            changed.append(
                "the played demonstrations differ from the run's (another copes version "
                "writes them differently)"
            )
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

    def _train_defaults(self) -> dict[str, Any]:
        """TrainConfig's defaults, as the run config stores them (JSON)."""
        defaults = {
            f.name: f.default for f in fields(self.config) if f.default is not MISSING
        }  # fmt: skip
        return json.loads(json.dumps(defaults, default=str))

    def _optimizer_defaults(self) -> dict[str, Any]:
        """The optimizer config's defaults, as the run config stores them (JSON)."""
        config = get_optimizer(self.config.optimizer).config
        defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
        return json.loads(json.dumps(defaults, default=str))


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run's folder holds no run: checked before anything is built or written."""
    existing = [
        p for p in ("metrics.jsonl", "es_log.jsonl", "checkpoints") if (run_dir / p).exists()
    ]
    if existing:
        raise FileExistsError(
            f"{run_dir} already holds a run ({', '.join(existing)}); pass --resume to "
            "continue it or choose another --out-dir"
        )
