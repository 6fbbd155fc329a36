"""The `Tool` protocol and the `@tool` decorator that turns a plain function into one.

A tool is anything with a `name`, a `description`, a JSON-schema `parameters` dict and a
`__call__(**kwargs) -> str`. Tools that keep state across calls of one episode (the Python
interpreter) or that depend on the task (the per-question search pool) also implement the
optional `reset(task)` and `close()` hooks, which the environment calls at `reset()` and
`close()`.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from copes.envs.tasks.base import Task


@runtime_checkable
class Tool(Protocol):
    """What an environment needs from a tool."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, **kwargs: Any) -> str: ...


@runtime_checkable
class EpisodicTool(Tool, Protocol):
    """A tool whose state belongs to one episode (the Python interpreter) or that depends on
    the task (the per-question search pool): the env resets it for every episode."""

    def reset(self, task: Task | None) -> None: ...


@runtime_checkable
class ClosableTool(Tool, Protocol):
    """A tool that holds something to release (worker processes, an index)."""

    def close(self) -> None: ...


def reset_tool(tool: Tool, task: Task | None) -> None:
    """Start a new episode for `tool` if it cares about episodes."""
    if isinstance(tool, EpisodicTool):
        tool.reset(task)


def close_tool(tool: Tool) -> None:
    """Release what `tool` holds (worker processes, indexes) if it holds anything."""
    if isinstance(tool, ClosableTool):
        tool.close()


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI/Qwen function-calling schema of `tool`, as chat templates take in `tools=`."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


# --------------------------------------------------------------------------------------
# Argument checking: the environment turns bad calls into messages, never exceptions.


@functools.lru_cache(maxsize=256)
def _validator(parameters_json: str) -> Any:
    """A jsonschema validator of a tool's arguments (one per distinct schema). Unknown
    arguments are refused unless the schema says `additionalProperties`."""
    import jsonschema

    schema = {"additionalProperties": False, **json.loads(parameters_json), "type": "object"}
    return jsonschema.Draft202012Validator(schema)


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit `tool.parameters` (validated by jsonschema), or None when
    they do; the message names the argument and what was expected, for the agent to fix."""
    props: Mapping[str, Any] = tool.parameters.get("properties", {})
    validator = _validator(json.dumps(tool.parameters, sort_keys=True, default=str))
    errors = sorted(validator.iter_errors(dict(arguments)), key=_error_order)
    if not errors:
        return None
    error = errors[0]
    if error.validator == "required":
        missing = [n for n in tool.parameters.get("required", []) if n not in arguments]
        return f"missing required argument(s) {', '.join(missing)} for tool '{tool.name}'"
    if error.validator == "additionalProperties" and not error.path:
        unknown = [name for name in arguments if name not in props]
        expected = ", ".join(props) or "none"
        return (
            f"unknown argument(s) {', '.join(unknown)} for tool '{tool.name}' "
            f"(it takes: {expected})"
        )
    name = str(error.path[0]) if error.path else "?"
    schema = props.get(name, {})
    wanted = f"of type {schema.get('type')}" if "type" in schema else "valid"
    if "enum" in schema:
        wanted += f" in {schema['enum']}"
    value = arguments.get(name)
    return (
        f"argument '{name}' of tool '{tool.name}' must be {wanted}, got "
        f"{type(value).__name__} {value!r:.60} ({error.message:.120})"
    )


def _error_order(error: Any) -> tuple[int, int]:
    """Missing and unknown arguments first: they are what the agent most often gets wrong."""
    rank = {"required": 0, "additionalProperties": 1}.get(error.validator, 2)
    return rank, len(error.path)


def _coerce_text(text: str, schema: Mapping[str, Any]) -> Any:
    """Best-effort conversion of tag content to the single parameter's declared type."""
    kind = schema.get("type")
    stripped = text.strip()
    try:
        if kind == "integer":
            return int(stripped)
        if kind == "number":
            return float(stripped)
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
    except ValueError:
        return text
    return text


def arguments_from_text(tool: Tool, text: str) -> dict[str, Any] | str:
    """Map the content of a `<name>...</name>` tag onto the tool's arguments.

    A one-parameter tool takes the content as that parameter (converted to its type); a
    tool with several parameters takes a JSON object. Returns an error message on failure.
    """
    props: Mapping[str, Any] = tool.parameters.get("properties", {})
    if not text.strip() and not tool.parameters.get("required"):
        return {}  # `<clock></clock>`: a call with no arguments
    if len(props) == 1:
        ((name, schema),) = props.items()
        return {name: _coerce_text(text, schema)}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        names = ", ".join(f'"{n}": ...' for n in props)
        return (
            f"tool '{tool.name}' takes several arguments; write them as a JSON object "
            f"like <{tool.name}>{{{names}}}</{tool.name}> ({exc.msg} at char {exc.pos})"
        )
    if not isinstance(value, dict):
        return f"tool '{tool.name}' expects a JSON object of arguments, got {type(value).__name__}"
    return value


# --------------------------------------------------------------------------------------
# The @tool decorator.

_DOC_ARG = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _json_schema_for(annotation: Any) -> dict[str, Any]:
    """JSON schema of a Python type annotation (the subset tools need)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        values = list(args)
        schema = _json_schema_for(type(values[0]))
        schema["enum"] = values
        return schema
    if origin in (Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:
            return _json_schema_for(non_null[0])
        return {"anyOf": [_json_schema_for(a) for a in non_null]}
    if origin in (list, tuple, set, frozenset):
        schema: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _json_schema_for(args[0])
        return schema
    if origin is dict or annotation is dict:
        return {"type": "object"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}
    if annotation in simple:
        return {"type": simple[annotation]}
    raise TypeError(
        f"@tool cannot describe parameter type {annotation!r} in JSON schema; use str, int, "
        "float, bool, list[...], dict, Literal[...] or Optional[...]"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (summary, {argument: description})."""
    doc = inspect.cleandoc(doc)
    summary_lines: list[str] = []
    arg_docs: dict[str, str] = {}
    section = "summary"
    current: str | None = None
    for line in doc.splitlines():
        header = line.strip().rstrip(":").lower()
        if line.strip().endswith(":") and header in ("args", "arguments", "parameters"):
            section, current = "args", None
            continue
        if line.strip().endswith(":") and header in ("returns", "raises", "examples", "yields"):
            section = "other"
            continue
        if section == "summary":
            summary_lines.append(line)
        elif section == "args":
            match = _DOC_ARG.match(line)
            indent = len(line) - len(line.lstrip())
            if match and (current is None or indent <= 4):
                current = match.group(1).lstrip("*")
                arg_docs[current] = match.group(2).strip()
            elif current and line.strip():
                arg_docs[current] += " " + line.strip()
    summary = " ".join(" ".join(summary_lines).split())
    return summary, arg_docs


@dataclass
class FunctionTool:
    """A `Tool` made from a plain Python function by `@tool`."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def __call__(self, **kwargs: Any) -> str:
        result = resolve(self.fn(**kwargs))
        return result if isinstance(result, str) else str(result)


def resolve(value: Any) -> Any:
    """The result of a tool call: an awaitable (an `async def` tool) is run to completion,
    in this thread's own event loop, or in a fresh thread when one is already running here
    (a user stepping the env from async code)."""
    if not inspect.isawaitable(value):
        return value
    import asyncio

    async def wait() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def as_tool(candidate: Any) -> Tool:
    """A `Tool` as it is; a plain (or `async`) function through `@tool`, so
    ``extra_tools=[my_function]`` works. Anything else is a TypeError that says what a tool
    needs."""
    if isinstance(candidate, Tool):
        return candidate
    if inspect.isfunction(candidate) or inspect.ismethod(candidate):
        return tool(candidate)
    raise TypeError(
        f"{candidate!r} is not a tool: pass a function (its signature and docstring become "
        "the schema) or an object with name, description, parameters and __call__"
    )


# Our own schema builder, not transformers.utils.get_json_schema: that one refuses any
# function with an argument its docstring does not describe (DocstringParsingException), and
# a quick tool from a user often documents only some; it also drops defaults, which the
# tags prompt shows.
def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Any:
    """Make a `Tool` from a function: its signature becomes the JSON schema, its docstring
    the description (summary) and the per-argument descriptions (Google-style `Args:`).

        @tool
        def convert_length(value: float, from_unit: str, to_unit: str) -> str:
            '''Convert a length between metric and imperial units.

            Args:
                value: the number to convert.
                from_unit: unit of `value`, one of mm, cm, m, km, in, ft, mi.
                to_unit: the unit wanted.
            '''

    Use as `@tool` or `@tool(name="convert", description="...")`.
    """

    def build(func: Callable[..., Any]) -> FunctionTool:
        summary, arg_docs = _parse_docstring(func.__doc__ or "")
        hints = typing.get_type_hints(func)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for param in inspect.signature(func).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"@tool function {func.__name__} cannot take *args or **kwargs")
            schema = _json_schema_for(hints.get(param.name, param.annotation))
            if param.name in arg_docs:
                schema["description"] = arg_docs[param.name]
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
            else:
                schema.setdefault("default", param.default)
            properties[param.name] = schema
        text = description or summary
        if not text:
            raise ValueError(
                f"@tool function {func.__name__} needs a docstring (or description=...): "
                "the model only knows what a tool does from its description"
            )
        return FunctionTool(
            fn=func,
            name=name or func.__name__,
            description=text,
            parameters={"type": "object", "properties": properties, "required": required},
        )

    return build(fn) if fn is not None else build
