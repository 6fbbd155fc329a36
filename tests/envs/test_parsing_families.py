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


# ---------------------------------------------------------------------- glm-xml, mistral, harmony
def glm(name, **args):
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


GLM_CASES = [
    glm("python", code="print(1)\nprint(2)"),
    "<think>Plan.</think>\n" + glm("repeat", text="ab", times="2", loud="true"),
    "Plan first.\n" + glm("clock"),
    glm("missing", code="1"),
    "<answer>42</answer>",
    "Just words.",
]


def test_glm_xml_agrees_with_the_renderers_glm_parser(family_dir):
    """`renderers`' GLM-4.5/5 parser (token level, `GlmToolParser`) on the GLM family's
    tokenizer reads the same calls. Where a value is a JSON-looking string for a string
    parameter, we keep the string (vLLM's GLM parser does the same from the schema)."""
    parsers = pytest.importorskip("renderers.parsers")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dir("glm4_5"))
    theirs_parser = parsers.GlmToolParser(tokenizer)
    parser = TurnParser(TOOLS, "glm-xml")
    for text in GLM_CASES:
        _, calls = theirs_parser.extract(tokenizer(text, add_special_tokens=False)["input_ids"])
        ours = parser.parse(split_reasoning(text)[1])
        if ours.kind == "tool_call":
            assert calls and (ours.tool_name, ours.arguments) == (calls[0].name, calls[0].arguments)
        elif calls and calls[0].name not in TOOLS:
            assert ours.kind == "invalid" and "unknown tool" in ours.error
        else:
            assert not calls and ours.kind in ("answer", "invalid"), text
    assert parser.parse(glm("repeat", text="3", times="3")).arguments == {"text": "3", "times": 3}


def test_mistral_calls_are_read_as_vllms_mistral_parser_reads_them():
    """vLLM's MistralToolParser (pre-v11 tokenizers): the JSON list after [TOOL_CALLS], each
    {"name", "arguments"}; arguments may be a JSON string. An id the model wrote is kept
    only when the template would take it (9 alphanumeric characters)."""
    parser = TurnParser(TOOLS, "mistral")
    call = parser.parse('[TOOL_CALLS][{"name": "python", "arguments": {"code": "print(1)"}}]')
    assert (call.kind, call.tool_name, call.arguments, call.call_id) == (
        "tool_call", "python", {"code": "print(1)"}, None,
    )  # fmt: skip
    text = '[TOOL_CALLS] [{"name": "repeat", "arguments": "{\\"text\\": \\"a\\", \\"times\\": 2}"'
    text += ', "id": "Ab3De6Gh9"}, {"name": "clock", "arguments": {}}]'
    two = parser.parse(text)
    assert two.arguments == {"text": "a", "times": 2} and two.call_id == "Ab3De6Gh9"
    assert "only the first of 2" in two.note
    bad_id = parser.parse('[TOOL_CALLS][{"name": "clock", "arguments": {}, "id": "call_1"}]')
    assert bad_id.kind == "tool_call" and bad_id.call_id is None
    broken = parser.parse('[TOOL_CALLS][{"name": "python", "arguments": {')
    assert broken.kind == "invalid" and "not valid JSON" in broken.error
    assert parser.parse("<answer>4</answer> then [TOOL_CALLS][]").kind == "answer"
    assert parser.parse("Plain words.").kind == "invalid"


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.python"
    '<|channel|>commentary json<|message|>{"code": "print(1)"}<|call|>'
)


def test_harmony_turns_split_by_channel_and_calls_by_recipient():
    """The harmony grammar (openai/harmony's message format; its own parser needs the o200k
    vocabulary downloaded, which this machine cannot, so the cases below are checked against
    gpt-oss's real template in tests/agents/test_chat_families.py): analysis is reasoning,
    never graded; a message to=functions.NAME is the call, `to=` before or after the
    channel; its body is the JSON arguments."""
    parser = TurnParser(TOOLS, "harmony")
    reasoning, content, cut_off = split_reasoning(HARMONY_CALL)
    assert (reasoning, cut_off) == ("Need the tool.", False)
    call = parser.parse(content)
    assert (call.kind, call.tool_name, call.arguments) == (
        "tool_call",
        "python",
        {"code": "print(1)"},
    )
    after = "<|channel|>commentary to=functions.clock <|constrain|>json<|message|>{}<|call|>"
    assert parser.parse(split_reasoning(after)[1]).tool_name == "clock"
    final = "<|channel|>analysis<|message|>It is <answer>1</answer>?<|end|><|start|>assistant"
    final += "<|channel|>final<|message|>No idea.<|return|>"
    reasoning, content, _ = split_reasoning(final)
    assert reasoning == "It is <answer>1</answer>?" and content == "No idea."
    assert parser.parse(content).kind == "invalid"  # the analysis answer is not the answer
    assert TurnParser(TOOLS, "tags").parse(content).kind == "invalid"
    assert split_reasoning("<|channel|>analysis<|message|>still thinking") == (
        "still thinking", "", True,
    )  # fmt: skip
    browser = "<|channel|>commentary to=browser.search<|message|>{}<|call|>"
    wrong = parser.parse(split_reasoning(browser)[1])
    assert wrong.kind == "invalid" and "unknown recipient 'browser.search'" in wrong.error
    bad = parser.parse(split_reasoning(HARMONY_CALL.replace('"}', ""))[1])
    assert bad.kind == "invalid" and "not valid JSON" in bad.error


@pytest.mark.parametrize("call_format", ["glm-xml", "mistral", "harmony"])
def test_gym_make_takes_the_new_formats(call_format):
    import gymnasium as gym

    import copes.envs  # noqa: F401  (registers the envs)

    turns = {
        "glm-xml": glm("python", code="print(6 * 7)"),
        "mistral": '[TOOL_CALLS][{"name": "python", "arguments": {"code": "print(6 * 7)"}}]',
        "harmony": "<|channel|>commentary to=functions.python<|message|>"
        '{"code": "print(6 * 7)"}<|call|>',
    }
    env = gym.make("ToolMath-v0", call_format=call_format)
    try:
        env.reset(seed=0)
        _, _, _, _, info = env.step(turns[call_format])
        assert info["action"] == "tool_call" and info["messages"][-1]["content"].strip() == "42"
        assert info["messages"][1]["tool_calls"][0]["function"]["name"] == "python"
    finally:
        env.close()
