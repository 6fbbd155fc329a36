"""The batched population evaluator: every batch row computes with its own member's weights,
and a step's rewards equal sequential evaluation's (float64: exactly)."""

import pytest
import torch

from copes.agents.hf.population import StackedModel
from copes.weights import Perturbation, Subspace, WeightSpace


def _tiny_config(model_type: str):
    from transformers import AutoConfig

    shape = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    if model_type == "qwen3":
        shape["head_dim"] = 8
    if model_type == "llama":
        shape["tie_word_embeddings"] = False
    if model_type == "qwen3_moe":
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if model_type == "gemma3_text":
        shape.update(head_dim=8, query_pre_attn_scalar=8, sliding_window=16)
    return AutoConfig.for_model(model_type, **shape)


def _random_model(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_tiny_config(model_type), dtype=torch.float64).eval()


def _members(n: int, k: int = 2) -> list[Perturbation]:
    return [Perturbation(m, 1000 + m, Subspace(7, k, m % k), 1, 0.05) for m in range(n)]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
@torch.no_grad()
def test_each_row_computes_with_its_own_members_weights(model_type):
    """Qwen2 (biases), Qwen3 (per-head q/k norms), Llama (untied head): logits of
    a mixed batch (rows of 3 members, unsorted, one member absent) equal each member's own
    forward pass."""
    model = _random_model(model_type)
    weights = WeightSpace.from_module(model)
    members = _members(4)
    stacked = StackedModel(model, len(members))
    expected = {}
    ids = torch.randint(0, 96, (6, 5), generator=torch.Generator().manual_seed(1))
    rows = [2, 0, 2, 1, 0, 2]
    for slot, member in enumerate(members):
        weights.perturb(member)
        stacked.fill(slot)
        expected[slot] = model(input_ids=ids).logits
        weights.restore()
    plain = model(input_ids=ids).logits
    before = [(n, id(p)) for n, p in model.named_parameters()]
    with stacked.active():
        stacked.select(rows)
        got = model(input_ids=ids).logits
    for row, member in enumerate(rows):
        torch.testing.assert_close(got[row], expected[member][row], rtol=0, atol=1e-10)
        assert not torch.allclose(got[row], plain[row])  # the member's noise is there
    # Outside `active` the model is itself again, parameters and all.
    torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)
    assert [(n, id(p)) for n, p in model.named_parameters()] == before


@pytest.mark.parametrize(
    ("model_type", "why"),
    [("gemma3_text", "Embedding with its own forward"), ("qwen3_moe", "outside a Linear")],
)
def test_models_it_cannot_batch_exactly_are_refused(model_type, why):
    """Gemma's scaled embedding and fused MoE experts would silently use one member's
    weights for every row: refused when wrapped, naming the module and the way out."""
    model = _random_model(model_type)
    with pytest.raises(ValueError, match=why) as err:
        StackedModel(model, 2)
    assert "--population-eval sequential" in str(err.value)


def test_select_must_match_the_batch():
    model = _random_model("qwen2")
    stacked = StackedModel(model, 2)
    ids = torch.zeros((3, 2), dtype=torch.long)
    with stacked.active(), pytest.raises(RuntimeError, match="2 row members selected"):
        stacked.select([0, 1])
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        stacked.select([0, 2])


def _rollout(tiny_policy_64, temperature: float, tasks: int = 4):
    from copes.agents.policy import SamplingConfig
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks
    from copes.train import TaskRollout

    pool = synthetic_math_tasks("train", 40, seed=5)
    sampling = SamplingConfig(max_new_tokens=48, temperature=temperature)
    make_env = lambda: tool_math_env(tasks=pool[:1], invalid_penalty=0.2)  # noqa: E731
    return TaskRollout(make_env, pool, tasks, 1, sampling, 7)


@pytest.fixture(scope="module")
def tiny_policy_64(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    policy = HFPolicy.from_pretrained(tiny_agent_dir, device="cpu")
    policy.model.to(torch.float64)
    return policy


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_step_equals_sequential_in_float64(tiny_policy_64, temperature):
    """A CoPES K=2 step: the batched evaluator gives every member the reward sequential
    evaluation gives it (greedy, and sampled: each episode keeps its own stream), and the
    update lands on the same weights."""
    from copes.optimizers.batched import BatchedEvaluator
    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES, LocalEvaluator

    policy = tiny_policy_64
    rollout = _rollout(policy, temperature)
    config = CoPESConfig(
        population_size=4, num_subspaces=2, sigma=0.05, learning_rate=0.01, antithetic=True
    )
    try:
        start = policy.weights().master_state()
        start = {k: v.clone() for k, v in start.items()}
        sequential = CoPES(config, LocalEvaluator(policy, rollout))
        batched = CoPES(config, BatchedEvaluator(policy, rollout, config.population_size))
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
    finally:
        policy.weights().load_master_state(start)
        rollout.close()


def test_refuses_when_the_copies_do_not_fit(tiny_policy):
    from copes.optimizers.batched import BatchedEvaluator

    rollout = _rollout(tiny_policy, 0.0)
    try:
        with pytest.raises(ValueError, match="16 copies of the weights") as err:
            BatchedEvaluator(tiny_policy, rollout, 16, free_bytes=10_000_000)
        assert "--population-eval sequential" in str(err.value)
    finally:
        rollout.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizer", "grpo"], "grpo has none"),
        (["--optimizer", "copes", "--workers", "2"], "--workers 0"),
        (["--optimizer", "copes", "--population-eval", "parallel"], "unknown --population-eval"),
        (["--optimizer", "copes", "--backend", "vllm"], "add --noise lowrank"),
    ],
)
def test_batched_flag_errors_are_one_line(flags, message, capsys):
    from copes.cli import train_main

    args = ["--population-eval", "batched", *flags, "--steps", "1", "--dry-run"]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_dry_run_plans_the_stacked_copies(capsys):
    import json

    from copes.cli import train_main

    args = ["--optimizer", "copes", "--population-eval", "batched", "--population-size", "8",
            "--batch-size", "4", "--steps", "1", "--dry-run"]  # fmt: skip
    assert train_main(args) == 0
    memory = json.loads(capsys.readouterr().out)["memory_bytes"]
    batched = memory["copes (--population-eval batched, N=8)"]
    assert batched["population_weights"] == 8 * batched["weights"]
    assert batched["kv_cache"] == 8 * memory["copes"]["kv_cache"]  # 8 x 4 rows at once


@pytest.mark.slow
def test_copes_train_batched_trains_the_same_weights(tmp_path, tiny_agent_dir):
    """Through copes-train: the same logged rewards and the same checkpoint as sequential."""
    from copes.cli import train_main
    from copes.run_log import read_jsonl

    common = [
        "--model", str(tiny_agent_dir), "--optimizer", "copes", "--population-size", "4",
        "--num-subspaces", "2", "--sigma", "0.05", "--learning-rate", "0.01", "--batch-size",
        "4", "--max-new-tokens", "48", "--eval-tasks", "4", "--num-train-tasks", "50",
        "--steps", "2", "--no-progress", "--report-to", "none", "--invalid-penalty", "0.2",
    ]  # fmt: skip
    for mode in ("sequential", "batched"):
        out = tmp_path / mode
        assert train_main([*common, "--population-eval", mode, "--output-dir", str(out)]) == 0
    logs = [read_jsonl(tmp_path / m / "es_log.jsonl") for m in ("sequential", "batched")]
    assert [e["rewards"] for e in logs[0]] == [e["rewards"] for e in logs[1]]
    assert len(set(logs[0][0]["rewards"])) > 1
    files = [tmp_path / m / "checkpoints" / "step-000002" / "model.safetensors"
             for m in ("sequential", "batched")]  # fmt: skip
    assert files[0].read_bytes() == files[1].read_bytes()
