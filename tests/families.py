"""Tiny random models of real model families, built offline for the tests.

Each family's model is a few-thousand-parameter instance of its real transformers
architecture (qwen2, qwen3, qwen3_5 hybrid linear/full attention, qwen3_moe, llama, gemma3,
mistral, gpt_oss, phi3, granite, glm4_moe; R1-Distill is qwen2 with its own template),
with the family's real chat template (tests/fixtures/chat_templates/, sources in
SOURCES.md there) and special tokens, and a byte-level BPE tokenizer trained here. It is then
taught one scripted episode per call format by heart: a tool call in the family's native
format (with a reasoning block for the thinking families), an invalid turn, an answer. Greedy
rollouts of the trained model must reproduce that episode token for token: the real env
parses the call and runs the real Python sandbox, so every part of a multi-turn rollout
(template bridging, native parsing, reasoning, end-of-turn handling) is exercised on each
family with a real model.

The episode is the stream `rollout` would build for those turns (`ChatFormat` bridging),
so training and sampling see the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QUESTION = "What is 12 * 34? Use the python tool."
ANSWER = "408"
RECIPE_VERSION = 5

QWEN_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
# Qwen2.5 adds only the tool-call tags; Qwen3 and Qwen3.5 also the tool-response and think tags.
QWEN25_ADDED = ["<tool_call>", "</tool_call>"]
QWEN_ADDED = [*QWEN25_ADDED, "<tool_response>", "</tool_response>"]
THINK = ["<think>", "</think>"]
LLAMA_SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
]  # fmt: skip
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# The seven families of issue 27 (templates in tests/fixtures/chat_templates, SOURCES.md there):
# special tokens as listed for their tiny models in ../shared/chat-templates/README.md.
MISTRAL_SPECIAL = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
]  # fmt: skip
HARMONY_SPECIAL = [
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
    "<|start|>", "<|end|>", "<|message|>", "<|call|>",
]  # fmt: skip
PHI4_SPECIAL = [
    "<|endoftext|>", "<|system|>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>",
    "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>",
]  # fmt: skip
GRANITE_SPECIAL = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]
GLM_SPECIAL = [
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>",
]  # fmt: skip
GLM_ADDED = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
]  # fmt: skip
R1_SPECIAL = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>", "<｜tool▁sep｜>",
]  # fmt: skip


@dataclass(frozen=True)
class Family:
    """What makes a tiny model of one family (the real family's template and tokens)."""

    name: str
    model_type: str
    template: str  # file in TEMPLATES
    special: list[str]  # special tokens (skipped when decoding with skip_special_tokens)
    added: list[str]  # ordinary added tokens (kept in decoded text)
    eos: str
    generation_eos: list[str]  # generation_config.json eos_token_id, as tokens
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    tokenizer_class: str = "PreTrainedTokenizerFast"
    native: str | None = None  # the call format its template teaches (None: none)
    thinking: bool = False  # writes <think> blocks
    harmony: bool = False  # writes harmony messages (gpt-oss): analysis, then final or a call
    dated: bool = False  # the template writes today's date (strftime_now): rebuilt daily
    config: dict[str, Any] = field(default_factory=dict)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def call_formats(self) -> tuple[str, str]:
        """The two call formats its tests run: tags, and its native one (else hermes)."""
        return ("tags", self.native or "hermes")

    @property
    def cli_call_format(self) -> str:
        """What its CLI tests pass: ``native`` where the template teaches a format copes
        reads (resolved by round trip), else hermes (the refusal is tested apart)."""
        return "native" if self.native else "hermes"


_SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
)  # fmt: skip


def _qwen(name: str, model_type: str, template: str, native: str, **fields: Any) -> Family:
    """A Qwen family: ChatML specials, <|im_end|> ends a turn, Qwen2's tokenizer class."""
    added = QWEN25_ADDED if name == "qwen2" else QWEN_ADDED + THINK
    eos = ["<|im_end|>", "<|endoftext|>"]
    return Family(
        name, model_type, template, QWEN_SPECIAL, added, "<|im_end|>", eos, pad="<|endoftext|>",
        tokenizer_class="Qwen2Tokenizer", native=native, thinking=name != "qwen2", **fields,
    )  # fmt: skip


_TIED = {**_SMALL, "tie_word_embeddings": True}
_NO_HEAD_DIM = {k: v for k, v in _SMALL.items() if k != "head_dim"}  # phi3, granite derive it
_GLM_MOE = {
    "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}  # fmt: skip
_GPT_OSS = {
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"],
}  # fmt: skip
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
_HYBRID = {
    "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
}  # fmt: skip
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        _qwen("qwen2", "qwen2", "qwen2_5.jinja", "hermes", config=_TIED),
        _qwen("qwen3", "qwen3", "qwen3.jinja", "hermes", config=_TIED),
        _qwen("qwen3_moe", "qwen3_moe", "qwen3.jinja", "hermes", config={**_SMALL, **_MOE}),
        _qwen("qwen3_5", "qwen3_5_text", "qwen3_5.jinja", "qwen-xml", config={**_TIED, **_HYBRID}),
        Family(
            "llama", "llama", "llama3_2.jinja", LLAMA_SPECIAL, [], "<|eot_id|>",
            ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>",
            native="llama-json", config=_TIED,
            # The template writes today's date otherwise: fix it, so the episode is fixed.
            template_kwargs={"date_string": "26 Jul 2024"},
        ),
        Family(
            "gemma3", "gemma3_text", "gemma3.jinja", GEMMA_SPECIAL, [], "<end_of_turn>",
            ["<eos>", "<end_of_turn>"], bos="<bos>", pad="<pad>", unk="<unk>",
            config={
                **_SMALL, "sliding_window": 64, "query_pre_attn_scalar": 32,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
        Family(
            "llama3_1", "llama", "llama3_1.jinja", LLAMA_SPECIAL, [], "<|eot_id|>",
            ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>",
            native="llama-json", config=_TIED,
        ),
        Family(
            "mistral_nemo", "mistral", "mistral_nemo.jinja", MISTRAL_SPECIAL, [], "</s>",
            ["</s>"], bos="<s>", unk="<unk>", native="mistral",
            config={**_SMALL, "sliding_window": None},
        ),
        Family(
            "gpt_oss", "gpt_oss", "gptoss.jinja", HARMONY_SPECIAL, [], "<|return|>",
            ["<|return|>", "<|endoftext|>", "<|call|>"], bos="<|startoftext|>",
            pad="<|endoftext|>", native="harmony", harmony=True, dated=True,
            config={**_SMALL, **_GPT_OSS},
        ),
        Family(
            "phi4_mini", "phi3", "phi4_mini.jinja", PHI4_SPECIAL, [], "<|endoftext|>",
            ["<|end|>", "<|endoftext|>"], pad="<|endoftext|>", config=_NO_HEAD_DIM,
        ),
        Family(
            "granite3_3", "granite", "granite3_3.jinja", GRANITE_SPECIAL, [], "<|end_of_text|>",
            ["<|end_of_text|>"], bos="<|end_of_text|>", pad="<|end_of_text|>",
            unk="<|end_of_text|>", dated=True, config=_NO_HEAD_DIM,
        ),
        Family(
            "glm4_5", "glm4_moe", "glm4_5.jinja", GLM_SPECIAL, GLM_ADDED, "<|endoftext|>",
            ["<|endoftext|>", "<|user|>", "<|observation|>"], pad="<|endoftext|>",
            native="glm-xml", thinking=True, config={**_SMALL, **_GLM_MOE},
        ),
        Family(
            "r1_distill", "qwen2", "r1_distill_qwen.jinja", R1_SPECIAL, THINK,
            "<｜end▁of▁sentence｜>", ["<｜end▁of▁sentence｜>"], bos="<｜begin▁of▁sentence｜>",
            pad="<｜end▁of▁sentence｜>", thinking=True, config=_TIED,
        ),
    ]
}  # fmt: skip


# ---------------------------------------------------------------------- the scripted episode
def _tool_call(call_format: str) -> str:
    code = "print(12 * 34)"
    if call_format == "tags":
        return f"<python>{code}</python>"
    if call_format == "hermes":
        payload = json.dumps({"name": "python", "arguments": {"code": code}})
        return f"<tool_call>\n{payload}\n</tool_call>"
    if call_format == "qwen-xml":
        return (
            "<tool_call>\n<function=python>\n<parameter=code>\n"
            f"{code}\n</parameter>\n</function>\n</tool_call>"
        )
    if call_format == "llama-json":
        return json.dumps({"name": "python", "parameters": {"code": code}})
    if call_format == "glm-xml":
        return (
            "<tool_call>python\n<arg_key>code</arg_key>\n"
            f"<arg_value>{code}</arg_value>\n</tool_call>"
        )
    if call_format == "mistral":
        call = {"name": "python", "arguments": {"code": code}, "id": "a1b2c3d4e"}
        return f"[TOOL_CALLS][{json.dumps(call)}]"
    if call_format == "harmony":  # the message after the analysis one (see scripted_turns)
        arguments = json.dumps({"code": code})
        return f" to=functions.python<|channel|>commentary json<|message|>{arguments}<|call|>"
    raise ValueError(call_format)


def _stops_in(call_format: str) -> tuple[str, ...]:
    """Where a harmony turn stops without its closing: a stop string of the tags format, or
    the <|call|> that ends a native call."""
    return ("</python>", "</answer>", "<|call|>") if call_format == "tags" else ("<|call|>",)


def scripted_turns(family: Family, call_format: str) -> list[str]:
    """What the assistant writes in its three turns (the template's pre-fill included)."""
    turns = [_tool_call(call_format), "I am not sure yet.", f"<answer>{ANSWER}</answer>"]
    thoughts = ["Multiply with the tool.", "Check the output first.", "The tool printed it."]
    if family.harmony:  # an analysis message, then the call or the final message
        final = "<|channel|>final<|message|>"
        return [
            f"<|channel|>analysis<|message|>{t}<|end|><|start|>assistant"
            + (turn if turn.startswith(" to=") else f"{final}{turn}")
            + ("" if turn.endswith(_stops_in(call_format)) else "<|return|>")
            for t, turn in zip(thoughts, turns, strict=True)
        ]
    if not family.thinking:
        return turns
    return [f"<think>\n{t}\n</think>\n\n{turn}" for t, turn in zip(thoughts, turns, strict=True)]


def make_task() -> Any:
    from copes.envs.tasks.base import Task

    return Task(id="family-12x34", question=QUESTION, answers=(ANSWER,), kind="math")


def make_env(call_format: str) -> Any:
    from copes.envs.presets import tool_math_env

    return tool_math_env(
        tasks=[make_task()], max_turns=3, call_format=call_format, invalid_penalty=0.1
    )


def episode_stream(chat: Any, call_format: str, turns: list[str]) -> tuple[list[int], list[int]]:
    """(token ids, generated mask) of the episode `rollout` builds when the model writes
    `turns`: a turn that ends on a stop string (``</tool_call>``) stops there, any other
    ends with the model's end-of-turn token."""
    from copes.agents.rollout import stop_strings_for

    env = make_env(call_format)
    stops = stop_strings_for(env)
    eos = chat.tokenizer.convert_tokens_to_ids(chat.tokenizer.eos_token)
    try:
        _, info = env.reset(options={"task": make_task()})
        tools = info["tools"] if call_format != "tags" else None
        ids = chat.encode_prompt(info["messages"], tools)
        mask = [0] * len(ids)
        for turn in turns:
            prefill = chat.prefill_for(info["messages"])
            assert turn.startswith(prefill), (turn, prefill)
            sampled = chat.encode_text(turn[len(prefill) :])
            if not turn.endswith(stops) and sampled[-1] not in chat.end_of_turn_ids:
                sampled.append(eos)
            ids += sampled
            mask += [1] * len(sampled)
            _, _, terminated, truncated, info = env.step(turn)
            if terminated or truncated:
                break
            following = chat.encode_continuation(info["messages"], sampled, tools)
            ids += following
            mask += [0] * len(following)
        return ids, mask
    finally:
        env.close()


# ---------------------------------------------------------------------- building
def _train_tokenizer(family: Family, corpus: list[str]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=family.special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=family.eos,
        bos_token=family.bos,
        pad_token=family.pad,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    tokenizer.model_max_length = 1 << 20
    return tokenizer


def _build_model(family: Family, tokenizer: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    ids = tokenizer.convert_tokens_to_ids
    config = AutoConfig.for_model(
        family.model_type,
        vocab_size=len(tokenizer),
        bos_token_id=ids(family.bos) if family.bos else None,
        eos_token_id=ids(family.eos),
        pad_token_id=ids(family.pad) if family.pad else None,
        **family.config,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids(t) for t in family.generation_eos],
        bos_token_id=config.bos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model


def _fingerprint(family: Family) -> str:
    template = (TEMPLATES / family.template).read_bytes()
    recipe = {**asdict(family), "recipe": RECIPE_VERSION}
    if family.dated:  # its prompt holds today's date: a new day is a new episode
        import datetime

        recipe["date"] = datetime.date.today().isoformat()
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob + template).hexdigest()[:10]


def build_family(name: str, cache_dir: Path, *, max_steps: int = 1500) -> Path:
    """The folder of family `name`'s tiny trained model (built once into `cache_dir`)."""
    import fcntl

    family = FAMILIES[name]
    folder = Path(cache_dir) / f"family-{name}-{_fingerprint(family)}"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    # One builder at a time: CI runs the main and the vLLM suites side by side on one cache.
    with open(Path(cache_dir) / f".family-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "episodes.json").exists():
            # One torch thread, as copes.agents.tiny builds the tiny agent: these models are
            # too small for two to pay, and CI runs its two suites side by side on 2 cores,
            # where a second thread mostly waits (measured: 73 s of CPU for the thirteen
            # instead of 99 s, and no 10x stalls when the other suite holds a core).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                _build_family(family, folder, max_steps)
            finally:
                torch.set_num_threads(threads)
    return folder


def _build_family(family: Family, folder: Path, max_steps: int) -> None:
    from transformers import AutoTokenizer

    from copes.agents.chat import ChatFormat

    torch.manual_seed(0)
    corpus = [QUESTION, (TEMPLATES / family.template).read_text()]
    for call_format in family.call_formats:
        corpus += scripted_turns(family, call_format)
    scratch = folder.with_name(folder.name + ".tmp")
    _train_tokenizer(family, corpus * 4).save_pretrained(scratch)
    config_path = scratch / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = family.tokenizer_class
    tokenizer_config["unk_token"] = family.unk  # explicit, as the real configs (else a default)
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(scratch)  # train on what loading gives
    model = _build_model(family, tokenizer)
    eos_ids = set(model.generation_config.eos_token_id)
    chat = ChatFormat(tokenizer, end_of_turn_ids=eos_ids, template_kwargs=family.template_kwargs)
    episodes = {f: episode_stream(chat, f, scripted_turns(family, f)) for f in family.call_formats}
    loss = _memorize(model, list(episodes.values()), max_steps)
    model.save_pretrained(scratch)
    (scratch / "episodes.json").write_text(
        json.dumps({"final_loss": loss, "episodes": {f: ids for f, (ids, _) in episodes.items()}})
    )
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    scratch.rename(folder)


def _memorize(model: Any, examples: list[tuple[list[int], list[int]]], max_steps: int) -> float:
    """Train until every generated token of every episode is the argmax (or max_steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    width = max(len(ids) for ids, _ in examples)
    pad = 0
    input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        targets = torch.tensor(ids)
        labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, targets, -100)
    model.train()
    loss_value = float("inf")
    for step in range(max_steps):
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        loss_value = float(out.loss.detach())
        if step % 25 == 24:
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=attention).logits
            predicted = logits[:, :-1].argmax(-1)
            wanted = labels[:, 1:]
            if bool(((predicted == wanted) | (wanted == -100)).all()) and loss_value < 0.05:
                break
    model.eval()
    return loss_value
