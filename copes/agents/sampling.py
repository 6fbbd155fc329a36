"""Choosing the next token from logits, one random stream per sequence.

`sample_tokens` applies temperature, top-k and top-p the way transformers' logits warpers do
(in that order, with the same tie and keep-at-least-one rules), then samples by inverse CDF
with one uniform number per row. Each row's number comes from its own generator, so the
token a sequence draws depends on its own seed, how many tokens it drew before, and its
logits, never on which other sequences share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from copes.agents.policy import SamplingConfig


def stream(seed: int) -> torch.Generator:
    """A CPU random stream (uniforms are drawn on the CPU, one per row and token)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under the raw logits (temperature 1, no filtering), per row."""
    logits = logits.float()
    return logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=1)


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' warpers, same rules)."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, scores.shape[1])
        kth = torch.topk(scores, k, dim=1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=1)
        cumulative = ascending.softmax(dim=1).cumsum(dim=1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, streams: Sequence[torch.Generator]
) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``; greedy when temperature is 0."""
    if sampling.greedy:
        return logits.argmax(dim=1)
    probs = filtered_logits(logits, sampling).softmax(dim=1)
    uniform = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in streams])
    cdf = probs.double().cumsum(dim=1)
    target = (uniform.to(cdf.device) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[1] - 1)
    # Rounding can only ever land past the last token with mass: take the argmax there.
    valid = probs.gather(1, tokens) > 0
    return torch.where(valid, tokens, probs.argmax(dim=1, keepdim=True))[:, 0]
