"""The theoretical memory model: hand-computed values, shapes from real configs, the claim."""

from types import SimpleNamespace

import pytest
import torch
import transformers

from copes.optimizers.memory import (
    OPTIMIZERS,
    QWEN3_4B,
    MemoryEstimate,
    ModelShape,
    estimate_memory,
    kv_cache_bytes,
    layer_activation_bytes,
    lora_parameters,
    main,
    memory_table,
)

# h=8, i=16, 2 heads x 4 (q = 8), 1 KV head (kv = 4), 2 layers, vocab 32
SMALL = ModelShape(
    num_parameters=1000,
    num_layers=2,
    hidden_size=8,
    intermediate_size=16,
    num_attention_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=32,
    tie_word_embeddings=True,
)
S, B = 10, 3  # tokens T = 30


def test_kv_cache_is_two_x_layers_x_kv_heads_x_head_dim_x_tokens_x_bytes():
    assert kv_cache_bytes(SMALL, S, B) == 2 * 2 * 1 * 4 * 10 * 3 * 2 == 960
    assert kv_cache_bytes(SMALL, S, B, dtype_bytes=1) == 480


def test_layer_activations_by_hand():
    # 16-bit: 4h + 2q + 2kv + 4i = 32 + 16 + 8 + 64 = 120 elements; fp32: 2 norms + 2 heads
    per_token = 120 * 2 + 4 * 4
    assert layer_activation_bytes(SMALL, S, B) == 30 * per_token == 7680
    # eager attention stores the a x s probabilities: + 2 * 10 elements per token
    assert layer_activation_bytes(SMALL, S, B, flash=False) == 30 * (per_token + 20 * 2)


def test_layer_count_matches_what_autograd_saves_in_a_real_qwen3_layer():
    """Every tensor a transformers Qwen3 layer saves for backward (SDPA attention, eager
    RMSNorm), minus its weights and the RoPE tables shared by all layers."""
    config = _tiny(transformers.Qwen3Config, head_dim=16, attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    seq_len = 64
    x = torch.randn(1, seq_len, 32, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq_len)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_ids=positions, position_embeddings=(cos, sin))
    shape = ModelShape.from_config(config)
    assert sum(saved.values()) == layer_activation_bytes(shape, seq_len, 1, fused_rmsnorm=False)
    fused = layer_activation_bytes(shape, seq_len, 1)
    assert sum(saved.values()) - fused == seq_len * 4 * (2 * 32 + 4 * 16 + 2 * 16)


def test_grpo_by_hand_16_bytes_per_parameter():
    est = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B)
    states = est.weights + est.gradients + est.master_weights + est.optimizer_states
    assert states == 16 * SMALL.num_parameters
    assert (est.weights, est.gradients, est.master_weights, est.optimizer_states) == (
        2000,
        2000,
        4000,
        8000,
    )
    # checkpointing: 2 layer inputs (2 * 30 * 8 * 2) + one full layer + final norm / lm_head in
    assert est.activations == 960 + 7680 + 960
    assert est.logits == 30 * 32 * (4 + 4)
    assert est.kv_cache == 960 and est.reference_model == 0
    assert est.total == 16000 + 9600 + 7680 + 960
    assert est.as_dict()["total"] == est.total

    no_ckpt = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B, gradient_checkpointing=False)
    assert no_ckpt.activations == 2 * 7680 + 960
    with_ref = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B, kl_beta=0.04)
    assert with_ref.reference_model == 2000
    chunked = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B, logits_chunk_tokens=4)
    assert chunked.logits == 4 * 32 * 8
    apart = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B, colocated_rollout=False)
    assert apart.kv_cache == 0
    rollout = estimate_memory("grpo", SMALL, seq_len=S, batch_size=1, rollout_batch_size=B)
    assert rollout.kv_cache == 960


def test_es_and_copes_by_hand():
    es = estimate_memory("es", SMALL, seq_len=S, batch_size=B, chunk_size=64)
    assert es.weights == 2000 and es.kv_cache == 960
    assert es.gradients == es.optimizer_states == es.master_weights == 0
    assert es.activations == 30 * (2 * 8 + 3 * 16) * 2  # one prefill chunk, peak at the MLP
    assert es.logits == 3 * 32 * 4
    assert es.perturbation_workspace == 64 * 16
    assert es.host_master_weights == 4000  # fp32 master in CPU RAM, not in total
    assert es.total == 2000 + 960 + 3840 + 384 + 1024
    copes = estimate_memory("copes", SMALL, seq_len=S, batch_size=B, chunk_size=64)
    assert copes.total - es.total == 64 * 16  # only the permutation buffers differ
    on_gpu = estimate_memory("copes", SMALL, seq_len=S, batch_size=B, master_on_gpu=True)
    assert on_gpu.master_weights == 4000 and on_gpu.host_master_weights == 0
    assert "total (GPU)" in es.table()


def test_lora_grpo_by_hand():
    # r * (in + out): q 16, k 12, v 12, o 16, gate/up/down 24 each = 128 per layer
    assert lora_parameters(SMALL, rank=2) == 2 * 2 * 128
    est = estimate_memory("lora-grpo", SMALL, seq_len=S, batch_size=B, lora_rank=2)
    full = estimate_memory("grpo", SMALL, seq_len=S, batch_size=B)
    assert est.weights == (1000 + 512) * 2
    assert est.gradients + est.master_weights + est.optimizer_states == 14 * 512
    assert (est.activations, est.logits, est.kv_cache) == (
        full.activations,
        full.logits,
        full.kv_cache,
    )
    lora_ref = estimate_memory("lora-grpo", SMALL, seq_len=S, batch_size=B, kl_beta=0.1)
    assert lora_ref.reference_model == 0  # the reference is the base with the adapter off


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_memory_grows_with_context(optimizer):
    totals = [
        estimate_memory(optimizer, QWEN3_4B, seq_len=s).total for s in (1024, 8192, 32768, 131072)
    ]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)


def test_papers_claim_grpo_over_copes_above_8_at_128k_batch_1():
    (row,) = memory_table(QWEN3_4B, seq_lens=(131072,))
    assert row["grpo/copes"] > 8  # the model gives ~10.2 (see docs/memory.md)
    assert row["grpo/copes"] == row["grpo"] / row["copes"]
    assert set(OPTIMIZERS) <= set(row)


def test_table_generation_batch_reaches_es_and_grpo_rollouts_only():
    one, eight = (
        memory_table(QWEN3_4B, seq_lens=(8192,), generation_batch_size=g)[0] for g in (1, 8)
    )
    extra_kv = kv_cache_bytes(QWEN3_4B, 8192, 7)
    assert eight["grpo"] - one["grpo"] == extra_kv  # micro-batch unchanged, rollout KV grows
    assert eight["copes"] - one["copes"] > extra_kv  # ES also decodes 8 sequences


def test_qwen3_4b_preset_matches_its_config():
    config = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    assert ModelShape.from_config(config) == QWEN3_4B
    assert QWEN3_4B.num_parameters == 4_022_468_096  # 4.0B, 3.6B without embeddings


def _tiny(config_cls, **extra):
    return config_cls(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )


@pytest.mark.parametrize(
    ("config_cls", "extra"),
    [
        (transformers.Qwen2Config, {}),
        (transformers.Qwen2Config, {"tie_word_embeddings": True}),
        (transformers.Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),
        (transformers.LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    ],
)
def test_from_config_counts_the_parameters_of_the_built_model(config_cls, extra):
    config = _tiny(config_cls, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_model(model) == shape


def test_errors_are_specific():
    with pytest.raises(ValueError, match="unknown optimizer 'ppo'"):
        estimate_memory("ppo", SMALL, seq_len=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        estimate_memory("es", SMALL, seq_len=0)
    hybrid = SimpleNamespace(model_type="qwen3_5_text", layer_types=["linear_attention"])
    with pytest.raises(ValueError, match="full attention"):
        ModelShape.from_config(hybrid)
    unknown = _tiny(transformers.LlamaConfig)
    unknown.model_type = "olmo"
    with pytest.raises(ValueError, match="pass num_parameters"):
        ModelShape.from_config(unknown)
    assert ModelShape.from_config(unknown, num_parameters=123).num_parameters == 123


def test_cli_prints_the_table(capsys):
    main(["--model", "qwen3-4b", "--seq-lens", "8192", "131072", "--breakdown"])
    out = capsys.readouterr().out
    assert "| 131,072 |" in out and "kv_cache" in out and "4,022,468,096" in out


def test_memory_estimate_total_excludes_host():
    est = MemoryEstimate("es", weights=5, host_master_weights=100)
    assert est.total == 5 and est.as_dict()["host_master_weights"] == 100
