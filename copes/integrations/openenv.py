"""copes envs as OpenEnv environments, and OpenEnv servers as Gymnasium envs for copes.

OpenEnv (``openenv-core``, tested with 0.3.0; docs/integrations.md) serves an environment
over WebSocket sessions: `reset` and `step(Action)` return an `Observation` with `reward` and
`done`. Both directions:

- `CopesOpenEnv` / `create_app(make_env)`: a copes ToolEnv behind an OpenEnv server, so any
  OpenEnv client (TRL's OpenEnv examples, other trainers) drives copes' tools, sandbox and
  grader. An action is the agent's whole turn (`TurnAction.text`); the observation carries
  the env's reply, its tool schemas, the conversation in OpenAI format and the step's info.
- `OpenEnvGym(client)`: an OpenEnv client of such a server as a Gymnasium env, so copes'
  rollouts (and therefore copes-train's optimizers) run episodes against a remote server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from copes.envs.core import UnicodeText


class TurnAction(Action):
    """The agent's whole turn: a tool call or a final answer, in the env's call format."""

    text: str = Field(description="the agent's turn, e.g. <python>print(2**10)</python>")


class TurnObservation(Observation):
    """The env's reply to a turn (a tool's output, an error, or empty at the end)."""

    text: str = Field(default="", description="the first message after reset, then replies")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="tool JSON schemas")
    messages: list[dict[str, Any]] = Field(default_factory=list, description="OpenAI format")
    info: dict[str, Any] = Field(default_factory=dict, description="the step's info (JSON)")
    truncated: bool = Field(default=False, description="ended by the turn limit")


class EpisodeState(State):
    task_id: str | None = None
    call_format: str = "tags"


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """`info` without the parts that are sent apart (messages, tools), JSON round-tripped."""
    kept = {k: v for k, v in info.items() if k not in ("messages", "tools")}
    return json.loads(json.dumps(kept, default=str))


class CopesOpenEnv(Environment[TurnAction, TurnObservation, EpisodeState]):
    """One copes env as an OpenEnv `Environment` (one instance per session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own env (and sandbox)

    def __init__(self, make_env: Callable[[], Any]) -> None:
        super().__init__()
        from copes.integrations.trl import _copes_env

        self.env = make_env()
        self.base = _copes_env(self.env)
        self._state = EpisodeState(call_format=self.base.call_format)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        task_index: int | None = None,
        **kwargs: Any,
    ) -> TurnObservation:
        options: dict[str, Any] = {}
        if task_id is not None:
            options["task_id"] = task_id
        elif task_index is not None:
            options["task_index"] = task_index
        first, info = self.env.reset(seed=seed, options=options or None)
        self._state = EpisodeState(
            episode_id=episode_id, step_count=0, task_id=info["task_id"],
            call_format=self.base.call_format,
        )  # fmt: skip
        return TurnObservation(
            text=first, tools=info["tools"], messages=info["messages"], info=_jsonable(info)
        )

    def step(
        self, action: TurnAction, timeout_s: float | None = None, **kwargs: Any
    ) -> TurnObservation:
        reply, reward, terminated, truncated, info = self.env.step(action.text)
        self._state.step_count += 1
        return TurnObservation(
            text=reply, reward=float(reward), done=bool(terminated or truncated),
            truncated=bool(truncated), tools=info["tools"], messages=info["messages"],
            info=_jsonable(info),
        )  # fmt: skip

    @property
    def state(self) -> EpisodeState:
        return self._state

    def close(self) -> None:
        self.env.close()


def create_app(make_env: Callable[[], Any], *, max_concurrent_envs: int = 16) -> Any:
    """The FastAPI app serving `make_env`'s env (``uvicorn.run(create_app(...))``)."""
    from openenv.core.env_server.http_server import create_app as openenv_app

    return openenv_app(
        lambda: CopesOpenEnv(make_env), TurnAction, TurnObservation, env_name="copes",
        max_concurrent_envs=max_concurrent_envs,
    )  # fmt: skip


class TurnClient(EnvClient[TurnAction, TurnObservation, EpisodeState]):
    """An OpenEnv client of a copes server (``TurnClient(base_url="ws://host:port")``)."""

    def _step_payload(self, action: TurnAction) -> dict[str, Any]:
        return {"text": action.text}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TurnObservation]:
        observation = TurnObservation(
            **payload.get("observation", {}), reward=payload.get("reward"),
            done=bool(payload.get("done", False)),
        )  # fmt: skip
        return StepResult(observation, payload.get("reward"), bool(payload.get("done", False)))

    def _parse_state(self, payload: dict[str, Any]) -> EpisodeState:
        return EpisodeState(**payload)


class OpenEnvGym(gym.Env[str, str]):
    """A copes OpenEnv server's session as a Gymnasium env that copes' rollout can drive.

    `client` is a connected sync client (``TurnClient(base_url=...).sync()``). Tasks are
    chosen by id (``reset(options={"task_id": ...})``) or by the server's own draw; the
    call format and tool schemas come with every observation's info.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.action_space = UnicodeText(32_000)
        self.observation_space = UnicodeText(1_000_000)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = dict(options or {})
        if "task" in options:  # a Task object cannot cross the wire: its id does
            options["task_id"] = options.pop("task").id
        result = self.client.reset(seed=seed, **options)
        obs = result.observation  # its info is the server env's StepInfo (call_format, ...)
        return obs.text, {**obs.info, "messages": obs.messages, "tools": obs.tools}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        result = self.client.step(TurnAction(text=action))
        obs = result.observation
        info = {**obs.info, "messages": obs.messages, "tools": obs.tools}
        truncated = obs.truncated
        terminated = bool(result.done) and not truncated
        return obs.text, float(result.reward or 0.0), terminated, truncated, info

    def close(self) -> None:
        self.client.close()
