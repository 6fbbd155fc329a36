"""Turn parsing: what did the agent do in this turn?

One turn of the agent is free text. It holds either one tool call, a final answer, or
neither. Two call formats are understood:

- ``tags`` (default, learnable by any base model): ``<python>code</python>``,
  ``<search>query</search>``; final ``<answer>...</answer>``.
- ``hermes`` (what Qwen/Hermes chat templates with ``tools=`` teach):
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``; the final
  answer is still ``<answer>...</answer>``.

For math, a ``\\boxed{...}`` with no tag also counts as the final answer. Nothing here
raises on model output: every malformed turn becomes a `ParsedTurn` of kind ``invalid``
whose `error` tells the agent what was wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from copes.envs.tools.base import Tool, arguments_from_text, check_arguments

CallFormat = Literal["tags", "hermes"]
ANSWER_TAG = "answer"
_BOXED_OPENERS = ("\\boxed{", "\\fbox{")


@dataclass(frozen=True)
class ParsedTurn:
    """The action found in one agent turn."""

    kind: Literal["tool_call", "answer", "invalid"]
    tool_name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None
    error: str | None = None
    note: str | None = None  # e.g. "only the first of 2 tool calls ran"


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    Returns None when there is no box or the last one is never closed. Nested braces
    (`\\boxed{\\frac{1}{2}}`) are kept intact.
    """
    start = max(text.rfind(opener) for opener in _BOXED_OPENERS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


@dataclass(frozen=True)
class _Span:
    tag: str
    start: int  # index of "<tag>"
    end: int  # index just after "</tag>", or -1 when never closed
    content: str


def _find_spans(text: str, tags: list[str]) -> list[_Span]:
    """Every `<tag>...</tag>` occurrence of the given tags, in text order."""
    pattern = re.compile("<(" + "|".join(re.escape(t) for t in tags) + ")>")
    spans = []
    pos = 0
    while True:
        match = pattern.search(text, pos)
        if match is None:
            return spans
        tag = match.group(1)
        close = text.find(f"</{tag}>", match.end())
        if close < 0:
            spans.append(_Span(tag, match.start(), -1, text[match.end() :]))
            return spans
        end = close + len(tag) + 3
        spans.append(_Span(tag, match.start(), end, text[match.end() : close]))
        pos = end


class TurnParser:
    """Parses turns for one environment: its tools, its call format and its limits."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        call_format: CallFormat = "tags",
        *,
        accept_boxed: bool = False,
        max_call_chars: int = 8000,
    ) -> None:
        if call_format not in ("tags", "hermes"):
            raise ValueError(f"call_format must be 'tags' or 'hermes', got {call_format!r}")
        if ANSWER_TAG in tools or "tool_call" in tools:
            raise ValueError(
                f"a tool may not be named '{ANSWER_TAG}' or 'tool_call': those tags are reserved"
            )
        self.tools = dict(tools)
        self.call_format = call_format
        self.accept_boxed = accept_boxed
        self.max_call_chars = max_call_chars

    # The hint appended to every invalid-turn message, so the agent can recover.
    def usage_hint(self) -> str:
        if self.call_format == "tags":
            calls = ", ".join(f"<{name}>...</{name}>" for name in self.tools)
            return f"Call a tool with {calls} or give the final answer as <answer>...</answer>."
        example = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
        return f"Call a tool with {example} or give the final answer as <answer>...</answer>."

    def _invalid(self, error: str) -> ParsedTurn:
        return ParsedTurn(kind="invalid", error=f"Invalid action: {error}. {self.usage_hint()}")

    def parse(self, text: str) -> ParsedTurn:
        """Find the first complete action in `text` (a tool call or an answer)."""
        call_tag = "tool_call" if self.call_format == "hermes" else None
        tags = [call_tag] if call_tag else list(self.tools)
        spans = _find_spans(text, [*tags, ANSWER_TAG])
        if not spans:
            return self._no_tags(text)
        first = spans[0]
        if first.end < 0:
            return self._invalid(f"the <{first.tag}> tag is never closed with </{first.tag}>")
        nested = _find_spans(first.content, [*tags, ANSWER_TAG])
        if nested:
            return self._invalid(f"<{nested[0].tag}> is nested inside <{first.tag}>")
        if len(first.content) > self.max_call_chars:
            return self._invalid(
                f"the <{first.tag}> content is {len(first.content)} characters, over the limit "
                f"of {self.max_call_chars}"
            )
        if not first.content.strip():
            return self._invalid(f"the <{first.tag}> tag is empty")
        if first.tag == ANSWER_TAG:
            answer = first.content.strip()
            boxed = last_boxed(answer) if self.accept_boxed else None
            return ParsedTurn(kind="answer", answer=(boxed or answer).strip())
        more = sum(1 for s in spans[1:] if s.tag != ANSWER_TAG)
        note = (
            f"Note: only the first of {more + 1} tool calls was run; make one call per turn."
            if more
            else None
        )
        if first.tag == "tool_call":
            parsed = self._hermes_call(first.content)
        else:
            parsed = self._tag_call(first.tag, first.content)
        if parsed.kind == "tool_call" and note:
            return ParsedTurn(
                kind="tool_call", tool_name=parsed.tool_name, arguments=parsed.arguments, note=note
            )
        return parsed

    def _no_tags(self, text: str) -> ParsedTurn:
        if self.accept_boxed:
            boxed = last_boxed(text)
            if boxed is not None and boxed.strip():
                return ParsedTurn(kind="answer", answer=boxed.strip())
        if not text.strip():
            return self._invalid("the turn is empty")
        return self._invalid("no tool call and no final answer found")

    def _tag_call(self, name: str, content: str) -> ParsedTurn:
        tool = self.tools[name]
        arguments = arguments_from_text(tool, content)
        if isinstance(arguments, str):
            return self._invalid(arguments)
        return self._checked(tool, arguments)

    def _hermes_call(self, content: str) -> ParsedTurn:
        try:
            call = json.loads(content)
        except json.JSONDecodeError as exc:
            return self._invalid(f"the <tool_call> content is not valid JSON ({exc.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return self._invalid('a tool call must be a JSON object with a string "name"')
        name = call["name"]
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return self._invalid(f"unknown tool '{name}' (available: {known})")
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models emit the arguments JSON as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return self._invalid(f'"arguments" of {name} must be a JSON object')
        if not isinstance(arguments, dict):
            return self._invalid(f'"arguments" of {name} must be a JSON object')
        return self._checked(tool, arguments)

    def _checked(self, tool: Tool, arguments: dict[str, Any]) -> ParsedTurn:
        problem = check_arguments(tool, arguments)
        if problem:
            return self._invalid(problem)
        return ParsedTurn(kind="tool_call", tool_name=tool.name, arguments=arguments)
