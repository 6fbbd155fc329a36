"""The OpenAI chat-completions wire format: what a request may ask, and the reply.

Requests are read into `TurnRequest` with every field the server cannot honour refused by
name (a `ServeError`, sent as OpenAI's ``{"error": {...}}`` body): a served ES member must
sample exactly as its step says, so nothing a client asks is silently dropped. Tool calls in
the reply are the model's text parsed in the run's call format (`copes.envs.parsing`), the
same parser the environments use.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from copes.envs.parsing import HARMONY_MESSAGE, TurnParser, split_harmony


class ServeError(Exception):
    """A refused request: its HTTP status, one-line message and OpenAI error code."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


# Fields whose default is the only value a served turn can honour.
_MUST_BE_ABSENT = {
    "logit_bias": "per-token biases change a member's distribution; remove logit_bias",
    "functions": "the legacy functions= field is not served; send tools=",
    "function_call": "the legacy function_call= field is not served; send tool_choice=",
    "prediction": "predicted outputs are not served; remove prediction",
    "audio": "audio output is not served; remove audio",
}
_ZERO_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class TurnRequest:
    """One validated chat-completions request."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stop: tuple[str, ...]
    max_tokens: int | None
    logprobs: bool
    parse_tools: bool  # tool_choice "none" returns the text as it is
    temperature: float | None
    top_p: float | None

    def key(self) -> str:
        """What identifies a request for retries: same messages, tools and limits."""
        return json.dumps(
            [
                self.messages,
                self.tools,
                self.stop,
                self.max_tokens,
                self.logprobs,
                self.parse_tools,
            ],
            sort_keys=True,
            default=str,
        )


def _content_text(content: Any, where: str) -> str:
    """A message's content as text (OpenAI's list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                raise ServeError(
                    400, f"{where}: only text content parts are served", param="messages"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ServeError(
        400, f"{where}: content must be a string or a list of text parts", param="messages"
    )


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for call in calls or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ServeError(400, f"{where}: a tool call needs function.name", param="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise ServeError(
                    400, f"{where}: tool call arguments are not JSON", param="messages"
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content, tool-call arguments as objects,
    only the fields a template reads."""
    if not isinstance(raw, list) or not raw:
        raise ServeError(400, "messages must be a non-empty list", param="messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ServeError(400, f"{where} needs a string role", param="messages")
        role = "system" if message["role"] == "developer" else message["role"]
        out: dict[str, Any] = {
            "role": role,
            "content": _content_text(message.get("content"), where),
        }
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], where)
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                out[key] = message[key]
        messages.append(out)
    return messages


def parse_request(body: Any) -> TurnRequest:
    """Validate a chat-completions body; raises `ServeError` naming the offending field."""
    if not isinstance(body, Mapping):
        raise ServeError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ServeError(400, "model is required (GET /v1/models lists the names)", param="model")
    for name, why in _MUST_BE_ABSENT.items():
        if body.get(name):
            raise ServeError(400, f"{name} is not supported: {why}", param=name)
    for name in _ZERO_PENALTIES:
        if body.get(name):
            raise ServeError(
                400, f"{name} must be 0: penalties change a member's sampling", param=name
            )
    if body.get("n") not in (None, 1):
        raise ServeError(
            400, "n must be 1: each sample is its own session (ask for more work)", param="n"
        )
    if body.get("stream"):
        raise ServeError(
            400, "stream=true is not supported; request the whole reply", param="stream"
        )
    if body.get("seed") is not None:
        raise ServeError(
            400,
            "seed is set by the server (each session samples from its own "
            "stream of the step's seed); remove seed",
            param="seed",
        )
    if body.get("top_logprobs"):
        raise ServeError(
            400,
            "top_logprobs is not served; use logprobs=true for the sampled tokens' log-probs",
            param="top_logprobs",
        )
    response_format = body.get("response_format")
    if response_format and response_format.get("type") != "text":
        raise ServeError(
            400, "response_format other than text is not served", param="response_format"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ServeError(
            400,
            "tool_choice must be auto or none: a sampled turn cannot be forced to call a tool",
            param="tool_choice",
        )
    tools = body.get("tools") or None
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, Mapping)
            and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise ServeError(
            400, "tools must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise ServeError(400, "stop must be a string or a list of non-empty strings", param="stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ServeError(400, "max_tokens must be a positive integer", param="max_tokens")
    sampling = {}
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ServeError(400, f"{name} must be a number", param=name)
        sampling[name] = None if value is None else float(value)
    return TurnRequest(
        model=model,
        messages=normalize_messages(body.get("messages")),
        tools=[dict(t) for t in tools] if tools else None,
        stop=stops,
        max_tokens=limit,
        logprobs=bool(body.get("logprobs")),
        parse_tools=choice != "none",
        **sampling,
    )


# ---------------------------------------------------------------------- replies
@dataclass
class _SchemaTool:
    """A tool known only by its schema (the client runs it): enough for `TurnParser`."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, **kwargs: Any) -> str:  # pragma: no cover - never run here
        raise RuntimeError("the client runs its own tools")


def assistant_message(
    text: str, tools: Sequence[Mapping[str, Any]] | None, call_format: str, parse_tools: bool = True
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a sampled turn (its tool call in OpenAI's `tool_calls`) and
    the finish reason a tool call implies (None: the sampler's). A harmony turn's analysis
    channel is its `reasoning_content`, and its content the other channels."""
    reasoning = None
    if HARMONY_MESSAGE in text:
        reasoning, text, _ = split_harmony(text)
    message, finish = _assistant_message(text, tools, call_format, parse_tools)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message, finish


def _assistant_message(
    text: str, tools: Sequence[Mapping[str, Any]] | None, call_format: str, parse_tools: bool
) -> tuple[dict[str, Any], str | None]:
    if tools and parse_tools:
        schemas = {}
        for schema in tools:
            fn = schema["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            schemas[fn["name"]] = _SchemaTool(fn["name"], fn.get("description", ""), params)
        try:
            parser = TurnParser(schemas, call_format)  # type: ignore[arg-type]
        except ValueError:
            parser = None  # a client tool named like a reserved tag: no calls are parsed
        parsed = parser.parse(text) if parser is not None else None
        if parsed is not None and parsed.kind == "tool_call" and parsed.span is not None:
            start, end = parsed.span
            content = (text[:start] + text[end:]).strip() or None
            # Mistral's templates take back only 9-character alphanumeric ids.
            mistral_id = parsed.call_id or secrets.token_hex(5)[:9]
            call = {
                "id": mistral_id if call_format == "mistral" else f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": parsed.tool_name, "arguments": json.dumps(parsed.arguments)},
            }
            return {"role": "assistant", "content": content, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": text}, None


def token_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float]) -> dict:
    """OpenAI's ``choices[0].logprobs``: one entry per sampled token."""
    content = []
    for token_id, logprob in zip(ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append(
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        )
    return {"content": content}


def context_error(total: int, limit: int, context: int, param: str = "messages") -> ServeError:
    """The refusal of a turn that would not fit the model's context."""
    return ServeError(
        400,
        f"the prompt is {total} tokens and the turn may add {limit}: over the model's context "
        f"of {context} tokens; end the episode or ask for fewer max_tokens",
        code="context_length_exceeded",
        param=param,
    )


def turn_reply(
    request: TurnRequest,
    generation: Any,
    text: str,
    call_format: str,
    tokenizer: Any,
    extra: dict[str, Any],
) -> tuple[dict[str, Any], str]:
    """The chat.completion of a sampled turn (`text`: what the assistant wrote, pre-fill
    included) and its finish reason: ``length``, ``tool_calls`` or ``stop``."""
    message, call_reason = assistant_message(text, request.tools, call_format, request.parse_tools)
    finish = "length" if generation.finish_reason == "length" else call_reason or "stop"
    logprobs = (
        token_logprobs(tokenizer, generation.token_ids, generation.logprobs)
        if request.logprobs
        else None
    )
    reply = chat_completion(
        request.model,
        message,
        finish,
        len(generation.prompt_token_ids),
        len(generation.token_ids),
        logprobs,
        extra,
    )
    return reply, finish


def chat_completion(
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """A chat.completion object (`extra`: copes' own fields, under ``copes``)."""
    reply = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if extra:
        reply["copes"] = extra
    return reply
