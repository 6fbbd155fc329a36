"""The vLLM KV space copes asks for on a CPU: from the model, the batch and the context."""

import pytest
from transformers import AutoConfig

from copes.agents.models import resolve_model_path
from copes.agents.vllm.kv_space import ROW_TOKENS, cpu_kv_cache_bytes, kv_bytes_per_token


def test_a_token_of_smollm2_takes_23_kb_and_64_rows_fit_in_well_under_a_gib():
    config = AutoConfig.from_pretrained(resolve_model_path("smollm2-135m"))
    # 30 layers x 3 KV heads x head dim 64 (576 / 9 heads), K and V, bf16
    assert (config.num_hidden_layers, config.num_key_value_heads) == (30, 3)
    per_token = kv_bytes_per_token(config, 2)
    assert per_token == 2 * 30 * 3 * (576 // 9) * 2 == 23_040
    space = cpu_kv_cache_bytes(per_token, config.max_position_embeddings, rows=64)
    assert space == per_token * 64 * ROW_TOKENS  # the batch's rows, above one 8k context
    assert space < 0.75 * 2**30  # vLLM's default took 0.85 of the host's RAM (21 GB of 24)


def test_one_whole_context_always_fits_and_bad_sizes_are_refused(tiny_agent_dir):
    config = AutoConfig.from_pretrained(tiny_agent_dir)
    per_token = kv_bytes_per_token(config, 4)
    heads = config.num_attention_heads
    assert (
        per_token
        == 2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * (config.hidden_size // heads)
        * 4
    )
    # one whole context, with an eighth more for vLLM's block layout
    assert cpu_kv_cache_bytes(per_token, 100_000, rows=1) == per_token * 112_500
    with pytest.raises(ValueError, match="must be >= 1"):
        cpu_kv_cache_bytes(per_token, 1024, rows=0)
