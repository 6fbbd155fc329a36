"""copes envs in verifiers (v1), offline: verifiers' loaders find copes' harness and taskset;
the tiny agent's episodes through verifiers' interception server and scoring equal its own
copes rollouts token for token, reward for reward; one CoPES step trains through verifiers."""

import pytest

pytest.importorskip("verifiers.v1")

from copes.agents.policy import SamplingConfig


@pytest.fixture(autouse=True)
def verifiers_home(tmp_path_factory, monkeypatch):
    """verifiers' subprocess runtime makes a work folder per rollout under its cache."""
    import verifiers.v1.runtimes.subprocess as subprocess_runtime

    cache = tmp_path_factory.mktemp("verifiers-cache")
    monkeypatch.setattr(subprocess_runtime, "CACHE_DIR", cache)


def _taskset(limit: int = 12):
    from copes.integrations.verifiers import TASKSET_ID, CopesTasksetConfig

    return CopesTasksetConfig(
        id=TASKSET_ID, benchmark="synthetic-math", split="train", limit=limit,
        env_kwargs={"max_turns": 3, "invalid_penalty": 0.2},
    )  # fmt: skip


def test_verifiers_loads_copes_harness_and_taskset_by_id():
    from verifiers.v1.utils.loaders import harness_class, taskset_class

    from copes.integrations.verifiers import HARNESS_ID, CopesHarness, CopesTaskset

    assert harness_class(HARNESS_ID) is CopesHarness
    assert taskset_class(HARNESS_ID) is CopesTaskset
    tasks = list(CopesTaskset(_taskset(5)))
    assert len(tasks) == 5 and tasks[0].data.copes_task["kind"] == "math"


def test_episodes_through_verifiers_equal_copes_rollouts(tiny_policy):
    """Greedy: each verifiers trace has one token branch, equal to copes' own rollout of the
    task (ids, generated mask, log-probs), and verifiers' score equals copes' reward."""
    import gymnasium as gym

    from copes.agents.rollout import rollout
    from copes.envs.tasks.base import task_from_dict
    from copes.integrations.verifiers import VerifiersRollout

    sampling = SamplingConfig(max_new_tokens=64, temperature=0.0)
    through = VerifiersRollout(_taskset(), batch_size=4, sampling=sampling, seed=3)
    batch = through(tiny_policy, 0)
    assert len(batch) == 4 and batch.stats.generate_calls >= 4
    assert any(t.tool_calls for t in batch)  # the tools ran inside the harness
    for trajectory, trace in zip(batch, through.last_traces, strict=True):
        task = task_from_dict(trace.task.data.copes_task)
        env = gym.make("ToolMath-v0", tasks=[task], max_turns=3, invalid_penalty=0.2)
        try:
            [own] = rollout(tiny_policy, [env], sampling, options=[{"task": task}],
                            continuous_batching=False)  # fmt: skip
        finally:
            env.close()
        assert trajectory.token_ids == own.token_ids
        assert trajectory.generated_mask == own.generated_mask
        assert trajectory.logprobs == pytest.approx(own.logprobs, abs=1e-6)
        assert trajectory.reward == pytest.approx(own.reward)
        assert trace.rewards["copes_reward"].score == pytest.approx(own.reward)
        assert (trajectory.correct, trajectory.turns) == (own.correct, own.turns)


@pytest.mark.slow
def test_a_copes_step_trains_through_verifiers(tiny_policy):
    from copes.integrations.verifiers import VerifiersRollout
    from copes.optimizers.es import CoPES, CoPESConfig

    sampling = SamplingConfig(max_new_tokens=64, temperature=0.0)
    through = VerifiersRollout(_taskset(), batch_size=4, sampling=sampling, seed=3)
    weights = tiny_policy.weights()
    before = weights.checksum()
    saved = {name: t.clone() for name, t in weights.master_state().items()}
    optimizer = CoPES(CoPESConfig(population_size=4, num_subspaces=2, sigma=0.01,
                                  learning_rate=0.01, seed=0))  # fmt: skip
    try:
        stats = optimizer.step(tiny_policy, through, 0)
        rewards = stats.log["rewards"]
        assert len(rewards) == 4 and len(set(rewards)) > 1  # the members differ
        assert weights.checksum() != before  # and the update landed
    finally:
        weights.load_master_state(saved)  # the session's policy, as other tests expect it
    assert weights.checksum() == before


def test_a_grpo_step_trains_on_verifiers_traces(tiny_policy):
    """GRPO trains on the ids and log-probs the traces carry: its importance ratio at the
    first update is 1 (the recorded log-probs are the model's own) and the weights move."""
    import torch

    from copes.integrations.verifiers import VerifiersRollout
    from copes.optimizers.grpo import GRPO, GRPOConfig

    model = tiny_policy.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        torch.manual_seed(0)
        optimizer = GRPO(GRPOConfig(group_size=4, micro_batch_size=4, learning_rate=1e-4),
                         tiny_policy)  # fmt: skip
        through = VerifiersRollout(
            _taskset(), batch_size=2, sampling=SamplingConfig(64, temperature=1.0), seed=3,
            samples_per_task=optimizer.samples_per_task,
        )  # fmt: skip
        stats = optimizer.step(tiny_policy, through, 0)
        assert stats.metrics["trained_trajectories"] >= 4
        assert stats.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
    finally:
        model.load_state_dict(saved)
        model.eval()
        tiny_policy.weights().sync_from_working()
