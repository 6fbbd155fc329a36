"""Batched multi-turn rollouts in environments: many episodes at once, each growing one
token sequence.

Each episode is an `EnvDriver` of the one episode loop (`copes.agents.episodes`): the env's
reset gives its prompt, every turn is stepped in the env (tool call, grading) and what the
env answered continues the sequence. The loop runs them in the policy's own
continuous-batching loop (`HFPolicy`: KV caches kept across turns, an episode's env step in
a worker thread while the others keep decoding), or turn by turn for any other policy (one
batched call per turn, then the env steps in parallel threads).

Tool calls run in sandbox processes or release the GIL, so a slow call costs at most its own
timeout; finished episodes drop out. Each episode keeps one growing token sequence with a
mask of the tokens the model generated, so GRPO trains on exactly the sampled ids and ES
needs only the rewards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import gymnasium as gym

from copes.agents.episodes import Schedule, play_episodes
from copes.agents.policy import Generation, Policy, SamplingConfig

logger = logging.getLogger(__name__)

EndReason = Literal["answer", "max_turns", "context", "invalid"]

# Where the turn of a tool call or an answer ends: stop there (one action per turn).
HERMES_STOPS = ("</tool_call>", "</answer>")
# A Llama-3 JSON call has no closing tag: the model ends the turn with its end-of-turn token.
LLAMA_JSON_STOPS = ("</answer>",)


def stop_strings(info: dict[str, Any]) -> tuple[str, ...]:
    """The stop strings that end a turn in the call format of an env's `info` (its
    `StepInfo`: ``call_format`` and the tools' schemas); one action per turn."""
    call_format = info.get("call_format", "tags")
    if call_format in ("hermes", "qwen-xml", "glm-xml"):
        return HERMES_STOPS
    if call_format in ("llama-json", "mistral"):  # the call is the turn: the model ends it
        return LLAMA_JSON_STOPS
    if call_format == "harmony":  # <|call|> and <|return|> end a turn; a stop string could
        return ()  # fire inside the analysis channel

    names = [schema["function"]["name"] for schema in info.get("tools", [])]
    return (*(f"</{name}>" for name in names), "</answer>")


def stop_strings_for(env: gym.Env) -> tuple[str, ...]:
    """`stop_strings` of an env, read off a reset (which starts a new episode)."""
    _, info = env.reset()
    return stop_strings(info)


@dataclass
class Trajectory:
    """One finished episode.

    `token_ids` is the whole sequence (prompt, generated turns, tool outputs, ...);
    `generated_mask[i]` is 1 where the model generated token i (only those are trained on);
    `logprobs[i]` is the sampling-time log-prob of token i (0.0 where the mask is 0).
    """

    task_id: str
    messages: list[dict[str, Any]]
    token_ids: list[int]
    generated_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    reward: float = 0.0
    correct: bool = False
    grade: dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    end_reason: EndReason = "max_turns"

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.generated_mask)

    @property
    def undone_arithmetic(self) -> bool | None:
        """Refused although of the gold's value, for arithmetic left undone (issue 48: the
        grade's `undone_arithmetic`); False for an episode that gave no answer; None where
        the grader does not say (QA, an outside harness's reward)."""
        if self.end_reason != "answer":  # no answer was graded: nothing was refused
            return False
        said = self.grade.get("undone_arithmetic")
        return None if said is None else bool(said)


def mean_of_said(values: Iterable[float | bool | None]) -> float | None:
    """The mean of per-episode (or per-member) figures; None unless every one was said (a
    rate missing beats a 0 that was never measured)."""
    said = list(values)
    if not said or any(v is None for v in said):
        return None
    return sum(float(v) for v in said) / len(said)  # type: ignore[arg-type]


def undone_arithmetic_rate(trajectories: Sequence[Trajectory]) -> float | None:
    """The share of episodes refused for arithmetic left undone (`mean_of_said`)."""
    return mean_of_said(t.undone_arithmetic for t in trajectories)


@dataclass
class RolloutStats:
    """Where the time of a rollout went, and how much was generated.

    Turn by turn, `generation_seconds` and `env_seconds` add up (the env steps of a turn run
    between its `generate_ids` call and the next). Through the policy's episode loop, tool
    calls overlap decoding: `generation_seconds` is the whole loop, `env_seconds` the summed
    time of the env steps, and `engine` the loop's own diagnostics.
    """

    generation_seconds: float = 0.0
    env_seconds: float = 0.0  # tool calls and grading
    generated_tokens: int = 0
    generate_calls: int = 0
    # Inside env_seconds, summed over episodes (threads overlap, so the sums may exceed it):
    tool_seconds: float = 0.0  # in tool calls (ToolEnv's info["tool_seconds"])
    grade_seconds: float = 0.0  # in the grader (info["grade_seconds"])
    engine: dict[str, float] = field(default_factory=dict)


class RolloutBatch(list):
    """A list of `Trajectory` with the `RolloutStats` of the rollout that made it."""

    def __init__(self, trajectories: Sequence[Trajectory], stats: RolloutStats) -> None:
        super().__init__(trajectories)
        self.stats = stats


class EnvDriver:
    """An episode driven by its environment (`copes.agents.episodes.EpisodeDriver`): reset
    gives the prompt, every turn is stepped in the env (tool call, grading) and extends the
    trajectory's one token sequence; an episode whose next turn would not fit the context
    ends there, cleanly, with reward 0."""

    def __init__(
        self,
        policy: Policy,
        env: gym.Env,
        seed: int | None,
        options: dict | None,
        sampling: SamplingConfig,
        limit: int,
    ) -> None:
        _, info = env.reset(seed=seed, options=options)
        self.policy, self.env, self.sampling, self.limit = policy, env, sampling, limit
        # Model-native formats show the tools through the template (`tools=`); tags
        # describe them in the instructions.
        self.tools = info.get("tools") if info.get("call_format", "tags") != "tags" else None
        prompt = policy.chat.encode_prompt(info["messages"], self.tools)
        self.trajectory = Trajectory(
            task_id=info["task_id"],
            messages=info["messages"],
            token_ids=list(prompt),
            generated_mask=[0] * len(prompt),
            logprobs=[0.0] * len(prompt),
            prompt_length=len(prompt),
        )
        self.stops = stop_strings(info)
        self.done = False
        self.tool_seconds = 0.0
        self.grade_seconds = 0.0

    def start(self) -> list[int] | None:
        return list(self.trajectory.token_ids) if self._fits() else None

    def limits(self) -> None:
        return None  # the rollout's sampling: every episode alike

    def after_turn(self, generation: Generation) -> list[int] | None:
        """Feed the turn to the env and extend the token sequence; the ids that follow the
        turn, or None when the episode ended (or its next turn would not fit)."""
        traj = self.trajectory
        traj.token_ids.extend(generation.token_ids)
        traj.generated_mask.extend([1] * len(generation.token_ids))
        traj.logprobs.extend(generation.logprobs)
        # The env sees the whole assistant turn: what the template pre-filled there (e.g.
        # "<think>\n" after the question) and what the model wrote.
        action = self.policy.chat.turn_text(generation.token_ids, traj.messages)
        _, reward, terminated, truncated, info = self.env.step(action)
        self.tool_seconds += float(info.get("tool_seconds", 0.0))
        self.grade_seconds += float(info.get("grade_seconds", 0.0))
        traj.turns = info["turn"]
        traj.tool_calls = info["tool_calls"]
        traj.messages = info["messages"]
        traj.reward += float(reward)
        if terminated or truncated:
            self.done = True
            traj.correct = bool(info.get("correct", False))
            traj.grade = info.get("grade", {})
            reason = info.get("end_reason", "max_turns")
            if reason == "max_turns" and info.get("action") == "invalid":
                reason = "invalid"
            traj.end_reason = reason
            return None
        # What follows the sampled turn: its closing, the env's answer (tool output or
        # feedback), the next assistant header; the turn itself is never re-rendered.
        continuation = self.policy.chat.encode_continuation(
            info["messages"], generation.token_ids, self.tools
        )
        traj.token_ids.extend(continuation)
        traj.generated_mask.extend([0] * len(continuation))
        traj.logprobs.extend([0.0] * len(continuation))
        return continuation if self._fits() else None

    def _fits(self) -> bool:
        """Whether another turn of up to max_new_tokens fits the context (else: end now)."""
        if len(self.trajectory.token_ids) + self.sampling.max_new_tokens > self.limit:
            self.done = True
            self.trajectory.end_reason = "context"
            self.trajectory.reward = 0.0
            self.trajectory.correct = False
            return False
        return True


def rollout(
    policy: Policy,
    envs: Sequence[gym.Env],
    sampling: SamplingConfig,
    *,
    seeds: Sequence[int | None] | None = None,
    options: Sequence[dict[str, Any] | None] | None = None,
    max_context: int | None = None,
    tool_threads: int = 16,
    continuous_batching: bool = True,
    assign: Callable[[list[int]], None] | None = None,
    schedule: Schedule = "deterministic",
) -> RolloutBatch:
    """Run one episode in each env to the end; return their trajectories (in env order).

    Args:
        policy: the model backend.
        envs: one environment per episode (each is reset here).
        sampling: sampling of every turn; its stop strings default to the env's call format.
        seeds / options: passed to each env's `reset` (e.g. ``{"task": task}``).
        max_context: tokens an episode may use in all; default: the policy's context.
        tool_threads: threads stepping environments (tool calls) in parallel.
        continuous_batching: run whole episodes in the policy's own loop when it has one
            (KV caches kept across turns, turns overlapping tool calls); False, or a policy
            without it, runs turn by turn (`copes.agents.episodes`).
        assign: a population's `assign` of the episodes that start (their env indices).
        schedule: when a row's next turn joins the batch (`copes.agents.episodes`): fixed by
            the tokens (the default), or as soon as its env has answered.
    """
    if not envs:
        return RolloutBatch([], RolloutStats())
    seeds = list(seeds) if seeds is not None else [None] * len(envs)
    options = list(options) if options is not None else [None] * len(envs)
    if len(seeds) != len(envs) or len(options) != len(envs):
        raise ValueError("seeds and options must have one entry per env")
    limit = max_context or policy.max_context
    drivers = [
        EnvDriver(policy, env, s, o, sampling, limit)
        for env, s, o in zip(envs, seeds, options, strict=True)
    ]
    if not sampling.stop:  # the call format's, from the first episode's reset info
        sampling = replace(sampling, stop=drivers[0].stops)
        for driver in drivers:
            driver.sampling = sampling
    loop = play_episodes(
        policy, drivers, sampling, threads=tool_threads, continuous=continuous_batching,
        assign=assign, schedule=schedule,
    )  # fmt: skip
    stats = RolloutStats(
        generation_seconds=loop.generation_seconds,
        env_seconds=loop.after_turn_seconds,
        generated_tokens=sum(d.trajectory.num_generated_tokens for d in drivers),
        generate_calls=loop.generate_calls,
        tool_seconds=sum(d.tool_seconds for d in drivers),
        grade_seconds=sum(d.grade_seconds for d in drivers),
        engine=loop.engine,
    )
    return RolloutBatch([d.trajectory for d in drivers], stats)
