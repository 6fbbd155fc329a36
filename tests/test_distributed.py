"""copes.distributed on a local Ray (2 CPU actors, the tiny agent).

W = 1 and W = 2 give the one-process weights bit for bit; a worker SIGKILLed as a step starts
is replaced, rebuilt from the checkpoint plus the seed log, and the run's result does not
change; diverged replicas are an error; missing Ray is explained.

The runs use `--invalid-penalty 0.1` and sigma 0.05 so that members really score differently
(the tiny agent's answers are all wrong, so without shaping every reward is 0, the update is
zero and "identical weights" would prove nothing).
"""

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from copes.cli import parse_train_args, train_main
from copes.distributed import RayPopulation, ReplicaMismatchError, ReplicaSpec
from copes.optimizers.configs import CoPESConfig
from copes.run_log import read_jsonl
from copes.train import Trainer

# A worker is killed as a step starts (timed by polling the run's folder): in the xdist group
# of the wall-clock checks, so never beside the CPU hogs of test_grading_under_load.
pytestmark = pytest.mark.xdist_group("timing")

RUN = [
    "--optimizer", "copes", "--population-size", "4", "--num-subspaces", "2", "--sigma", "0.05",
    "--learning-rate", "0.01", "--invalid-penalty", "0.1", "--batch-size", "4",
    "--max-new-tokens", "32", "--max-turns", "3", "--num-train-tasks", "50", "--eval-tasks", "2",
    "--eval-every", "0", "--checkpoint-every", "1", "--steps", "2", "--no-progress",
    "--no-tensorboard",
]  # fmt: skip


def test_more_gpus_than_the_machine_has_fail_at_once(tmp_path):
    """Runs before the module's Ray is up: this population starts (and stops) its own."""
    assert not ray.is_initialized()
    spec = ReplicaSpec(policy_factory=print, model_path="unused", rollout_factory=list,
                       optimizer_config=CoPESConfig(), gpus_per_worker=1.0)  # fmt: skip
    population = RayPopulation(spec, None, workers=torch.cuda.device_count() + 1, run_dir=tmp_path)
    assert not ray.is_initialized()  # built with the run; Ray starts on the first step
    with pytest.raises(RuntimeError, match=r"short of \['GPU'\]"):
        population.start(0)
    assert not ray.is_initialized()  # the Ray it started is stopped again


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (2 CPUs, no dashboard), always shut down; torch on one
    thread in this process too, as in the actors (the machine's cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tiny_agent_dir):
    return ["--model", str(tiny_agent_dir)]


@pytest.fixture(scope="module")
def reference(local_ray, tiny, tmp_path_factory) -> Path:
    """The run in one process, without Ray (--workers 0)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train_main([*RUN, *tiny, "--out-dir", str(out)]) == 0
    return out


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "step-000002" / "model.safetensors"))


def assert_same_run(run: Path, reference: Path) -> None:
    rewards = [e["rewards"] for e in read_jsonl(run / "es_log.jsonl")]
    assert rewards == [e["rewards"] for e in read_jsonl(reference / "es_log.jsonl")]
    assert any(len(set(r)) > 1 for r in rewards)  # real, non-zero updates were applied
    ours, theirs = final_weights(run), final_weights(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_the_one_process_weights_bit_for_bit(
    local_ray, reference, tiny, tmp_path, workers
):
    out = tmp_path / f"w{workers}"
    args = [*RUN, *tiny, "--workers", str(workers), "--checksum-every", "1", "--out-dir", str(out)]
    if workers == 1:  # also: --resume starts fresh actors from the checkpoint (checksummed)
        assert train_main([*args, "--steps", "1"]) == 0
        assert train_main([*args, "--resume"]) == 0
    else:
        assert train_main(args) == 0
    assert_same_run(out, reference)
    record = next(r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train")
    assert record["workers"] == workers and record["worker_restarts"] == 0
    initial = load_file(str(Path(tiny[1]) / "model.safetensors"))
    trained = final_weights(out)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)


@pytest.mark.slow
def test_low_rank_members_on_a_worker_resumed_match_one_process(local_ray, tiny, tmp_path):
    """--noise lowrank travels as seeds too: a Ray worker, stopped after one step and resumed
    from the checkpoint, ends with the one-process run's weights bit for bit."""
    low = [*RUN, *tiny, "--noise", "lowrank", "--noise-rank", "2"]
    one = tmp_path / "one"
    assert train_main([*low, "--out-dir", str(one)]) == 0
    out = tmp_path / "ray"
    args = [*low, "--workers", "1", "--checksum-every", "1", "--out-dir", str(out)]
    assert train_main([*args, "--steps", "1"]) == 0
    assert train_main([*args, "--resume"]) == 0
    assert_same_run(out, one)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="kills a worker with SIGKILL")
def test_worker_sigkilled_mid_step_is_replaced_and_the_result_is_unchanged(
    local_ray, reference, tiny, tmp_path
):
    out = tmp_path / "killed"
    config, optimizer, _ = parse_train_args([*RUN, *tiny, "--workers", "2", "--out-dir", str(out)])
    trainer = Trainer(config, optimizer)
    seen: dict = {}

    def kill_a_worker_during_step_1() -> None:
        deadline = time.time() + 600
        while not (out / "checkpoints" / "latest").exists():  # step 0 done and checkpointed
            assert time.time() < deadline
            time.sleep(0.002)
        # Step 1 starts now: its members go to the actors. Killed here, not once an actor's
        # CPU time moves: a tiny agent's member is a few clock ticks of CPU, and on an AMD
        # EPYC with AVX-512 the whole step's members were done before either actor's CPU time
        # showed 0.02 s (and one actor sometimes got no member at all).
        pid = trainer.evaluator.worker_pids()[0]
        seen["steps_logged"] = len(read_jsonl(out / "es_log.jsonl"))
        os.kill(pid, signal.SIGKILL)
        seen["pid"] = pid

    killer = threading.Thread(target=kill_a_worker_during_step_1, daemon=True)
    killer.start()
    trainer.run()
    killer.join(timeout=60)
    assert seen["steps_logged"] == 1  # killed inside step 1, before its result existed
    population = trainer.evaluator
    assert population.restarts == 1
    (rebuilt,) = population.rebuilds
    assert rebuilt["pid"] != seen["pid"]
    assert Path(rebuilt["source"]).name == "step-000001"  # the checkpoint, then the seed log
    assert_same_run(out, reference)


@pytest.mark.slow
def test_rebuild_from_the_initial_model_and_diverged_replicas_are_an_error(
    local_ray, reference, tiny, tmp_path
):
    config, optimizer, _ = parse_train_args([*RUN, *tiny, "--workers", "2", "--out-dir",
                                             str(tmp_path / "run")])  # fmt: skip
    trainer = Trainer(config, optimizer)
    population = trainer.evaluator  # Ray and the actors start on the first step
    try:
        first = trainer.optimizer.step(trainer.policy, trainer.train_rollout)
        os.kill(population.worker_pids()[1], signal.SIGKILL)  # idle, between steps
        stats = trainer.optimizer.step(trainer.policy, trainer.train_rollout)  # replaced
        assert stats.metrics["worker_restarts"] == 1
        (rebuilt,) = population.rebuilds
        assert rebuilt["source"] == tiny[1] and rebuilt["replayed_steps"] == 1  # no checkpoint
        expected = [e["rewards"] for e in read_jsonl(reference / "es_log.jsonl")]
        assert [first.log["rewards"], stats.log["rewards"]] == expected
        ref = final_weights(reference)
        assert all(torch.equal(ref[n], t) for n, t in trainer.policy.model.state_dict().items()
                   if n in ref)  # fmt: skip
        ray.get(population._workers[0].tell.remote(2, [1.0, 0.0, 0.0, 0.0]))  # diverge one
        with pytest.raises(ReplicaMismatchError, match="worker 0"):
            population.verify(trainer.policy.weights().checksum())
    finally:
        population.close()
        trainer.train_rollout.close()
        trainer.eval_rollout.close()


def test_workers_without_ray_say_how_to_install_it(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    code = train_main([*RUN, *tiny, "--workers", "2", "--out-dir", str(tmp_path / "run")])
    assert code == 2
    assert 'pip install "copes[ray]"' in capsys.readouterr().err


def test_workers_are_for_es_only(capsys):
    assert train_main(["--optimizer", "grpo", "--workers", "2"]) == 2
    assert "ES/CoPES" in capsys.readouterr().err
