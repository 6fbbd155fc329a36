"""Protocol demonstrations: worked examples of the call protocol, played before the task as
earlier turns of the conversation.

An instruct model that never saw copes' call protocol answers in prose (SmolLM2-135M-Instruct
on GSM8K: no tool call and no tagged answer in 32 of 32 episodes). Instructions alone barely
change that; the same examples played as earlier turns (a question, a call, the tool's real
output, a final answer) do (docs/results.md, "A real model"). So `demonstrations=N` puts the
first N examples of the env's kind before the task.

Each example is *played*, not written out: a `ToolEnv` of the same call format, the same
instructions and a fresh tool of the same kind steps through it, so every call is written by
`copes.envs.parsing.format_call`, parsed back by the env's own parser (a turn that does not
parse back to its call is an error, so a format change cannot leave the examples behind), run
by the real tool (the sandboxed Python; BM25 over the example's own passages), and the final
answer graded correct by the env's grader. The transcript is the env's own `messages`, in the
format the env gives every conversation (native formats: structured `tool_calls`).

The examples are made up (no benchmark's data), fixed, and their transcript's digest is
recorded by copes-train and copes-eval. Their tokens are prompt: never generated, never
trained on.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from copes.envs.tasks.base import Passage, Task, TaskKind


@dataclass(frozen=True)
class Call:
    """One tool call of an example: the tool's name and its arguments."""

    tool: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class Demonstration:
    """A made-up task and the turns that solve it: calls, then the final answer."""

    task: Task
    calls: tuple[Call, ...]
    answer: str


MATH_DEMONSTRATIONS = (
    Demonstration(
        Task(
            "demonstration-math-1",
            "A library has 37 shelves with 48 books on each shelf. It lends out 259 of the "
            "books. How many books are still on the shelves?",
            ("1517",),
            "math",
            source="demonstration",
        ),
        (Call("python", {"code": "print(37 * 48 - 259)"}),),
        "1517",
    ),
    Demonstration(
        Task(
            "demonstration-math-2",
            "A cyclist rides 14.5 km on each weekday and 32 km on each day of the weekend. "
            "How many kilometres does she ride in 6 weeks?",
            ("819",),
            "math",
            source="demonstration",
        ),
        (Call("python", {"code": "week = 5 * 14.5 + 2 * 32\nprint(6 * week)"}),),
        "819",
    ),
)

QA_DEMONSTRATIONS = (
    Demonstration(
        Task(
            "demonstration-qa-1",
            "In which city was the founder of the Larkspur Observatory born?",
            ("Szeged",),
            "qa",
            passages=(
                Passage(
                    "Larkspur Observatory",
                    "The Larkspur Observatory is a small astronomical observatory on a hill "
                    "above the Tarn valley. It was founded in 1911 by the astronomer Edith "
                    "Varga, who ran it until her retirement.",
                ),
                Passage(
                    "Edith Varga",
                    "Edith Varga (1868-1942) was an astronomer known for her catalogue of "
                    "variable stars. She was born in Szeged and studied in Vienna before "
                    "founding an observatory of her own.",
                ),
                Passage(
                    "Tarn valley",
                    "The Tarn valley is a farming region crossed by the Tarn river; its "
                    "largest town is Belmont, a market town since the 14th century.",
                ),
            ),
            source="demonstration",
        ),
        (
            Call("search", {"query": "Larkspur Observatory founded by"}),
            Call("search", {"query": "Edith Varga born"}),
        ),
        "Szeged",
    ),
    Demonstration(
        Task(
            "demonstration-qa-2",
            "In what year was the Meridian Canal opened?",
            ("1847",),
            "qa",
            passages=(
                Passage(
                    "Meridian Canal",
                    "The Meridian Canal is a 62 km waterway linking the Osk and Brant rivers. "
                    "Work began in 1839 and the canal was opened to boats in 1847.",
                ),
                Passage(
                    "Brant river",
                    "The Brant river rises in the Halden hills and flows north for 210 km "
                    "before it joins the sea at Porthaven.",
                ),
            ),
            source="demonstration",
        ),
        (Call("search", {"query": "Meridian Canal opened"}),),
        "1847",
    ),
)

DEMONSTRATIONS: dict[TaskKind, tuple[Demonstration, ...]] = {
    "math": MATH_DEMONSTRATIONS,
    "qa": QA_DEMONSTRATIONS,
}


class DemonstrationError(RuntimeError):
    """An example did not play as written: a call did not parse back, or the answer was
    graded wrong. A bug in copes (a writer and its parser disagree), never the user's."""


def check_count(kind: TaskKind, count: int) -> None:
    """`count` examples of `kind` exist (ValueError naming the range otherwise)."""
    available = len(DEMONSTRATIONS[kind])
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= available:
        raise ValueError(
            f"demonstrations must be an integer from 0 to {available} (the {kind} examples "
            f"copes has), got {count!r}"
        )


def play(
    kind: TaskKind,
    count: int,
    *,
    call_format: str,
    instructions: Any = None,
    max_tool_output_chars: int = 4000,
    tool_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The transcript of the first `count` examples of `kind`, played in a `ToolEnv` with a
    fresh tool of that kind (`PythonTool` or a pool-mode `SearchTool`, built with
    `tool_options`) and the kind's default grader (see the module docstring); [] for 0."""
    check_count(kind, count)
    if count == 0:
        return []
    options = tuple(sorted((tool_options or {}).items()))
    played = _played(kind, count, call_format, instructions, max_tool_output_chars, options)
    return json.loads(played)


@functools.lru_cache(maxsize=64)
def _played(
    kind: TaskKind,
    count: int,
    call_format: str,
    instructions: Any,
    max_tool_output_chars: int,
    tool_options: tuple[tuple[str, Any], ...],
) -> str:
    """`play`, as JSON text (each caller decodes its own copy), so that an env built many
    times plays its examples once per process."""
    from copes.envs.core import ToolEnv, default_instructions
    from copes.envs.parsing import format_answer, format_call
    from copes.envs.rewards.graders import MathGrader, QAGrader

    demonstrations = DEMONSTRATIONS[kind][:count]
    if kind == "math":
        from copes.envs.tools.python import PythonTool

        tool: Any = PythonTool(**dict(tool_options))
        grader: Any = MathGrader()
    else:
        from copes.envs.tools.search import SearchTool

        tool, grader = SearchTool(**dict(tool_options)), QAGrader()
    env = ToolEnv(
        [d.task for d in demonstrations], [tool], grader,
        max_turns=max(len(d.calls) for d in demonstrations) + 1,
        call_format=call_format,  # type: ignore[arg-type]
        max_tool_output_chars=max_tool_output_chars,
        instructions=instructions or default_instructions,
    )  # fmt: skip
    messages: list[dict[str, Any]] = []
    try:
        for demonstration in demonstrations:
            env.reset(options={"task": demonstration.task})
            for call in demonstration.calls:
                turn = format_call(call_format, env.tools[call.tool], call.arguments)
                _, _, done, _, info = env.step(turn)
                if info.get("action") != "tool_call" or done:
                    raise DemonstrationError(
                        f"{demonstration.task.id}: the {call_format} call {turn!r} did not parse "
                        f"back as a call ({info.get('action')})"
                    )
                output = info["messages"][-1]["content"]
                if output.startswith("Error:"):
                    raise DemonstrationError(f"{demonstration.task.id}: the tool failed: {output}")
            _, _, done, _, info = env.step(format_answer(call_format, demonstration.answer))
            if not (done and info.get("correct")):
                raise DemonstrationError(
                    f"{demonstration.task.id}: the final answer {demonstration.answer!r} was not "
                    f"graded correct ({info.get('action')}, {info.get('grade')})"
                )
            messages += info["messages"]
    finally:
        env.close()
    return json.dumps(messages)


def transcript_digest(messages: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of a transcript, as runs record it."""
    text = json.dumps(list(messages), ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
