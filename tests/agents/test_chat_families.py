"""Real model families through `ChatFormat`: token streams that never re-render a sampled
turn, identical to the `renderers` package's bridges where it hand-codes the family, and
whole episodes of tiny trained models of every family (tests/families.py)."""

import json

import pytest

from copes.agents.chat import ChatFormat, ChatTemplateError
from copes.agents.hf import HFPolicy
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout

FAMILY_NAMES = [
    "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "llama", "gemma3",
    "llama3_1", "mistral_nemo", "gpt_oss", "phi4_mini", "granite3_3", "glm4_5", "r1_distill",
]  # fmt: skip


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
    with pytest.raises(ChatTemplateError, match="renders tool calls in no format copes parses"):
        gemma.native_call_format()
    expected = {
        "qwen2": "hermes", "qwen3": "hermes", "qwen3_5": "qwen-xml", "llama": "llama-json",
        "llama3_1": "llama-json", "glm4_5": "glm-xml", "mistral_nemo": "mistral",
        "gpt_oss": "harmony",
    }  # fmt: skip
    for name, call_format in expected.items():
        chat = chat_for(family_tokenizer(name), families.FAMILIES[name])
        # Exactly one format gives the template's rendered call back: GLM's <tool_call> is
        # not hermes, gpt-oss's and Mistral's calls sit in special tokens.
        assert chat.round_trip_formats() == [call_format], name
        assert chat.native_call_format() == call_format
        assert chat.tool_role == "tool" and chat.shows_tools
    for name in ("phi4_mini", "granite3_3", "r1_distill"):  # no structured call comes back
        chat = chat_for(family_tokenizer(name), families.FAMILIES[name])
        with pytest.raises(ChatTemplateError, match=r"use --call-format tags$"):
            chat.native_call_format()
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
        if family.thinking or family.harmony:
            assert reasoning[0] == "Multiply with the tool."
            assert all("<think>" not in m["content"] for m in trajectory.messages[1::2])
        else:
            assert reasoning == [None, None, None]


# ---------------------------------------------------------------------- issue 27's families
def test_harmony_turns_are_bridged_as_the_template_renders_them(family_tokenizer):
    """gpt-oss: a turn the model closed with <|return|> is not given the template's <|end|>
    too; after a <|call|> the tool output follows in the functions.NAME message the template
    writes; the analysis channel is the reasoning and an <answer> in it is never graded."""
    families = families_module()
    tokenizer = family_tokenizer("gpt_oss")
    chat = chat_for(tokenizer, families.FAMILIES["gpt_oss"])
    env = families.make_env("harmony")
    try:
        _, info = env.reset(options={"task": families.make_task()})
        final = "<|channel|>analysis<|message|>Maybe <answer>408</answer>?<|end|>"
        final += "<|start|>assistant<|channel|>final<|message|>Not sure.<|return|>"
        ids = chat.encode_text(final)
        _, _, done, _, info = env.step(chat.turn_text(ids, info["messages"]))
        assert not done and info["action"] == "invalid"  # the analysis answer is not graded
        assert info["messages"][1]["reasoning_content"] == "Maybe <answer>408</answer>?"
        following = tokenizer.decode(chat.encode_continuation(info["messages"], ids))
        assert following.startswith("<|start|>user<|message|>Invalid action")
        assert following.endswith("<|end|><|start|>assistant")
        call = "<|channel|>analysis<|message|>Use it.<|end|><|start|>assistant to=functions."
        call += 'python<|channel|>commentary json<|message|>{"code": "print(12 * 34)"}<|call|>'
        ids = chat.encode_text(call)
        _, _, _, _, info = env.step(chat.turn_text(ids, info["messages"]))
        assert info["action"] == "tool_call" and info["messages"][-1]["role"] == "tool"
        following = tokenizer.decode(chat.encode_continuation(info["messages"], ids))
        assert following == (
            '<|start|>functions.python to=assistant<|channel|>commentary<|message|>"408"'
            "<|end|><|start|>assistant"
        )
    finally:
        env.close()


def test_r1_prefills_think_after_a_question_and_nothing_after_a_tool_output(family_tokenizer):
    """DeepSeek-R1 distills open <think> in the generation prompt after a user turn only: a
    turn that answers right after a tool output is an answer, not an open reasoning block."""
    families = families_module()
    chat = chat_for(family_tokenizer("r1_distill"), families.FAMILIES["r1_distill"])
    assert chat.prefills == {"first": "<think>\n", "tool": "", "feedback": "<think>\n"}
    assert chat.reasoning
    env = families.make_env("tags")
    try:
        _, info = env.reset(options={"task": families.make_task()})
        turn = chat.encode_text("Use the tool.\n</think>\n\n<python>print(12 * 34)</python>")
        _, _, _, _, info = env.step(chat.turn_text(turn, info["messages"]))
        assert info["action"] == "tool_call"
        answer = chat.encode_text("<answer>408</answer>")
        assert chat.turn_text(answer, info["messages"]) == "<answer>408</answer>"
        _, reward, done, _, info = env.step(chat.turn_text(answer, info["messages"]))
        assert done and info["correct"] and reward == 1.0
    finally:
        env.close()


def test_mistral_tool_output_gets_its_real_tool_turn_with_a_valid_id(family_tokenizer):
    families = families_module()
    tokenizer = family_tokenizer("mistral_nemo")
    chat = chat_for(tokenizer, families.FAMILIES["mistral_nemo"])
    assert chat.tool_role == "tool"
    env = families.make_env("mistral")
    try:
        _, info = env.reset(options={"task": families.make_task()})
        call = '[TOOL_CALLS][{"name": "python", "arguments": {"code": "print(2)"}}]'
        ids = [*chat.encode_text(call), tokenizer.eos_token_id]
        assert chat.turn_text(ids, info["messages"]) == call  # [TOOL_CALLS] is kept, </s> not
        _, _, _, _, info = env.step(chat.turn_text(ids, info["messages"]))
        tool_message = info["messages"][-1]
        assert tool_message["tool_call_id"] == "call00001"  # 9 alphanumeric characters
        following = tokenizer.decode(chat.encode_continuation(info["messages"], ids))
        assert following == '[TOOL_RESULTS]{"content": 2, "call_id": "call00001"}[/TOOL_RESULTS]'
        given = '[TOOL_CALLS][{"name": "python", "arguments": {"code": "1"}, "id": "a1b2c3d4e"}]'
        _, _, _, _, info = env.step(given)
        assert info["messages"][-1]["tool_call_id"] == "a1b2c3d4e"  # the model's own id
    finally:
        env.close()
    tags = chat.render([
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "<python>1</python>"},
        {"role": "tool", "name": "python", "content": "1"},
        {"role": "assistant", "content": "hmm"}, {"role": "user", "content": "feedback"},
    ])  # fmt: skip
    assert "[INST]1[/INST]" in tags  # after a plain turn, tool output is a user turn


def test_reasoning_is_read_from_what_templates_render_not_from_their_text(family_tokenizer):
    families = families_module()
    reasoning = {
        name: chat_for(family_tokenizer(name), families.FAMILIES[name]).reasoning
        for name in ("granite3_3", "glm4_5", "r1_distill", "gpt_oss", "phi4_mini", "qwen3")
    }
    # Granite mentions <think></think> in a system prompt, but renders no reasoning.
    assert reasoning == {
        "granite3_3": False, "glm4_5": True, "r1_distill": True, "gpt_oss": False,
        "phi4_mini": False, "qwen3": True,
    }  # fmt: skip
