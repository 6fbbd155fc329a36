"""Turn parsing: what did the agent do in this turn?

One turn of the agent is free text. It holds either one tool call, a final answer, or
neither. Two call formats are understood:

- ``tags`` (default, learnable by any base model): ``<python>code</python>``,
  ``<search>query</search>``; final ``<answer>...</answer>``.
- ``hermes`` (what Qwen2.5/Qwen3/Hermes chat templates with ``tools=`` teach):
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``;
- ``qwen-xml`` (Qwen3.5, Qwen3-Coder): ``<tool_call><function=python><parameter=code>
  ...</parameter></function></tool_call>``; a parameter's text is kept as a string when the
  tool's schema says string, else read as JSON (falling back to the text), as vLLM's and
  `renderers`' Qwen3.5 parsers do;
- ``llama-json`` (Llama 3.1+ templates with ``tools=``): the turn is one JSON object
  ``{"name": "python", "parameters": {"code": "..."}}``.

In every format the final answer is ``<answer>...</answer>``. The hermes, qwen-xml and
llama-json grammars follow the parsers of the `renderers` package (parse_qwen3,
parse_qwen35, parse_llama_3); tests/envs/test_parsing_families.py checks that they agree.
These are small grammars over text: `renderers`' parsers need a family renderer and token
ids, and transformers' `parse_response` a `response_template` that these models' tokenizers
do not ship, so copes keeps its own.

For math, a ``\\boxed{...}`` with no tag also counts as the final answer. Nothing here
raises on model output: every malformed turn becomes a `ParsedTurn` of kind ``invalid``
whose `error` tells the agent what was wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from copes.envs.tools.base import Tool, arguments_from_text, check_arguments

CallFormat = Literal["tags", "hermes", "qwen-xml", "llama-json"]
CALL_FORMATS: tuple[str, ...] = ("tags", "hermes", "qwen-xml", "llama-json")
TOOL_CALL_TAG = "tool_call"
REASONING_MARKERS = ("<think>", "</think>")
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
    span: tuple[int, int] | None = None  # where the call or answer sits in the turn text


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, content, open) of an assistant turn's text (its pre-fill included).

    ``<think>R</think>C`` gives ``("R", "C", False)``; a turn cut off inside its reasoning,
    ``<think>R``, gives ``("R", "", True)``; a turn without markers gives ``(None, text,
    False)``. A ``<tool_call>`` also ends an unclosed reasoning block (as the Qwen parsers
    of vLLM and `renderers` read it). Newlines next to the markers are dropped, as the Qwen
    templates do.
    """
    opener, closer = REASONING_MARKERS
    close = text.find(closer)
    if close >= 0:
        before = text[:close]
        start = before.find(opener)
        reasoning = before[start + len(opener) :] if start >= 0 else before
        return reasoning.strip("\n"), text[close + len(closer) :].lstrip("\n"), False
    start = text.find(opener)
    if start >= 0 and not text[:start].strip():
        rest = text[start + len(opener) :]
        call = rest.find(f"<{TOOL_CALL_TAG}>")
        if call >= 0:
            return rest[:call].strip("\n"), rest[call:], False
        return rest.strip("\n"), "", True
    return None, text, False


# `<name>...</name>` of a tool the env does not have (tags format): say so, not "no call".
_UNKNOWN_TAG = re.compile(r"<([A-Za-z_][\w\-]*)>.*?</\1>", re.DOTALL)


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
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
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
        example = {
            "hermes": '<tool_call>{"name": "...", "arguments": {...}}</tool_call>',
            "qwen-xml": "<tool_call><function=...><parameter=...>...</parameter></function>"
            "</tool_call>",
            "llama-json": '{"name": "...", "parameters": {...}}',
        }[self.call_format]
        return f"Call a tool with {example} or give the final answer as <answer>...</answer>."

    def invalid(self, error: str) -> ParsedTurn:
        """An invalid turn whose message says what was wrong and how to act."""
        return ParsedTurn(kind="invalid", error=f"Invalid action: {error}. {self.usage_hint()}")

    def parse(self, text: str) -> ParsedTurn:
        """Find the first complete action in `text` (a tool call or an answer)."""
        if self.call_format == "llama-json":
            json_call = self._llama_call(text)
            if json_call is not None:
                return json_call
        tags = {"tags": list(self.tools), "llama-json": []}.get(self.call_format, [TOOL_CALL_TAG])
        spans = _find_spans(text, [*tags, ANSWER_TAG])
        if not spans:
            return self._no_tags(text)
        first = spans[0]
        if first.end < 0:
            return self.invalid(f"the <{first.tag}> tag is never closed with </{first.tag}>")
        nested = _find_spans(first.content, [*tags, ANSWER_TAG])
        if nested:
            return self.invalid(f"<{nested[0].tag}> is nested inside <{first.tag}>")
        if len(first.content) > self.max_call_chars:
            return self.invalid(
                f"the <{first.tag}> content is {len(first.content)} characters, over the limit "
                f"of {self.max_call_chars}"
            )
        takes_nothing = first.tag in self.tools and not self.tools[first.tag].parameters.get(
            "required"
        )
        if not first.content.strip() and not takes_nothing:  # `<clock></clock>` is a call
            return self.invalid(f"the <{first.tag}> tag is empty")
        span = (first.start, first.end)
        if first.tag == ANSWER_TAG:
            answer = first.content.strip()
            boxed = last_boxed(answer) if self.accept_boxed else None
            return ParsedTurn(kind="answer", answer=(boxed or answer).strip(), span=span)
        more = sum(1 for s in spans[1:] if s.tag != ANSWER_TAG)
        note = (
            f"Note: only the first of {more + 1} tool calls was run; make one call per turn."
            if more
            else None
        )
        if first.tag == TOOL_CALL_TAG and self.call_format == "qwen-xml":
            parsed = self._xml_call(first.content)
        elif first.tag == TOOL_CALL_TAG:
            parsed = self._hermes_call(first.content)
        else:
            parsed = self._tag_call(first.tag, first.content)
        if parsed.kind == "tool_call":
            return replace(parsed, note=note, span=span)
        return parsed

    def _no_tags(self, text: str) -> ParsedTurn:
        if self.accept_boxed:
            boxed = last_boxed(text)
            if boxed is not None and boxed.strip():
                return ParsedTurn(kind="answer", answer=boxed.strip())
        if not text.strip():
            return self.invalid("the turn is empty")
        if self.call_format == "tags" and (tag := _UNKNOWN_TAG.search(text)):
            known = ", ".join(self.tools) or "none"
            return self.invalid(f"unknown tool '{tag.group(1)}' (available: {known})")
        return self.invalid("no tool call and no final answer found")

    def _tag_call(self, name: str, content: str) -> ParsedTurn:
        tool = self.tools[name]
        arguments = arguments_from_text(tool, content)
        if isinstance(arguments, str):
            return self.invalid(arguments)
        return self._checked(tool, arguments)

    def _hermes_call(self, content: str) -> ParsedTurn:
        return self._json_call(content, "the <tool_call> content")

    def _json_call(self, body: str, what: str) -> ParsedTurn:
        """``{"name": ..., "arguments": {...}}`` (or ``"parameters"``, Llama's key)."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return self.invalid(f"{what} is not valid JSON ({exc.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return self.invalid('a tool call must be a JSON object with a string "name"')
        key = "arguments" if "arguments" in call else "parameters"
        arguments = call.get(key, {})
        if isinstance(arguments, str):  # some models emit the arguments JSON as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return self.invalid(f'"{key}" of {call["name"]} must be a JSON object')
        return self._named_call(call["name"], arguments, key)

    def _named_call(self, name: str, arguments: Any, key: str) -> ParsedTurn:
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return self.invalid(f"unknown tool '{name}' (available: {known})")
        if not isinstance(arguments, dict):
            return self.invalid(f'"{key}" of {name} must be a JSON object')
        return self._checked(tool, arguments)

    def _xml_call(self, content: str) -> ParsedTurn:
        """``<function=NAME><parameter=ARG>VALUE</parameter>...</function>``."""
        body = content.strip()
        if not body.startswith("<function=") or ">" not in body:
            return self.invalid("a <tool_call> must hold <function=NAME>...</function>")
        name = body[len("<function=") : body.index(">")].strip()
        end = body.rfind("</function>")
        if end < 0:
            return self.invalid(f"<function={name}> is never closed with </function>")
        inner = body[body.index(">") + 1 : end]
        tool = self.tools.get(name)
        props = tool.parameters.get("properties", {}) if tool is not None else {}
        arguments: dict[str, Any] = {}
        pos = 0
        while (start := inner.find("<parameter=", pos)) >= 0:
            head_end = inner.find(">", start)
            close = inner.find("</parameter>", head_end)
            if head_end < 0 or close < 0:
                return self.invalid("a <parameter=...> is never closed with </parameter>")
            key = inner[start + len("<parameter=") : head_end].strip()
            arguments[key] = _typed_value(inner[head_end + 1 : close].strip(), props.get(key))
            pos = close + len("</parameter>")
        return self._named_call(name, arguments, "parameters")

    def _llama_call(self, text: str) -> ParsedTurn | None:
        """A turn that is one JSON object (None when it is not shaped so: no call)."""
        body = text.strip()
        if not (body.startswith("{") and body.endswith("}")):
            return None
        parsed = self._json_call(body, "the tool call")
        return replace(parsed, span=(0, len(text))) if parsed.kind == "tool_call" else parsed

    def _checked(self, tool: Tool, arguments: dict[str, Any]) -> ParsedTurn:
        problem = check_arguments(tool, arguments)
        if problem:
            return self.invalid(problem)
        return ParsedTurn(kind="tool_call", tool_name=tool.name, arguments=arguments)


def _typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A qwen-xml parameter's value: the text when the schema says string, else JSON
    (falling back to the text), the rule of vLLM's and `renderers`' Qwen3.5 parsers."""
    if schema is not None and schema.get("type") in ("string", ["string"]):
        return text
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text
