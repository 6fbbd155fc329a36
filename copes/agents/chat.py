"""Conversations to token ids, through the tokenizer's own chat template.

A multi-turn rollout grows one token sequence: the prompt, then each generated turn exactly
as sampled, then the tokens that follow it (the closing the model did not write, the new
messages, the next assistant header), then the next turn. A sampled turn is never re-encoded
from its text (re-encoding can split the same text differently, and GRPO must train on the
ids that were sampled), and past turns are never re-rendered: templates that rewrite history
(Qwen3 adds an empty think block to the last assistant turn only; Qwen3.5 keeps reasoning only
after the last user query) therefore work, and reasoning stays in the stream.

What follows a turn is read off the template itself: the conversation is rendered with the
turn's content replaced by a placeholder, and everything after the placeholder is the
continuation. That is the template's text after an assistant turn, which for every template
we know does not depend on what the turn said. `ChatFormat` checks that once (the same text
follows a plain turn and one with a reasoning block) and refuses a template where it does
not hold. The result is token-identical to the `renderers` package's `bridge_to_next_turn`
(past reasoning kept) on the families it hand-codes (tests/agents/test_chat_families.py).

Templates differ in what they accept; `ChatFormat` finds out by trial renders, once:
- the role tool output may take (`tool`; else `ipython`; else `user`, e.g. Gemma 3),
- whether the template shows `tools=` at all (if not, the schemas go into the first user
  message as text, so a model is never asked to call tools it was not shown),
- the reasoning markers (`<think>` ... `</think>`) when the template has a think block, and
  what the generation prompt pre-fills after the assistant header (e.g. Qwen3.5 opens
  `<think>\\n` itself; Qwen3 with thinking off writes an empty think block).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from copes.envs.parsing import CALL_FORMATS, REASONING_MARKERS, split_reasoning

# Unlikely to occur in real text, and without characters a template might strip or escape.
_PLACEHOLDER = "COPESPLACEHOLDERTURN"
_PROBE_QUESTION = "COPESPROBEQUESTION"
_PROBE_OUTPUT = "COPESPROBETOOLOUTPUT"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "copes_probe_tool",
        "description": "COPESPROBEDESCRIPTION",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for incremental multi-turn encoding."""


class ChatFormat:
    """Renders conversations with a Hugging Face tokenizer's chat template and extends an
    episode's token sequence turn by turn.

    Args:
        tokenizer: a tokenizer with a chat template.
        end_of_turn_ids: the ids that end a sampled turn (the model's eos ids); when a turn
            ends with one, the template's own closing token is not added again.
        template_kwargs: extra variables for the template, e.g. ``{"enable_thinking": False}``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        end_of_turn_ids: Iterable[int] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                "template; use an instruct/chat model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        ends = set(end_of_turn_ids) | {tokenizer.eos_token_id}
        self.end_of_turn_ids = frozenset(i for i in ends if i is not None)
        self.tool_role = self._find_tool_role()
        self.shows_tools = self._shows_tools()
        self.reasoning = all(marker in self.template_text for marker in REASONING_MARKERS)
        self.prefill = self._find_prefill()
        self._check_closing_is_independent()

    # ------------------------------------------------------------------ rendering
    @property
    def template_text(self) -> str:
        """The Jinja source of the chat template (all named templates, joined)."""
        template = self.tokenizer.chat_template
        return "\n".join(template.values()) if isinstance(template, dict) else str(template)

    def _apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        kwargs: dict[str, Any] = {
            "tokenize": False,
            "add_generation_prompt": add_generation_prompt,
            **self.template_kwargs,
        }
        if tools:
            kwargs["tools"] = list(tools)
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)

    def adapt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The conversation as this template accepts it: tool output in the role it takes,
        and the tool schemas in the first user message when the template cannot show them."""
        adapted = []
        for message in messages:
            message = dict(message)
            if message.get("role") == "tool" and self.tool_role != "tool":
                message = {"role": self.tool_role, "content": message.get("content", "")}
            adapted.append(message)
        if tools and not self.shows_tools:
            first = next((i for i, m in enumerate(adapted) if m.get("role") == "user"), None)
            if first is not None:
                listing = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
                text = f"Tools (JSON schema):\n{listing}\n\n{adapted[first].get('content', '')}"
                adapted[first] = {**adapted[first], "content": text}
        return adapted

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        shown = tools if self.shows_tools else None
        return self._apply(self.adapt(messages, tools), shown, add_generation_prompt)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of template text (special tokens written in it are recognised)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Ids of the conversation so far, ending where the assistant starts to write."""
        return self.encode_text(self.render(messages, tools, add_generation_prompt=True))

    # ------------------------------------------------------------------ continuation
    def turn_text(self, turn_ids: Sequence[int]) -> str:
        """What the assistant wrote in a turn: the template's pre-fill (e.g. ``<think>\\n``),
        then the sampled ids decoded (special tokens dropped, as in `Generation.text`)."""
        return self.prefill + self.tokenizer.decode(list(turn_ids), skip_special_tokens=True)

    def encode_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        turn_ids: Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Ids that follow a sampled assistant turn: its closing, the messages after it,
        and the next assistant header (with the template's pre-fill).

        Args:
            messages: the whole conversation: ending in the assistant turn that was
                sampled and the messages that followed it (tool output, feedback).
            turn_ids: the ids sampled for that turn.
            tools: the tool schemas the prompt was rendered with.

        A turn that ended with an end-of-turn id keeps it, and the template's closing token
        is not added again; a turn cut off (length, or a stop string such as
        ``</tool_call>``) gets the template's closing. A turn cut off inside its reasoning
        gets the closing marker ``</think>`` first, so the next turn starts outside it.
        """
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        new = list(messages[last + 1 :])
        if last < 0 or not new:
            raise ValueError("messages must end in an assistant turn and what followed it")
        history = [*messages[:last], {"role": "assistant", "content": _PLACEHOLDER}]
        after = self._after_placeholder([*history, *new], tools)
        ids: list[int] = []
        ended = bool(turn_ids) and turn_ids[-1] in self.end_of_turn_ids
        if self.reasoning and not ended and split_reasoning(self.turn_text(turn_ids))[2]:
            ids += self.encode_text(REASONING_MARKERS[1])
        following = self.encode_text(after)
        if ended and following and following[0] in self.end_of_turn_ids:
            following = following[1:]  # the model closed its turn itself
        return ids + following

    def _after_placeholder(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> str:
        rendered = self.render(messages, tools, add_generation_prompt=True)
        cut = rendered.rfind(_PLACEHOLDER)
        if cut < 0:
            raise ChatTemplateError("the chat template drops the content of assistant turns")
        return rendered[cut + len(_PLACEHOLDER) :]

    # ------------------------------------------------------------------ what the template takes
    def _renders(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str | None:
        try:
            return self._apply(messages, tools, add_generation_prompt=True)
        except Exception:  # jinja's TemplateError, or a template's raise_exception
            return None

    def _find_tool_role(self) -> str:
        """The first role whose message the template renders with its content."""
        base = [
            {"role": "user", "content": _PROBE_QUESTION},
            {"role": "assistant", "content": _PLACEHOLDER},
        ]
        for role in ("tool", "ipython", "user"):
            message = {"role": role, "content": _PROBE_OUTPUT}
            if role == "tool":
                message["name"] = "copes_probe_tool"
            text = self._renders([*base, message])
            if text is not None and _PROBE_OUTPUT in text:
                return role
        raise ChatTemplateError(
            "the chat template renders no message after an assistant turn (tried the roles "
            "tool, ipython and user), so a multi-turn episode cannot continue"
        )

    def _shows_tools(self) -> bool:
        probe = [{"role": "user", "content": _PROBE_QUESTION}]
        text = self._renders(probe, [_PROBE_TOOL])
        return text is not None and "copes_probe_tool" in text

    def _find_prefill(self) -> str:
        """What the generation prompt writes after the assistant header, from the reasoning
        opener on (`<think>\\n`, or an empty think block with thinking off); '' otherwise."""
        probe = [{"role": "user", "content": _PROBE_QUESTION}]
        opened = self._apply(probe, None, add_generation_prompt=True)
        closed = self._apply(probe, None, add_generation_prompt=False)
        header = opened[len(closed) :] if opened.startswith(closed) else ""
        start = header.find(REASONING_MARKERS[0]) if self.reasoning else -1
        return header[start:] if start >= 0 else ""

    def _check_closing_is_independent(self) -> None:
        """The text after a turn must not depend on the turn (else the bridge would be
        wrong for some turns): compare a plain turn with ones that carry reasoning."""
        question = {"role": "user", "content": _PROBE_QUESTION}
        follow = {"role": self.tool_role, "content": _PROBE_OUTPUT}
        if self.tool_role == "tool":
            follow["name"] = "copes_probe_tool"
        variants = [
            {"role": "assistant", "content": _PLACEHOLDER},
            {"role": "assistant", "content": f"<think>\nCOPESPROBE\n</think>\n\n{_PLACEHOLDER}"},
            {"role": "assistant", "content": _PLACEHOLDER, "reasoning_content": "COPESPROBE"},
        ]
        afters = set()
        for turn in variants:
            text = self._renders([question, turn, follow])
            if text is None or _PLACEHOLDER not in text:
                raise ChatTemplateError("the chat template drops the content of assistant turns")
            afters.add(text[text.rfind(_PLACEHOLDER) + len(_PLACEHOLDER) :])
        if len(afters) != 1:
            raise ChatTemplateError(
                "the text this chat template writes after an assistant turn depends on what "
                "the turn said, so the token sequence of a multi-turn episode cannot be "
                "extended without re-rendering sampled turns; use another template"
            )

    def native_call_format(self) -> str:
        """The tool-call format this template teaches the model (copes.envs.parsing):
        ``qwen-xml`` (Qwen3.5 / Qwen3-Coder ``<function=..><parameter=..>``), ``hermes``
        (Qwen2.5 / Qwen3 JSON in ``<tool_call>``) or ``llama-json`` (Llama 3.1+:
        ``{"name": .., "parameters": ..}``). Raises when the template teaches none."""
        template = self.template_text
        if "<function=" in template and "<parameter=" in template:
            return "qwen-xml"
        if "<tool_call>" in template:
            return "hermes"
        if '"parameters"' in template and ("ipython" in template or "python_tag" in template):
            return "llama-json"
        raise ChatTemplateError(
            f"the chat template of {getattr(self.tokenizer, 'name_or_path', 'this model')!r} "
            "teaches no tool-call format (no <tool_call>, <function=...> or Llama-3 JSON "
            "calls), so --call-format native has nothing to use; choose tags or hermes"
        )


def resolve_call_format(requested: str, chat: ChatFormat | None) -> str:
    """The env call format for a run: ``native`` becomes the model's own (its template's);
    any other name is taken as given (`copes.envs.parsing.CALL_FORMATS`)."""
    if requested == "native":
        if chat is None:
            raise ValueError("--call-format native needs a model with a chat template")
        return chat.native_call_format()
    if requested not in CALL_FORMATS:
        raise ValueError(
            f"unknown call format {requested!r}; choose native or one of {CALL_FORMATS}"
        )
    return requested


def template_kwargs_for(
    enable_thinking: bool | None, extra_json: str | None = None
) -> dict[str, Any] | None:
    """Chat-template kwargs of a run: `--chat-template-kwargs` (a JSON object, e.g.
    ``{"date_string": "26 Jul 2024"}``) and `--enable-thinking` (None: the template's
    default). Raises ValueError with the fix for text that is not a JSON object."""
    kwargs: dict[str, Any] = {}
    if extra_json:
        try:
            kwargs = json.loads(extra_json)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--chat-template-kwargs is not JSON ({exc.msg}): {extra_json!r}"
            ) from None
        if not isinstance(kwargs, dict):
            raise ValueError(
                "--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'"
            )
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return kwargs or None
