"""Batched multi-turn rollouts: many episodes at once, each growing one token sequence.

Two ways to run them, with the same trajectories:

- **Episode loop** (a policy with `EpisodePolicy.generate_episodes`, e.g. `HFPolicy`): the
  policy runs all episodes in one continuous-batching loop and keeps each episode's KV cache
  across turns; when an episode's turn ends, its env is stepped (tool call, grading) in a
  worker thread while the other episodes keep decoding, and the episode continues with what
  the env answered.
- **Turn by turn** (any `Policy`): every turn, all unfinished episodes are generated in one
  `generate_ids` call, then their turns are stepped in their environments in parallel
  threads.

Tool calls run in sandbox processes or release the GIL, so a slow call costs at most its own
timeout; finished episodes drop out. Each episode keeps one growing token sequence with a
mask of the tokens the model generated, so GRPO trains on exactly the sampled ids and ES
needs only the rewards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import gymnasium as gym

from copes.agents.policy import (
    EpisodePolicy,
    Generation,
    Policy,
    SamplingConfig,
    TurnPopulation,
    runs_episodes,
)

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


@dataclass
class _Episode:
    env: gym.Env
    trajectory: Trajectory
    tools: list[dict[str, Any]] | None
    stops: tuple[str, ...]
    done: bool = False
    tool_seconds: float = 0.0
    grade_seconds: float = 0.0


def _start(policy: Policy, env: gym.Env, seed: int | None, options: dict | None) -> _Episode:
    _, info = env.reset(seed=seed, options=options)
    # Model-native formats show the tools through the template (`tools=`); tags describe
    # them in the instructions.
    tools = info.get("tools") if info.get("call_format", "tags") != "tags" else None
    prompt = policy.chat.encode_prompt(info["messages"], tools)
    trajectory = Trajectory(
        task_id=info["task_id"],
        messages=info["messages"],
        token_ids=list(prompt),
        generated_mask=[0] * len(prompt),
        logprobs=[0.0] * len(prompt),
        prompt_length=len(prompt),
    )
    return _Episode(env, trajectory, tools, stop_strings(info))


def _step(policy: Policy, episode: _Episode, generation: Generation) -> list[int] | None:
    """Feed one generated turn to the episode's env and extend its token sequence; return
    the ids that follow the turn (None when the episode ended)."""
    traj = episode.trajectory
    traj.token_ids.extend(generation.token_ids)
    traj.generated_mask.extend([1] * len(generation.token_ids))
    traj.logprobs.extend(generation.logprobs)
    # The env sees the whole assistant turn: what the template pre-filled there (e.g.
    # "<think>\n" after the question) and what the model wrote.
    action = policy.chat.turn_text(generation.token_ids, traj.messages)
    _, reward, terminated, truncated, info = episode.env.step(action)
    episode.tool_seconds += float(info.get("tool_seconds", 0.0))
    episode.grade_seconds += float(info.get("grade_seconds", 0.0))
    traj.turns = info["turn"]
    traj.tool_calls = info["tool_calls"]
    traj.messages = info["messages"]
    traj.reward += float(reward)
    if terminated or truncated:
        episode.done = True
        traj.correct = bool(info.get("correct", False))
        traj.grade = info.get("grade", {})
        reason = info.get("end_reason", "max_turns")
        if reason == "max_turns" and info.get("action") == "invalid":
            reason = "invalid"
        traj.end_reason = reason
        return None
    # What follows the sampled turn: its closing, the env's answer (tool output or
    # feedback), the next assistant header; the turn itself is never re-rendered.
    continuation = policy.chat.encode_continuation(
        info["messages"], generation.token_ids, episode.tools
    )
    traj.token_ids.extend(continuation)
    traj.generated_mask.extend([0] * len(continuation))
    traj.logprobs.extend([0.0] * len(continuation))
    return continuation


def _end_for_context(episode: _Episode) -> None:
    """The next turn would not fit the model's context: end cleanly with reward 0."""
    episode.done = True
    episode.trajectory.end_reason = "context"
    episode.trajectory.reward = 0.0
    episode.trajectory.correct = False


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
            (`EpisodePolicy`: KV caches kept across turns, turns overlapping tool calls);
            False, or a policy without it, runs turn by turn: one `generate_ids` call per
            turn over all unfinished episodes, whose seed is varied per turn.
    """
    if not envs:
        return RolloutBatch([], RolloutStats())
    seeds = list(seeds) if seeds is not None else [None] * len(envs)
    options = list(options) if options is not None else [None] * len(envs)
    if len(seeds) != len(envs) or len(options) != len(envs):
        raise ValueError("seeds and options must have one entry per env")
    limit = max_context or policy.max_context
    stats = RolloutStats()
    episodes = [_start(policy, env, s, o) for env, s, o in zip(envs, seeds, options, strict=True)]
    if not sampling.stop:  # the call format's, from the first episode's reset info
        sampling = replace(sampling, stop=episodes[0].stops)
    if continuous_batching and runs_episodes(policy):
        _run_episodes(policy, episodes, sampling, limit, stats, tool_threads)
    else:
        _run_turns(policy, episodes, sampling, limit, stats, tool_threads)
    stats.tool_seconds = sum(e.tool_seconds for e in episodes)
    stats.grade_seconds = sum(e.grade_seconds for e in episodes)
    return RolloutBatch([e.trajectory for e in episodes], stats)


def _fits(episode: _Episode, sampling: SamplingConfig, limit: int) -> bool:
    """Whether another turn of up to max_new_tokens fits the context (else: end cleanly)."""
    if len(episode.trajectory.token_ids) + sampling.max_new_tokens > limit:
        _end_for_context(episode)
        return False
    return True


def _run_episodes(
    policy: EpisodePolicy,
    episodes: list[_Episode],
    sampling: SamplingConfig,
    limit: int,
    stats: RolloutStats,
    threads: int,
) -> None:
    """All episodes in the policy's episode loop; env steps run as their turns end."""
    active = [e for e in episodes if _fits(e, sampling, limit)]
    if not active:
        return
    env_seconds: list[float] = []  # appended from worker threads

    def next_turn(index: int, generation: Generation) -> list[int] | None:
        start = time.perf_counter()
        episode = active[index]
        continuation = _step(policy, episode, generation)
        if continuation is not None and not _fits(episode, sampling, limit):
            continuation = None
        env_seconds.append(time.perf_counter() - start)
        return continuation

    start = time.perf_counter()
    prompts = [list(e.trajectory.token_ids) for e in active]
    stats.engine = policy.generate_episodes(prompts, sampling, next_turn, threads=threads)
    stats.generation_seconds += time.perf_counter() - start
    stats.env_seconds += sum(env_seconds)
    stats.generate_calls += 1
    stats.generated_tokens += sum(e.trajectory.num_generated_tokens for e in active)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a turn-by-turn rollout (prompt i adds i)."""
    return seed + 1_000_003 * turn


def _run_turns(
    policy: Policy,
    episodes: list[_Episode],
    sampling: SamplingConfig,
    limit: int,
    stats: RolloutStats,
    threads: int,
) -> None:
    """Turn by turn: one batched `generate_ids` call over all unfinished episodes, then
    their env steps in parallel threads. A policy serving a population
    (`copes.agents.vllm.population`) is called with `generate_turn(prompts, sampling,
    episode indices, turn)` instead, so each row samples as its member alone would."""
    turn = 0
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(episodes)))) as pool:
        while True:
            indices = [
                i for i, e in enumerate(episodes) if not e.done and _fits(e, sampling, limit)
            ]
            if not indices:
                break
            active = [episodes[i] for i in indices]
            prompts = [e.trajectory.token_ids for e in active]
            start = time.perf_counter()
            if isinstance(policy, TurnPopulation):  # a population: rows know their episode
                generations = policy.generate_turn(prompts, sampling, indices, turn)
            else:
                turn_sampling = sampling
                if sampling.seed is not None:
                    turn_sampling = replace(sampling, seed=turn_seed(sampling.seed, turn))
                generations = policy.generate_ids(prompts, turn_sampling)
            stats.generation_seconds += time.perf_counter() - start
            stats.generate_calls += 1
            stats.generated_tokens += sum(len(g.token_ids) for g in generations)
            start = time.perf_counter()
            list(pool.map(lambda pair: _step(policy, *pair), zip(active, generations, strict=True)))
            stats.env_seconds += time.perf_counter() - start
            for episode in active:
                if not episode.done and len(episode.trajectory.token_ids) >= limit:
                    _end_for_context(episode)
            turn += 1
