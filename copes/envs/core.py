"""`ToolEnv`: the multi-turn loop shared by every tool-using environment.

An episode is a conversation. `reset()` returns the first user message (the task and how to
use the tools); every `step(action)` takes the agent's whole turn, finds one tool call or a
final answer in it (`copes.envs.parsing`), and returns the tool's output, the grade, or a
message saying what was wrong with the turn. The conversation so far is always in
``info["messages"]`` in OpenAI chat format, ready for a tokenizer's chat template.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, TypedDict

import gymnasium as gym
import numpy as np

from copes.envs.parsing import (
    REASONING_MARKERS,
    CallFormat,
    ParsedTurn,
    TurnParser,
    split_reasoning,
)
from copes.envs.rewards.graders import Grade, Grader
from copes.envs.tasks.base import Task
from copes.envs.tools.base import Tool, as_tool, close_tool, reset_tool, resolve, tool_schema

logger = logging.getLogger(__name__)

Instructions = Callable[[Task, Sequence[Tool], CallFormat], str]


class StepInfo(TypedDict, total=False):
    """The `info` of every `reset` and `step`: what rollouts and wrappers read (never the
    env's internals). The first five are always there; the rest as the step has them."""

    tools: list[dict[str, Any]]  # the tools' JSON schemas
    messages: list[dict[str, Any]]  # the conversation so far, OpenAI format
    task_id: str
    turn: int
    tool_calls: int
    call_format: str  # how this env parses calls: tags or a native one (parsing.CALL_FORMATS)
    action: str  # this turn: tool_call, answer or invalid
    tool: str
    tool_seconds: float
    answer: str
    grade: dict[str, Any]
    grade_seconds: float
    correct: bool
    end_reason: str  # answer or max_turns


@dataclass(frozen=True)
class EpisodeRules:
    """The rules a trainer or an evaluator sets for every episode, whatever `ToolEnv` (a
    plugin's included) runs it: the turn limit, the reward of a turn with no valid action
    (negated), the longest tool output kept. None leaves the env's own value.

    Set with `ToolEnv.set_rules` after the env is built (`Benchmark.make_env(rules=...)`),
    so a run never has to learn which constructor arguments an env factory takes."""

    max_turns: int | None = None
    invalid_penalty: float | None = None
    max_tool_output_chars: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.invalid_penalty is not None and self.invalid_penalty < 0:
            raise ValueError(
                f"invalid_penalty is the reward taken off (>= 0), got {self.invalid_penalty}"
            )
        if self.max_tool_output_chars is not None and self.max_tool_output_chars < 1:
            raise ValueError(
                f"max_tool_output_chars must be >= 1, got {self.max_tool_output_chars}"
            )


class UnicodeText(gym.spaces.Space[str]):
    """A space of arbitrary Unicode strings up to `max_length` characters.

    Gymnasium's `Text` space only admits a fixed character set; model turns and tool outputs
    can hold any character, so this space admits them all.
    """

    def __init__(self, max_length: int, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(0, min(self.max_length, 64) + 1))
        points = self.np_random.integers(0x20, 0x2FFF, size=length)
        return "".join(chr(int(p)) for p in points)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length


def default_instructions(task: Task, tools: Sequence[Tool], call_format: CallFormat) -> str:
    """The first user message: how to call tools and answer, then the question.

    The question comes last, next to where the agent starts writing: small models copy
    numbers and names from it far more easily there.
    """
    lines = []
    if call_format == "tags":
        lines.append("Tools (one call per turn, then wait for the result):")
        for t in tools:
            lines.append(f"<{t.name}>{tag_arguments(t)}</{t.name}> {t.description.strip()}")
    else:
        lines.append("Use the tools when they help (one call per turn).")
    lines.append("Give the final answer as <answer>...</answer>.")
    lines += ["", f"Question: {task.question.strip()}"]
    return "\n".join(lines)


def tag_arguments(tool: Tool) -> str:
    """What goes inside a tool's tag: `...` for one argument (the content is it), nothing
    for none, else the JSON object of its arguments with their types (optional ones marked)."""
    props = tool.parameters.get("properties", {})
    if len(props) == 1:
        return "..."
    required = set(tool.parameters.get("required", []))
    fields = [
        f'"{name}": {schema.get("type", "value")}' + ("" if name in required else " (optional)")
        for name, schema in props.items()
    ]
    return "{" + ", ".join(fields) + "}" if fields else ""


class ToolEnv(gym.Env[str, str]):
    """A multi-turn text environment in which an agent calls tools and then answers.

    Args:
        tasks: the problems episodes are drawn from (uniformly with the env's seed, or
            chosen with ``reset(options={"task": t})`` / ``{"task_index": i}`` /
            ``{"task_id": "..."}``).
        tools: the tools the agent may call, by their `name`.
        grader: turns a final answer into a reward (`copes.envs.rewards.graders`).
        max_turns: agent turns before the episode is truncated (reward 0).
        call_format: "tags" (``<python>..</python>``), or a model-native format: "hermes"
            (``<tool_call>{json}``), "qwen-xml" (Qwen3.5), "llama-json" (Llama 3.1+), "glm-xml"
            (GLM-4.5), "mistral" or "harmony" (gpt-oss);
            `copes.agents.chat.ChatFormat.native_call_format` names a model's own.
        invalid_penalty: reward given for a turn with no valid action (default 0: no shaping).
        accept_boxed: a bare ``\\boxed{x}`` counts as the final answer (math).
        max_tool_output_chars: longer tool outputs are cut, with a marker.
        max_action_chars: longest turn accepted; used as the action space's max length.
        system_prompt: an optional system message at the start of the conversation.
        instructions: builds the first user message; default `default_instructions`.
        demonstration_messages: earlier turns played before every task (after the system
            prompt): worked examples of the call protocol, as
            `copes.envs.demonstrations.play` makes them. They are part of the prompt.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        tasks: Sequence[Task],
        tools: Sequence[Tool],
        grader: Grader,
        *,
        max_turns: int = 4,
        call_format: CallFormat = "tags",
        invalid_penalty: float = 0.0,
        accept_boxed: bool = False,
        max_tool_output_chars: int = 4000,
        max_action_chars: int = 32_000,
        system_prompt: str | None = None,
        instructions: Instructions = default_instructions,
        demonstration_messages: Sequence[Mapping[str, Any]] = (),
        render_mode: str | None = None,
    ) -> None:
        if not tasks:
            raise ValueError("ToolEnv needs at least one task")
        self.rules = EpisodeRules(max_turns, invalid_penalty, max_tool_output_chars)
        tools = [as_tool(t) for t in tools]  # plain and async functions become tools
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.tasks = list(tasks)
        from copes.envs.rewards.checks import unknown_checks, with_checks

        unknown = sorted({c for t in self.tasks for c in unknown_checks(t.checks)})
        if unknown:
            raise ValueError(
                f"tasks name unknown answer checks {unknown}; register them with "
                "copes.envs.rewards.checks.register_answer_check, or fix the tasks' checks"
            )
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self._schemas = [tool_schema(t) for t in tools]
        self.grader = with_checks(grader)  # each task's answer checks, whatever the grader
        self.call_format = call_format
        self.system_prompt = system_prompt
        self.instructions = instructions
        self.demonstration_messages = [dict(m) for m in demonstration_messages]
        if any(not isinstance(m.get("role"), str) for m in self.demonstration_messages):
            raise ValueError("demonstration_messages must be chat messages with a 'role'")
        self.render_mode = render_mode
        self.parser = TurnParser(
            self.tools, call_format, accept_boxed=accept_boxed, max_call_chars=max_action_chars
        )
        self._task_index = {t.id: i for i, t in enumerate(self.tasks)}
        self.action_space = UnicodeText(max_action_chars)
        self.observation_space = UnicodeText(1_000_000)
        self.task: Task | None = None
        self._messages: list[dict[str, Any]] = []
        self._turn = 0
        self._tool_calls = 0
        self._done = True

    # ------------------------------------------------------------------ episode rules
    def set_rules(self, rules: EpisodeRules) -> None:
        """Take `rules`' values that are set (None: keep this env's); from the next episode."""
        changes = {name: v for name, v in asdict(rules).items() if v is not None}
        self.rules = replace(self.rules, **changes)

    # An env's own rules always hold every value (the constructor sets them all).
    @property
    def max_turns(self) -> int:
        return int(self.rules.max_turns or 0)

    @property
    def invalid_penalty(self) -> float:
        return float(self.rules.invalid_penalty or 0.0)

    @property
    def max_tool_output_chars(self) -> int:
        return int(self.rules.max_tool_output_chars or 0)

    # ------------------------------------------------------------------ public helpers
    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Function schemas of the tools, for chat templates that take ``tools=``."""
        return [dict(schema) for schema in self._schemas]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._messages]

    # ------------------------------------------------------------------ gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(
                'reset(options=...) takes a dict: {"task": Task}, {"task_index": i} or '
                f'{{"task_id": "..."}} (or None), got {type(options).__name__} {options!r:.60}'
            )
        self.task = self._choose_task(options or {})
        for t in self.tools.values():
            reset_tool(t, self.task)
        first = self.instructions(self.task, list(self.tools.values()), self.call_format)
        self._messages = []
        if self.system_prompt:
            self._messages.append({"role": "system", "content": self.system_prompt})
        self._messages += [dict(m) for m in self.demonstration_messages]
        self._messages.append({"role": "user", "content": first})
        self._turn = 0
        self._tool_calls = 0
        self._done = False
        return first, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done or self.task is None:
            raise RuntimeError("the episode is over (or never started): call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"an action is the agent's turn as a str, got {type(action).__name__}")
        self._turn += 1
        reasoning, content, cut_off = split_reasoning(action)
        if cut_off:
            parsed = self.parser.invalid(
                f"the turn ended inside its reasoning ({REASONING_MARKERS[0]} with no "
                f"{REASONING_MARKERS[1]}); close the reasoning, then act"
            )
        else:  # tool calls and answers count only after the reasoning
            parsed = self.parser.parse(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        call_id = None
        if parsed.kind == "tool_call" and self.call_format != "tags" and parsed.span:
            # OpenAI format: the call as `tool_calls`, the content what the turn said around
            # it (in the tags format the call is the text itself, and stays there).
            # Mistral's template takes only 9-character alphanumeric ids (its own, if given).
            default = f"call{self._turn:05d}" if self.call_format == "mistral" else None
            call_id = parsed.call_id or default or f"call_{self._turn}"
            start, end = parsed.span
            message["content"] = (content[:start] + content[end:]).strip()
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": parsed.tool_name, "arguments": dict(parsed.arguments)},
                }
            ]
        if reasoning is not None:  # kept apart, as chat templates take it
            message["reasoning_content"] = reasoning
        self._messages.append(message)
        extra: dict[str, Any] = {"action": parsed.kind}

        if parsed.kind == "answer":
            assert parsed.answer is not None
            start = time.perf_counter()
            grade = self._grade(parsed.answer)
            self._done = True
            extra.update(answer=parsed.answer, grade=grade.details, correct=grade.correct)
            extra["grade_seconds"] = time.perf_counter() - start
            extra["end_reason"] = "answer"
            return "", grade.reward, True, False, self._info(**extra)

        if parsed.kind == "tool_call":
            observation, seconds = self._run_tool(parsed)
            self._tool_calls += 1
            message = {"role": "tool", "name": parsed.tool_name, "content": observation}
            if call_id is not None:
                message["tool_call_id"] = call_id
            self._messages.append(message)
            extra.update(tool=parsed.tool_name, tool_seconds=seconds)
            reward = 0.0
        else:
            observation = parsed.error or "Invalid action."
            self._messages.append({"role": "user", "content": observation})
            reward = -self.invalid_penalty

        truncated = self._turn >= self.max_turns
        if truncated:
            self._done = True
            extra.update(end_reason="max_turns", correct=False)
        return observation, reward, False, truncated, self._info(**extra)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self._messages)

    def close(self) -> None:
        for t in self.tools.values():
            close_tool(t)
        super().close()

    # ------------------------------------------------------------------ internals
    def _choose_task(self, options: Mapping[str, Any]) -> Task:
        if "task" in options:
            task = options["task"]
            if not isinstance(task, Task):
                raise TypeError(f'options["task"] must be a Task, got {type(task).__name__}')
            from copes.envs.rewards.checks import unknown_checks

            if unknown := unknown_checks(task.checks):
                raise ValueError(f"task {task.id!r} names unknown answer checks {unknown}")
            return task
        if "task_id" in options:
            try:
                return self.tasks[self._task_index[options["task_id"]]]
            except KeyError:
                raise KeyError(f"no task with id {options['task_id']!r} in this env") from None
        if "task_index" in options:
            index = int(options["task_index"])
            if not 0 <= index < len(self.tasks):
                raise IndexError(f"task_index {index} out of range [0, {len(self.tasks)})")
            return self.tasks[index]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _run_tool(self, parsed: ParsedTurn) -> tuple[str, float]:
        assert parsed.tool_name is not None
        start = time.perf_counter()
        try:
            output = resolve(self.tools[parsed.tool_name](**parsed.arguments))
            if not isinstance(output, str):
                output = str(output)
        except Exception as exc:  # a tool bug must not end the training run
            logger.warning("tool %s raised %r", parsed.tool_name, exc)
            output = f"Error: the {parsed.tool_name} tool failed: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        if len(output) > self.max_tool_output_chars:
            cut = len(output) - self.max_tool_output_chars
            output = output[: self.max_tool_output_chars] + f"\n...[truncated {cut} characters]"
        if parsed.note:
            output = f"{output}\n{parsed.note}"
        return output, seconds

    def _grade(self, answer: str) -> Grade:
        assert self.task is not None
        try:
            return self.grader(answer, self.task)
        except Exception as exc:  # a grader bug scores 0 and is logged, never crashes a run
            logger.exception("grader failed on task %s", self.task.id)
            return Grade(0.0, False, {"prediction": answer, "error": repr(exc)})

    def _info(self, **extra: Any) -> StepInfo:
        assert self.task is not None
        info: StepInfo = {
            "tools": self.tool_schemas,  # on every step: wrappers may start mid-episode
            "messages": self.messages,
            "task_id": self.task.id,
            "turn": self._turn,
            "tool_calls": self._tool_calls,
            "call_format": self.call_format,
        }
        info.update(extra)  # type: ignore[typeddict-item]
        return info
