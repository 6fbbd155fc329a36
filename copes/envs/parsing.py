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
  ``{"name": "python", "parameters": {"code": "..."}}``;
- ``glm-xml`` (GLM-4.5): ``<tool_call>python<arg_key>code</arg_key><arg_value>...
  </arg_value></tool_call>``; values typed by the tool's schema as in qwen-xml;
- ``mistral`` (Mistral-Nemo and the other pre-v11 Mistral templates): ``[TOOL_CALLS]`` then a
  JSON list of ``{"name", "arguments"[, "id"]}``; a 9-character alphanumeric ``id`` the model
  wrote becomes the call's id (the template refuses any other), as vLLM's Mistral parser reads it;
- ``harmony`` (gpt-oss): the turn is harmony messages; a message addressed
  ``to=functions.NAME`` (commentary channel) is the call, its body the JSON arguments.
  `split_reasoning` gives the ``analysis`` channel as the reasoning, so nothing written while
  reasoning is ever graded.

In every format the final answer is ``<answer>...</answer>``. The hermes, qwen-xml, llama-json
and glm-xml grammars follow the parsers of the `renderers` package (parse_qwen3,
parse_qwen35, parse_llama_3, its GLM parser), harmony the `openai-harmony` message grammar,
mistral vLLM's Mistral tool parser; tests/envs/test_parsing_families.py checks that they agree.
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

CallFormat = Literal["tags", "hermes", "qwen-xml", "llama-json", "glm-xml", "mistral", "harmony"]
CALL_FORMATS: tuple[str, ...] = (
    "tags", "hermes", "qwen-xml", "llama-json", "glm-xml", "mistral", "harmony",
)  # fmt: skip
TOOL_CALL_TAG = "tool_call"
REASONING_MARKERS = ("<think>", "</think>")
MISTRAL_CALLS = "[TOOL_CALLS]"
# Harmony's framing tokens (openai/harmony): a message is `<|start|>HEADER<|message|>BODY`
# closed by <|end|>, or by <|call|> / <|return|>, the two the model samples to stop.
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_CLOSINGS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_TOKENS = (
    HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, "<|constrain|>", *HARMONY_CLOSINGS,
)  # fmt: skip
# Special tokens a turn's text must keep for the parsers above (decoding drops the others).
STRUCTURAL_TOKENS = (MISTRAL_CALLS, *HARMONY_TOKENS)
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
    call_id: str | None = None  # the id the model gave its call (mistral), if any


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, content, open) of an assistant turn's text (its pre-fill included).

    ``<think>R</think>C`` gives ``("R", "C", False)``; a turn cut off inside its reasoning,
    ``<think>R``, gives ``("R", "", True)``; a turn without markers gives ``(None, text,
    False)``. A ``<tool_call>`` also ends an unclosed reasoning block (as the Qwen parsers
    of vLLM and `renderers` read it). Newlines next to the markers are dropped, as the Qwen
    templates do. A harmony turn (gpt-oss) is split by channel (`split_harmony`).
    """
    if HARMONY_MESSAGE in text:
        return split_harmony(text)
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


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of a harmony turn: ``[<|start|>]HEADER<|message|>BODY[CLOSING]``."""

    header: str  # e.g. "assistant to=functions.python<|channel|>commentary json"
    body: str
    closing: str  # one of HARMONY_CLOSINGS, or "" when the turn was cut off

    @property
    def channel(self) -> str:
        if HARMONY_CHANNEL not in self.header:
            return ""
        words = self.header.split(HARMONY_CHANNEL, 1)[1].split()
        return words[0] if words else ""

    @property
    def recipient(self) -> str | None:
        """``functions.python`` for a call (``to=`` may sit before or after the channel)."""
        for word in self.header.replace(HARMONY_CHANNEL, " ").split():
            if word.startswith("to="):
                return word[3:]
        return None

    def text(self) -> str:
        """The message as the template writes it (an assistant message's role included)."""
        header = self.header if self.header.startswith("assistant") else "assistant" + self.header
        return f"{HARMONY_START}{header}{HARMONY_MESSAGE}{self.body}{self.closing}"


def harmony_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a harmony turn. The first one's ``<|start|>assistant`` is in the
    prompt, so the text starts inside its header; text after a message's closing up to the
    next ``<|start|>`` (none in a well-formed turn) is dropped, as harmony parsers do."""
    messages = []
    for chunk in text.split(HARMONY_START):
        if HARMONY_MESSAGE not in chunk:
            if chunk.strip():  # a header cut off before its body
                messages.append(HarmonyMessage(chunk, "", ""))
            continue
        header, rest = chunk.split(HARMONY_MESSAGE, 1)
        ends = [(rest.find(c), c) for c in HARMONY_CLOSINGS if c in rest]
        at, closing = min(ends) if ends else (len(rest), "")
        messages.append(HarmonyMessage(header, rest[:at], closing))
    return messages


def split_harmony(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, content, open) of a harmony turn: the ``analysis`` channel is the
    reasoning; the content is the other messages' bodies, with a message addressed to a tool
    (``to=functions.NAME``) kept whole for the harmony call format. Open: the turn was cut off
    inside its analysis."""
    messages = harmony_messages(text)
    thoughts = [m.body for m in messages if m.channel == "analysis" and m.recipient is None]
    content = "".join(
        m.text() if m.recipient else m.body
        for m in messages
        if not (m.channel == "analysis" and m.recipient is None)
    )
    cut_off = bool(messages) and messages[-1].channel == "analysis" and not messages[-1].closing
    return ("\n\n".join(thoughts) if thoughts else None), content, cut_off and not content


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
            "glm-xml": "<tool_call>NAME<arg_key>...</arg_key><arg_value>...</arg_value>"
            "</tool_call>",
            "mistral": f'{MISTRAL_CALLS}[{{"name": "...", "arguments": {{...}}}}]',
            "harmony": "a commentary message to=functions.NAME whose body is the JSON arguments",
        }[self.call_format]
        return f"Call a tool with {example} or give the final answer as <answer>...</answer>."

    def invalid(self, error: str) -> ParsedTurn:
        """An invalid turn whose message says what was wrong and how to act."""
        return ParsedTurn(kind="invalid", error=f"Invalid action: {error}. {self.usage_hint()}")

    def parse(self, text: str) -> ParsedTurn:
        """Find the first complete action in `text` (a tool call or an answer)."""
        first_call = {
            "llama-json": self._llama_call,
            "mistral": self._mistral_call,
            "harmony": self._harmony_call,
        }.get(self.call_format)
        if first_call is not None and (call := first_call(text)) is not None:
            return call
        no_call_tag = ("llama-json", "mistral", "harmony")
        tags = list(self.tools) if self.call_format == "tags" else [TOOL_CALL_TAG]
        tags = [] if self.call_format in no_call_tag else tags
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
        elif first.tag == TOOL_CALL_TAG and self.call_format == "glm-xml":
            parsed = self._glm_call(first.content)
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

    def _glm_call(self, content: str) -> ParsedTurn:
        """``NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`` (GLM-4.5)."""
        key_tag, value_tag = "<arg_key>", "<arg_value>"
        first = content.find(key_tag)
        name = (content if first < 0 else content[:first]).strip()
        if not name:
            return self.invalid("a <tool_call> must start with the tool's name")
        tool = self.tools.get(name)
        props = tool.parameters.get("properties", {}) if tool is not None else {}
        arguments: dict[str, Any] = {}
        pos = max(first, 0)
        while (start := content.find(key_tag, pos)) >= 0:
            key_end = content.find("</arg_key>", start)
            value = content.find(value_tag, key_end)
            value_end = content.find("</arg_value>", value)
            if min(key_end, value, value_end) < 0:
                return self.invalid("an <arg_key> needs </arg_key><arg_value>...</arg_value>")
            key = content[start + len(key_tag) : key_end].strip()
            text = content[value + len(value_tag) : value_end].strip()
            arguments[key] = _typed_value(text, props.get(key))
            pos = value_end + len("</arg_value>")
        return self._named_call(name, arguments, "arguments")

    def _mistral_call(self, text: str) -> ParsedTurn | None:
        """``[TOOL_CALLS][{"name": .., "arguments": {..}, "id": ..}, ...]``: the first call
        runs (None when the turn has no ``[TOOL_CALLS]`` before any answer)."""
        at = text.find(MISTRAL_CALLS)
        answer = text.find(f"<{ANSWER_TAG}>")
        if at < 0 or 0 <= answer < at:
            return None
        body = text[at + len(MISTRAL_CALLS) :].lstrip()
        try:
            calls, length = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            return self.invalid(f"the {MISTRAL_CALLS} list is not valid JSON ({exc.msg})")
        calls = [calls] if isinstance(calls, dict) else calls
        if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
            return self.invalid(f"{MISTRAL_CALLS} must be followed by a JSON list of calls")
        parsed = self._json_call(json.dumps(calls[0]), "the call")
        if parsed.kind != "tool_call":
            return parsed
        given = calls[0].get("id")
        valid_id = isinstance(given, str) and re.fullmatch(r"[A-Za-z0-9]{9}", given)
        note = (
            f"Note: only the first of {len(calls)} tool calls was run; make one call per turn."
            if len(calls) > 1
            else None
        )
        end = len(text) - len(body) + length
        return replace(parsed, span=(at, end), note=note, call_id=given if valid_id else None)

    def _harmony_call(self, text: str) -> ParsedTurn | None:
        """The first harmony message addressed to a tool (None when there is none)."""
        at = text.find(HARMONY_START)
        while at >= 0:
            end = text.find(HARMONY_START, at + 1)
            chunk = text[at : end if end >= 0 else len(text)]
            [message] = harmony_messages(chunk) or [HarmonyMessage("", "", "")]
            if message.recipient is not None:
                name = message.recipient.removeprefix("functions.")
                if not message.closing and HARMONY_MESSAGE not in chunk:
                    return self.invalid(f"the call to {name} was cut off before its arguments")
                body = message.body.strip() or "{}"
                try:
                    arguments = json.loads(body)
                except json.JSONDecodeError as exc:
                    return self.invalid(f"the arguments of {name} are not valid JSON ({exc.msg})")
                if not message.recipient.startswith("functions."):
                    known = ", ".join(f"functions.{t}" for t in self.tools) or "none"
                    return self.invalid(
                        f"unknown recipient '{message.recipient}' (available: {known})"
                    )
                parsed = self._named_call(name, arguments, "arguments")
                span = (at, at + len(chunk))
                return replace(parsed, span=span) if parsed.kind == "tool_call" else parsed
            at = end
        return None

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


# ---------------------------------------------------------------------------------------------
# Writing turns: the inverse of `TurnParser.parse`, for protocol demonstrations
# (`copes.envs.demonstrations` checks that every turn written here parses back to itself).


def format_call(
    call_format: str, tool: Tool | str, arguments: Mapping[str, Any], call_id: str = "democall1"
) -> str:
    """The text of a turn that calls `tool` (a tool, or its name) with `arguments` in
    `call_format`, as a model writes it (a harmony turn starts inside the message header the
    prompt opened). In tags, a tool's one argument is the tag's content, more are JSON."""
    name = tool if isinstance(tool, str) else tool.name
    args = dict(arguments)
    props = set(args) if isinstance(tool, str) else set(tool.parameters.get("properties", {}))
    if call_format == "tags":
        if len(props) == 1 and set(args) == props:
            (value,) = args.values()
            body = value if isinstance(value, str) else json.dumps(value)
        else:
            body = json.dumps(args)
        return f"<{name}>{body}</{name}>"
    if call_format == "hermes":
        call = json.dumps({"name": name, "arguments": args})
        return f"<{TOOL_CALL_TAG}>{call}</{TOOL_CALL_TAG}>"
    if call_format == "qwen-xml":
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n"
            "</parameter>\n"
            for key, value in args.items()
        )
        return f"<{TOOL_CALL_TAG}>\n<function={name}>\n{parameters}</function>\n</{TOOL_CALL_TAG}>"
    if call_format == "glm-xml":
        pairs = "".join(
            f"<arg_key>{key}</arg_key>\n<arg_value>"
            f"{value if isinstance(value, str) else json.dumps(value)}</arg_value>\n"
            for key, value in args.items()
        )
        return f"<{TOOL_CALL_TAG}>{name}\n{pairs}</{TOOL_CALL_TAG}>"
    if call_format == "llama-json":
        return json.dumps({"name": name, "parameters": args})
    if call_format == "mistral":
        return f"{MISTRAL_CALLS}{json.dumps([{'name': name, 'arguments': args, 'id': call_id}])}"
    if call_format == "harmony":
        return (
            f"{HARMONY_CHANNEL}commentary to=functions.{name} <|constrain|>json"
            f"{HARMONY_MESSAGE}{json.dumps(args)}{HARMONY_CLOSINGS[1]}"
        )
    raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")


def format_answer(call_format: str, answer: str) -> str:
    """The text of a turn that gives `answer` as the final answer in `call_format`."""
    tagged = f"<{ANSWER_TAG}>{answer}</{ANSWER_TAG}>"
    if call_format == "harmony":  # the final channel, closed as the model closes its reply
        return f"{HARMONY_CHANNEL}final{HARMONY_MESSAGE}{tagged}{HARMONY_CLOSINGS[2]}"
    if call_format not in CALL_FORMATS:
        raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
    return tagged
