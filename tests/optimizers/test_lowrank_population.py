"""Low-rank members served as per-row adapters (`LowRankPopulation`): every batch row
computes with its own member's delta, and a batched step's rewards equal sequential
evaluation's of the same low-rank members (float64)."""

import pytest
import torch

from copes.agents.hf.population import LowRankPopulation, StackedModel
from copes.weights import Perturbation, Subspace, WeightSpace
from tests.optimizers.test_batched_population import _random_model, _rollout


def _members(n: int, k: int = 2, rank: int = 2) -> list[Perturbation]:
    return [
        Perturbation(m, 1000 + m, Subspace(7, k, m % k), 1 - 2 * (m % 2), 0.05, rank)
        for m in range(n)
    ]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
@torch.no_grad()
def test_each_row_computes_with_its_own_members_adapter(model_type):
    """Qwen2, Qwen3, Llama (random, untied heads; the tiny agent's tied head is covered by
    the step tests): logits of a mixed batch equal each member's own forward pass with its
    delta added to the weights."""
    model = _random_model(model_type)
    weights = WeightSpace.from_module(model)
    weights.restore()  # the working weights are now exactly the master's
    members = _members(4)
    population = LowRankPopulation(model, weights, len(members), rank=2)
    ids = torch.randint(0, 96, (6, 5), generator=torch.Generator().manual_seed(1))
    rows = [2, 0, 2, 1, 0, 2]
    expected = {}
    for slot, member in enumerate(members):
        weights.perturb(member)
        expected[slot] = model(input_ids=ids).logits
        weights.restore()
        population.load(slot, weights.low_rank_factors(member))
    plain = model(input_ids=ids).logits
    with population.active():
        population.select(rows)
        got = model(input_ids=ids).logits
    for row, member in enumerate(rows):
        torch.testing.assert_close(got[row], expected[member][row], rtol=0, atol=1e-10)
        assert not torch.allclose(got[row], plain[row])  # the member's delta is there
    torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)  # unhooked
    # Adapters, not copies: N x (rows + cols) x r per matrix.
    assert population.nbytes() == LowRankPopulation.bytes_needed(model, 4, 2)
    assert population.nbytes() < 0.2 * StackedModel.bytes_needed(model, 4)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("gemma3_text", "Gemma3TextScaledWordEmbedding"),
        ("qwen3_moe", "cannot serve model.layers.0.mlp"),
    ],
)
def test_matrices_it_cannot_serve_as_adapters_are_refused(model_type, why):
    model = _random_model(model_type)
    with pytest.raises(ValueError, match=why) as err:
        LowRankPopulation(model, WeightSpace.from_module(model), 2, rank=1)
    assert "--population-eval sequential" in str(err.value)


def test_factors_must_match_the_population(tiny_policy):
    weights = tiny_policy.weights()
    population = LowRankPopulation(tiny_policy.model, weights, 2, rank=1)
    factors = weights.low_rank_factors(_members(1, rank=1)[0])
    factors.pop(next(iter(factors)))
    with pytest.raises(ValueError, match="cover exactly"):
        population.load(0, factors)


@pytest.fixture(scope="module")
def tiny_policy_64(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    policy = HFPolicy.from_pretrained(tiny_agent_dir, device="cpu")
    policy.model.to(torch.float64)
    policy.weights().restore()
    return policy


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_low_rank_batched_step_equals_sequential_in_float64(tiny_policy_64, temperature):
    """CoPES K=2 with --noise lowrank: served as adapters, every member gets the reward (and
    the tokens) it gets with its delta in the weights, and the update is the same."""
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES, LocalEvaluator

    policy = tiny_policy_64
    rollout = _rollout(policy, temperature)
    config = CoPESConfig(
        population_size=4, num_subspaces=2, sigma=0.05, learning_rate=0.01, antithetic=True,
        noise="lowrank", noise_rank=2,
    )  # fmt: skip
    start = {k: v.clone() for k, v in policy.weights().master_state().items()}
    try:
        sequential = CoPES(config, LocalEvaluator(policy, rollout))
        batched = CoPES(config, BatchedEvaluator(policy, rollout, 4, rank=2))
        members = sequential.ask(0)
        seq = sequential.evaluator.evaluate(0, members)
        bat = batched.evaluator.evaluate(0, members)
        assert [r.reward for r in bat] == [r.reward for r in seq]
        assert [r.generated_tokens for r in bat] == [r.generated_tokens for r in seq]
        assert len({r.reward for r in seq}) > 1  # the members differ: the test can fail
        sequential.tell(0, members, [r.reward for r in seq], policy.weights())
        after_sequential = policy.weights().checksum()
        policy.weights().load_master_state(start)
        batched.step(policy, rollout, 0)
        assert policy.weights().checksum() == after_sequential
        with pytest.raises(ValueError, match="serves rank-2 members"):
            batched.evaluator.evaluate(1, CoPES(CoPESConfig(4, 2)).ask(1))
    finally:
        policy.weights().load_master_state(start)
        rollout.close()


def test_refuses_when_the_factors_do_not_fit(tiny_policy):
    from copes.optimizers.batched import BatchedEvaluator

    rollout = _rollout(tiny_policy, 0.0)
    try:
        with pytest.raises(ValueError, match="16 members' rank-4 factors"):
            BatchedEvaluator(tiny_policy, rollout, 16, free_bytes=100_000, rank=4)
    finally:
        rollout.close()


def test_a_perturbed_matrix_no_linear_uses_is_refused():
    """A raw 2-D parameter (as fused MoE experts hold) has no module an adapter could hook."""

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(3, 4)
            self.experts = torch.nn.Parameter(torch.zeros(2, 3, 3))

    model = Experts()
    with pytest.raises(ValueError, match="cannot serve experts as an adapter: no Linear"):
        LowRankPopulation(model, WeightSpace.from_module(model), 2, rank=1)


def test_dry_run_plans_the_adapters_not_copies(capsys):
    import json

    from copes.cli import train_main

    args = ["--optimizer", "copes", "--population-eval", "batched", "--population-size", "8",
            "--batch-size", "4", "--steps", "1", "--dry-run", "--noise", "lowrank",
            "--noise-rank", "2"]  # fmt: skip
    assert train_main(args) == 0
    memory = json.loads(capsys.readouterr().out)["memory_bytes"]
    batched = memory["copes (--population-eval batched, --noise lowrank r=2, N=8)"]
    assert batched["population_weights"] == 0
    # 8 members x rank 2 x (rows + cols) of every matrix, in bf16: far below one weight copy
    assert 0 < batched["population_adapters"] < 0.5 * batched["weights"]
    assert batched["kv_cache"] == 8 * memory["copes"]["kv_cache"]


def test_dry_run_on_vllm_without_vllm_says_its_slot_rank_is_unknown(capsys):
    """Where vllm is not installed the plan cannot know vLLM's padded LoRA rank: its key says
    so (the vLLM suite checks the padded plan)."""
    import importlib.util
    import json

    from copes.cli import train_main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed: tests/agents/test_vllm_population.py checks this plan")
    args = ["--optimizer", "copes", "--population-eval", "batched", "--population-size", "8",
            "--batch-size", "4", "--steps", "1", "--dry-run", "--noise", "lowrank",
            "--noise-rank", "2", "--backend", "vllm"]  # fmt: skip
    assert train_main(args) == 0
    memory = json.loads(capsys.readouterr().out)["memory_bytes"]
    (key,) = [k for k in memory if "batched" in k]
    assert "vLLM's padded slot rank unknown: vllm is not installed" in key


@pytest.mark.slow
def test_copes_train_low_rank_batched_and_sequential(tmp_path, tiny_agent_dir):
    """Through copes-train on the float32 tiny agent: both evaluators run the low-rank
    family; the logged rewards agree member by member (float32 rounding could flip a
    greedy token: this run's are all equal) and the trained weights differ from the start."""
    from safetensors.torch import load_file

    from copes.cli import train_main
    from copes.run_log import read_jsonl

    common = [
        "--model", str(tiny_agent_dir), "--optimizer", "copes", "--population-size", "4",
        "--num-subspaces", "2", "--sigma", "0.05", "--learning-rate", "0.01", "--batch-size",
        "4", "--max-new-tokens", "48", "--eval-tasks", "2", "--num-train-tasks", "50",
        "--steps", "1", "--no-progress", "--report-to", "none", "--invalid-penalty", "0.2",
        "--noise", "lowrank", "--noise-rank", "2",
    ]  # fmt: skip
    for mode in ("sequential", "batched"):
        out = tmp_path / mode
        assert train_main([*common, "--population-eval", mode, "--output-dir", str(out)]) == 0
    logs = [read_jsonl(tmp_path / m / "es_log.jsonl") for m in ("sequential", "batched")]
    assert [e["rewards"] for e in logs[0]] == [e["rewards"] for e in logs[1]]
    assert len(set(logs[0][0]["rewards"])) > 1
    initial = load_file(str(tiny_agent_dir / "model.safetensors"))
    trained = load_file(str(tmp_path / "batched" / "checkpoints" / "step-000001" /
                            "model.safetensors"))  # fmt: skip
    changed = {k for k in initial if not torch.equal(initial[k], trained[k])}
    assert changed and all(initial[k].dim() >= 2 for k in changed)  # 1-D tensors held still
