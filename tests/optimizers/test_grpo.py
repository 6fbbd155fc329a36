"""GRPO on a tiny real Qwen2 model and a toy task with a known optimum: say the letter z.

The tokenizer has one token per character (31 tokens), so a random model says "z" in a
4-token turn about 12% of the time; reward 1 if the turn contains it. GRPO must learn that.
"""

import copy
import json
import time

import pytest
import torch

from copes.agents.hf import HFPolicy
from copes.agents.policy import SamplingConfig
from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory
from copes.optimizers.grpo import GRPO, GRPOConfig, group_advantages

TARGET = "z"
PROMPTS = ("say z", "z please")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer with ChatML specials and a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *"abcdefghijklmnopqrstuvwxyz \n"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A hidden-32 model is fastest on one thread (and the CPUs are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_policy(tokenizer, seed=0, init_std=0.02):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return HFPolicy(model, tokenizer)


class SayTarget:
    """A real `RolloutFn`: G sampled turns per prompt; reward 1 if the turn contains z."""

    def __init__(self, group_size, seed=0, max_new_tokens=4, prompts=PROMPTS):
        self.group_size, self.seed, self.max_new_tokens = group_size, seed, max_new_tokens
        self.prompts = prompts
        self.calls = 0

    def __call__(self, policy, step, member=None):
        assert member is None  # GRPO asks once for the whole batch
        sampling = SamplingConfig(max_new_tokens=self.max_new_tokens, seed=self.seed + self.calls)
        self.calls += 1
        prompts = [
            policy.chat.encode_prompt([{"role": "user", "content": p}]) for p in self.prompts
        ]
        start = time.perf_counter()
        gens = policy.generate_ids([p for p in prompts for _ in range(self.group_size)], sampling)
        seconds = time.perf_counter() - start
        trajectories = []
        for i, gen in enumerate(gens):
            prompt = gen.prompt_token_ids
            hit = TARGET in gen.text
            trajectories.append(
                Trajectory(
                    task_id=f"task-{i // self.group_size}",
                    messages=[],
                    token_ids=prompt + gen.token_ids,
                    generated_mask=[0] * len(prompt) + [1] * len(gen.token_ids),
                    logprobs=[0.0] * len(prompt) + gen.logprobs,
                    prompt_length=len(prompt),
                    reward=float(hit),
                    correct=hit,
                )
            )
        tokens = sum(len(g.token_ids) for g in gens)
        return RolloutBatch(trajectories, RolloutStats(seconds, 0.0, tokens, 1))


class Fixed:
    """A `RolloutFn` that returns the same (deep-copied) trajectories every call."""

    def __init__(self, trajectories):
        self.trajectories = trajectories

    def __call__(self, policy, step, member=None):
        return RolloutBatch(copy.deepcopy(self.trajectories), RolloutStats())


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def success_rate(policy, samples_per_prompt=32):
    """Mean reward on a fixed held-out sample (a seed training never uses)."""
    batch = SayTarget(samples_per_prompt, seed=10_000)(policy, 0)
    return sum(t.reward for t in batch) / len(batch)


def train(policy, config, steps, seed=0):
    grpo = GRPO(config, policy)
    rollout = SayTarget(config.group_size, seed=seed)
    return grpo, [grpo.step(policy, rollout) for _ in range(steps)]


def test_grpo_learns_to_say_the_target(tokenizer):
    policy = make_policy(tokenizer)
    before = success_rate(policy)
    config = GRPOConfig(group_size=8, learning_rate=1e-2, micro_batch_size=8)
    grpo, history = train(policy, config, steps=15)
    rewards = [s.metrics["reward_mean"] for s in history]
    assert before < 0.25 and rewards[0] < 0.25
    assert success_rate(policy) > 0.7 and sum(rewards[-5:]) / 5 > 0.7, rewards
    first = history[0]
    for key in (
        "loss",
        "clip_fraction",
        "approx_kl",
        "grad_norm",
        "advantage_std",
        "zero_variance_groups",
        "tokens",
        "reward_std",
        "accuracy",
    ):
        assert key in first.metrics and first.metrics[key] == first.metrics[key]  # not NaN
    assert first.metrics["accuracy"] == first.metrics["reward_mean"]
    assert first.generated_tokens == first.metrics["tokens"] > 0
    assert first.generation_seconds > 0 and first.optimizer_seconds > 0
    assert not policy.model.training  # back in eval mode for the next rollout
    assert grpo.merged_model() is policy.model


def test_lora_grpo_learns_and_only_the_adapter_changes(tokenizer):
    from peft import PeftModel

    # LoRA cannot touch the (tied) embeddings or norms, and a 0.02-init model's logits are
    # too small for projections alone to make one token likely: a larger init gives it room.
    policy = make_policy(tokenizer, init_std=0.2)
    base = weights(policy.model)
    before = success_rate(policy)
    config = GRPOConfig(group_size=8, learning_rate=3e-2, lora=True, lora_rank=4, lora_alpha=8)
    grpo, history = train(policy, config, steps=15)
    assert isinstance(policy.model, PeftModel) and policy.model is grpo.model
    rewards = [s.metrics["reward_mean"] for s in history]
    assert before < 0.3
    assert success_rate(policy) > 0.7 and sum(rewards[-5:]) / 5 > 0.7, rewards
    live = policy.model.state_dict()
    changed_adapter = False
    for name, value in live.items():
        if "lora_" in name:
            changed_adapter |= "lora_B" in name and bool(value.abs().sum() > 0)
            continue
        plain = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(value, base[plain]), name  # base weights bit-identical
    assert changed_adapter
    # merged export: a plain model equal in output to base + adapter; the live one unchanged
    ids = torch.tensor([policy.chat.encode_prompt([{"role": "user", "content": "say z"}])])
    merged = grpo.merged_model()
    assert not isinstance(merged, PeftModel)
    assert not any("lora_" in k for k in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, policy.model(ids).logits, atol=1e-5)
    assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in live.items())


def test_group_advantages_normalize_per_task_and_zero_variance_is_zero():
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5]
    tasks = ["a"] * 4 + ["b"] * 4 + ["c"]
    adv = group_advantages(rewards, tasks, "group")
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()  # Bessel-corrected, as TRL
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-4)
    assert torch.allclose(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(5))  # equal rewards and a group of one: exactly 0
    assert torch.isfinite(adv).all()
    dr = group_advantages(rewards, tasks, "none")
    assert torch.allclose(dr[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    # groups are found by task id, not by position
    mixed = group_advantages([1.0, 0.0, 0.0, 1.0], ["a", "b", "a", "b"], "none")
    assert torch.allclose(mixed, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_all_equal_rewards_give_no_update_and_no_nan(tokenizer):
    policy = make_policy(tokenizer)
    before = weights(policy.model)
    grpo = GRPO(GRPOConfig(group_size=4, learning_rate=1e-2), policy)
    batch = SayTarget(4)(policy, 0)
    for t in batch:
        t.reward = 1.0
    stats = grpo.step(policy, Fixed(list(batch)))
    assert stats.metrics["zero_variance_groups"] == 1.0
    assert stats.metrics["advantage_std"] == 0.0 and stats.metrics["grad_norm"] == 0.0
    assert all(v == v for v in stats.metrics.values())
    assert all(torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())


def _tool_trajectories(policy, tool_ids, tool_logprob, first_logprob_shift=0.0):
    """One task, two samples: prompt | turn (3) | tool output | turn (2) | tool output.

    Generated tokens store log p = -3.4 (about uniform over 31 tokens, so ratio ~ 1); the
    tool outputs (masked out) store `tool_logprob`; the first generated one is shifted.
    """
    prompt = policy.chat.encode_prompt([{"role": "user", "content": "say z"}])
    out = []
    for k, reward in enumerate((1.0, 0.0)):
        turn1, turn2 = [5 + k, 6, 7], [8, 9 + k]
        ids = prompt + turn1 + tool_ids + turn2 + tool_ids
        mask = [0] * len(prompt) + [1] * 3 + [0] * len(tool_ids) + [1] * 2 + [0] * len(tool_ids)
        logprobs = [
            -3.4 if m else (tool_logprob if i >= len(prompt) else 0.0) for i, m in enumerate(mask)
        ]
        logprobs[len(prompt)] += first_logprob_shift
        out.append(Trajectory("t", [], ids, mask, logprobs, len(prompt), reward=reward))
    return out


def _one_step(tokenizer, trajectories, **overrides):
    policy = make_policy(tokenizer)
    grpo = GRPO(GRPOConfig(group_size=2, learning_rate=1e-2, **overrides), policy)
    stats = grpo.step(policy, Fixed(trajectories))
    return weights(policy.model), stats


def test_masked_tokens_get_no_gradient(tokenizer):
    policy = make_policy(tokenizer)
    base, stats = _one_step(tokenizer, _tool_trajectories(policy, [20, 21, 22], 0.0))
    assert stats.metrics["tokens"] == 10  # 5 generated tokens in each of the two trajectories
    # other stored log-probs and other ids at masked-out positions: the very same update
    # (the trailing tool output is never a target; the middle one is context only)
    same, _ = _one_step(tokenizer, _tool_trajectories(policy, [20, 21, 22], -50.0))
    assert all(torch.equal(same[k], base[k]) for k in base)
    trailing = _tool_trajectories(policy, [20, 21, 22], 0.0)
    for t in trailing:
        t.token_ids[-3:] = [11, 12, 13]
    same, _ = _one_step(tokenizer, trailing)
    assert all(torch.equal(same[k], base[k]) for k in base)
    # control: a masked-in token's stored log-prob does change the update
    shifted, _ = _one_step(tokenizer, _tool_trajectories(policy, [20, 21, 22], 0.0, -1.0))
    assert any(not torch.equal(shifted[k], base[k]) for k in base)


def test_clip_fraction_counts_shifted_old_logprobs(tokenizer):
    policy = make_policy(tokenizer)
    batch = SayTarget(8, seed=3)(policy, 0)
    grpo = GRPO(GRPOConfig(group_size=8, learning_rate=1e-3, micro_batch_size=16), policy)
    # the same weights (same seed) with the true log-probs: the ratio is 1 up to float error
    twin = make_policy(tokenizer)
    stats = GRPO(GRPOConfig(group_size=8, learning_rate=1e-3), twin).step(twin, Fixed(batch))
    assert stats.metrics["clip_fraction"] == 0.0
    assert abs(stats.metrics["ratio_mean"] - 1) < 1e-3 and stats.metrics["approx_kl"] < 1e-5
    for t in batch:  # old log-probs 1 nat lower: ratio e > 1 + eps, clipped where A > 0
        t.logprobs = [
            lp - 1.0 if m else lp for lp, m in zip(t.logprobs, t.generated_mask, strict=True)
        ]
    stats = grpo.step(policy, Fixed(list(batch)))
    assert stats.metrics["clip_fraction"] > 0.1
    assert stats.metrics["approx_kl"] > 0.5  # (e - 1) - 1 per token


@pytest.mark.parametrize("lora", [False, True])
def test_state_round_trip_gives_the_same_next_step(tokenizer, lora):
    config = GRPOConfig(
        group_size=4, learning_rate=1e-2, updates_per_batch=2, micro_batch_size=3, lora=lora
    )
    policy = make_policy(tokenizer)
    grpo = GRPO(config, policy)
    grpo.step(policy, SayTarget(4, seed=0))
    state = grpo.state_dict()
    tensors = state.pop("optimizer_tensors")
    state = json.loads(json.dumps(state))  # the rest is JSON
    saved = weights(policy.model)
    a = grpo.step(policy, SayTarget(4, seed=1))

    # full: the checkpointed weights; LoRA: the initial base model (the adapter is in the state)
    resumed = make_policy(tokenizer, seed=0 if lora else 5)
    if not lora:
        resumed.model.load_state_dict(saved)
    again = GRPO(GRPOConfig(group_size=4, lora=lora), resumed)
    again.load_state_dict({**state, "optimizer_tensors": tensors})
    assert again.config == config and again.step_count == 1
    assert all(torch.equal(v, saved[k]) for k, v in resumed.model.state_dict().items())
    b = again.step(resumed, SayTarget(4, seed=1))
    assert a.metrics["loss"] == b.metrics["loss"]
    after_a, after_b = weights(policy.model), weights(resumed.model)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_a_frozen_reference(tokenizer, lora):
    policy = make_policy(tokenizer)
    initial = weights(policy.model)
    config = GRPOConfig(
        group_size=8, learning_rate=1e-2, kl_beta=0.1, clip_epsilon_high=0.28, lora=lora
    )
    grpo, history = train(policy, config, steps=3)
    kls = [s.metrics["kl"] for s in history]
    assert kls[0] < 1e-6 < kls[-1]  # starts at the reference, then moves away
    if lora:  # the reference is the same model with the adapter off
        assert grpo.reference is None
    else:
        assert all(torch.equal(v, initial[k]) for k, v in grpo.reference.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"group_size": 1}, "group_size"),
        ({"learning_rate": 0}, "learning_rate"),
        ({"clip_epsilon": 1.5}, "clip_epsilon"),
        ({"clip_epsilon_high": -0.1}, "clip_epsilon_high"),
        ({"kl_beta": -1}, "kl_beta"),
        ({"scale_rewards": "batch"}, "scale_rewards"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"updates_per_batch": 0}, "updates_per_batch"),
        ({"adam_betas": (0.9, 1.0)}, "adam_betas"),
        ({"lora": True, "lora_target_modules": ()}, "lora_target_modules"),
        ({"lora_rank": 0}, "lora_rank"),
    ],
)
def test_bad_config_is_explained(overrides, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**overrides)


def test_sequence_mean_equals_token_mean_for_equal_lengths(tokenizer):
    policy = make_policy(tokenizer)
    batch = _tool_trajectories(policy, [20, 21, 22], 0.0)  # 5 generated tokens each
    token, _ = _one_step(tokenizer, batch)
    sequence, _ = _one_step(tokenizer, batch, loss_aggregation="sequence_mean")
    assert all(torch.allclose(token[k], sequence[k], atol=1e-7) for k in token)
    batch[0].generated_mask[-4] = 0  # now 4 and 5 tokens: the two weightings differ
    token, _ = _one_step(tokenizer, batch)
    sequence, _ = _one_step(tokenizer, batch, loss_aggregation="sequence_mean")
    assert any(not torch.allclose(token[k], sequence[k], atol=1e-7) for k in token)


def test_gradient_checkpointing_gives_the_same_update(tokenizer):
    policy = make_policy(tokenizer)
    batch = _tool_trajectories(policy, [20, 21, 22], 0.0)
    plain, _ = _one_step(tokenizer, batch)
    checkpointed, _ = _one_step(tokenizer, batch, gradient_checkpointing=True)
    assert GRPO(GRPOConfig(gradient_checkpointing=True), policy).model.is_gradient_checkpointing
    assert all(torch.allclose(plain[k], checkpointed[k], atol=1e-6) for k in plain)


def test_mismatched_resume_is_refused(tokenizer):
    policy = make_policy(tokenizer)
    grpo = GRPO(GRPOConfig(group_size=4), policy)
    state = grpo.state_dict()
    with pytest.raises(ValueError, match="lora"):
        grpo.load_state_dict({**state, "config": {**state["config"], "lora": True}})
    with pytest.raises(ValueError, match="optimizer_tensors"):
        grpo.load_state_dict({k: v for k, v in state.items() if k != "optimizer_tensors"})


def test_multi_turn_env_rollout_is_on_policy_at_the_first_update():
    """Real multi-turn trajectories (env feedback between turns, masked out): GRPO's forward
    pass reproduces the sampling-time log-probs, so the first update's ratio is 1."""
    from copes.agents.rollout import rollout
    from copes.agents.tiny_recipe import train_tokenizer
    from copes.envs.presets import tool_qa_env
    from copes.envs.tasks.synthetic import synthetic_qa_tasks

    tasks = synthetic_qa_tasks("validation", 2, seed=1)
    # byte-level BPE (the embedded agent's recipe): every character and tool tag is encodable
    policy = make_policy(train_tokenizer([t.question for t in tasks], vocab_size=300))
    envs = [tool_qa_env(tasks=[t], max_turns=3) for t in tasks for _ in range(4)]
    batch = rollout(policy, envs, SamplingConfig(max_new_tokens=12, seed=0))
    assert all(t.turns > 1 for t in batch)  # tool-less random turns get feedback, continue
    for i, t in enumerate(batch):
        t.reward = float(i % 4)  # rewards that differ inside each group: every A != 0
    grpo = GRPO(GRPOConfig(group_size=4, learning_rate=1e-3, micro_batch_size=3), policy)
    stats = grpo.step(policy, Fixed(list(batch)))
    assert stats.metrics["trained_trajectories"] == 8
    assert stats.metrics["tokens"] == sum(t.num_generated_tokens for t in batch)
    assert abs(stats.metrics["ratio_mean"] - 1) < 1e-4 and stats.metrics["approx_kl"] < 1e-6
    assert stats.metrics["clip_fraction"] == 0.0
