"""The raw baseline of the throughput benchmarks: one plain batched `model.generate` in which
sequence i produces exactly as many tokens as episode i generated (rollout_throughput.py,
population_batch.py)."""

from __future__ import annotations

import time
from typing import Any

import torch


class _ExactLengths:
    """Logits processor: row i ends with eos at exactly its `lengths[i]`-th new token."""

    def __init__(self, lengths: list[int], prompt_width: int, eos: int) -> None:
        self.lengths = torch.tensor(lengths)
        self.width = prompt_width
        self.eos = eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width  # new tokens so far
        scores = scores.clone()
        early = step < self.lengths - 1
        scores[early, self.eos] = float("-inf")
        last = step == self.lengths - 1
        scores[last] = float("-inf")
        scores[last, self.eos] = 0.0
        return scores


def measure_generate(
    policy: Any,
    prompts: list[list[int]],
    lengths: list[int],
    seed: int,
    cache_implementation: str | None = None,
) -> tuple[float, int]:
    """One plain batched `model.generate` over `prompts`, row i producing exactly
    `lengths[i]` tokens (finished rows are padded until the longest ends, as `generate`
    does), with transformers' default KV cache or `cache_implementation` ("static").
    Returns (seconds, tokens generated)."""
    from transformers import GenerationConfig, LogitsProcessorList

    if min(lengths) < 1:
        raise ValueError(f"every sequence needs at least one token, got lengths {lengths}")
    tok = policy.tokenizer
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=max(lengths), do_sample=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        cache_implementation=cache_implementation,
    )  # fmt: skip
    processors = LogitsProcessorList([_ExactLengths(lengths, width, tok.eos_token_id)])
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config,
            logits_processor=processors,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    ends = [(row == tok.eos_token_id).nonzero()[0].item() + 1 for row in out[:, width:]]
    if ends != lengths:
        raise RuntimeError(f"generate produced {ends} tokens, expected {lengths}")
    return seconds, sum(lengths)
