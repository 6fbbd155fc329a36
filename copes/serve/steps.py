"""A served step: the sessions the trainer opened, and how it ends.

The trainer opens a step with every session it needs (ES: member x task, in the order the
in-process population rollout runs them; GRPO and validation: task x sample of the policy),
hands them to a harness (in-process, or clients that ask over HTTP), and waits. The step
closes when every session has its reward; at its deadline, or when a harness fails, it fails
as a whole (`StepFailed`), and no update is applied: a partial step is never trained on.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from copes.errors import UserError
from copes.serve.sessions import Session
from copes.serve.wire import ServeError


class StepFailed(UserError):
    """A served step ended without every reward (timeout, or a harness error): the run
    stops with one line saying why (`copes-train` exits 2), and nothing of the step is kept."""


@dataclass(frozen=True)
class SessionSpec:
    """One session to open: its member (None: the policy) and stack slot, its task, and the
    sampling stream its episode draws from."""

    member: int | None
    slot: int | None
    task: Any
    stream: int | None = None


class ServedStep:
    """The open step's sessions (in episode order) and its deadline."""

    def __init__(
        self,
        step: int,
        purpose: str,
        policy_version: int,
        names: Sequence[str],
        specs: Sequence[SessionSpec],
        timeout: float,
    ) -> None:
        self.step = step
        self.purpose = purpose  # "train" or "validation"
        self.policy_version = policy_version
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.sampling: Any = None  # what its episodes sample with (set when it runs)
        self.failed: ServeError | None = None
        self.closed = False
        self._ended = 0
        self._done = threading.Condition()
        self.specs = list(specs)
        self.sessions = [
            Session(
                f"{purpose[0]}{step}-{i}-{secrets.token_hex(4)}",
                i,
                name,
                spec.member,
                spec.task,
                self,
            )
            for i, (name, spec) in enumerate(zip(names, specs, strict=True))
        ]
        self.by_id = {s.id: s for s in self.sessions}
        self._unclaimed = list(self.sessions)
        self._claim_lock = threading.Lock()

    def claim(self, limit: int, by: str) -> list[Session]:
        """Up to `limit` sessions no client has been given yet (ask/tell over HTTP), for the
        client `by` (named in the step's failure if it never rewards them)."""
        with self._claim_lock:
            taken, self._unclaimed = self._unclaimed[:limit], self._unclaimed[limit:]
        for session in taken:
            session.claimed_by = by
        return taken

    def waiting_reason(self, schedule: str) -> str:
        """Why a turn of this step may not have been generated yet (for a request's 504)."""
        silent = sum(1 for s in self.sessions if not s.turns and s.inflight is None and not s.ended)
        if schedule == "deterministic" and silent:
            return (
                f"the deterministic schedule starts step {self.step} once all of its "
                f"{len(self.sessions)} sessions have sent a first request, and {silent} have "
                "not: play a step's sessions at once, or serve with --turn-schedule as-they-come"
            )
        busy = sum(1 for s in self.sessions if s.inflight is not None)
        return f"the episode loop was generating {busy} sessions' turns"

    def session_ended(self) -> None:
        with self._done:
            self._ended += 1
            self._done.notify_all()

    def fail(self, message: str) -> None:
        """End the step without an update; waiting requests get the reason."""
        error = ServeError(409, f"step {self.step} failed: {message}", code="step_failed")
        with self._done:
            if self.failed is None:
                self.failed = error
            self._done.notify_all()
        for session in self.sessions:
            session.fail(error)

    def wait_rewards(self) -> None:
        """Until every session has its reward; raises `StepFailed` at the deadline or when
        the step failed."""
        with self._done:
            while self._ended < len(self.sessions) and self.failed is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(timeout=min(left, 1.0))
        if self.failed is None and self._ended < len(self.sessions):
            self.fail(self._missing())
        if self.failed is not None:
            raise StepFailed(f"{self.failed.message}; no update was applied")

    def _missing(self) -> str:
        """Which sessions have no reward at the deadline: never asked for, or taken (by
        whom) and never rewarded."""
        missing = [s for s in self.sessions if not s.ended]
        never = sum(1 for s in missing if s.claimed_by is None)
        owners = Counter(s.claimed_by for s in missing if s.claimed_by is not None)
        parts = []
        if never:
            parts.append(f"{never} never asked for (POST /copes/v1/ask hands them out)")
        if owners:
            taken = ", ".join(f"{n} by {who}" for who, n in owners.most_common())
            parts.append(f"{sum(owners.values())} taken and never rewarded ({taken})")
        return (
            f"{len(missing)} of {len(self.sessions)} sessions have no reward after "
            f"--step-timeout {self.timeout:g} s: {'; '.join(parts)}"
        )
