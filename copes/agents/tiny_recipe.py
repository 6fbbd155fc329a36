"""The tiny agent's recipe: every step that makes the embedded default agent from nothing.

1. a scripted expert (`copes.agents.scripted`) acts in the real synthetic ToolMath and ToolQA
   environments (real sandboxed Python, real BM25 search), making deliberate mistakes in a
   fraction of episodes;
2. a byte-level BPE tokenizer (Qwen2's pre-tokenizer, so digits one per token; tool tags as
   single tokens; a ChatML chat template) is trained on those transcripts and the task text;
3. a Qwen2-architecture causal LM is initialised from a config, first taught to copy (random
   token stretches repeated after a random gap: this forms the induction heads every tool
   call needs), then fine-tuned on the expert's turns for a fixed, short budget, so it knows the
   format but is far from perfect.

`copes.agents.tiny` runs it into a folder, caches and checks it, and is its command line.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 5  # bump whenever the recipe changes: it renames the cache folder
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = [
    "<python>", "</python>", "<search>", "</search>", "<answer>", "</answer>",
    "<tool_call>", "</tool_call>",
]  # fmt: skip

# ChatML, as Qwen uses it; tool schemas (for the hermes format) go in a system message.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyAgentConfig:
    """Everything that determines the tiny agent; its hash names the cache folder."""

    # The recipe's outcome is chaotic in float32 rounding: on one machine seeds 0, 1 and 2
    # gave greedy math/QA 0.28/0.00, 0.42/0.09 and 0.41/0.23 (docs/results.md). The shipped
    # agent is seed 2's, the first with a partial warm start on both kinds.
    seed: int = 2
    vocab_size: int = 1024
    # Two layers of two 64-wide heads: the smallest shape that forms induction heads within
    # the build's budget (measured: 1.8M- and 2.1M-parameter shapes with 4 or 3 layers and
    # 48/64-wide heads did not within 800 copy steps; docs/results.md).
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_context: int = 1024
    math_transcripts: int = 1500
    qa_transcripts: int = 3000
    mistake_rate: float = 0.25
    # Pure copying before the SFT: random token stretches repeated after a gap (see
    # `induction_drills`). A model this small does not discover copying from the transcripts
    # within minutes, but forms induction heads on these drills in a few hundred steps of a
    # large enough batch (docs/results.md), and the SFT then uses them.
    copy_pretrain_steps: int = 800
    copy_batch_size: int = 32
    copy_learning_rate: float = 2e-3
    sft_steps: int = 2400
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    # Loss weight of the tokens the agent does not write (prompt, tool outputs). Zero: the
    # random numbers and names there are unpredictable, and their loss drowns the copying
    # signal (measured: copy accuracy 0.42 instead of 1.00 at weight 0.1).
    context_loss_weight: float = 0.0
    # Short copying drills from the same task distribution ("the numbers in this question,
    # in order"), mixed into the SFT data.
    copy_drills: int = 4000

    def fingerprint(self) -> str:
        import hashlib

        blob = json.dumps({**asdict(self), "format": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


# ---------------------------------------------------------------------- transcripts
def collect_transcripts(
    config: TinyAgentConfig, progress: bool = True
) -> list[list[dict[str, Any]]]:
    """Conversations of the scripted expert acting in the real synthetic environments."""
    from tqdm.auto import tqdm

    from copes.agents.scripted import ScriptedExpert
    from copes.envs.presets import tool_math_env, tool_qa_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    expert = ScriptedExpert(mistake_rate=config.mistake_rate, seed=config.seed)
    jobs = [
        (tool_math_env, synthetic_math_tasks("train", config.math_transcripts, seed=config.seed)),
        (tool_qa_env, synthetic_qa_tasks("train", config.qa_transcripts, seed=config.seed)),
    ]
    conversations = []
    bar = tqdm(
        total=sum(len(t) for _, t in jobs),
        desc="expert transcripts",
        disable=None if progress else True,
    )
    for make_env, tasks in jobs:
        env = make_env(tasks=tasks)
        try:
            for task in tasks:
                _, info = env.reset(options={"task": task})
                done = False
                while not done:
                    turn = expert.act(task, info["messages"])
                    _, _, terminated, truncated, info = env.step(turn)
                    done = terminated or truncated
                conversations.append(info["messages"])
                bar.update()
        finally:
            env.close()
    bar.close()
    random.Random(config.seed).shuffle(conversations)
    return conversations


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Byte-level BPE with exactly Qwen2's normalizer and pre-tokenizer, ChatML specials and
    the tool tags as single tokens.

    Qwen2's pipeline, not a variant: transformers (and so vLLM) load a `qwen2` model's
    tokenizer as `Qwen2Tokenizer`, which rebuilds that pipeline around the saved vocabulary
    and merges, so any other pre-tokenizer would tokenize differently after loading.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(TAG_TOKENS)  # ordinary tokens: they survive skip_special_tokens
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1 << 20
    return tokenizer


# ---------------------------------------------------------------------- copy drills
def induction_drills(tokenizer: Any, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` pure copying exercises: random tokens with a stretch of 10-30 of them repeated after
    a random gap; the repeat (after its first token) is the target.

    Each target is predictable only by finding the previous occurrence of the current token
    and copying its successor: the induction heads that copying numbers into a tool call, or
    a tool's output into an answer, needs. The random gap rules out fixed-offset shortcuts.
    """
    rng = random.Random(seed)
    low, high = len(SPECIAL_TOKENS), len(tokenizer) - len(TAG_TOKENS) - 1
    drills = []
    for _ in range(n):
        segment = [rng.randint(low, high) for _ in range(rng.randint(10, 30))]
        before = [rng.randint(low, high) for _ in range(rng.randint(0, 30))]
        gap = [rng.randint(low, high) for _ in range(rng.randint(0, 20))]
        head = [*before, *segment, *gap, segment[0]]
        drills.append(([*head, *segment[1:]], [0] * len(head) + [1] * (len(segment) - 1)))
    return drills


def copy_drills(tokenizer: Any, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` short exercises: a question (or passage) then its numbers (or names) in order.

    The target after the colon is what the agent must copy into its tool calls; only it is
    masked in (the rest is weighted like any context token).
    """
    import re

    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    rng = random.Random(seed)
    texts: list[tuple[str, str]] = []
    for task in synthetic_math_tasks("train", n // 2, seed=seed + 7):
        numbers = re.findall(r"\d+(?:/\d+)?", task.question)
        texts.append((f"{task.question}\nNumbers:", " " + " ".join(numbers)))
    name = re.compile(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*")
    for task in synthetic_qa_tasks("train", n - n // 2, seed=seed + 7):
        passage = rng.choice(task.passages)
        source = rng.choice([task.question, passage.text])
        names = [m for m in name.findall(source) if m not in ("In", "Who", "What", "The", "Its")]
        texts.append((f"{source}\nNames:", " " + ", ".join(names)))
    drills = []
    for prompt, target in texts:
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tail = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        drills.append((head + tail, [0] * len(head) + [1] * len(tail)))
    return drills


# ---------------------------------------------------------------------- model
def model_config(
    config: TinyAgentConfig | None = None,
    vocab_size: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """The agent's transformers config. Without a tokenizer's figures (`copes-train --dry-run`,
    which must not build anything) the vocabulary is what the tokenizer training gives: the
    BPE vocabulary plus the tool tags."""
    from transformers import Qwen2Config

    config = config or TinyAgentConfig()
    return Qwen2Config(
        vocab_size=vocab_size or config.vocab_size + len(TAG_TOKENS),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_context,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_model(tokenizer: Any, config: TinyAgentConfig) -> Any:
    from transformers import GenerationConfig, Qwen2ForCausalLM

    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(
        model_config(config, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    )
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def encode_transcript(chat: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask of the assistant's tokens (its targets).

    Built exactly as a rollout builds its sequence (`ChatFormat`), so training and sampling
    see the same tokens; each assistant turn's end-of-turn token is a target too.
    """
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = chat.encode_prompt(messages[:first])
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        turn = [*chat.encode_text(messages[i]["content"]), chat.tokenizer.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            following = chat.encode_continuation(messages[:j], turn)
            ids += following
            mask += [0] * len(following)
        i = j
    return ids, mask


def _length_grouped_batches(
    examples: Sequence[tuple[list[int], list[int]]], batch_size: int, rng: random.Random
) -> list[list[int]]:
    """One epoch of batches, each of similar lengths (little padding), in random order."""
    order = rng.sample(range(len(examples)), len(examples))
    window = batch_size * 16
    batches = []
    for start in range(0, len(order), window):
        group = sorted(order[start : start + window], key=lambda i: len(examples[i][0]))
        batches += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    batches = [b for b in batches if len(b) == batch_size] or batches
    rng.shuffle(batches)
    return batches


@dataclass(frozen=True)
class TrainPhase:
    """One supervised phase of the build: how long, how large, how fast."""

    description: str
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    context_loss_weight: float
    decay: bool = True  # cosine to 10% of the rate; off keeps the rate constant after warmup


def supervised_finetune(
    model: Any,
    examples: Sequence[tuple[list[int], list[int]]],
    phase: TrainPhase,
    pad_id: int,
    seed: int = 0,
    max_context: int = 1024,
    progress: bool = True,
) -> list[float]:
    """Train on the masked-in tokens of `examples` for `phase.steps`; returns the losses."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=phase.learning_rate, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < phase.warmup_steps:
            return (step + 1) / phase.warmup_steps
        if not phase.decay:
            return 1.0
        progress_ = (step - phase.warmup_steps) / max(1, phase.steps - phase.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(progress_ * math.pi))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses = []
    batches: list[list[int]] = []
    bar = tqdm(range(phase.steps), desc=phase.description, disable=None if progress else True)
    for _ in bar:
        if not batches:
            batches = _length_grouped_batches(examples, phase.batch_size, rng)
        batch = [examples[i] for i in batches.pop()]
        width = min(max(len(ids) for ids, _ in batch), max_context)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        weights = torch.zeros((len(batch), width))
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            ids, mask = ids[:width], mask[:width]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            is_turn = torch.tensor(mask, dtype=torch.float32)
            weights[row, : len(ids)] = is_turn + phase.context_loss_weight * (1 - is_turn)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
        ).view(len(batch), -1)
        w = weights[:, 1:]
        loss = (token_loss * w).sum() / w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


# ---------------------------------------------------------------------- evaluation
def validation_accuracy(
    policy: Any, kind: str, n: int = 64, seed: int = 0, temperature: float = 0.0
) -> float:
    """Fraction of synthetic validation tasks answered correctly (greedy by default)."""
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.envs.presets import tool_math_env, tool_qa_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    if kind == "math":
        tasks, make_env = synthetic_math_tasks("validation", n, seed=seed), tool_math_env
    else:
        tasks, make_env = synthetic_qa_tasks("validation", n, seed=seed), tool_qa_env
    envs = [make_env(tasks=[t]) for t in tasks]
    try:
        sampling = SamplingConfig(max_new_tokens=96, temperature=temperature, seed=seed)
        trajectories = rollout(policy, envs, sampling)
    finally:
        for env in envs:
            env.close()
    return sum(t.correct for t in trajectories) / len(trajectories)
