"""Served episodes are the in-process ones: the real `openai` client driving copes' env loop
through the server gets the rollout's tokens, rewards and log-probs; a served ES step
updates to the in-process step's weights bit for bit; GRPO trains on the recorded turns."""

import threading

import pytest
import torch


def _server(policy, sampling, **kwargs):
    from copes.serve import PolicyServer

    server = PolicyServer(policy, sampling, **kwargs)
    server.start()
    return server


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_env_loop_through_the_server_equals_the_in_process_rollout(
    tiny_policy, temperature, make_task_rollout
):
    """Greedy and sampled: the same token ids, sampled mask, rewards and turn counts as
    `TaskRollout` in process (each session samples from the stream its episode would)."""
    from copes.serve import EnvLoop, InProcessHarness, ServedRollout

    rollout, make_env = make_task_rollout(samples=2, temperature=temperature)
    expected = rollout(tiny_policy, 3)
    server = _server(tiny_policy, rollout.sampling)
    try:
        served = ServedRollout(server, InProcessHarness(EnvLoop(make_env)), rollout)(tiny_policy, 3)
    finally:
        server.stop()
    assert [t.token_ids for t in served] == [t.token_ids for t in expected]
    assert [t.generated_mask for t in served] == [t.generated_mask for t in expected]
    assert [t.reward for t in served] == [t.reward for t in expected]
    assert [t.turns for t in served] == [t.turns for t in expected]
    assert max(t.turns for t in expected) > 1  # multi-turn: bridged continuations were used
    for got, want in zip(served, expected, strict=True):
        mask = torch.tensor(want.generated_mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(got.logprobs)[mask], torch.tensor(want.logprobs)[mask],
            rtol=0, atol=1e-4,
        )  # fmt: skip


TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]  # fmt: skip


def _tool_loop(base_url: str, session, task) -> dict:
    """One episode on the synchronous `openai.OpenAI` client: the first turn with tools=;
    after a tool call, its (made-up) result and a second turn."""
    import openai

    from copes.envs.presets import tool_math_env

    client = openai.OpenAI(base_url=f"{base_url}/s/{session.id}/v1", api_key="x")
    _, info = tool_math_env(tasks=[task]).reset(options={"task": task})
    messages = info["messages"]
    ask = dict(model=session.model, tools=TOOLS, stop=["</python>", "</answer>"], logprobs=True)
    first = client.chat.completions.create(messages=messages, **ask)
    calls = first.choices[0].message.tool_calls
    second = None
    if calls:
        assert first.choices[0].finish_reason == "tool_calls"
        messages = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]  # fmt: skip
        second = client.chat.completions.create(messages=messages, **ask)
    record = session.record()
    session.end(0.5)
    return {"first": first, "second": second, "record": record}


def test_openai_client_tool_calls_bridge_and_logprobs_match_a_forward_pass(
    tiny_policy, make_task_rollout
):
    """A hand-written tool loop on the synchronous `openai.OpenAI` client, six sessions at
    once: the tiny agent's `<python>` calls come back as OpenAI tool calls; the next turn
    (the tool result after the echoed call) is bridged token-exactly; the recorded and the
    returned log-probs are the model's (a forward pass over the recorded sequence)."""
    from concurrent.futures import ThreadPoolExecutor

    from copes.serve import HttpHarness, SessionSpec
    from copes.serve.training import _serve_step

    rollout, _ = make_task_rollout()
    tasks = rollout.tasks[:6]
    server = _server(tiny_policy, rollout.sampling)
    served = server.open_step(0, [SessionSpec(None, None, t) for t in tasks], "validation")
    runner = threading.Thread(
        target=_serve_step, args=(server, HttpHarness(), served, tiny_policy, rollout.sampling)
    )
    runner.start()
    try:
        with ThreadPoolExecutor(len(tasks)) as pool:
            episodes = list(pool.map(_tool_loop, [server.base_url] * len(tasks),
                                     served.sessions, tasks))  # fmt: skip
    finally:
        runner.join(timeout=60)
        server.stop()
    called = [e for e in episodes if e["second"] is not None]
    assert called, "no session made a tool call: the test would check nothing"
    for episode in called:
        call = episode["first"].choices[0].message.tool_calls[0]
        assert call.function.name == "python" and "code" in call.function.arguments
        assert episode["second"].model_extra["copes"]["prompt"] == "bridged"
        assert [t["bridged"] for t in episode["record"]["turns"]] == [False, True]
    for episode in episodes:
        record = episode["record"]
        ids = torch.tensor([record["token_ids"]])
        with torch.no_grad():
            logits = tiny_policy.model(input_ids=ids).logits[0].float()
        chosen = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(record["sampled_mask"][1:], dtype=torch.bool)
        assert mask.any()
        torch.testing.assert_close(torch.tensor(record["logprobs"][1:])[mask], chosen[mask],
                                   rtol=0, atol=1e-4)  # fmt: skip
        sent = [c.logprob for c in episode["first"].choices[0].logprobs.content]
        assert sent == record["turns"][0]["logprobs"]


def _train(tmp_path, name, *flags):
    from copes.cli import train_main

    common = [
        "--model", "tiny", "--learning-rate", "0.01", "--batch-size", "4", "--max-new-tokens", "48",
        "--eval-tasks", "4", "--num-train-tasks", "50", "--steps", "2", "--no-progress",
        "--report-to", "none", "--invalid-penalty", "0.2",
    ]  # fmt: skip
    assert train_main([*common, *flags, "--output-dir", str(tmp_path / name)]) == 0
    return tmp_path / name


def _same_checkpoints(a, b) -> bool:
    files = [run / "checkpoints" / "step-000002" / "model.safetensors" for run in (a, b)]
    return files[0].read_bytes() == files[1].read_bytes()


@pytest.mark.slow
def test_served_copes_steps_give_the_in_process_weights(tmp_path):
    """copes-train --harness env (members served, copes' env loop as the client) against
    --population-eval batched: the same logged rewards, the same checkpoint bytes."""
    from copes.run_log import read_jsonl

    es = [
        "--optimizer",
        "copes",
        "--population-size",
        "4",
        "--num-subspaces",
        "2",
        "--sigma",
        "0.05",
    ]
    local = _train(tmp_path, "local", *es, "--population-eval", "batched")
    served = _train(tmp_path, "served", *es, "--harness", "env")
    logs = [read_jsonl(run / "es_log.jsonl") for run in (local, served)]
    assert [e["rewards"] for e in logs[0]] == [e["rewards"] for e in logs[1]]
    assert len(set(logs[0][0]["rewards"])) > 1  # the members differ: an update happened
    assert _same_checkpoints(local, served)
    validations = [
        [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "validation"]
        for run in (local, served)
    ]
    keys = ("reward_mean", "accuracy", "tool_calls_mean", "turns_mean", "invalid_rate")
    assert [[v[k] for k in keys] for v in validations[0]] == [
        [v[k] for k in keys] for v in validations[1]
    ]


@pytest.mark.slow
def test_served_grpo_trains_on_the_recorded_turns(tmp_path):
    """GRPO whose groups are served sessions: the recorded token ids, masks and log-probs
    are its training data, and the step lands on the in-process step's weights."""
    from copes.run_log import read_jsonl

    flags = ["--optimizer", "grpo", "--group-size", "2", "--temperature", "1.0"]
    local = _train(tmp_path, "local", *flags)
    served = _train(tmp_path, "served", *flags, "--harness", "env")
    train = [
        [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]
        for run in (local, served)
    ]
    assert [r["reward_mean"] for r in train[0]] == [r["reward_mean"] for r in train[1]]
    assert _same_checkpoints(local, served)
