"""The model-native call formats: qwen-xml (Qwen3.5), llama-json (Llama 3.1+) and hermes
(Qwen2.5/Qwen3), and the reasoning split, checked against the `renderers` package's own
parsers (parse_qwen35, parse_llama_3, parse_qwen3) on the same turns."""

import pytest

from copes.envs.parsing import TurnParser, split_reasoning
from copes.envs.tools.base import tool


@tool
def python(code: str) -> str:
    """Run Python code.

    Args:
        code: the source.
    """
    return code


@tool
def repeat(text: str, times: int, loud: bool = False) -> str:
    """Repeat a text.

    Args:
        text: what to repeat.
        times: how often.
        loud: upper-case it.
    """
    return text * times


@tool
def clock() -> str:
    """The time."""
    return "12:00"


TOOLS = {t.name: t for t in (python, repeat, clock)}
SCHEMAS = [
    {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
    for t in TOOLS.values()
]

XML = "<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return XML.format(name=name, params=body)


CASES = {
    "qwen-xml": [
        "<think>\nPlan.\n</think>\n\n" + xml("python", code="print(1)\nprint(2)"),
        xml("repeat", text="true", times="3", loud="true"),
        "Plan first.\n" + xml("repeat", text="ab", times="2"),
        "<think>\nno closing marker, a call ends it\n" + xml("python", code="x = 1"),
        xml("clock"),
        xml("missing", code="1"),
        "<answer>42</answer>",
        "<think>\nPlan.\n</think>\n\nJust words.",
    ],
    "llama-json": [
        '{"name": "python", "parameters": {"code": "print(1)"}}',
        '{"name": "repeat", "arguments": {"text": "a", "times": 2}}',
        '{"name": "clock", "parameters": {}}',
        '{"name": "missing", "parameters": {}}',
        "<answer>42</answer>",
        "The answer is 42.",
    ],
    "hermes": [
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>',
        '<think>\nPlan.\n</think>\n\n<tool_call>\n{"name": "repeat", "arguments": '
        '{"text": "a", "times": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>',
        "<answer>42</answer>",
    ],
}
FAMILY_OF = {"qwen-xml": "qwen3_5", "llama-json": "llama", "hermes": "qwen3"}


@pytest.fixture(scope="module")
def renderer_of(family_dir):
    renderers = pytest.importorskip("renderers")
    from transformers import AutoTokenizer

    configs = {
        "qwen3_5": renderers.Qwen35RendererConfig(enable_thinking=False),
        "llama": renderers.Llama3RendererConfig(date_string="26 Jul 2024"),
        "qwen3": renderers.Qwen3RendererConfig(),
    }

    def build(family):
        tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
        return tokenizer, renderers.create_renderer(tokenizer, configs[family])

    return build


@pytest.mark.parametrize("call_format", sorted(CASES))
def test_native_parsers_agree_with_renderers(renderer_of, call_format):
    tokenizer, renderer = renderer_of(FAMILY_OF[call_format])
    parser = TurnParser(TOOLS, call_format)
    for text in CASES[call_format]:
        theirs = renderer.parse_response(
            tokenizer(text, add_special_tokens=False)["input_ids"], tools=SCHEMAS
        )
        reasoning, content, cut_off = split_reasoning(text)
        assert not cut_off
        assert (reasoning or None) == (theirs.reasoning_content or None), text
        ours = parser.parse(content)
        calls = [c for c in theirs.tool_calls if c.name]
        if ours.kind == "tool_call":
            assert calls, text
            assert (ours.tool_name, ours.arguments) == (calls[0].name, calls[0].arguments), text
        elif "<answer>" in text:
            assert ours.kind == "answer" and not calls
        elif calls and calls[0].name not in TOOLS:  # renderers parses it; we say unknown tool
            assert ours.kind == "invalid" and "unknown tool" in ours.error
        else:
            assert ours.kind == "invalid" and not calls, text


def test_xml_values_follow_the_tool_schema():
    parser = TurnParser(TOOLS, "qwen-xml")
    parsed = parser.parse(xml("repeat", text="true", times="3", loud="true"))
    assert parsed.arguments == {"text": "true", "times": 3, "loud": True}
    parsed = parser.parse(xml("python", code="print(1)\nprint(2)"))
    assert parsed.arguments == {"code": "print(1)\nprint(2)"}
    assert parser.parse(xml("clock")).tool_name == "clock"  # a call with no arguments


def test_xml_and_json_mistakes_become_clear_invalid_turns():
    xml_parser = TurnParser(TOOLS, "qwen-xml")
    bad = xml_parser.parse("<tool_call>\npython(1)\n</tool_call>")
    assert bad.kind == "invalid" and "<function=NAME>" in bad.error
    unclosed = xml_parser.parse("<tool_call>\n<function=python>\n<parameter=code>\n1\n</tool_call>")
    assert unclosed.kind == "invalid" and "never closed" in unclosed.error
    missing = xml_parser.parse(xml("repeat", text="a"))
    assert missing.kind == "invalid" and "times" in missing.error
    json_parser = TurnParser(TOOLS, "llama-json")
    broken = json_parser.parse('{"name": "python", "parameters": {"code": }')
    assert broken.kind == "invalid" and "not valid JSON" in broken.error
    assert "parameters" in json_parser.usage_hint()


def test_reasoning_is_split_off_and_an_open_block_is_reported():
    assert split_reasoning("<think>\nA\n</think>\n\nB") == ("A", "B", False)
    assert split_reasoning("A\n</think>\n\nB") == ("A", "B", False)  # "<think>" pre-filled
    assert split_reasoning("<think>\nstill going") == ("still going", "", True)
    assert split_reasoning("no markers") == (None, "no markers", False)
    assert split_reasoning("<think>\nA\n<tool_call>x</tool_call>") == (
        "A",
        "<tool_call>x</tool_call>",
        False,
    )


def test_env_keeps_reasoning_apart_and_refuses_a_turn_cut_off_inside_it():
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.base import Task

    task = Task(id="t", question="1 + 1?", answers=("2",), kind="math")
    env = tool_math_env(tasks=[task], call_format="qwen-xml", max_turns=3)
    try:
        env.reset(options={"task": task})
        _, _, _, _, info = env.step("<think>\nI should add.\n</think>\n\n<answer>2</answer>")
        assert info["correct"]
        assert info["messages"][-1] == {
            "role": "assistant",
            "content": "<answer>2</answer>",
            "reasoning_content": "I should add.",
        }
        env.reset(options={"task": task})
        obs, _, terminated, _, info = env.step("<think>\n<answer>2</answer> maybe")
        assert not terminated and info["action"] == "invalid"
        assert "ended inside its reasoning" in obs
    finally:
        env.close()
