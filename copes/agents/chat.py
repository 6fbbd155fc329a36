"""Conversations to token ids, through the tokenizer's own chat template.

A multi-turn rollout grows one token sequence: the prompt, then each generated turn exactly
as generated, then the tokens of the messages that follow (tool output, feedback), then the
next turn. The ids of a generated turn are never re-encoded from its text (re-encoding can
split the same text differently, and GRPO must train on the ids that were sampled).

To find the tokens that follow a generated turn without re-rendering the turn itself, the
template is rendered around a fixed placeholder conversation; the difference is what the
template adds after an assistant turn and before the next one. This works for any template
whose rendering of earlier messages does not depend on later ones (ChatML / Qwen / Llama
style), and fails loudly otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_PLACEHOLDER_REPLY = "COPES_PLACEHOLDER_REPLY"
_PLACEHOLDER_BASE = (
    {"role": "user", "content": "COPES_PLACEHOLDER_QUESTION"},
    {"role": "assistant", "content": _PLACEHOLDER_REPLY},
)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for incremental multi-turn encoding."""


class ChatFormat:
    """Renders conversations with a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                "template; use an instruct/chat model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self._base_cache: dict[str, tuple[str, str]] = {}

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = list(tools)
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of template text (special tokens written in it are recognised)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Ids of the conversation so far, ending where the assistant starts to write."""
        return self.encode_text(self.render(messages, tools, add_generation_prompt=True))

    # ------------------------------------------------------------------ continuation
    def _rendered_base(self, tools: Sequence[dict[str, Any]] | None) -> tuple[str, str]:
        """(placeholder conversation ending in a closed assistant turn, the closing text)."""
        key = json.dumps(list(tools), sort_keys=True) if tools else ""
        if key not in self._base_cache:
            closed = self.render(_PLACEHOLDER_BASE, tools, add_generation_prompt=False)
            cut = closed.rfind(_PLACEHOLDER_REPLY)
            if cut < 0:
                raise ChatTemplateError("the chat template drops assistant message content")
            self._base_cache[key] = (closed, closed[cut + len(_PLACEHOLDER_REPLY) :])
        return self._base_cache[key]

    def encode_continuation(
        self,
        new_messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        generated_text_end: str = "",
    ) -> list[int]:
        """Ids that follow a generated assistant turn: its closing (the part the model did not
        generate itself), the new messages, and the next assistant header.

        `generated_text_end` is the decoded end of the generated turn *including special
        tokens*, so a closing token the model already produced (e.g. `<|im_end|>`) is not
        added twice.
        """
        closed, closing = self._rendered_base(tools)
        rendered = self.render([*_PLACEHOLDER_BASE, *new_messages], tools, True)
        if not rendered.startswith(closed):
            raise ChatTemplateError(
                "the chat template renders earlier turns differently once more messages "
                "follow, so a multi-turn rollout cannot extend its token sequence; use a "
                "template without that behaviour (e.g. one that keeps past reasoning)"
            )
        # Drop the part of the closing the model already wrote (its end-of-turn token).
        for size in range(len(closing), 0, -1):
            if generated_text_end.endswith(closing[:size]):
                closing = closing[size:]
                break
        return self.encode_text(closing + rendered[len(closed) :])
