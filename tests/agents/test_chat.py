"""ChatFormat: incremental multi-turn encoding equals rendering the whole conversation."""

import pytest

from copes.agents.chat import ChatFormat, ChatTemplateError

CONVERSATION = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "<python>print(12 * 34)</python>"},
    {"role": "tool", "name": "python", "content": "408\n"},
    {"role": "assistant", "content": "<answer>408</answer>"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_agent_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_agent_dir)


def incremental(chat, messages, model_wrote_end_of_turn):
    ids = chat.encode_prompt(messages[:1])
    for i in (1, 3):
        turn = chat.encode_text(messages[i]["content"])
        if model_wrote_end_of_turn:
            turn += [chat.tokenizer.eos_token_id]
        ids += turn
        if i == 1:
            ids += chat.encode_continuation(messages[:3], turn)
    return ids


@pytest.mark.parametrize("model_wrote_end_of_turn", [True, False])
def test_incremental_sequence_renders_like_the_template(tokenizer, model_wrote_end_of_turn):
    chat = ChatFormat(tokenizer)
    ids = incremental(chat, CONVERSATION, model_wrote_end_of_turn)
    text = tokenizer.decode(ids)
    full = chat.render(CONVERSATION, add_generation_prompt=False)
    if model_wrote_end_of_turn:
        assert text == full.rstrip("\n")
    else:  # the final turn has no end-of-turn token yet
        assert full.startswith(text) and full[len(text) :].strip() == tokenizer.eos_token


def test_tools_go_through_the_template(tokenizer):
    chat = ChatFormat(tokenizer)
    schema = [{"type": "function", "function": {"name": "python", "parameters": {}}}]
    assert '"name": "python"' in chat.render(CONVERSATION[:1], tools=schema)
    assert '"name": "python"' not in chat.render(CONVERSATION[:1])


def test_template_that_rewrites_history_still_extends_the_sampled_stream(tokenizer):
    """A template that drops past reasoning (as Qwen3 and Qwen3.5 do) does
    not matter: the sampled turn is never re-rendered, only what follows it is read off."""
    import copy

    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatFormat(rewriting)
    assert "<think>" not in chat.render(
        [*CONVERSATION[:1], {"role": "assistant", "content": "<think>a</think>b"}, CONVERSATION[2]]
    )
    turn = chat.encode_text(CONVERSATION[1]["content"])
    following = chat.encode_continuation(CONVERSATION[:3], turn)
    assert rewriting.decode(following) == (
        "<|im_end|>\n<|im_start|>tool\n408\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_whose_closing_depends_on_the_turn_is_refused(tokenizer):
    import copy

    dependent = copy.deepcopy(tokenizer)
    # Closes a turn differently when it carried reasoning: the bridge would be wrong.
    dependent.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}<|endoftext|>"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="depends on what the turn said"):
        ChatFormat(dependent)


def test_missing_template_is_explained(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat(bare)
