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
    eos = chat.tokenizer.eos_token
    for i in (1, 3):
        turn = chat.encode_text(messages[i]["content"])
        if model_wrote_end_of_turn:
            turn += [chat.tokenizer.eos_token_id]
        ids += turn
        if i == 1:
            end = eos if model_wrote_end_of_turn else messages[i]["content"][-8:]
            ids += chat.encode_continuation(messages[2:3], None, end)
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


def test_template_that_rewrites_history_is_refused(tokenizer):
    import copy

    rewriting = copy.deepcopy(tokenizer)
    # Drops the content of assistant turns that are not the last message, like templates
    # that strip past reasoning: an incremental token sequence would not match it.
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError):
        ChatFormat(rewriting).encode_continuation(CONVERSATION[2:3])


def test_missing_template_is_explained(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat(bare)
