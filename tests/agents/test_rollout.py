"""Batched multi-turn rollouts with the real tiny agent in the real environments."""

import gymnasium as gym
import pytest
import torch

from copes.agents.policy import SamplingConfig
from copes.agents.rollout import rollout, stop_strings_for
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks


class RecordingPolicy:
    """The real policy, keeping every Generation it returned (to check the sequences); with
    `episodes`, it offers the policy's episode loop too."""

    def __init__(self, policy, episodes=False):
        self.policy = policy
        self.chat = policy.chat
        self.max_context = policy.max_context
        self.supports_episodes = episodes
        self.serves_members = self.trainable = False
        self.calls = []

    def generate_ids(self, prompts, sampling):
        out = self.policy.generate_ids(prompts, sampling)
        self.calls.append(([list(p) for p in prompts], out))
        return out

    def generate_episodes(self, prompts, sampling, next_turn, *, threads=16):
        def recording(index, generation):
            self.calls.append(([generation.prompt_token_ids], [generation]))
            return next_turn(index, generation)

        return self.policy.generate_episodes(prompts, sampling, recording, threads=threads)


def spans(mask):
    """(start, end) of every run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def make_envs(n=4):
    math = [tool_math_env(tasks=[t]) for t in synthetic_math_tasks("validation", n, seed=1)]
    qa = [tool_qa_env(tasks=[t]) for t in synthetic_qa_tasks("validation", n, seed=1)]
    return math, qa


@pytest.mark.parametrize("episodes", [False, True], ids=["turn-by-turn", "episode-loop"])
def test_rollout_sequences_masks_and_logprobs(tiny_policy, episodes):
    recorder = RecordingPolicy(tiny_policy, episodes)
    math, qa = make_envs()
    sampling = SamplingConfig(max_new_tokens=64, temperature=1.0, seed=0)
    trajectories = rollout(recorder, math, sampling) + rollout(recorder, qa, sampling)
    generated = [g for _, gens in recorder.calls for g in gens]
    assert len(trajectories) == 8
    for traj in trajectories:
        assert len(traj.token_ids) == len(traj.generated_mask) == len(traj.logprobs)
        assert traj.generated_mask[: traj.prompt_length] == [0] * traj.prompt_length
        runs = spans(traj.generated_mask)
        assert len(runs) == traj.turns >= 1
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        for (start, end), text in zip(runs, assistant, strict=True):
            ids = traj.token_ids[start:end]
            # retokenization safety: the trained ids are exactly ids the policy generated,
            # after exactly the ids it was given
            prefix = traj.token_ids[:start]
            assert any(g.token_ids == ids and g.prompt_token_ids == prefix for g in generated)
            assert tiny_policy.tokenizer.decode(ids, skip_special_tokens=True) == text
        # tool outputs sit in the mask-0 stretch between two turns (the agent may well copy
        # an output into its answer, so look at where the text is, not whether it recurs)
        ends = [(len(traj.token_ids), 0)]
        between = [
            tiny_policy.tokenizer.decode(traj.token_ids[end:start])
            for (_, end), (start, _) in zip(runs, [*runs[1:], *ends], strict=True)
        ]
        outputs = [m["content"].strip() for m in traj.messages if m["role"] == "tool"]
        for output in outputs:
            assert any(output in gap for gap in between)
        assert traj.end_reason in ("answer", "max_turns", "invalid", "context")
        assert 0.0 <= traj.reward <= 1.0

    # log-probs of generated tokens match a fresh forward pass over the whole sequence
    traj = max(trajectories, key=lambda t: t.turns)
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_policy.model(ids).logits[0, :-1].float(), dim=-1)
    fresh = logp.gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(traj.generated_mask[1:], dtype=torch.bool)
    assert torch.allclose(torch.tensor(traj.logprobs[1:])[mask], fresh[mask], atol=1e-3)


def test_tool_calls_really_run(tiny_policy):
    math, _ = make_envs(6)
    trajectories = rollout(tiny_policy, math, SamplingConfig(max_new_tokens=64, temperature=0.0))
    with_tools = [t for t in trajectories if t.tool_calls]
    assert with_tools, "the warm-started agent should call the calculator"
    tool_outputs = [m for t in with_tools for m in t.messages if m["role"] == "tool"]
    assert all(m["name"] == "python" for m in tool_outputs)


def test_context_overflow_ends_cleanly(tiny_policy):
    _, qa = make_envs(4)
    sampling = SamplingConfig(max_new_tokens=32, temperature=0.0)
    prompt = max(
        len(tiny_policy.chat.encode_prompt(env.reset(seed=0)[1]["messages"])) for env in qa
    )
    limit = prompt + 32 + 8  # room for the first turn, not for a search result after it
    trajectories = rollout(tiny_policy, qa, sampling, max_context=limit)
    assert {t.end_reason for t in trajectories} <= {"context", "answer"}
    overflowed = [t for t in trajectories if t.end_reason == "context"]
    assert overflowed, "the agent searches first, so its episodes must overflow"
    assert all(t.reward == 0.0 and t.turns >= 1 and not t.correct for t in overflowed)
    assert all(len(t.token_ids) <= limit + 200 for t in trajectories)


def test_stop_strings_follow_the_env_format():
    math = tool_math_env(tasks=synthetic_math_tasks("test", 1))
    hermes = tool_math_env(tasks=synthetic_math_tasks("test", 1), call_format="hermes")
    assert stop_strings_for(math) == ("</python>", "</answer>")
    assert stop_strings_for(hermes) == ("</tool_call>", "</answer>")


def test_rollout_is_reproducible_with_a_seed(tiny_policy):
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0, seed=5)
    a = rollout(tiny_policy, make_envs(3)[0], sampling)
    b = rollout(tiny_policy, make_envs(3)[0], sampling)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert a.stats.generated_tokens == sum(t.num_generated_tokens for t in a)


def test_as_they_come_each_episode_keeps_its_draws(tiny_policy):
    """`schedule="as-they-come"` re-joins a row as soon as its env answered; each episode
    still samples from its own stream, so on the tiny agent (float32) the tokens are the
    deterministic schedule's (only float rounding of other batches could differ)."""
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0, seed=5)
    fixed = rollout(tiny_policy, make_envs(4)[0], sampling)
    loose = rollout(tiny_policy, make_envs(4)[0], sampling, schedule="as-they-come")
    assert [t.token_ids for t in loose] == [t.token_ids for t in fixed]
    assert sum(t.turns for t in fixed) > len(fixed)  # tool calls: rows re-joined


def test_stats_split_tool_calls_from_grading(tiny_policy):
    """RolloutStats sums the time inside tools and inside the grader, apart (es_overhead)."""
    import time

    from copes.agents.policy import Generation
    from copes.envs.core import ToolEnv
    from copes.envs.rewards.graders import Grade
    from copes.envs.tasks.base import Task
    from copes.envs.tools.base import tool

    @tool
    def slow(text: str) -> str:
        """Echo after 30 ms."""
        time.sleep(0.03)
        return text

    def slow_grader(answer: str, task: Task) -> Grade:
        time.sleep(0.02)
        return Grade(1.0, True, {})

    class Scripted:  # a tool call, then an answer
        chat, max_context = tiny_policy.chat, tiny_policy.max_context
        supports_episodes = serves_members = trainable = False

        def __init__(self):
            self.turn = 0

        def generate_ids(self, prompts, sampling):
            text = "<slow>x</slow>" if self.turn == 0 else "<answer>1</answer>"
            self.turn += 1
            ids = tiny_policy.tokenizer.encode(text)
            return [Generation(text, ids, [0.0] * len(ids), "stop") for _ in prompts]

    tasks = [Task(id="t", question="?", answers=("1",), kind="qa")]
    envs = [ToolEnv(tasks, [slow], slow_grader) for _ in range(3)]
    batch = rollout(Scripted(), envs, SamplingConfig(max_new_tokens=8), tool_threads=1)
    stats = batch.stats
    assert all(t.correct and t.tool_calls == 1 for t in batch)
    assert stats.tool_seconds >= 3 * 0.03 and stats.grade_seconds >= 3 * 0.02
    assert stats.tool_seconds + stats.grade_seconds <= stats.env_seconds  # one thread: nested


class _BrokenReset(gym.Wrapper):
    def reset(self, **kwargs):
        raise RuntimeError("no such task")


@pytest.mark.parametrize("continuous", [True, False])
def test_an_env_whose_reset_raises_fails_the_rollout_at_once(tiny_policy, continuous):
    """A driver's start runs in a worker thread: its error reaches the caller (no hang)."""
    envs = [tool_math_env(), _BrokenReset(tool_math_env())]
    with pytest.raises(RuntimeError, match="no such task"):
        rollout(tiny_policy, envs, SamplingConfig(8), continuous_batching=continuous)
