"""What a model is, for the memory planner: `ModelShape`, counted from its config alone.

transformers builds the model from the config on the meta device (no weights, no memory), and
its modules say the parameter count, the layer types (full, sliding-window, linear attention),
the mixture-of-experts layout, and which linears are matrices or LoRA targets. `PRESETS` holds
the paper's Qwen3-4B stand-in. The memory of each optimizer is `copes.memory.plan`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from copes.errors import UserError, one_line
from copes.optimizers.configs import LORA_TARGETS

GIB = 1 << 30
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
GDN_CHUNK = 64  # fla's chunk_gated_delta_rule works on 64-token chunks


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
        text = _setting(config, "text_config") or config
        model_type = _setting(text, "model_type", "") or type(text).__name__
        for name, what in _UNMODELED.items():
            if _setting(text, name):
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
            linear = GatedDeltaNet(*(int(_setting(text, f)) for f in _GDN_FIELDS))
        facts = _inspect(model, text, model_type)
        total = facts["parameters"] if num_parameters is None else int(num_parameters)
        return cls(
            num_parameters=total,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=_setting(text, "intermediate_size") or 4 * hidden,
            num_attention_heads=heads,
            num_kv_heads=_setting(text, "num_key_value_heads") or heads,
            head_dim=_setting(text, "head_dim") or hidden // heads,
            vocab_size=text.vocab_size,
            tie_word_embeddings=bool(_setting(text, "tie_word_embeddings", False)),
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
    window = _setting(config, "sliding_window") or None
    types = _setting(config, "layer_types")
    if types is None:
        use = _setting(config, "use_sliding_window")
        first = _setting(config, "max_window_layers", 0) if use else 0
        if window is not None and use is not False:
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif _setting(config, "attention_chunk_size"):
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
    if LINEAR in types and any(_setting(config, f) is None for f in _GDN_FIELDS):
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
        model_type = _setting(config, "model_type") or type(config).__name__
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
    )  # a matrix is rows x the product of its other dims (copes.weights)
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
        intermediate_size=_setting(config, "moe_intermediate_size") or config.intermediate_size,
        # a shared expert is a gated MLP: gate, up (h x i) and down (i x h)
        shared_intermediate_size=max(shared.values(), default=0) // (3 * hidden),
        layers=tuple(sorted(i for i in routed if i < config.num_hidden_layers)),
    )
    return facts


def _setting(config: Any, name: str, default: Any = None) -> Any:
    """An optional field of a transformers config, the one place they are read: families
    name and omit them differently (Qwen2 had no `layer_types` before transformers 4.53,
    Llama has no `sliding_window`, Qwen3.5 nests its decoder's in `text_config`)."""
    return getattr(config, name, default)


def _first_int(config: Any, names: Sequence[str]) -> int | None:
    return next((v for n in names if isinstance(v := _setting(config, n), int)), None)


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


def llama_rows_plus_cols(shape: ModelShape) -> int:
    """Rows + columns of a Llama/Qwen decoder's matrices (biases and norms are vectors)."""
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_kv_heads * hd
    per_layer = (q + h) + 2 * (kv + h) + (h + q) + 2 * (i + h) + (h + i)
    heads = 1 if shape.tie_word_embeddings else 2  # embeddings (and an untied LM head)
    return shape.num_layers * per_layer + heads * (shape.vocab_size + h)


def llama_lora_in_plus_out(shape: ModelShape) -> int:
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
    rows_plus_cols=llama_rows_plus_cols(_QWEN3_4B),
    lora_in_plus_out=llama_lora_in_plus_out(_QWEN3_4B),
)  # 4,022,468,096 parameters
PRESETS: dict[str, ModelShape] = {"qwen3-4b": QWEN3_4B}
