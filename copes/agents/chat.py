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

from copes.envs.parsing import (
    CALL_FORMATS,
    HARMONY_CLOSINGS,
    REASONING_MARKERS,
    STRUCTURAL_TOKENS,
    TurnParser,
    split_reasoning,
)
from copes.envs.tools.base import FunctionTool
from copes.errors import json_object_flag

# Unlikely to occur in real text, and without characters a template might strip or escape.
_PLACEHOLDER = "COPESPLACEHOLDERTURN"
_PROBE_QUESTION = "COPESPROBEQUESTION"
_PROBE_OUTPUT = "COPESPROBETOOLOUTPUT"
_PROBE_REASONING = "COPESPROBEREASONING"
_PROBE_ID = "copes0001"  # 9 alphanumeric characters: Mistral's templates refuse other ids
_PROBE_ARGUMENTS = {"code": "print(6 * 7)"}
_PROBE_PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "COPESPROBEARGUMENT"}},
    "required": ["code"],
}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "copes_probe_tool",
        "description": "COPESPROBEDESCRIPTION",
        "parameters": _PROBE_PARAMETERS,
    },
}
_PROBE_CALL = {
    "id": _PROBE_ID,
    "type": "function",
    "function": {"name": "copes_probe_tool", "arguments": _PROBE_ARGUMENTS},
}
_QUESTION = {"role": "user", "content": _PROBE_QUESTION}
_TOOL_OUTPUT = {
    "role": "tool", "name": "copes_probe_tool", "tool_call_id": _PROBE_ID, "content": _PROBE_OUTPUT,
}  # fmt: skip
_CALLED = "copes_placeholder_called"  # marks a placeholder turn that made a call
_HARMONY_CALL_END = HARMONY_CLOSINGS[1]  # <|call|>: a harmony tool call's last token


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
        specials = {
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special
        }  # fmt: skip
        vocab = tokenizer.get_vocab()
        # Special tokens a call format reads (harmony's framing, Mistral's [TOOL_CALLS]) stay
        # in a turn's text; the others are dropped from it as `skip_special_tokens` does.
        self._kept_ids = frozenset(vocab[t] for t in STRUCTURAL_TOKENS if vocab.get(t) in specials)
        self._dropped_ids = frozenset(specials - self._kept_ids)
        # A model that closes its turn itself (<|return|>, <|call|>) replaces the closing the
        # template writes after a past turn (harmony's <|end|>), which is not added again.
        closings = {vocab.get(t) for t in HARMONY_CLOSINGS} & specials
        self._closing_ids = self.end_of_turn_ids | closings
        self.tool_role, self._tool_needs_call, self._tool_needs_id = self._find_tool_role()
        self._bridge_with_call = self._bridges_through_call()
        self.shows_tools = self._shows_tools()
        self.prefills = self._find_prefills()
        self.prefill = self.prefills["first"]  # after the task's question
        self.reasoning = self._renders_reasoning()
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
        called = False  # the last assistant turn made a structured call
        for index, message in enumerate(messages):
            message = dict(message)
            role = message.get("role")
            if role == "assistant":  # (a placeholder standing for a call says so)
                called = bool(message.get("tool_calls") or message.pop(_CALLED, False))
            if role == "tool" and (
                self.tool_role != "tool" or (self._tool_needs_call and not called)
            ):  # e.g. gpt-oss renders tool output only after a structured call
                role = "user" if self.tool_role == "tool" else self.tool_role
                message = {"role": role, "content": message.get("content", "")}
            elif role == "tool" and self._tool_needs_id:
                given = str(message.get("tool_call_id", ""))
                if not (len(given) == 9 and given.isalnum()):
                    message["tool_call_id"] = f"call{index:05d}"
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
    def decode_turn(self, turn_ids: Sequence[int]) -> str:
        """The sampled ids as text: special tokens dropped (as `Generation.text`), except the
        ones a call format reads (harmony's framing, Mistral's ``[TOOL_CALLS]``)."""
        if not self._kept_ids:
            return self.tokenizer.decode(list(turn_ids), skip_special_tokens=True)
        kept = [i for i in turn_ids if i not in self._dropped_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def prefill_for(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """What the template pre-fills for the turn that follows `messages`: after the
        question, after a tool's output and after feedback can differ (R1 distills open
        ``<think>\\n`` after a user turn, nothing after a tool output)."""
        last = messages[-1].get("role") if messages else "user"
        if last == "tool":
            return self.prefills["tool"]
        asked = any(m.get("role") == "assistant" for m in messages)
        return self.prefills["feedback" if asked else "first"]

    def turn_text(self, turn_ids: Sequence[int], messages: Sequence[Mapping[str, Any]] = ()) -> str:
        """What the assistant wrote in the turn after `messages` (the conversation before
        it): the template's pre-fill there (e.g. ``<think>\\n``), then the sampled ids."""
        return self.prefill_for(messages) + self.decode_turn(turn_ids)

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
        turn: dict[str, Any] = {"role": "assistant", "content": _PLACEHOLDER}
        calls = messages[last].get("tool_calls")
        if self._bridge_with_call and calls:  # its tool output renders only after the call
            turn["tool_calls"] = calls
        elif calls:
            turn[_CALLED] = True  # its tool output keeps the tool role (`adapt`)
        after = self._after_placeholder([*messages[:last], turn, *new], tools)
        ids: list[int] = []
        ended = bool(turn_ids) and turn_ids[-1] in self.end_of_turn_ids
        if "tool_calls" in turn:
            # Harmony writes the call after the placeholder and closes it with <|call|>: the
            # sampled turn is that call, so what follows starts after its closing (kept when
            # the model did not write it).
            cut = after.find(_HARMONY_CALL_END)
            if cut < 0:
                raise ChatTemplateError("the chat template does not close a tool call")
            after = after[cut + (len(_HARMONY_CALL_END) if ended else 0) :]
            return self.encode_text(after)
        turn_text = self.turn_text(turn_ids, messages[:last])
        if self.reasoning and not ended and split_reasoning(turn_text)[2]:
            ids += self.encode_text(REASONING_MARKERS[1])
        following = self.encode_text(after)
        if ended and following and following[0] in self._closing_ids:
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

    def _find_tool_role(self) -> tuple[str, bool, bool]:
        """(role, needs a structured call, needs an id) of tool output: the first role whose
        message the template renders with its content, in a conversation that goes on after
        it (an answer, then feedback). A tool message carries a valid 9-character id
        (Mistral refuses others), and is tried after a plain turn, then after a structured
        call: gpt-oss renders tool output only after a call, and Mistral's role alternation
        counts a tool output after a plain turn as a second assistant turn."""
        plain = {"role": "assistant", "content": _PLACEHOLDER}
        call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
        after = [
            {"role": "assistant", "content": "COPESPROBEANSWER"},
            {"role": "user", "content": "COPESPROBEFEEDBACK"},
        ]
        for role in ("tool", "ipython", "user"):
            message = dict(_TOOL_OUTPUT) if role == "tool" else {"role": role}
            message["content"] = _PROBE_OUTPUT
            for turn in (plain, call) if role == "tool" else (plain,):
                text = self._renders([_QUESTION, turn, message, *after])
                if text is not None and _PROBE_OUTPUT in text:
                    anonymous = {k: v for k, v in message.items() if k != "tool_call_id"}
                    bare = self._renders([_QUESTION, turn, anonymous, *after])
                    needs_id = role == "tool" and (bare is None or _PROBE_OUTPUT not in bare)
                    return role, turn is call, needs_id
        raise ChatTemplateError(
            "the chat template renders no message after an assistant turn (tried the roles "
            "tool, ipython and user), so a multi-turn episode cannot continue"
        )

    def _bridges_through_call(self) -> bool:
        """Whether what follows a call turn renders only after the call itself (gpt-oss:
        a tool message needs the assistant's call before it), not after a plain turn."""
        if not self._tool_needs_call:
            return False
        text = self._renders(
            [_QUESTION, {"role": "assistant", "content": _PLACEHOLDER}, _TOOL_OUTPUT]
        )
        return text is None or _PROBE_OUTPUT not in text

    def _shows_tools(self) -> bool:
        text = self._renders([_QUESTION], [_PROBE_TOOL])
        return text is not None and "copes_probe_tool" in text

    def _find_prefills(self) -> dict[str, str]:
        """What the generation prompt writes after the assistant header, from the reasoning
        opener on (`<think>\\n`, or an empty think block with thinking off; '' otherwise),
        after the question, after a tool's output and after feedback."""
        plain = {"role": "assistant", "content": _PLACEHOLDER}
        called = {**plain, "tool_calls": [_PROBE_CALL]} if self._tool_needs_call else plain
        positions = {
            "first": [_QUESTION],
            "tool": [_QUESTION, called, _TOOL_OUTPUT],
            "feedback": [_QUESTION, plain, {"role": "user", "content": _PROBE_OUTPUT}],
        }
        prefills = {}
        for position, conversation in positions.items():
            try:
                opened = self.render(conversation, add_generation_prompt=True)
                closed = self.render(conversation, add_generation_prompt=False)
            except Exception:  # jinja's TemplateError, or a template's raise_exception
                opened = closed = ""
            header = opened[len(closed) :] if opened.startswith(closed) else ""
            start = header.find(REASONING_MARKERS[0])
            prefills[position] = header[start:] if start >= 0 else ""
        return prefills

    def _renders_reasoning(self) -> bool:
        """Whether the template writes reasoning blocks: it opens one in a generation prompt,
        or renders a turn's `reasoning_content` inside the markers (a template that merely
        mentions ``<think>`` in its system prompt, as Granite's does, is not one)."""
        if any(REASONING_MARKERS[0] in prefill for prefill in self.prefills.values()):
            return True
        turn = {"role": "assistant", "content": _PLACEHOLDER, "reasoning_content": _PROBE_REASONING}
        text = self._renders(self.adapt([_QUESTION, turn, _TOOL_OUTPUT]))
        opener, closer = REASONING_MARKERS
        if text is None or opener not in text:
            return False
        return _PROBE_REASONING in text.split(opener, 1)[1].split(closer, 1)[0]

    def _check_closing_is_independent(self) -> None:
        """The text after a turn must not depend on the turn (else the bridge would be
        wrong for some turns): compare a plain turn with ones that carry reasoning."""
        variants = [
            {"role": "assistant", "content": _PLACEHOLDER},
            {"role": "assistant", "content": f"<think>\nCOPESPROBE\n</think>\n\n{_PLACEHOLDER}"},
            {"role": "assistant", "content": _PLACEHOLDER, "reasoning_content": "COPESPROBE"},
        ]
        afters = set()
        for turn in variants:
            text = self._renders(self.adapt([_QUESTION, turn, _TOOL_OUTPUT]))
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
        """The tool-call format this template teaches the model (copes.envs.parsing), found
        by round trip: a structured call is rendered with the template, decoded as a
        sampled turn would be, and parsed with each known format; the format that gives the
        same call back is the template's. Never read from a substring of the template (GLM's
        ``<tool_call>`` is not hermes). Raises when no format round-trips."""
        formats = self.round_trip_formats()
        if formats:
            return formats[0]
        raise ChatTemplateError(
            f"the chat template of {getattr(self.tokenizer, 'name_or_path', 'this model')!r} "
            "renders tool calls in no format copes parses (a rendered call parses back with "
            f"none of {', '.join(CALL_FORMATS[1:])}), so --call-format native has nothing to "
            "use; use --call-format tags"
        )

    def round_trip_formats(self) -> list[str]:
        """The call formats that parse a structured call back from this template's rendering
        of it (see `native_call_format`), in `CALL_FORMATS` order."""
        probe = FunctionTool(str, "copes_probe_tool", "probe", _PROBE_PARAMETERS)
        # The turn starts where the generation prompt's pre-fill starts (it is the turn's).
        prompt = self._renders([_QUESTION], [_PROBE_TOOL]) or ""
        prefill = self.prefills["first"]
        prefix = prompt[: len(prompt) - len(prefill)] if prompt.endswith(prefill) else prompt
        formats = []
        for turn_text in self._rendered_calls(prefix):
            content = split_reasoning(self.decode_turn(self.encode_text(turn_text)))[1]
            for call_format in CALL_FORMATS[1:]:
                parsed = TurnParser({probe.name: probe}, call_format).parse(content)
                same = (parsed.tool_name, parsed.arguments) == (probe.name, _PROBE_ARGUMENTS)
                if parsed.kind == "tool_call" and same and call_format not in formats:
                    formats.append(call_format)
        return [f for f in CALL_FORMATS if f in formats]

    def _rendered_calls(self, prefix: str) -> list[str]:
        """The text of an assistant turn holding one structured call, as the template
        renders it after the question's generation prompt. Arguments are tried as a dict
        and as a JSON string, content as "" and None: templates differ in what they take."""
        texts = []
        for arguments in (_PROBE_ARGUMENTS, json.dumps(_PROBE_ARGUMENTS)):
            for content in ("", None):
                function = {"name": "copes_probe_tool", "arguments": arguments}
                turn = {"role": "assistant", "content": content,
                        "tool_calls": [{**_PROBE_CALL, "function": function}]}  # fmt: skip
                try:
                    text = self._apply([_QUESTION, turn], [_PROBE_TOOL], False)
                except Exception:  # jinja's TemplateError, or a template's raise_exception
                    continue
                if prefix and text.startswith(prefix):
                    texts.append(text[len(prefix) :])
        return texts


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
    kwargs = json_object_flag("--chat-template-kwargs", extra_json, '{"enable_thinking": false}')
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return kwargs or None
