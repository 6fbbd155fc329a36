"""Model names the server answers to.

The current policy is ``policy@VERSION`` (VERSION: the updates applied so far). During an ES
step, member m of step s of run RUN is ``RUN.sS.mM``. A name carries its step, so a client
holding a stale name is refused instead of reaching weights that changed under it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

_MEMBER = re.compile(r"^(?P<run>[A-Za-z0-9_-]+)\.s(?P<step>\d+)\.m(?P<member>\d+)$")
_POLICY = re.compile(r"^policy@(?P<version>\d+)$")


def new_run_id() -> str:
    """A short id that keeps two server runs' member names apart."""
    return f"copes-{secrets.token_hex(3)}"


def policy_name(version: int) -> str:
    return f"policy@{version}"


def member_name(run: str, step: int, member: int) -> str:
    return f"{run}.s{step}.m{member}"


@dataclass(frozen=True)
class ModelName:
    """A parsed model name: the policy at `version`, or `member` of `step` of `run`."""

    run: str | None
    step: int
    member: int | None

    @property
    def is_policy(self) -> bool:
        return self.member is None


def parse_model_name(name: str) -> ModelName | None:
    """The name's parts, or None when it is neither a policy nor a member name."""
    if match := _POLICY.match(name):
        return ModelName(None, int(match["version"]), None)
    if match := _MEMBER.match(name):
        return ModelName(match["run"], int(match["step"]), int(match["member"]))
    return None
