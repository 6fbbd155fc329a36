"""The theoretical memory model: hand-computed values, shapes from real configs, the claim."""

import inspect
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import transformers

from copes.errors import UserError
from copes.memory.plan import (
    OPTIMIZERS,
    MemoryEstimate,
    estimate_memory,
    kv_cache_bytes,
    layer_activation_bytes,
    linear_state_bytes,
    lora_parameters,
    main,
    matrix_rows_and_cols,
    memory_table,
)
from copes.memory.shapes import (
    FULL,
    LINEAR,
    QWEN3_4B,
    SLIDING,
    Experts,
    GatedDeltaNet,
    ModelShape,
    _count_parameters,
    llama_lora_in_plus_out,
    llama_rows_plus_cols,
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
    # the closed forms agree with the meta-device model on the Llama/Qwen layout
    model_type = config.model_type
    bias = bool(getattr(config, "attention_bias", False))
    closed = _count_parameters(
        shape,
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=model_type != "qwen2" and bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    assert closed == shape.num_parameters
    assert shape.rows_plus_cols == llama_rows_plus_cols(shape)
    assert shape.lora_in_plus_out == llama_lora_in_plus_out(shape)
    assert shape.layer_types == () and shape.experts is None
    assert shape.active_parameters == shape.num_parameters


def test_errors_are_specific():
    with pytest.raises(ValueError, match="unknown optimizer 'ppo'"):
        estimate_memory("ppo", SMALL, seq_len=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        estimate_memory("es", SMALL, seq_len=0)
    not_a_config = SimpleNamespace(model_type="qwen3_5_text", layer_types=["linear_attention"])
    with pytest.raises(UserError, match="transformers cannot build 'qwen3_5_text' as a causal"):
        ModelShape.from_config(not_a_config)
    assert ModelShape.from_config(_tiny(transformers.LlamaConfig), 123).num_parameters == 123


def test_cli_prints_the_table(capsys):
    main(["--model", "qwen3-4b", "--seq-lens", "8192", "131072", "--breakdown"])
    out = capsys.readouterr().out
    assert "| 131,072 |" in out and "kv_cache" in out and "4,022,468,096" in out


def test_memory_estimate_total_excludes_host():
    est = MemoryEstimate("es", weights=5, host_master_weights=100)
    assert est.total == 5 and est.as_dict()["host_master_weights"] == 100


# ------------------------------------------------ sliding, linear and MoE layers, by hand
SLIDING_SMALL = replace(SMALL, layer_types=(SLIDING, FULL), sliding_window=4)
GDN = GatedDeltaNet(
    num_key_heads=1, num_value_heads=2, key_head_dim=4, value_head_dim=4, conv_kernel=3
)
LINEAR_SMALL = replace(SMALL, layer_types=(LINEAR, FULL), linear_attention=GDN)
MOE_SMALL = replace(
    SMALL,
    experts=Experts(
        num_experts=4, per_token=2, intermediate_size=6, shared_intermediate_size=5, layers=(1,)
    ),
    num_active_parameters=700,
)


def test_a_sliding_layer_caches_at_most_its_window():
    # full layer: 2 (K, V) x 1 KV head x 4 dims x 10 tokens x 3 sequences x 2 bytes = 480;
    # sliding layer: the same for min(10, 4) = 4 tokens = 192
    assert kv_cache_bytes(SLIDING_SMALL, S, B) == 480 + 192
    assert kv_cache_bytes(SLIDING_SMALL, 3, B) == 2 * (2 * 1 * 4 * 3 * 3 * 2)  # below the window
    est = estimate_memory("grpo", SLIDING_SMALL, seq_len=S, batch_size=B)
    assert est.kv_cache == 672  # FlashAttention's window is a mask: the same activations
    assert est.activations == estimate_memory("grpo", SMALL, seq_len=S, batch_size=B).activations


def test_a_linear_layer_holds_a_fixed_state_not_a_kv_cache():
    # recurrent state: 2 value heads x 4 x 4 in fp32 = 128; conv state: conv_dim (2*4 + 8 = 16)
    # x 3 taps in bf16 = 96; per sequence and linear layer 224, whatever the length
    assert GDN.conv_dim == 16 and GDN.state_bytes() == 128 + 96
    assert linear_state_bytes(LINEAR_SMALL, B) == 3 * 224
    assert kv_cache_bytes(LINEAR_SMALL, S, B) == 480  # the full layer only
    for seq_len in (S, 100 * S):
        est = estimate_memory("copes", LINEAR_SMALL, seq_len=seq_len, batch_size=B)
        assert est.kv_cache == kv_cache_bytes(LINEAR_SMALL, seq_len, B) + 672


def test_linear_and_moe_layer_activations_by_hand():
    # GDN layer: 16-bit 4h + conv input 16 + q, k 8 + 4 x v 32 + 65 x 2 heads (beta, A) + 4i
    # = 32 + 16 + 8 + 32 + 130 + 64 = 282; fp32: 2 norms + 2 x 1 key head + 4 x 2 value heads
    assert layer_activation_bytes(LINEAR_SMALL, S, B, layer=0) == 30 * (282 * 2 + 12 * 4)
    assert layer_activation_bytes(LINEAR_SMALL, S, B, layer=1) == 7680  # the full layer
    # MoE layer: 4h + 2q + 2kv + k (2h + 4 i_e) + 4 shared = 32 + 16 + 8 + 2 x 40 + 20 = 156;
    # fp32: 2 norms + 2 heads + 4 router probabilities
    assert layer_activation_bytes(MOE_SMALL, S, B, layer=1) == 30 * (156 * 2 + 8 * 4)
    assert layer_activation_bytes(MOE_SMALL, S, B, layer=0) == 7680  # a dense layer
    grpo = estimate_memory("grpo", MOE_SMALL, seq_len=S, batch_size=B, gradient_checkpointing=False)
    assert grpo.activations == 7680 + 30 * 344 + 960
    # ES/CoPES generation: the widest MLP, 2 x 6 + 5 = 17 active > 16 dense
    es = estimate_memory("es", MOE_SMALL, seq_len=S, batch_size=B)
    assert es.activations == 30 * (2 * 8 + 3 * 17) * 2
    assert MOE_SMALL.active_parameters == 700 and SMALL.active_parameters == 1000


# ------------------------------------------------ every family's config, built on the meta device
_BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# name: (model_type, config fields, expected layer types, (experts, per token, MoE layers))
FAMILIES = {
    "llama": ("llama", {}, {FULL: 2}, None),
    "qwen2": ("qwen2", {}, {FULL: 2}, None),
    "qwen2-sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        {FULL: 1, SLIDING: 1},
        None,
    ),
    # DeepSeek-R1-Distill-Qwen's config.json: Qwen2 with a window it does not use
    "deepseek-r1-distill": (
        "qwen2",
        {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 1},
        {FULL: 2},
        None,
    ),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}, {FULL: 2}, None),
    "qwen3_moe": ("qwen3_moe", {**_MOE, "num_experts": 4}, {FULL: 2}, (4, 2, 2)),
    "qwen3_5_text": (
        "qwen3_5_text",
        {
            "layer_types": [LINEAR, FULL],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
        },
        {LINEAR: 1, FULL: 1},
        None,
    ),
    "gemma3_text": (
        "gemma3_text",
        {"layer_types": [SLIDING, FULL], "sliding_window": 16, "query_pre_attn_scalar": 16},
        {SLIDING: 1, FULL: 1},
        None,
    ),
    "mistral": ("mistral", {"sliding_window": 16}, {SLIDING: 2}, None),  # every layer slides
    "phi3": ("phi3", {}, {FULL: 2}, None),
    "granite": ("granite", {}, {FULL: 2}, None),
    "glm4_moe": (
        "glm4_moe",
        {**_MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1},
        {FULL: 2},
        (4, 2, 1),
    ),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 8,
            "layer_types": [SLIDING, FULL],
        },
        {SLIDING: 1, FULL: 1},
        (4, 2, 2),
    ),
}


def _family_config(name):
    model_type, extra, _, _ = FAMILIES[name]
    return transformers.AutoConfig.for_model(model_type, **{**_BASE, **extra})


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_is_counted_on_the_meta_device_as_built(name):
    _, _, types, moe = FAMILIES[name]
    config = _family_config(name)
    shape = ModelShape.from_config(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)  # real weights, on the CPU
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_model(model) == shape
    assert dict(Counter(shape.types)) == types
    matrices = [p for p in model.parameters() if p.dim() > 1]
    assert matrix_rows_and_cols(shape) == sum(p.shape[0] + p[0].numel() for p in matrices)
    if moe is None:
        assert shape.experts is None and shape.active_parameters == shape.num_parameters
    else:
        experts, per_token, layers = moe
        assert (shape.experts.num_experts, shape.experts.per_token) == (experts, per_token)
        assert len(shape.experts.layers) == layers
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        idle = routed * (experts - per_token) // experts
        assert shape.active_parameters == shape.num_parameters - idle
    for optimizer in OPTIMIZERS:  # every estimate works on the shape
        assert estimate_memory(optimizer, shape, seq_len=64).total > 0


def test_the_shapes_of_sliding_linear_and_moe_families():
    gemma = ModelShape.from_config(_family_config("gemma3_text"))
    assert gemma.sliding_window == 16 and gemma.qk_norm
    # 2 (K, V) x 2 KV heads x 16 dims x 2 bytes = 128 per token and layer: full 40, sliding 16
    assert kv_cache_bytes(gemma, 40, 3) == 128 * (40 + 16) * 3
    qwen35 = ModelShape.from_config(_family_config("qwen3_5_text"))
    assert qwen35.linear_attention == GatedDeltaNet(2, 4, 16, 16, 4)
    # 4 value heads x 16 x 16 x 4 bytes + conv_dim (2 x 32 + 64 = 128) x 4 taps x 2 bytes
    assert linear_state_bytes(qwen35, 3) == 3 * (4096 + 1024)
    glm = ModelShape.from_config(_family_config("glm4_moe"))
    assert glm.experts == Experts(4, 2, 32, shared_intermediate_size=32, layers=(1,))
    mistral = ModelShape.from_config(_family_config("mistral"))
    assert mistral.sliding_window == 16 and mistral.layer_types == (SLIDING, SLIDING)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_5_text"])
def test_cache_bytes_match_what_transformers_caches(name):
    """A bf16 forward over 40 tokens of 3 sequences: the linear layers' states are the model's
    byte for byte; a sliding layer holds window - 1 keys between steps, one token short of the
    window the next token attends (the model counts that peak)."""
    config = _family_config(name)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    cache = transformers.DynamicCache(config=config)
    # transformers 5 renamed past_key_values to cache
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(torch.randint(3, 97, (3, 40)), use_cache=True, **{kwarg: cache})
    held = 0
    for layer in cache.layers:
        for kind in ("keys", "values"):
            tensor = getattr(layer, kind, None)
            held += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
        for kind in ("conv_states", "recurrent_states"):
            held += sum(t.nbytes for t in getattr(layer, kind, {}).values() if t is not None)
    shape = ModelShape.from_config(config)
    one_token = 2 * shape.num_kv_heads * shape.head_dim * 2 * 3  # K and V, 3 sequences, bf16
    sliding = Counter(shape.types)[SLIDING]
    expected = kv_cache_bytes(shape, 40, 3) + linear_state_bytes(shape, 3)
    assert held + sliding * one_token == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_dry_run_plans_every_family_from_its_config_alone(name, tmp_path, capsys):
    import json

    from copes.cli import train_main

    _, _, types, moe = FAMILIES[name]
    config = _family_config(name)
    config.save_pretrained(tmp_path)  # config.json only: no weights, no tokenizer
    assert train_main(["--dry-run", "--model", str(tmp_path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    model = plan["model"]
    shape = ModelShape.from_config(config)
    assert model["parameters"] == shape.num_parameters
    assert model["active_parameters"] == shape.active_parameters
    assert model["layer_types"] == types
    assert ("experts" in model) == (moe is not None)
    if moe is not None:
        assert model["experts"]["num_experts"] == moe[0] and model["experts"]["per_token"] == moe[1]
        assert model["active_parameters"] < model["parameters"]
    assert set(OPTIMIZERS) <= set(plan["memory_bytes"])
    assert all(e["total"] > 0 for e in plan["memory_bytes"].values())


@pytest.mark.parametrize(
    ("model_type", "extra", "message"),
    [
        ("t5", {"vocab_size": 97, "d_model": 64}, "transformers cannot build 't5' as a causal LM"),
        ("mamba", {"vocab_size": 97, "hidden_size": 64}, "Mamba state-space layers"),
        ("deepseek_v3", {"vocab_size": 97, "hidden_size": 64}, "multi-head latent attention"),
        ("lfm2", {"vocab_size": 97, "layer_types": ["conv", "full_attention"],
                  "num_hidden_layers": 2}, "layer type(s) conv"),
    ],
)  # fmt: skip
def test_dry_run_refuses_what_it_cannot_plan_in_one_line(
    model_type, extra, message, tmp_path, capsys
):
    from copes.cli import train_main

    transformers.AutoConfig.for_model(model_type, **extra).save_pretrained(tmp_path)
    assert train_main(["--dry-run", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("copes-train: error:")]
    assert message in line and "Traceback" not in err
