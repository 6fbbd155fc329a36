"""@tool builds a correct JSON schema from a plain function."""

from typing import Literal

import pytest

from copes.envs.tools.base import Tool, check_arguments, tool, tool_schema


def test_schema_from_signature_and_docstring():
    @tool
    def lookup(term: str, k: int = 3, exact: bool | None = None, mode: Literal["a", "b"] = "a"):
        """Look a term up in the glossary.

        Args:
            term: what to look up.
            k: how many entries
                to return.
        """
        return [term, k]

    assert isinstance(lookup, Tool)
    assert lookup.name == "lookup"
    assert lookup.description == "Look a term up in the glossary."
    props = lookup.parameters["properties"]
    assert props["term"] == {"type": "string", "description": "what to look up."}
    assert props["k"] == {
        "type": "integer",
        "description": "how many entries to return.",
        "default": 3,
    }
    assert props["exact"]["type"] == "boolean"
    assert props["mode"]["enum"] == ["a", "b"]
    assert lookup.parameters["required"] == ["term"]
    assert lookup(term="x") == "['x', 3]"  # results become text
    assert tool_schema(lookup)["function"]["name"] == "lookup"


def test_name_and_description_override():
    @tool(name="calc", description="Adds numbers.")
    def add(a: float, b: float) -> float:
        return a + b

    assert (add.name, add.description) == ("calc", "Adds numbers.")
    assert add(a=1, b=2.5) == "3.5"


def test_missing_docstring_is_an_error():
    with pytest.raises(ValueError, match="docstring"):

        @tool
        def nodoc(x: str) -> str:
            return x


def test_unsupported_type_is_an_error():
    with pytest.raises(TypeError, match="cannot describe"):

        @tool
        def weird(x: complex) -> str:
            """Weird."""
            return str(x)


def test_check_arguments():
    @tool
    def f(n: int, s: str = "") -> str:
        """F."""
        return s * n

    assert check_arguments(f, {"n": 2}) is None
    assert "missing" in check_arguments(f, {})
    assert "type integer" in check_arguments(f, {"n": True})
    assert "unknown" in check_arguments(f, {"n": 1, "z": 0})
