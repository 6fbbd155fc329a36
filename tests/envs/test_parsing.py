"""Turn parsing: every malformed turn becomes a message, never an exception."""

import pytest

from copes.envs.parsing import TurnParser, last_boxed
from copes.envs.tools.base import tool


@tool
def python(code: str) -> str:
    """Run code."""
    return code


@tool
def search(query: str) -> str:
    """Search passages."""
    return query


@tool
def convert(value: float, unit: str) -> str:
    """Convert a value.

    Args:
        value: the number.
        unit: the target unit.
    """
    return f"{value} {unit}"


TOOLS = {"python": python, "search": search, "convert": convert}


@pytest.fixture
def tags():
    return TurnParser(TOOLS, "tags", accept_boxed=True, max_call_chars=200)


@pytest.fixture
def hermes():
    return TurnParser(TOOLS, "hermes", accept_boxed=True, max_call_chars=200)


def test_tag_tool_call(tags):
    turn = tags.parse("Let me compute.\n<python>print(2**10)</python>")
    assert turn.kind == "tool_call"
    assert turn.tool_name == "python"
    assert turn.arguments == {"code": "print(2**10)"}


def test_tag_answer_and_boxed_inside_answer(tags):
    assert tags.parse("<answer> 42 </answer>").answer == "42"
    assert tags.parse(r"<answer>so \boxed{\frac{1}{2}}</answer>").answer == r"\frac{1}{2}"


def test_bare_boxed_is_an_answer_only_when_accepted(tags):
    assert tags.parse(r"The result is \boxed{7}.").answer == "7"
    strict = TurnParser(TOOLS, "tags", accept_boxed=False)
    assert strict.parse(r"The result is \boxed{7}.").kind == "invalid"


def test_first_action_wins(tags):
    turn = tags.parse("<search>who</search> then <answer>x</answer>")
    assert turn.kind == "tool_call" and turn.tool_name == "search"
    assert tags.parse("<answer>x</answer><python>1</python>").kind == "answer"


def test_second_call_is_reported_not_run(tags):
    turn = tags.parse("<python>a=1</python><python>b=2</python>")
    assert turn.arguments == {"code": "a=1"}
    assert "first of 2" in turn.note


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("<python>print(1)", "never closed"),
        ("<python><python>1</python></python>", "nested"),
        ("<python>   </python>", "empty"),
        ("<python>" + "x" * 500 + "</python>", "over the limit"),
        ("", "empty"),
        ("I think the answer is 4", "no tool call"),
        (
            "<calculator>1+1</calculator>",
            "unknown tool 'calculator' (available: python, search, convert)",
        ),
        ("<answer></answer>", "empty"),
        ('<convert>{"value": "3"}</convert>', "missing required"),
        ('<convert>{"value": "x", "unit": "km"}</convert>', "must be of type number"),
        ("<convert>3 km</convert>", "JSON object"),
    ],
)
def test_malformed_tag_turns_are_invalid_with_reason(tags, text, fragment):
    turn = tags.parse(text)
    assert turn.kind == "invalid"
    assert fragment in turn.error
    assert "<answer>...</answer>" in turn.error  # the hint that lets the agent recover


def test_multi_argument_tool_takes_json_in_tags(tags):
    turn = tags.parse('<convert>{"value": 3, "unit": "km"}</convert>')
    assert turn.arguments == {"value": 3, "unit": "km"}


def test_hermes_call(hermes):
    call = '{"name": "python", "arguments": {"code": "1+1"}}'
    turn = hermes.parse(f"<tool_call>\n{call}\n</tool_call>")
    assert (turn.kind, turn.tool_name, turn.arguments) == ("tool_call", "python", {"code": "1+1"})


def test_hermes_arguments_as_json_string(hermes):
    call = '{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}'
    turn = hermes.parse(f"<tool_call>{call}</tool_call>")
    assert turn.arguments == {"query": "x"}


def test_hermes_ignores_tag_style_calls(hermes):
    assert hermes.parse("<python>1</python>").kind == "invalid"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>["python"]</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm'"),
        ('<tool_call>{"name": "python", "arguments": 3}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "missing required"),
        (
            '<tool_call>{"name": "python", "arguments": {"code": "1", "x": 2}}</tool_call>',
            "unknown",
        ),
        ('<tool_call>{"name": "python"', "never closed"),
    ],
)
def test_malformed_hermes_turns_are_invalid_with_reason(hermes, text, fragment):
    turn = hermes.parse(text)
    assert turn.kind == "invalid"
    assert fragment in turn.error


def test_reserved_tool_names_are_rejected():
    @tool(name="answer")
    def bad(x: str) -> str:
        """Bad."""
        return x

    with pytest.raises(ValueError, match="reserved"):
        TurnParser({"answer": bad})


def test_last_boxed():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{3}") == "3"
    assert last_boxed(r"\boxed{1") is None
    assert last_boxed("nothing") is None
