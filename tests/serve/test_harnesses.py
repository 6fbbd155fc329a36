"""Agents copes has never seen, trained by changing their base URL: the docs' OpenAI-client
agent in process (--harness) and from another process (ask/tell over HTTP, the same update),
and an OpenAI Agents SDK agent, unchanged."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
HERE = Path(__file__).resolve().parent


def _flags(out: Path, *extra: str) -> list[str]:
    return [
        "--model", "tiny", "--optimizer", "copes", "--population-size", "4",
        "--num-subspaces", "2", "--sigma", "0.05", "--learning-rate", "0.01",
        "--batch-size", "6", "--max-new-tokens", "48", "--eval-tasks", "4",
        "--num-train-tasks", "50", "--steps", "1", "--no-progress", "--report-to", "none",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _moved(run: Path) -> bool:
    """Whether the checkpoint's weights differ from the shipped tiny agent's."""
    from safetensors.torch import load_file

    from copes.agents.tiny import ensure_tiny_agent

    before = load_file(ensure_tiny_agent() / "model.safetensors")
    after = load_file(run / "checkpoints" / "step-000001" / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(HERE))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_docs_agent_trains_in_process_and_over_ask_tell_to_the_same_weights(
    tmp_path, examples_on_path
):
    from copes.cli import train_main
    from copes.run_log import read_jsonl
    from copes.serve.cli import serve_main

    local = tmp_path / "harness"
    sampled = ["--es-temperature", "1.0"]  # members' texts differ more: rewards vary
    assert train_main(_flags(local, "--harness", "openai_agent:episode", *sampled)) == 0
    rewards = read_jsonl(local / "es_log.jsonl")[0]["rewards"]
    assert len(rewards) == 4 and len(set(rewards)) > 1  # the members differ: an update
    assert _moved(local)

    remote = tmp_path / "ask-tell"
    port = _free_port()
    status: list[int] = []
    server = threading.Thread(
        target=lambda: status.append(
            # the deterministic schedule: the in-process harness's tokens, bit for bit
            serve_main(
                _flags(remote, "--port", str(port), "--turn-schedule", "deterministic", *sampled)
            )
        )
    )
    server.start()
    client = subprocess.run(
        [sys.executable, str(EXAMPLES / "ask_tell_client.py"), f"http://127.0.0.1:{port}"],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    server.join(timeout=600)
    assert client.returncode == 0, client.stderr[-2000:]
    assert status == [0]
    assert read_jsonl(remote / "es_log.jsonl")[0]["rewards"] == rewards
    step = Path("checkpoints") / "step-000001" / "model.safetensors"
    assert (local / step).read_bytes() == (remote / step).read_bytes()


@pytest.mark.slow
def test_an_openai_agents_sdk_agent_is_trained_unchanged(
    tmp_path, examples_on_path, tiny_policy, make_task_rollout
):
    """The SDK's chat-completions model on a session's client: the model's tool calls reach
    the SDK's function tool and its results come back as tool messages; one copes-train ES
    step on its rewards moves the weights."""
    pytest.importorskip("agents")
    import agents_sdk_agent

    from copes.cli import train_main
    from copes.run_log import read_jsonl
    from copes.serve import InProcessHarness, PolicyServer, ServedRollout

    rollout, _ = make_task_rollout(tasks=6)
    server = PolicyServer(tiny_policy, rollout.sampling)
    server.start()
    agents_sdk_agent.TOOL_RUNS.clear()
    try:
        batch = ServedRollout(server, InProcessHarness(agents_sdk_agent.episode), rollout)(
            tiny_policy, 0
        )
    finally:
        server.stop()
    assert agents_sdk_agent.TOOL_RUNS  # a call the model wrote ran in the SDK
    called = [t for t in batch if t.tool_calls]
    assert called and all(t.turns >= 2 for t in called)  # and the SDK came back with its output
    run = tmp_path / "sdk"
    assert train_main(_flags(run, "--harness", "agents_sdk_agent:episode")) == 0
    rewards = read_jsonl(run / "es_log.jsonl")[0]["rewards"]
    assert len(set(rewards)) > 1
    assert _moved(run)
