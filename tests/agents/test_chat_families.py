"""Real model families through `ChatFormat`: token streams that never re-render a sampled
turn, identical to the `renderers` package's bridges where it hand-codes the family, and
whole episodes of tiny trained models of every family (tests/families.py)."""

import json

import pytest

from copes.agents.chat import ChatFormat, ChatTemplateError
from copes.agents.hf import HFPolicy
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout

FAMILY_NAMES = ["qwen2", "qwen3", "qwen3_moe", "qwen3_5", "llama", "gemma3"]


def families_module():
    import families  # on sys.path through conftest's family_dir

    return families


@pytest.fixture(scope="module")
def family_tokenizer(family_dir):
    from transformers import AutoTokenizer

    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(family_dir(name))
        return cache[name]

    return load


def chat_for(tokenizer, family, **template_kwargs):
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(tokenizer.name_or_path).eos_token_id
    kwargs = {**family.template_kwargs, **template_kwargs}
    return ChatFormat(tokenizer, end_of_turn_ids=eos, template_kwargs=kwargs)


# ---------------------------------------------------------------------- renderers parity
def renderer_for(name, tokenizer, enable_thinking=None):
    renderers = pytest.importorskip("renderers")
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    config = {
        "qwen3": lambda: renderers.Qwen3RendererConfig(thinking_retention="all", **thinking),
        "qwen3_5": lambda: renderers.Qwen35RendererConfig(thinking_retention="all", **thinking),
        "llama": lambda: renderers.Llama3RendererConfig(
            thinking_retention="all", date_string="26 Jul 2024"
        ),
    }[name]()
    return renderers.create_renderer(tokenizer, config)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the code"}},
                "required": ["code"],
            },
        },
    }
]


def sampled_turns(name, thinking):
    """(turn text as sampled, how it ends) for three turns of an episode."""
    call = {
        "llama": '{"name": "python", "parameters": {"code": "print(2 + 2)"}}',
        "qwen3_5": "<tool_call>\n<function=python>\n<parameter=code>\nprint(2 + 2)\n"
        "</parameter>\n</function>\n</tool_call>",
    }.get(
        name, '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}\n</tool_call>'
    )
    think = "<think>\nLet me compute.\n</think>\n\n" if thinking and name == "qwen3" else ""
    if thinking and name == "qwen3_5":
        think = "Let me compute.\n</think>\n\n"  # the template pre-filled "<think>\n"
    return [
        (think + call, "eos"),  # the model ended its turn with its end-of-turn token
        (think + "Hmm, not yet", "length"),  # cut off by the token budget
        (think + "I think so", "stop"),  # stopped on a stop string
    ]


@pytest.mark.parametrize(
    ("name", "enable_thinking"),
    [("qwen3", None), ("qwen3", False), ("qwen3_5", None), ("qwen3_5", False), ("llama", None)],
)
def test_bridge_is_token_identical_to_renderers(family_tokenizer, name, enable_thinking):
    """Prompt and every bridge equal `renderers`' (thinking_retention="all": past reasoning
    kept), for turns that end on eos, are cut off, or stop on a stop string."""
    families = families_module()
    tokenizer = family_tokenizer(name)
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    chat = chat_for(tokenizer, families.FAMILIES[name], **thinking)
    renderer = renderer_for(name, tokenizer, enable_thinking)
    messages = [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    prompt = chat.encode_prompt(messages, TOOLS)
    assert prompt == renderer.render_ids(messages, tools=TOOLS, add_generation_prompt=True)
    sequence = list(prompt)
    followers = [
        [{"role": "tool", "content": "4", "name": "python"}],
        [{"role": "user", "content": "Invalid action: say it with <answer>."}],
        [{"role": "tool", "content": "4\n5", "name": "python"}],
    ]
    turns = sampled_turns(name, enable_thinking is not False)
    for (text, end), new in zip(turns, followers, strict=True):
        turn = chat.encode_text(text)
        if end == "eos":
            turn.append(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
        bridged = renderer.bridge_to_next_turn(sequence, turn, new, tools=TOOLS)
        assert bridged is not None
        messages = [*messages, {"role": "assistant", "content": chat.turn_text(turn)}, *new]
        ours = [*sequence, *turn, *chat.encode_continuation(messages, turn, TOOLS)]
        assert ours == bridged.token_ids, tokenizer.decode(ours)
        sequence = ours


def test_a_turn_cut_off_inside_its_reasoning_is_closed(family_tokenizer):
    """Qwen3.5 pre-fills `<think>\\n`; a turn cut off before `</think>` gets the closing
    marker before the template's closing, so the next turn starts outside the reasoning."""
    families = families_module()
    tokenizer = family_tokenizer("qwen3_5")
    chat = chat_for(tokenizer, families.FAMILIES["qwen3_5"])
    assert chat.prefill == "<think>\n"
    turn = chat.encode_text("Still thinking about it")
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Invalid action"},
    ]
    text = tokenizer.decode(chat.encode_continuation(messages, turn))
    assert text.startswith("</think><|im_end|>\n<|im_start|>user\nInvalid action<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    renderer = renderer_for("qwen3_5", tokenizer)
    prompt = chat.encode_prompt(messages[:1])
    bridged = renderer.bridge_to_next_turn(prompt, turn, messages[2:])
    assert [*prompt, *turn, *chat.encode_continuation(messages, turn)] == bridged.token_ids


def test_templates_are_read_by_trial_renders(family_tokenizer):
    families = families_module()
    gemma = chat_for(family_tokenizer("gemma3"), families.FAMILIES["gemma3"])
    assert gemma.tool_role == "user"  # the template only takes alternating user/model turns
    assert not gemma.shows_tools  # it ignores tools=: the schemas go into the user message
    assert "python" in gemma.render([{"role": "user", "content": "Q"}], TOOLS)
    with pytest.raises(ChatTemplateError, match="teaches no tool-call format"):
        gemma.native_call_format()
    expected = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_5": "qwen-xml", "llama": "llama-json"}
    for name, call_format in expected.items():
        chat = chat_for(family_tokenizer(name), families.FAMILIES[name])
        assert chat.native_call_format() == call_format
        assert chat.tool_role == "tool" and chat.shows_tools
    qwen3 = family_tokenizer("qwen3")
    assert chat_for(qwen3, families.FAMILIES["qwen3"]).prefill == ""
    no_thinking = chat_for(qwen3, families.FAMILIES["qwen3"], enable_thinking=False)
    assert no_thinking.prefill == "<think>\n\n</think>\n\n"


# ---------------------------------------------------------------------- whole episodes
@pytest.fixture(scope="module")
def family_policy(family_dir):
    families = families_module()
    cache = {}

    def load(name):
        if name not in cache:
            family = families.FAMILIES[name]
            cache[name] = HFPolicy.from_pretrained(
                family_dir(name), device="cpu", chat_template_kwargs=family.template_kwargs or None
            )
        return cache[name]

    return load


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("continuous_batching", [True, False])
def test_family_model_runs_its_scripted_episode(
    family_dir, family_policy, name, continuous_batching
):
    """The tiny model of each family calls the tool in its native format (reasoning first
    for the thinking families), makes an invalid turn, then answers: the real sandbox runs
    the call, and the rollout's token stream is the one it was trained on."""
    families = families_module()
    family = families.FAMILIES[name]
    policy = family_policy(name)
    expected = json.loads((family_dir(name) / "episodes.json").read_text())["episodes"]
    for call_format in family.call_formats:
        env = families.make_env(call_format)
        try:
            [trajectory] = rollout(
                policy,
                [env],
                SamplingConfig(64, temperature=0),
                options=[{"task": families.make_task()}],
                continuous_batching=continuous_batching,
            )
        finally:
            env.close()
        assert trajectory.token_ids == expected[call_format], call_format
        assert trajectory.tool_calls == 1 and trajectory.turns == 3
        assert trajectory.correct and trajectory.reward == pytest.approx(0.9)
        roles = [m["role"] for m in trajectory.messages]
        assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert trajectory.messages[2]["content"].strip() == families.ANSWER  # the sandbox ran
        reasoning = [m.get("reasoning_content") for m in trajectory.messages[1::2]]
        if family.thinking:
            assert reasoning[0] == "Multiply with the tool."
            assert all("<think>" not in m["content"] for m in trajectory.messages[1::2])
        else:
            assert reasoning == [None, None, None]
