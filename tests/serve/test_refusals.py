"""Every refusal is a clear HTTP error and changes nothing: unknown, closed and future
members, stale policy names, requests after a reward, second and non-finite rewards, a model
that is not the session's, n > 1, logit_bias, a context over the limit; retries get the
recorded reply; a non-loopback address needs a key; a step without every reward fails whole."""

import threading

import httpx
import pytest

from copes.agents.policy import SamplingConfig


@pytest.fixture
def server(tiny_policy):
    from copes.serve import PolicyServer

    server = PolicyServer(tiny_policy, SamplingConfig(max_new_tokens=24, temperature=0.0))
    server.start()
    yield server
    server.stop()


def _tasks(n: int = 2):
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks

    return synthetic_math_tasks("train", n, seed=5)


def _chat(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "1+1?"}], **extra}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=60)


def _code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_model_names_and_request_fields_are_refused_with_their_reason(server):
    from copes.serve import SessionSpec

    tasks = _tasks()
    served = server.open_step(3, [SessionSpec(m, m, t) for m, t in enumerate(tasks)])
    run, v1 = server.run_id, f"{server.base_url}/v1"
    s0, s1 = served.sessions
    session = f"{server.base_url}/s/{s0.id}/v1"
    assert _code(_chat(v1, "nope")) == (404, "model_not_found")
    assert _code(_chat(v1, f"{run}.s3.m7")) == (404, "model_not_found")
    assert _code(_chat(v1, "other-run.s3.m0")) == (404, "model_not_found")
    assert _code(_chat(v1, f"{run}.s2.m0")) == (409, "step_closed")
    assert _code(_chat(v1, f"{run}.s4.m0")) == (409, "step_not_open")
    assert _code(_chat(v1, f"{run}.s3.m0")) == (400, "session_required")
    assert _code(_chat(v1, "policy@5")) == (409, "model_stale")
    assert _code(_chat(session, s1.model)) == (400, "model_not_session")
    assert _code(_chat(f"{server.base_url}/s/none/v1", s0.model)) == (404, "session_not_found")
    for field, value in [("n", 2), ("logit_bias", {"5": 10}), ("stream", True), ("seed", 1),
                         ("temperature", 0.7), ("top_logprobs", 3),
                         ("tool_choice", "required")]:  # fmt: skip
        response = _chat(session, s0.model, **{field: value})
        assert response.status_code == 400, field
        assert field in response.json()["error"]["message"]
    models = httpx.get(f"{v1}/models").json()["data"]
    assert [m["id"] for m in models] == ["policy@0", s0.model, s1.model]
    # Rewards: a number, finite, once; after it the session takes no request.
    reward = f"{server.base_url}/copes/v1/sessions/{s0.id}/reward"
    for bad in ('{"reward": NaN}', '{"reward": Infinity}', '{"reward": "1"}', "{}"):
        response = httpx.post(reward, content=bad, headers={"content-type": "application/json"})
        assert response.status_code == 400, bad
    assert httpx.post(reward, json={"reward": 0.25, "correct": False}).status_code == 200
    assert _code(httpx.post(reward, json={"reward": 1.0})) == (409, "reward_exists")
    assert s0.reward == 0.25
    assert _code(_chat(session, s0.model)) == (409, "session_ended")
    assert s0.turns == [] and s1.turns == [] and s1.reward is None  # nothing else changed
    server.close_step(served)
    assert _code(_chat(session, s0.model)) == (404, "session_not_found")


def test_a_retry_gets_the_recorded_reply_and_an_overlong_turn_changes_nothing(server, tiny_policy):
    from copes.serve import HttpHarness, SessionSpec
    from copes.serve.training import _serve_step

    (task,) = _tasks(1)
    served = server.open_step(0, [SessionSpec(None, None, task)], "validation")
    runner = threading.Thread(
        target=_serve_step, args=(server, HttpHarness(), served, tiny_policy, server.sampling)
    )
    runner.start()
    (session,) = served.sessions
    url = f"{server.base_url}/s/{session.id}/v1"
    try:
        too_long = _chat(url, session.model, max_tokens=10**6)
        assert _code(too_long) == (400, "context_length_exceeded")
        first = _chat(url, session.model).json()
        again = _chat(url, session.model).json()
        assert again == first  # the recorded reply, not a new sample
        assert len(session.turns) == 1
        with pytest.raises(httpx.HTTPStatusError):
            _chat(url, session.model, max_tokens=10**6).raise_for_status()
        assert len(session.turns) == 1 and session.inflight is None
        session.end(1.0)
    finally:
        runner.join(timeout=60)
    assert not runner.is_alive()


def test_non_loopback_addresses_need_a_key_and_the_key_is_checked(tiny_policy, capsys):
    from copes.serve import PolicyServer
    from copes.serve.cli import serve_main
    from copes.train import TrainConfig

    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    with pytest.raises(ValueError, match="needs an API key"):
        PolicyServer(tiny_policy, sampling).start(host="0.0.0.0")
    with pytest.raises(ValueError, match="--api-key"):
        TrainConfig(harness="env", host="0.0.0.0")
    assert serve_main(["--host", "0.0.0.0", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("copes-serve: error: --host 0.0.0.0")
    keyed = PolicyServer(tiny_policy, sampling, api_key="s3cret")
    url = keyed.start()
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.get(f"{url}/v1/models", headers=wrong).status_code == 401
        right = {"authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/v1/models", headers=right).json()["data"][0]["id"] == "policy@0"
    finally:
        keyed.stop()


def test_a_step_missing_rewards_fails_whole_and_updates_nothing(tiny_policy, make_task_rollout):
    """Nobody asks for the work: at the step's deadline the optimizer step raises, the
    weights are unchanged, and the server's names move on to no new version."""

    from copes.optimizers.configs import CoPESConfig
    from copes.optimizers.es import CoPES
    from copes.serve import HttpHarness, PolicyServer, ServedEvaluator, StepFailed

    rollout, _ = make_task_rollout(tasks=2)
    server = PolicyServer(tiny_policy, rollout.sampling, step_timeout=1.5)
    server.start()
    optimizer = CoPES(
        CoPESConfig(population_size=2, num_subspaces=1, sigma=0.05),
        ServedEvaluator(server, HttpHarness(), tiny_policy, rollout, 2),
    )
    before = tiny_policy.weights().checksum()
    try:
        with pytest.raises(
            StepFailed,
            match=r"4 of 4 sessions have no reward after --step-timeout 1.5 s: "
            r"4 never asked for .*no update was applied",
        ):
            optimizer.step(tiny_policy, rollout, 0)
    finally:
        server.stop()
    assert tiny_policy.weights().checksum() == before
    assert optimizer.step_count == 0 and server.policy_version == 0 and server.open is None


def test_a_harness_that_raises_fails_the_step(tiny_policy, make_task_rollout):

    from copes.serve import InProcessHarness, PolicyServer, ServedRollout, StepFailed

    async def broken(client, model, task):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task["question"]}]
        )
        raise KeyError("gold")

    rollout, _ = make_task_rollout(tasks=2)
    server = PolicyServer(tiny_policy, rollout.sampling)
    server.start()
    try:
        with pytest.raises(StepFailed, match="raised KeyError"):
            ServedRollout(server, InProcessHarness(broken), rollout)(tiny_policy, 0)
    finally:
        server.stop()


def test_bad_harness_flags_are_one_line_errors(capsys):
    from copes.cli import train_main

    for flags, expected in [
        (["--harness", "nomodule_xyz:episode"], "cannot import nomodule_xyz"),
        (["--harness", "json:nothing"], "json has no nothing"),
        (["--harness", "json:dumps"], "must be an async function"),
        (["--harness", "justaname"], "expected module:function"),
        (["--harness", "env", "--workers", "2"], "--workers 0"),
        (["--harness", "env", "--step-timeout", "0"], "--step-timeout must be positive"),
        (["--harness", "env", "--request-timeout", "0"], "--request-timeout must be positive"),
        (["--harness", "http", "--turn-schedule", "fast"], "expected one of deterministic"),
        (["--turn-schedule", "as-they-come"], "add --harness"),
    ]:
        assert train_main([*flags, "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (flags, err)


@pytest.mark.slow
def test_the_api_key_is_used_by_the_harness_and_never_written(tmp_path):
    """The in-process harness sends the key (the server checks it on every turn); the run
    folder and its logs hold no copy of it."""
    from copes.cli import train_main

    out = tmp_path / "keyed"
    flags = ["--harness", "env", "--api-key", "s3cret-k3y", "--steps", "1", "--batch-size",
             "2", "--population-size", "4", "--eval-tasks", "2", "--num-train-tasks", "20",
             "--max-new-tokens", "32", "--no-progress", "--output-dir", str(out)]  # fmt: skip
    assert train_main(flags) == 0
    for path in out.rglob("*"):
        if path.is_file():
            assert b"s3cret-k3y" not in path.read_bytes(), path


def test_a_session_is_held_to_its_own_steps_sampling(server, tiny_policy):
    """A validation step samples greedily while the run trains at temperature 1: its
    sessions take temperature 0 and refuse 1 (not the run's value)."""
    from dataclasses import replace

    from copes.serve import SessionSpec

    server.sampling = replace(server.sampling, temperature=1.0)
    greedy = replace(server.sampling, temperature=0.0)
    (task,) = _tasks(1)
    served = server.open_step(0, [SessionSpec(None, None, task)], "validation", sampling=greedy)
    (session,) = served.sessions
    url = f"{server.base_url}/s/{session.id}/v1"
    response = _chat(url, session.model, temperature=1.0)
    assert response.status_code == 400 and "temperature=0.0" in response.json()["error"]["message"]
    session.end(0.0)  # (a request at temperature 0 would be queued for the episode loop)
    server.close_step(served)
