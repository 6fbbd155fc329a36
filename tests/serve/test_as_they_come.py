"""Serving any client (issue 37): turns join the batch as they come, so a sequential agent, a
client with a few sessions in flight, a slow tool and a plain request during an open step are
all served; what cannot be served by its deadline says why.

The agents here are real OpenAI-client agents over HTTP (copes' env loop on `openai`'s
client, run through ask/tell), against a real server and the real tiny model."""

import asyncio
import threading
import time

import gymnasium as gym
import httpx
import pytest

from copes.optimizers.configs import CoPESConfig

CONFIG = CoPESConfig(population_size=4, num_subspaces=2, sigma=0.05, learning_rate=0.05, seed=3)
TASKS = 3  # tasks per member: 12 sessions a step


class SlowTool(gym.Wrapper):
    """An env whose every step (the tool call, grading) sleeps first: the agent's next
    request comes late."""

    def __init__(self, env, seconds):
        super().__init__(env)
        self.seconds = seconds

    def step(self, action):
        time.sleep(self.seconds)
        return self.env.step(action)


def _policy(tiny_agent_dir):
    from copes.agents.hf import HFPolicy

    return HFPolicy.from_pretrained(tiny_agent_dir, device="cpu")


def _serve(policy, rollout, schedule="as-they-come", **kwargs):
    """A started server and a CoPES optimizer whose members are served to HTTP clients."""
    from copes.optimizers.es import CoPES
    from copes.serve import HttpHarness, PolicyServer, ServedEvaluator

    server = PolicyServer(policy, rollout.sampling, schedule=schedule, **kwargs)
    server.start()
    evaluator = ServedEvaluator(server, HttpHarness(), policy, rollout, CONFIG.population_size)
    return server, CoPES(CONFIG, evaluator), evaluator


def _in_background(function, *args):
    """Run `function(*args)` in a thread; returns (thread, box with 'result' or 'error')."""
    box: dict = {}

    def run():
        try:
            box["result"] = function(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


async def _agent(url, make_env, in_flight, sessions):
    """An ask/tell client (`copes.serve.client.ask_tell`) with at most `in_flight` sessions
    at once (1: one episode at a time), each played by copes' env loop on
    `openai.AsyncOpenAI`; returns the rewards it posted by session."""
    from copes.serve.client import ask_tell
    from copes.serve.harness import EnvLoop

    return await ask_tell(url, EnvLoop(make_env), in_flight=in_flight, sessions=sessions)


class Replay:
    """The population evaluator that gives each member the mean of the rewards a served
    step recorded for it: the update those rewards call for, computed in process."""

    def __init__(self, served):
        self.served = served

    def evaluate(self, step, members):
        from copes.optimizers.base import MemberResult

        results = []
        for member in members:
            mine = [s.reward for s in self.served.sessions if s.member == member.member]
            zero = {"generation_seconds": 0, "env_seconds": 0, "generated_tokens": 0}
            results.append(
                MemberResult.of(member.member, mine, [False] * len(mine), weight_seconds=0, **zero)
            )
        return results

    def applied(self, step, rewards):
        return {}

    def close(self):
        pass


@pytest.mark.parametrize("in_flight", [1, 4, 12])
def test_clients_with_any_number_of_sessions_in_flight_train_a_copes_step(
    tiny_agent_dir, make_task_rollout, in_flight
):
    """1 (a sequential agent), 4, and all 12 sessions in flight: the step completes, every
    session has the reward its client posted, and the weights equal the update computed in
    process from those rewards."""
    from copes.optimizers.es import CoPES

    policy = _policy(tiny_agent_dir)
    rollout, make_env = make_task_rollout(tasks=TASKS, temperature=1.0)
    server, optimizer, evaluator = _serve(policy, rollout)
    try:
        step, box = _in_background(optimizer.step, policy, rollout, 0)
        posted = asyncio.run(_agent(server.base_url, make_env, in_flight, 4 * TASKS))
        step.join(timeout=300)
    finally:
        server.stop()
    assert "error" not in box, box.get("error")
    served = evaluator.last_served
    assert {s.id: s.reward for s in served.sessions} == posted
    assert all(s.turns for s in served.sessions)  # every episode was generated

    replayed = _policy(tiny_agent_dir)
    CoPES(CONFIG, Replay(served)).step(replayed, rollout, 0)
    assert replayed.weights().checksum() == policy.weights().checksum()
    assert policy.weights().checksum() != _policy(tiny_agent_dir).weights().checksum()


def test_an_agent_whose_tool_sleeps_between_turns_is_served(tiny_agent_dir, make_task_rollout):
    """Four sessions in flight, each tool call 0.3 s: the step completes with every reward;
    no turn waits for another session's tool."""
    policy = _policy(tiny_agent_dir)
    rollout, make_env = make_task_rollout(tasks=TASKS)
    server, optimizer, evaluator = _serve(policy, rollout)
    try:
        step, box = _in_background(optimizer.step, policy, rollout, 0)
        posted = asyncio.run(
            _agent(server.base_url, lambda: SlowTool(make_env(), 0.3), 4, 4 * TASKS)
        )
        step.join(timeout=300)
    finally:
        server.stop()
    assert "error" not in box, box.get("error")
    assert len(posted) == 4 * TASKS and all(s.ended for s in evaluator.last_served.sessions)


@pytest.mark.parametrize("schedule", ["as-they-come", "deterministic"])
def test_plain_requests_are_answered_during_an_open_step_with_the_policys_own_weights(
    tiny_agent_dir, make_task_rollout, schedule
):
    """While an ES step is open (its members stacked in the loop, no session asked for
    yet, then sessions in flight), `policy@0` requests are answered at once, and (greedy)
    exactly as outside any step: the members' weights never leak into them."""
    policy = _policy(tiny_agent_dir)
    rollout, make_env = make_task_rollout(tasks=TASKS)
    server, optimizer, _ = _serve(policy, rollout, schedule=schedule)
    request = {"model": "policy@0", "max_tokens": 24,
               "messages": [{"role": "user", "content": "What is 12 * 7?"}]}  # fmt: skip
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            before = http.post("/v1/chat/completions", json=request).json()
            step, box = _in_background(optimizer.step, policy, rollout, 0)
            while server.open is None:
                time.sleep(0.01)
            start = time.monotonic()
            during = http.post("/v1/chat/completions", json=request)
            waited = time.monotonic() - start
            text = http.post("/v1/completions", json={**request, "prompt": "12 * 7 ="})
            assert during.status_code == 200 and text.status_code == 200, during.text
            assert during.json()["choices"] == before["choices"]
            assert waited < 30  # answered while no session has been asked for
            # Now the sessions, all at once, with plain requests beside them.
            agent, played = _in_background(
                lambda: asyncio.run(_agent(server.base_url, make_env, 4 * TASKS, 4 * TASKS))
            )
            beside = http.post("/v1/chat/completions", json=request)
            agent.join(timeout=300)
            step.join(timeout=300)
    finally:
        server.stop()
    assert "error" not in box and "error" not in played, (box, played)
    assert beside.status_code == 200 and beside.json()["choices"] == before["choices"]


def test_a_sequential_agent_on_the_deterministic_schedule_is_told_why_it_waits(
    tiny_agent_dir, make_task_rollout
):
    """The deterministic schedule starts a step once every session sent its first request:
    one session's turn gets a 504 within --request-timeout naming the reason and the fix,
    instead of hanging."""
    policy = _policy(tiny_agent_dir)
    rollout, _ = make_task_rollout(tasks=TASKS)
    server, optimizer, _ = _serve(
        policy, rollout, schedule="deterministic", request_timeout=1.0, step_timeout=20
    )
    try:
        step, _ = _in_background(optimizer.step, policy, rollout, 0)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            while server.open is None:
                time.sleep(0.01)
            work = http.post("/copes/v1/ask", json={"max_sessions": 1}).json()["work"][0]
            turn = http.post(
                f"{work['base_url']}/chat/completions",
                json={"model": work["model"], "messages": [{"role": "user", "content": "hi"}]},
            )
            server.open.fail("the test is over")
            step.join(timeout=60)
    finally:
        server.stop()
    assert turn.status_code == 504
    error = turn.json()["error"]
    assert error["code"] == "request_timeout"
    assert "11 have not" in error["message"] and "--turn-schedule as-they-come" in error["message"]


def test_a_step_timeout_names_sessions_never_asked_for_and_who_took_the_rest(
    tiny_agent_dir, make_task_rollout
):
    """One client takes two sessions, plays one turn of one and never rewards either;
    nobody asks for the rest. At --step-timeout the step fails in one line counting both
    kinds and naming the client, no weights change, and the next ask answers done with the
    reason."""
    from copes.serve import StepFailed

    policy = _policy(tiny_agent_dir)
    before = policy.weights().checksum()
    rollout, _ = make_task_rollout(tasks=TASKS)
    server, optimizer, _ = _serve(policy, rollout, step_timeout=4.0)
    try:
        step, box = _in_background(optimizer.step, policy, rollout, 0)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            while server.open is None:
                time.sleep(0.01)
            asked = http.post("/copes/v1/ask", json={"max_sessions": 2, "client": "lazy"})
            work = asked.json()["work"][0]
            turn = http.post(
                f"{work['base_url']}/chat/completions",
                json={"model": work["model"], "messages": [{"role": "user", "content": "hi"}]},
            )
            step.join(timeout=60)
            after = http.post("/copes/v1/ask", json={"max_sessions": 1}).json()
    finally:
        server.stop()
    assert turn.status_code == 200  # served at once, as it came
    assert isinstance(box.get("error"), StepFailed)
    message = str(box["error"])
    assert "12 of 12 sessions have no reward after --step-timeout 4 s" in message
    assert "10 never asked for" in message
    assert "2 taken and never rewarded (2 by client 'lazy')" in message
    assert "no update was applied" in message and "\n" not in message
    assert after["done"] is True and "10 never asked for" in after["error"]
    assert policy.weights().checksum() == before
