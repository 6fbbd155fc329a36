"""Theoretical GPU memory of one training step for ES, CoPES, GRPO and LoRA-GRPO.

A closed-form model, not a measurement: it counts the tensors each optimizer must hold at its
peak, in bytes, from the model's shape. `copes-train --dry-run` prints it, and
`python -m copes.memory --model qwen3-4b` prints the comparison table of
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
the model's shape (`copes.memory.shapes`), counted from its config alone.

Not modeled: the CUDA context and kernels' workspaces (~0.5-1 GiB), allocator fragmentation,
communication buffers, and the transient gradient tensors of the layer being back-propagated.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Literal

from copes.memory.shapes import (
    FULL,
    GDN_CHUNK,
    GIB,
    LINEAR,
    PRESETS,
    SLIDING,
    ModelShape,
    llama_lora_in_plus_out,
    llama_rows_plus_cols,
)
from copes.optimizers.table import OPTIMIZERS as _TABLE

OptimizerName = Literal["es", "copes", "grpo", "lora-grpo"]
OPTIMIZERS: tuple[str, ...] = tuple(_TABLE)  # the optimizer table's order


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
        return {name: value for name, value in asdict(self).items() if name not in skip}

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
    return llama_rows_plus_cols(shape)


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
        elements += gdn.conv_dim + 2 * gdn.key_dim + 4 * vd + (1 + GDN_CHUNK) * heads_v
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
    return rank * llama_lora_in_plus_out(shape)


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
        chunk_size: coordinates ES/CoPES perturb at a time (`copes.weights`).
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
        # (Run on a CPU, CoPES also keeps the step's partition between members, 4 bytes x d
        # of host RAM while that is <= 1 GiB, else the current subspace's, 4 bytes x d / K:
        # `WeightSpace(keep_partition_bytes=...)`; nothing on a GPU.)
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
