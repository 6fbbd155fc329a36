"""Theoretical GPU memory of one training step for ES, CoPES, GRPO and LoRA-GRPO.

A closed-form model, not a measurement: it counts the tensors each optimizer must hold at its
peak, in bytes, from the model's shape. `copes-train --dry-run` prints it, and
`python -m copes.optimizers.memory --model qwen3-4b` prints the comparison table of
docs/memory.md. Sources of the formulas:

- Mixed-precision Adam: 16 bytes per trained parameter (2 bf16 weights + 2 bf16 gradients +
  4 fp32 master + 4 + 4 fp32 Adam moments), Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", Sec. 3.1.
- Activations saved for backward: counted tensor by tensor in the way of Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1 (their GPT
  layer gives s*b*h*(34 + 5*a*s/h) bytes), redone for the Llama/Qwen layer (RMSNorm, GQA,
  SwiGLU, no dropout) with FlashAttention (Dao et al. 2022), which stores no s x s matrix.
- KV cache: keys and values of every layer, KV head, head dimension and token,
  2 * layers * kv_heads * head_dim * tokens * dtype_bytes (Pope et al. 2022, "Efficiently
  Scaling Transformer Inference", Sec. 2; Kwon et al. 2023, PagedAttention/vLLM). A
  sliding-window layer keeps only the last `sliding_window` tokens (Beltagy et al. 2020,
  Longformer; Jiang et al. 2023, Mistral 7B, Sec. 2 "rolling buffer cache").
- Linear attention (Gated DeltaNet, Yang et al. 2024, arXiv:2412.06464, as in Qwen3-Next and
  Qwen3.5): no KV cache but a fixed-size state per sequence, a d_k x d_v matrix per value head
  (fp32) and the short convolution's last kernel-size inputs (transformers'
  `LinearAttentionLayer`; the kernels of fla-org/flash-linear-attention, `chunk.py`).
- Mixture of experts: each token runs k of E routed experts (Shazeer et al. 2017; Fedus et
  al. 2022, Switch Transformers) plus any shared experts (Dai et al. 2024, DeepSeekMoE).
- LoRA: rank-r factors A (r x in) and B (out x r) per adapted linear, Hu et al. 2021.

The parameter count, and which modules are experts, adapted linears or matrices, come from
the model transformers builds from the config on the meta device (no weights, no memory).

Not modeled: the CUDA context and kernels' workspaces (~0.5-1 GiB), allocator fragmentation,
communication buffers, and the transient gradient tensors of the layer being back-propagated.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from typing import Any, Literal

from copes.errors import UserError, one_line
from copes.optimizers.configs import LORA_TARGETS
from copes.optimizers.table import OPTIMIZERS as _TABLE

GIB = 1 << 30
OptimizerName = Literal["es", "copes", "grpo", "lora-grpo"]
OPTIMIZERS: tuple[str, ...] = tuple(_TABLE)  # the optimizer table's order
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
# Older names transformers still reads (configuration_utils._LEGACY_LAYER_TYPE_REMAP).
_LEGACY_LAYER_TYPES = {"attention": FULL}
# Config fields of layers whose state the model does not count: refused, not guessed.
_UNMODELED = {
    "kv_lora_rank": "multi-head latent attention (kv_lora_rank)",
    "state_size": "Mamba state-space layers",
    "ssm_state_size": "Mamba state-space layers",
    "mamba_d_state": "Mamba state-space layers",
    "mamba_n_heads": "Mamba state-space layers",
    "block_types": "recurrent (RG-LRU) blocks",
}
_GDN_FIELDS = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim",
)  # fmt: skip
_GDN_CHUNK = 64  # fla's chunk_gated_delta_rule works on 64-token chunks


@dataclass(frozen=True)
class GatedDeltaNet:
    """The shapes of a Gated DeltaNet linear-attention layer (Yang et al. 2024): q and k of
    `num_key_heads` x `key_head_dim`, v of `num_value_heads` x `value_head_dim`, a causal
    depthwise convolution of `conv_kernel` taps over [q | k | v]."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype_bytes: int = 2) -> int:
        """One sequence's state: the fp32 recurrent state [value heads, d_k, d_v] and the conv
        state [conv_dim, kernel] in the working dtype (transformers' LinearAttentionLayer
        holds both tensors at these shapes; fla returns the final state in fp32)."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return recurrent + self.conv_dim * self.conv_kernel * dtype_bytes


@dataclass(frozen=True)
class Experts:
    """The routed experts of the MoE layers `layers`: each token runs `per_token` of
    `num_experts` experts of MLP width `intermediate_size`, plus shared experts of total width
    `shared_intermediate_size` that every token runs."""

    num_experts: int
    per_token: int
    intermediate_size: int
    shared_intermediate_size: int = 0
    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder-only transformer that set its memory (Llama/Qwen layout).

    `qk_norm` marks Qwen3's per-head RMSNorm on queries and keys (more saved activations).
    `layer_types` gives each layer's token mixer (full, sliding-window or linear attention;
    empty: all full). `linear_attention` and `experts` are set for models that have them.
    `num_active_parameters` (MoE: the parameters one token runs), `rows_plus_cols` and
    `lora_in_plus_out` come from the built model; None means the Llama closed form.
    """

    num_parameters: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    linear_attention: GatedDeltaNet | None = None
    experts: Experts | None = None
    num_active_parameters: int | None = None
    rows_plus_cols: int | None = None
    lora_in_plus_out: int | None = None

    @property
    def types(self) -> tuple[str, ...]:
        """The token mixer of every layer."""
        return self.layer_types or (FULL,) * self.num_layers

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not sent to."""
        if self.num_active_parameters is None:
            return self.num_parameters
        return self.num_active_parameters

    def describe(self) -> dict[str, Any]:
        """What a plan reports beside the counts: layer types, window, state, experts."""
        out: dict[str, Any] = {
            "active_parameters": self.active_parameters,
            "layer_types": dict(Counter(self.types)),
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.linear_attention is not None:
            out["linear_attention"] = {
                **asdict(self.linear_attention),
                "state_bytes_per_sequence_and_layer": self.linear_attention.state_bytes(),
            }
        if self.experts is not None:
            out["experts"] = {**asdict(self.experts), "layers": len(self.experts.layers)}
        return out

    @classmethod
    def from_config(cls, config: Any, num_parameters: int | None = None) -> ModelShape:
        """From a transformers config of any decoder transformers can build as a causal LM.

        The model is built on the meta device (shapes, no weights): it gives the exact
        parameter count (`num_parameters` overrides it), the experts and the adapted linears.
        Layers the memory model does not count (Mamba, multi-head latent attention, other
        linear attentions than Gated DeltaNet) are refused with a UserError, not guessed.
        """
        return cls._from(config, _empty_model(config), num_parameters)

    @classmethod
    def from_model(cls, model: Any) -> ModelShape:
        """From a transformers model: shapes from `model.config`, the parameter count from the
        model itself (tied weights counted once)."""
        return cls._from(model.config, model, None)

    @classmethod
    def _from(cls, config: Any, model: Any, num_parameters: int | None) -> ModelShape:
        text = getattr(config, "text_config", None) or config
        model_type = getattr(text, "model_type", "") or type(text).__name__
        for name, what in _UNMODELED.items():
            if getattr(text, name, None):
                raise UserError(
                    f"{model_type}: its {what} are not in the memory model (it counts full, "
                    "sliding-window and Gated DeltaNet linear attention, dense and MoE MLPs)"
                )
        try:
            heads, hidden = text.num_attention_heads, text.hidden_size
            num_layers = text.num_hidden_layers
        except AttributeError as exc:
            raise UserError(f"{model_type} config is not a decoder's ({exc})") from None
        types, window = _layer_types(text, model_type, num_layers)
        linear = None
        if LINEAR in types:
            linear = GatedDeltaNet(*(int(getattr(text, f)) for f in _GDN_FIELDS))
        facts = _inspect(model, text, model_type)
        total = facts["parameters"] if num_parameters is None else int(num_parameters)
        return cls(
            num_parameters=total,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
            num_attention_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or hidden // heads,
            vocab_size=text.vocab_size,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            qk_norm=facts["qk_norm"],
            layer_types=() if set(types) == {FULL} else tuple(types),
            sliding_window=window,
            linear_attention=linear,
            experts=facts["experts"],
            num_active_parameters=None if facts["experts"] is None else total - facts["idle"],
            rows_plus_cols=facts["rows_plus_cols"],
            lora_in_plus_out=facts["lora_in_plus_out"],
        )


def _layer_types(config: Any, model_type: str, num_layers: int) -> tuple[list[str], int | None]:
    """Each layer's token mixer and the sliding window, as transformers' caches read them
    (cache_utils.get_layer_types_and_kwargs): `layer_types` if the config has it (Gemma 3,
    gpt-oss, Qwen3.5, Qwen2 since transformers 4.53), else sliding for every layer where
    `sliding_window` is set (Mistral, Phi-3) unless `use_sliding_window` is off (Qwen2: then
    layers from `max_window_layers` on), chunked where `attention_chunk_size` is, else full.
    A chunked layer (Llama 4) is cached as a sliding one of the chunk's size."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is None:
        use = getattr(config, "use_sliding_window", None)
        first = getattr(config, "max_window_layers", 0) if use else 0
        if window is not None and use is not False:
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif getattr(config, "attention_chunk_size", None):
            types = ["chunked_attention"] * num_layers
        else:
            types = [FULL] * num_layers
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
    if "chunked_attention" in types:
        if SLIDING in types:
            raise UserError(f"{model_type}: both sliding and chunked layers are not modeled")
        types = [SLIDING if t == "chunked_attention" else t for t in types]
        window = config.attention_chunk_size
    if len(types) != num_layers:
        raise UserError(
            f"{model_type}: layer_types names {len(types)} layers, num_hidden_layers is "
            f"{num_layers}"
        )
    if other := sorted(set(types) - {FULL, SLIDING, LINEAR}):
        raise UserError(
            f"{model_type}: layer type(s) {', '.join(other)} are not in the memory model (it "
            "counts full_attention, sliding_attention and Gated DeltaNet linear_attention)"
        )
    if SLIDING in types and not window:
        raise UserError(f"{model_type}: sliding_attention layers but no sliding_window")
    if LINEAR in types and any(getattr(config, f, None) is None for f in _GDN_FIELDS):
        raise UserError(
            f"{model_type}: its linear_attention layers are not Gated DeltaNet (no "
            f"{', '.join(_GDN_FIELDS)}): their state is not in the memory model"
        )
    return types, window if SLIDING in types else None


def _empty_model(config: Any) -> Any:
    """The causal LM transformers builds from `config`, on the meta device: every parameter
    at its real shape, no memory allocated and no weights read."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as exc:  # any failure to build is the config's: say so in one line
        model_type = getattr(config, "model_type", None) or type(config).__name__
        why = one_line(exc).split(". ")[0]  # not transformers' list of every known config
        raise UserError(
            f"transformers cannot build {model_type!r} as a causal LM ({why[:300]}); give the "
            "config of a decoder-only model"
        ) from exc


def _inspect(model: Any, config: Any, model_type: str) -> dict[str, Any]:
    """What the built model says: its parameters (shared ones once), whether attention has
    q/k norms, its routed and shared experts and the routed parameters a token does not run,
    the rows + columns of its matrices and the in + out of the linears LoRA adapts."""
    import torch

    params = list(model.parameters())  # shared (tied) parameters once
    rows_plus_cols = sum(
        p.shape[0] + math.prod(p.shape[1:]) for p in params if p.is_floating_point() and p.dim() > 1
    )  # a matrix is rows x the product of its other dims (copes.optimizers.perturb)
    lora = qk_norm = 0
    routed: dict[int, tuple[int, int]] = {}  # layer -> (experts, their parameters)
    shared: dict[int, int] = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and last in LORA_TARGETS:  # PEFT matches names
            lora += module.in_features + module.out_features
        if last in ("q_norm", "k_norm") and any(True for _ in module.parameters()):
            qk_norm = True
        if last not in ("experts", "shared_expert", "shared_experts", "shared_mlp"):
            continue
        layer = re.search(r"\.(\d+)\.", f".{name}")  # model.layers.<i>.mlp.experts
        owned = list(module.parameters())
        if layer is None or not owned:
            continue
        if last == "experts":  # fused [E, ...] tensors, or a ModuleList of E MLPs
            count = len(module) if isinstance(module, torch.nn.ModuleList) else owned[0].shape[0]
            routed[int(layer.group(1))] = (int(count), sum(p.numel() for p in owned))
        else:
            shared[int(layer.group(1))] = sum(p.numel() for p in owned)
    facts: dict[str, Any] = {
        "parameters": sum(p.numel() for p in params),
        "qk_norm": bool(qk_norm),
        "experts": None,
        "idle": 0,
        "rows_plus_cols": rows_plus_cols,
        "lora_in_plus_out": lora,
    }
    if not routed:
        return facts
    k = _first_int(config, ("num_experts_per_tok", "moe_k", "moe_topk", "top_k"))
    if not k:
        raise UserError(f"{model_type}: MoE layers but no num_experts_per_tok in the config")
    # the config's count where it names one (a fused tensor's first dim is E, but not always)
    named = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    num_experts = _first_int(config, named) or max(e for e, _ in routed.values())
    hidden = config.hidden_size
    facts["idle"] = sum(n * (num_experts - k) // num_experts for _, n in routed.values())
    facts["experts"] = Experts(
        num_experts=num_experts,
        per_token=int(k),
        intermediate_size=getattr(config, "moe_intermediate_size", None)
        or config.intermediate_size,
        # a shared expert is a gated MLP: gate, up (h x i) and down (i x h)
        shared_intermediate_size=max(shared.values(), default=0) // (3 * hidden),
        layers=tuple(sorted(i for i in routed if i < config.num_hidden_layers)),
    )
    return facts


def _first_int(config: Any, names: Sequence[str]) -> int | None:
    return next((v for n in names if isinstance(v := getattr(config, n, None), int)), None)


def _count_parameters(shape: ModelShape, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> int:
    """Parameters of a Llama/Qwen decoder, layer by layer as transformers builds it (a test
    checks it against the meta-device count)."""
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    attention += (q + 2 * kv if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * i + (2 * i + h if mlp_bias else 0)  # gate, up, down
    norms = 2 * h + (2 * d if shape.qk_norm else 0)  # input/post-attention (+ q_norm, k_norm)
    embeddings = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return shape.num_layers * (attention + mlp + norms) + embeddings + h  # + final norm


def _llama_rows_plus_cols(shape: ModelShape) -> int:
    """Rows + columns of a Llama/Qwen decoder's matrices (biases and norms are vectors)."""
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_kv_heads * hd
    per_layer = (q + h) + 2 * (kv + h) + (h + q) + 2 * (i + h) + (h + i)
    heads = 1 if shape.tie_word_embeddings else 2  # embeddings (and an untied LM head)
    return shape.num_layers * per_layer + heads * (shape.vocab_size + h)


def _llama_lora_in_plus_out(shape: ModelShape) -> int:
    """in + out of the seven linears of every Llama/Qwen layer (q, k, v, o, gate, up, down)."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return shape.num_layers * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i))


# Qwen3-4B, from its public config.json (huggingface.co/Qwen/Qwen3-4B). The paper trains
# "Qwen3.5-4B"; Qwen3-4B is our stand-in (Qwen3.5 mixes linear-attention layers, see docs).
_QWEN3_4B = ModelShape(
    num_parameters=0,
    num_layers=36,
    hidden_size=2560,
    intermediate_size=9728,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    qk_norm=True,
)
QWEN3_4B = replace(
    _QWEN3_4B,
    num_parameters=_count_parameters(_QWEN3_4B, qkv_bias=False, o_bias=False, mlp_bias=False),
    rows_plus_cols=_llama_rows_plus_cols(_QWEN3_4B),
    lora_in_plus_out=_llama_lora_in_plus_out(_QWEN3_4B),
)  # 4,022,468,096 parameters
PRESETS: dict[str, ModelShape] = {"qwen3-4b": QWEN3_4B}


# ---------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one training step, in bytes, by component.

    `total` is GPU memory; `host_master_weights` (CPU RAM) is reported but not in `total`.
    For ES/CoPES `activations` and `logits` are the transient ones of generation.
    `kv_cache` holds the attention layers' keys and values and the linear-attention layers'
    fixed-size states: what generation keeps per sequence.
    """

    optimizer: str
    weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    master_weights: int = 0
    activations: int = 0
    logits: int = 0
    kv_cache: int = 0
    reference_model: int = 0
    perturbation_workspace: int = 0
    population_weights: int = 0  # ES/CoPES --population-eval batched: N stacked copies
    population_adapters: int = 0  # ... with --noise lowrank: N members' rank-r factors
    host_master_weights: int = 0

    @property
    def components(self) -> dict[str, int]:
        """The GPU components by name."""
        skip = {"optimizer", "host_master_weights"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @property
    def total(self) -> int:
        return sum(self.components.values())

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def table(self) -> str:
        """A human-readable breakdown in GiB."""
        rows = [*self.components.items(), ("total (GPU)", self.total)]
        rows.append(("host: master weights", self.host_master_weights))
        width = max(len(name) for name, _ in rows)
        lines = [f"{self.optimizer}: GiB"]
        lines += [f"  {name:<{width}}  {value / GIB:10.3f}" for name, value in rows]
        return "\n".join(lines)


def matrix_rows_and_cols(shape: ModelShape) -> int:
    """Sum over the model's matrices of rows + columns: a rank-1 factor pair of each."""
    if shape.rows_plus_cols is not None:
        return shape.rows_plus_cols
    return _llama_rows_plus_cols(shape)


def kv_cache_bytes(shape: ModelShape, seq_len: int, batch_size: int, dtype_bytes: int = 2) -> int:
    """Keys and values of `batch_size` sequences of `seq_len` tokens (Pope et al. 2022): a full
    attention layer caches every token, a sliding-window one the last min(seq_len, window)
    (the rolling buffer of Jiang et al. 2023; transformers keeps window - 1 between steps and
    the new token beside them), a linear-attention layer none (`linear_state_bytes`)."""
    per_token = 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes  # one layer's K and V
    counts = Counter(shape.types)
    window = min(seq_len, shape.sliding_window or seq_len)
    tokens = counts[FULL] * seq_len + counts[SLIDING] * window
    return per_token * tokens * batch_size


def linear_state_bytes(shape: ModelShape, batch_size: int, dtype_bytes: int = 2) -> int:
    """The fixed-size states of the linear-attention layers (Gated DeltaNet: fp32 recurrent
    state and conv state, `GatedDeltaNet.state_bytes`), whatever the sequence length."""
    if shape.linear_attention is None:
        return 0
    layers = Counter(shape.types)[LINEAR]
    return layers * batch_size * shape.linear_attention.state_bytes(dtype_bytes)


def _mlp_width(shape: ModelShape, layer: int) -> int:
    """The MLP width a token runs in `layer`: the dense intermediate size, or in an MoE layer
    its k routed experts' and the shared experts' widths."""
    experts = shape.experts
    if experts is None or layer not in experts.layers:
        return shape.intermediate_size
    return experts.per_token * experts.intermediate_size + experts.shared_intermediate_size


def layer_activation_bytes(
    shape: ModelShape,
    seq_len: int,
    batch_size: int,
    dtype_bytes: int = 2,
    flash: bool = True,
    fused_rmsnorm: bool = True,
    layer: int = 0,
) -> int:
    """What decoder layer `layer` saves for backward, counted as in Korthikanti et al. 2022
    Sec. 4.1.

    Per token, in 16-bit: the two RMSNorm inputs (the residual stream before attention and
    before the MLP), the normed inputs of the q/k/v and gate/up projections (4h); Q, K, V and the
    attention output, which is o_proj's input (2*q + 2*kv); Qwen3's q_norm/k_norm inputs
    (q + kv); SwiGLU's gate, silu(gate), up and their product, down_proj's input (4i). In fp32:
    the RMSNorm 1/rms per row and FlashAttention's log-sum-exp per head. A fused RMSNorm saves
    its input and 1/rms; transformers' eager RMSNorm (`fused_rmsnorm=False`) saves an fp32 copy
    of its input and the normalized value before the weight instead: 4 more bytes per normed
    element. Without FlashAttention the attention probabilities add a*s per token in 16-bit
    (Korthikanti's 5as^2b term without the dropout mask and output: attention dropout is 0).
    A sliding-window layer saves what a full one does (FlashAttention's window is a mask).

    A Gated DeltaNet layer saves instead, with fla's kernels: the convolution's input [q|k|v]
    (causal-conv1d recomputes its output), the l2-normed q and k, v, beta and the 64-wide
    chunk matrix A per value head (`ChunkGatedDeltaRuleFunction.forward`), the core output, z
    and the gated norm's output (out_proj's input); in fp32 the q/k l2-norm 1/norm per key
    head, the decay g, softplus's input and output and the gated norm's 1/rms per value head.
    An MoE layer's MLP saves, per routed expert a token runs, its gathered input, the SwiGLU
    tensors of its width and its output before the routing weight (k*(2h + 4*i_e)), the shared
    experts' SwiGLU tensors, and the router's fp32 probabilities (E per token).
    """
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    elements, fp32_rows, normed = 4 * h, 2, 2 * h  # norm inputs/outputs; norm 1/rms; normed
    gdn = shape.linear_attention
    if shape.types[layer] == LINEAR and gdn is not None:
        heads_k, heads_v, vd = gdn.num_key_heads, gdn.num_value_heads, gdn.value_dim
        elements += gdn.conv_dim + 2 * gdn.key_dim + 4 * vd + (1 + _GDN_CHUNK) * heads_v
        fp32_rows += 2 * heads_k + 4 * heads_v
        normed += vd
    else:
        elements += 2 * q + 2 * kv + (q + kv if shape.qk_norm else 0)
        fp32_rows += shape.num_attention_heads  # log-sum-exp
        if not flash:
            elements += shape.num_attention_heads * seq_len
        if shape.qk_norm:
            fp32_rows += shape.num_attention_heads + shape.num_kv_heads
            normed += q + kv
    experts = shape.experts
    if experts is not None and layer in experts.layers:
        k, width = experts.per_token, experts.intermediate_size
        elements += k * (2 * h + 4 * width) + 4 * experts.shared_intermediate_size
        fp32_rows += experts.num_experts
    else:
        elements += 4 * i
    unfused = 0 if fused_rmsnorm else 4 * normed
    return seq_len * batch_size * (elements * dtype_bytes + 4 * fp32_rows + unfused)


def _per_layer_activations(
    shape: ModelShape, seq_len: int, batch_size: int, *args: Any
) -> list[int]:
    """`layer_activation_bytes` of every layer, computed once per kind of layer."""
    kinds: dict[tuple[str, int], int] = {}
    out = []
    for layer, mixer in enumerate(shape.types):
        kind = (mixer, _mlp_width(shape, layer))
        if kind not in kinds:
            kinds[kind] = layer_activation_bytes(shape, seq_len, batch_size, *args, layer=layer)
        out.append(kinds[kind])
    return out


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """LoRA parameters r*(in + out) on every linear named like the default targets (q, k, v,
    o, gate, up, down; PEFT matches module names, so fused MoE experts and Gated DeltaNet's
    projections get none), Hu et al. 2021."""
    if shape.lora_in_plus_out is not None:
        return rank * shape.lora_in_plus_out
    return rank * _llama_lora_in_plus_out(shape)


def estimate_memory(
    optimizer: OptimizerName,
    shape: ModelShape,
    *,
    seq_len: int,
    batch_size: int = 1,
    dtype_bytes: int = 2,
    gradient_checkpointing: bool = True,
    flash_attention: bool = True,
    fused_rmsnorm: bool = True,
    lora_rank: int = 16,
    chunk_size: int = 1 << 20,
    kl_beta: float = 0.0,
    master_on_gpu: bool = False,
    rollout_batch_size: int | None = None,
    colocated_rollout: bool = True,
    kv_cache_dtype_bytes: int | None = None,
    logits_chunk_tokens: int | None = None,
    prefill_chunk_tokens: int = 8192,
    population_copies: int = 0,
    population_rank: int = 0,
) -> MemoryEstimate:
    """Peak GPU memory of one step of `optimizer` on sequences of `seq_len` tokens.

    Args:
        batch_size: sequences processed at once: GRPO's training micro-batch, ES's generation
            batch (all sequences of one population member's evaluation, generated together).
        dtype_bytes: bytes of the working weights, gradients and activations (2: bf16).
        gradient_checkpointing: GRPO keeps each layer's input and recomputes one layer at a time.
        flash_attention: no s x s attention matrix is stored (else it is, per layer).
        fused_rmsnorm: False counts the fp32 copies transformers' eager RMSNorm saves.
        lora_rank: r of LoRA-GRPO.
        chunk_size: coordinates ES/CoPES perturb at a time (`copes.optimizers.perturb`).
        kl_beta: GRPO's KL coefficient; > 0 keeps a frozen reference model (full GRPO only:
            LoRA-GRPO's reference is the base model with the adapter switched off).
        master_on_gpu: ES/CoPES keep the fp32 master on the GPU instead of in CPU RAM.
        rollout_batch_size: sequences GRPO generates at once (default `batch_size`).
        colocated_rollout: GRPO generates on the same GPU and its rollout KV cache stays
            allocated while it trains (a vLLM engine reserves its pool up front). False:
            rollouts run elsewhere.
        kv_cache_dtype_bytes: bytes of a KV-cache entry (default `dtype_bytes`; 1 for fp8).
        logits_chunk_tokens: GRPO's loss computes logits for this many tokens at a time (a
            chunked / fused linear-cross-entropy); None materializes all of them.
        prefill_chunk_tokens: tokens in one generation forward (chunked prefill).
        population_copies: ES/CoPES with the batched evaluator (`copes.optimizers.batched`)
            hold this many stacked weight copies beside the model; `batch_size` is then the
            rows of the whole population's episode loop (N x tasks).
        population_rank: with `population_copies` = N, the members are `--noise lowrank`
            rank-r deltas served as adapters: N x r x (rows + cols) per matrix instead of N
            weight copies.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}"
        )
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("lora_rank", lora_rank)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    params, h, vocab = shape.num_parameters, shape.hidden_size, shape.vocab_size
    kv_bytes = kv_cache_dtype_bytes or dtype_bytes

    def cache(sequences: int) -> int:  # K/V of the attention layers, linear layers' states
        kv = kv_cache_bytes(shape, seq_len, sequences, kv_bytes)
        return kv + linear_state_bytes(shape, sequences, dtype_bytes)

    if optimizer in ("es", "copes"):
        # Inference only: one perturbed model generates; nothing of size d but the weights.
        # The population is evaluated member after member on the same weights, perturbed in
        # place and restored from the fp32 master, so the peak does not grow with N or K.
        # CoPES's subspace noise is regenerated chunk by chunk from seeds like ES's, so the two
        # differ only by the int64 permutation that deals a chunk's coordinates to subspaces.
        tokens = min(seq_len * batch_size, prefill_chunk_tokens)
        width, layers = partial(_mlp_width, shape), range(shape.num_layers)
        # perturb/update temporaries per chunk coordinate: noise, fp32 upcast or accumulator,
        # scaled noise, master slice (4 x fp32); CoPES adds the permutation and its index (int64)
        workspace = chunk_size * (16 + (16 if optimizer == "copes" else 0))
        return MemoryEstimate(
            optimizer=optimizer,
            weights=params * dtype_bytes,
            master_weights=4 * params if master_on_gpu else 0,
            host_master_weights=0 if master_on_gpu else 4 * params,
            kv_cache=cache(batch_size),
            # peak of one layer's forward over a prefill chunk, at the MLP: residual stream and
            # normed input (2h), gate activation, up, their product (3i; an MoE layer's i is
            # its active experts' widths), at the widest layer
            activations=tokens * (2 * h + 3 * max(map(width, layers))) * dtype_bytes,
            logits=batch_size * vocab * 4,  # fp32 logits of the next token, for sampling
            perturbation_workspace=workspace,
            population_weights=0 if population_rank else population_copies * params * dtype_bytes,
            population_adapters=population_copies
            * population_rank
            * dtype_bytes
            * matrix_rows_and_cols(shape),
        )
    if population_copies:
        raise ValueError(f"{optimizer} has no population to batch (population_copies > 0)")

    # GRPO and LoRA-GRPO: backprop through every layer, so the same activations and logits.
    tokens = seq_len * batch_size
    per_layer = _per_layer_activations(
        shape, seq_len, batch_size, dtype_bytes, flash_attention, fused_rmsnorm
    )
    if gradient_checkpointing:  # every layer's input, plus one layer recomputed in backward
        activations = shape.num_layers * tokens * h * dtype_bytes + max(per_layer)
    else:
        activations = sum(per_layer)
    activations += 2 * tokens * h * dtype_bytes  # final-norm input and lm_head input
    logit_tokens = tokens if logits_chunk_tokens is None else min(tokens, logits_chunk_tokens)
    logits = logit_tokens * vocab * (4 + 4)  # fp32 logits + fp32 log-softmax saved for backward
    rollout = rollout_batch_size or batch_size
    kv_cache = cache(rollout) if colocated_rollout else 0

    if optimizer == "grpo":  # ZeRO's 16 bytes per parameter (Rajbhandari et al. 2020)
        return MemoryEstimate(
            optimizer=optimizer,
            weights=params * dtype_bytes,
            gradients=params * dtype_bytes,
            master_weights=4 * params,
            optimizer_states=8 * params,  # Adam m and v in fp32
            activations=activations,
            logits=logits,
            kv_cache=kv_cache,
            reference_model=params * dtype_bytes if kl_beta > 0 else 0,
        )
    adapters = lora_parameters(shape, lora_rank)  # trained in mixed precision, 16 bytes each
    return MemoryEstimate(
        optimizer=optimizer,
        weights=(params + adapters) * dtype_bytes,
        gradients=adapters * dtype_bytes,
        master_weights=4 * adapters,
        optimizer_states=8 * adapters,
        activations=activations,
        logits=logits,
        kv_cache=kv_cache,
    )


def compare_optimizers(
    shape: ModelShape,
    seq_len: int,
    *,
    batch_size: int = 1,
    generation_batch_size: int | None = None,
    **kwargs: Any,
) -> dict[str, MemoryEstimate]:
    """The estimate of every optimizer for the same workload.

    `batch_size` is GRPO's training micro-batch; `generation_batch_size` (default
    `batch_size`) is the sequences generated at once: ES/CoPES's batch and GRPO's rollout batch.
    Other `kwargs` go to `estimate_memory`.
    """
    generation = generation_batch_size or batch_size
    estimates = {}
    for name in OPTIMIZERS:
        grpo = name in ("grpo", "lora-grpo")
        estimates[name] = estimate_memory(
            name,  # type: ignore[arg-type]
            shape,
            seq_len=seq_len,
            batch_size=batch_size if grpo else generation,
            rollout_batch_size=generation if grpo else None,
            **kwargs,
        )
    return estimates


def memory_table(
    shape: ModelShape, seq_lens: Sequence[int] = (8192, 32768, 131072), **kwargs: Any
) -> list[dict[str, Any]]:
    """Total GPU bytes of every optimizer per context length, and the ratio GRPO / CoPES.

    `kwargs` go to `compare_optimizers` (batch_size, generation_batch_size, ...).
    """
    rows = []
    for seq_len in seq_lens:
        totals = {n: e.total for n, e in compare_optimizers(shape, seq_len, **kwargs).items()}
        rows.append({"seq_len": seq_len, **totals, "grpo/copes": totals["grpo"] / totals["copes"]})
    return rows


def format_memory_table(rows: Sequence[dict[str, Any]]) -> str:
    """`memory_table` rows as a markdown table in GiB."""
    header = "| context | " + " | ".join(f"{n} (GiB)" for n in OPTIMIZERS) + " | GRPO / CoPES |"
    lines = [header, "|" + "---:|" * (len(OPTIMIZERS) + 2)]
    for row in rows:
        cells = [f"{row[n] / GIB:.1f}" for n in OPTIMIZERS]
        lines.append(
            f"| {row['seq_len']:,} | " + " | ".join(cells) + f" | {row['grpo/copes']:.2f} |"
        )
    return "\n".join(lines)


def _load_shape(model: str) -> ModelShape:
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(model))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-4b", help="a preset (qwen3-4b) or HF config path")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batch-size", type=int, default=1, help="GRPO training micro-batch")
    parser.add_argument(
        "--generation-batch-size", type=int, default=None, help="ES/CoPES and GRPO rollouts"
    )
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--eager-attention", action="store_true", help="no FlashAttention")
    parser.add_argument("--unfused-rmsnorm", action="store_true", help="transformers' eager")
    parser.add_argument("--kv-cache-dtype-bytes", type=int, default=None, help="1 for fp8")
    parser.add_argument("--logits-chunk-tokens", type=int, default=None)
    parser.add_argument("--breakdown", action="store_true", help="components at the last length")
    args = parser.parse_args(argv)
    shape = _load_shape(args.model)
    kwargs: dict[str, Any] = dict(
        kl_beta=args.kl_beta,
        lora_rank=args.lora_rank,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        flash_attention=not args.eager_attention,
        fused_rmsnorm=not args.unfused_rmsnorm,
        kv_cache_dtype_bytes=args.kv_cache_dtype_bytes,
        logits_chunk_tokens=args.logits_chunk_tokens,
    )
    kwargs |= dict(batch_size=args.batch_size, generation_batch_size=args.generation_batch_size)
    active = shape.active_parameters
    per_token = f" ({active:,} active per token)" if active != shape.num_parameters else ""
    out = [
        f"{args.model}: {shape.num_parameters:,} parameters{per_token}; GRPO micro-batch "
        f"{args.batch_size}, "
        f"generation batch {args.generation_batch_size or args.batch_size}",
        "",
        format_memory_table(memory_table(shape, args.seq_lens, **kwargs)),
    ]
    if args.breakdown:
        seq_len = args.seq_lens[-1]
        out += ["", f"Components at {seq_len:,} tokens:", "", "```"]
        out += [e.table() for e in compare_optimizers(shape, seq_len, **kwargs).values()]
        out.append("```")
    print("\n".join(out))


if __name__ == "__main__":
    main()
