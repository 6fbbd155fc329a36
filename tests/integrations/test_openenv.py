"""copes envs behind a real OpenEnv server (uvicorn, WebSocket sessions): an OpenEnv client
plays an episode; the tiny agent's rollouts over the server equal its local rollouts token
for token; one CoPES step trains through the server."""

import socket
import threading
import time

import gymnasium as gym
import pytest

pytest.importorskip("openenv")

import copes  # noqa: F401
from copes.envs.presets import load_tasks


@pytest.fixture
def server():
    import uvicorn

    from copes.integrations.openenv import create_app

    tasks = load_tasks("synthetic-math", "train", limit=4)
    app = create_app(lambda: gym.make("ToolMath-v0", tasks=tasks, max_turns=3))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"ws://127.0.0.1:{port}", tasks
    server.should_exit = True
    thread.join(10)


def _client(url):
    from copes.integrations.openenv import TurnClient

    client = TurnClient(base_url=url).sync()
    client.connect()
    return client


def test_an_openenv_client_plays_a_copes_episode(server):
    from copes.integrations.openenv import TurnAction

    url, tasks = server
    client = _client(url)
    try:
        first = client.reset(task_id=tasks[1].id)
        assert tasks[1].question in first.observation.text and not first.done
        assert [t["function"]["name"] for t in first.observation.tools] == ["python"]
        reply = client.step(TurnAction(text="<python>print(6 * 7)</python>"))
        assert (reply.observation.text, reply.reward, reply.done) == ("42", 0.0, False)
        assert reply.observation.info["tool"] == "python"
        end = client.step(TurnAction(text=f"<answer>{tasks[1].answers[0]}</answer>"))
        assert end.done and end.reward == 1.0 and end.observation.info["correct"]
        assert client.state().task_id == tasks[1].id and client.state().step_count == 2
    finally:
        client.close()


@pytest.mark.slow
def test_tiny_agent_rollouts_over_openenv_match_local_ones_and_train(server, tiny_policy):
    from copes.agents.policy import SamplingConfig
    from copes.agents.rollout import rollout
    from copes.integrations.openenv import OpenEnvGym
    from copes.optimizers.es import CoPES, CoPESConfig
    from copes.train import TaskRollout

    url, tasks = server
    sampling = SamplingConfig(48, temperature=0.0)
    options = [{"task": t} for t in tasks]
    remote_envs = [OpenEnvGym(_client(url)) for _ in tasks]
    local_envs = [gym.make("ToolMath-v0", tasks=tasks, max_turns=3) for _ in tasks]
    try:
        remote = rollout(tiny_policy, remote_envs, sampling, options=options)
        local = rollout(tiny_policy, local_envs, sampling, options=options)
        assert [e.token_ids for e in remote] == [e.token_ids for e in local]
        assert [e.reward for e in remote] == [e.reward for e in local]
        assert [e.end_reason for e in remote] == [e.end_reason for e in local]
    finally:
        for env in local_envs:
            env.close()
    train_rollout = TaskRollout(lambda: remote_envs.pop(), tasks, 4, 1, sampling, seed=0)
    weights = tiny_policy.weights()
    before = weights.checksum()
    saved = {name: t.clone() for name, t in weights.master_state().items()}
    optimizer = CoPES(CoPESConfig(population_size=4, num_subspaces=2, sigma=0.02,
                                  learning_rate=0.01, seed=0))  # fmt: skip
    try:
        stats = optimizer.step(tiny_policy, train_rollout)
        assert len(stats.log["rewards"]) == 4
        changed = weights.checksum() != before
        assert changed == (len(set(stats.log["rewards"])) > 1)  # no signal: no update
    finally:
        weights.load_master_state(saved)  # the session's policy, as other tests expect it
        train_rollout.close()
    assert weights.checksum() == before
