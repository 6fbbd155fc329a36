"""copes envs in verifiers (``verifiers.v1``), and copes policies as verifiers' model.

verifiers (tested with 0.4.0; docs/integrations.md) runs a rollout as a *harness* program
whose model calls go through its interception server to a *client*, records every call in a
`Trace`, and scores the trace with the *task*'s reward functions. Three pieces make a copes
env a verifiers environment and let copes' optimizers train through it:

- `CopesTaskset` (config `CopesTasksetConfig`): a registered copes benchmark's tasks as
  verifiers tasks (the copes `Task` travels in the task data).
- `CopesHarness`: the episode loop of the copes env itself (`gym.make` of its id): each turn
  is one chat-completions call to the interception endpoint, with the env's messages and its
  stop strings; the env runs the tools (its sandbox) and grades. Its reward, turns and end
  reason go to ``trace.info["copes"]``, which `CopesTask`'s reward function reads, so
  verifiers reports exactly the reward copes' own rollout gives for the same turns.
- `PolicyClient`: a copes `Policy` as a verifiers `Client`. It bridges tokens as copes'
  rollout does: a session's first prompt is rendered by the chat template, every later one is
  the previous ids + the sampled turn + `ChatFormat.encode_continuation`, never a re-render,
  so verifiers' trace keeps one branch whose ids are exactly what the model saw and sampled.

`VerifiersRollout` is a copes `RolloutFn` over them: `copes.train`'s optimizers (ES, CoPES,
GRPO) step on trajectories whose rewards verifiers computed.

verifiers loads harnesses and tasksets by module name (the module's ``__all__`` names the
class); ``copes_verifiers`` is that module (ids ``copes_verifiers``), a re-export of this one.
verifiers has no public way to hand its interception server a client object, so
`_PolicyInterception` overrides its ``_client`` hook: pinned to the version tested.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects import ChatDialect, Dialect
from verifiers.v1.interception import InterceptionServer

from copes.agents.policy import SamplingConfig
from copes.agents.rollout import RolloutBatch, RolloutStats, Trajectory, stop_strings
from copes.envs.tasks.base import task_from_dict, task_to_dict
from copes.seeding import derive_seed

__all__ = [
    "HARNESS_ID",
    "TASKSET_ID",
    "CopesHarness",
    "CopesTask",
    "CopesTaskData",
    "CopesTaskset",
    "CopesTasksetConfig",
    "PolicyClient",
    "VerifiersRollout",
]

HARNESS_ID = TASKSET_ID = "copes_verifiers"  # the module verifiers' loaders import


class CopesTaskData(vf.TaskData):
    """One copes task and the env that runs it (`prompt` is the question, for display)."""

    copes_task: dict[str, Any]
    benchmark: str = "synthetic-math"  # whose env (`Benchmark.make_env`) runs the task
    env_id: str = "ToolMath-v0"
    env_kwargs: dict[str, Any] = Field(default_factory=dict)


class CopesTask(vf.Task[CopesTaskData]):
    @vf.reward(weight=1.0)
    async def copes_reward(self, trace: vf.Trace) -> float:
        """The copes env's reward for the episode the harness ran (0 when it did not finish:
        a harness error leaves no result)."""
        result = trace.info.get("copes")
        return float(result["reward"]) if result else 0.0


class CopesTasksetConfig(vf.TasksetConfig):
    benchmark: str = "synthetic-math"
    split: str = "train"
    limit: int = 64
    task_seed: int = 0
    env: str | None = None  # default: the benchmark's env
    # e.g. {"max_turns": 3, "invalid_penalty": 0.2}
    env_kwargs: dict[str, Any] = Field(default_factory=dict)


class CopesTaskset(vf.Taskset[CopesTask, CopesTasksetConfig]):
    """`limit` tasks of a copes benchmark's split (`copes.registry`)."""

    def load(self):  # type: ignore[override]
        from copes.registry import get_benchmark

        c = self.config
        benchmark = get_benchmark(c.benchmark)
        env_id = c.env or benchmark.env_id
        env_kwargs = {**benchmark.env_kwargs, **c.env_kwargs}
        tasks = benchmark.load_tasks(split=c.split, limit=c.limit, seed=c.task_seed)
        for task in tasks:
            data = CopesTaskData(
                prompt=task.question, copes_task=task_to_dict(task), benchmark=benchmark.name,
                env_id=env_id, env_kwargs=env_kwargs,
            )  # fmt: skip
            yield CopesTask(data, c.task)


# ---------------------------------------------------------------------- the harness
class CopesHarness(vf.Harness[vf.HarnessConfig]):
    """The copes env's own episode loop, in this process; tools run in the env."""

    NEEDS_CONTAINER = False  # nothing to install: the loop and the tools are copes'
    EXECUTES_CODE = False  # code runs in copes' sandbox, not in verifiers' runtime

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):  # type: ignore[override]
        from openai import AsyncOpenAI

        from copes.registry import get_benchmark

        task = task_from_dict(data.copes_task)
        benchmark = get_benchmark(data.benchmark)  # its grader too, as every run grades
        env = benchmark.make_env([task], env_id=data.env_id, **data.env_kwargs)
        total = 0.0
        try:
            _, info = env.reset(options={"task": task})
            stops = list(stop_strings(info))
            tools = info.get("tools") if info.get("call_format", "tags") != "tags" else None
            async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as api:
                while True:
                    request: dict[str, Any] = {"model": ctx.model, "messages": info["messages"]}
                    if stops:
                        request["stop"] = stops
                    if tools:
                        request["tools"] = tools
                    completion = await api.chat.completions.create(**request)
                    text = completion.choices[0].message.content or ""
                    _, reward, terminated, truncated, info = await asyncio.to_thread(env.step, text)
                    total += float(reward)
                    if terminated or truncated:
                        break
            trace.info["copes"] = {
                "reward": total,
                "correct": bool(info.get("correct", False)),
                "turns": info["turn"],
                "tool_calls": info["tool_calls"],
                "end_reason": info.get("end_reason", "max_turns"),
                "task_id": task.id,
            }
        finally:
            env.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


# ---------------------------------------------------------------------- the model
class PolicyClient(vf.Client):
    """A copes policy answering verifiers' chat-completions calls, one at a time.

    `sampling` sets temperature and top-p; a request's ``stop`` and ``max_tokens`` override
    its stop strings and length. Sessions (verifiers' trace ids) keep their token ids so every
    turn continues the previous one (module docstring).
    """

    def __init__(self, policy: Any, sampling: SamplingConfig) -> None:
        self.policy = policy
        self.sampling = sampling
        self._sessions: dict[str, tuple[list[int], list[int]]] = {}  # ids so far, last turn
        self._lock = threading.Lock()  # one generation at a time on the shared model
        self.calls = 0

    def _prompt(self, session: str | None, messages: list[dict], tools: list | None) -> list[int]:
        chat = self.policy.chat
        state = self._sessions.get(session) if session else None
        if state is None:
            return chat.encode_prompt(messages, tools)
        ids, turn = state
        return ids + chat.encode_continuation(messages, turn, tools)

    def _generate(self, prompt: list[int], sampling: SamplingConfig) -> Any:
        with self._lock:
            return self.policy.generate_ids([prompt], sampling)[0]

    async def get_response(  # type: ignore[override]
        self, dialect: Dialect, body: dict, sampling: Any, session_id: str | None = None,
        turn: Any = None, headers: Any = None,
    ) -> vf.Response:  # fmt: skip
        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(
                f"PolicyClient serves chat-completions harnesses, not {type(dialect).__name__}"
            )
        messages = [dict(m) for m in body["messages"]]
        tools = body.get("tools") or None
        prompt = self._prompt(session_id, messages, tools)
        mine = self.sampling
        stop = body.get("stop")
        if stop:
            mine = replace(mine, stop=tuple([stop] if isinstance(stop, str) else stop))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit:
            mine = replace(mine, max_new_tokens=int(limit))
        generation = await asyncio.to_thread(self._generate, prompt, mine)
        self.calls += 1
        if session_id:
            self._sessions[session_id] = (prompt + generation.token_ids, generation.token_ids)
        raw = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "copes-policy"),
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": self.policy.chat.turn_text(generation.token_ids, messages),
                    },
                    "finish_reason": "length" if generation.finish_reason == "length" else "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(generation.token_ids),
                "total_tokens": len(prompt) + len(generation.token_ids),
            },
        }  # fmt: skip
        response = dialect.parse_response(dialect.validate_response(raw))
        response.raw = raw  # what the interception server hands back to the harness
        response.tokens = vf.TurnTokens(
            prompt_ids=list(prompt),
            completion_ids=list(generation.token_ids),
            completion_logprobs=list(generation.logprobs),
        )
        return response


class _PolicyInterception(InterceptionServer):
    """verifiers' interception server with our client for every rollout (its `_client`
    hook builds one from a URL config otherwise)."""

    def __init__(self, client: vf.Client) -> None:
        super().__init__()
        self._policy_client = client

    def _client(self, config: Any) -> vf.Client:
        return self._policy_client


# Never contacted (the interception above answers with the policy): a placeholder config.
_PLACEHOLDER = vf.EvalClientConfig(base_url="http://copes-policy.invalid/v1", api_key_var="NONE")


# ---------------------------------------------------------------------- copes' RolloutFn
class VerifiersRollout:
    """A copes `RolloutFn` whose episodes run in verifiers (`CopesHarness`, `PolicyClient`)
    and whose rewards are verifiers' scores of the traces.

    Step `step`'s batch is `batch_size` tasks drawn with `seed` and the step (the same for
    every ES member), each rolled out `samples_per_task` times.
    """

    def __init__(
        self,
        taskset: CopesTasksetConfig,
        batch_size: int,
        sampling: SamplingConfig,
        seed: int = 0,
        samples_per_task: int = 1,
        concurrency: int = 8,
    ) -> None:
        self.tasks = list(CopesTaskset(taskset))
        if not self.tasks:
            raise ValueError(f"taskset {taskset.benchmark!r} {taskset.split!r} has no tasks")
        self.batch_size = min(batch_size, len(self.tasks))
        self.samples = samples_per_task
        self.sampling = sampling
        self.seed = seed
        self.concurrency = concurrency
        # verifiers' own cap on model calls: above every task's env turn limit (the env ends
        # the episode itself), including limits the benchmark's env kwargs set.
        import inspect

        from copes.envs.core import ToolEnv

        default = inspect.signature(ToolEnv.__init__).parameters["max_turns"].default
        max_turns = max(int(t.data.env_kwargs.get("max_turns", default)) for t in self.tasks)
        self.agent_config = vf.AgentConfig(
            model="copes-policy",
            client=_PLACEHOLDER,
            harness=vf.HarnessConfig(id=HARNESS_ID),
            runtime=vf.SubprocessConfig(),  # the default is a remote sandbox
            max_turns=max_turns + 1,
        )
        self.last_traces: list[vf.Trace] = []

    def tasks_of(self, step: int) -> list[CopesTask]:
        rng = random.Random(derive_seed("batch", self.seed, step, None))
        return rng.sample(self.tasks, self.batch_size)

    def __call__(self, policy: Any, step: int, member: int | None = None) -> RolloutBatch:
        tasks = [t for t in self.tasks_of(step) for _ in range(self.samples)]
        start = time.perf_counter()
        client = PolicyClient(policy, self.sampling)
        traces = asyncio.run(self._run(client, tasks))
        seconds = time.perf_counter() - start
        self.last_traces = traces
        trajectories = [self._trajectory(trace) for trace in traces]
        stats = RolloutStats(
            generation_seconds=seconds,
            generated_tokens=sum(t.num_generated_tokens for t in trajectories),
            generate_calls=client.calls,
        )
        return RolloutBatch(trajectories, stats)

    async def _run(self, client: PolicyClient, tasks: Sequence[CopesTask]) -> list[vf.Trace]:
        gate = asyncio.Semaphore(self.concurrency)
        async with _PolicyInterception(client) as interception:
            agent = vf.Agent(self.agent_config, interception=interception)

            async def one(task: CopesTask) -> vf.Trace:
                async with gate:
                    return await agent.run(task)

            return list(await asyncio.gather(*(one(t) for t in tasks)))

    @staticmethod
    def _trajectory(trace: vf.Trace) -> Trajectory:
        """A copes `Trajectory` from a verifiers trace: its one branch's ids and mask, and
        the reward verifiers scored."""
        if not trace.ok or "copes" not in trace.info:
            errors = "; ".join(f"{e.type}: {e.message}" for e in trace.errors) or "no result"
            raise RuntimeError(f"a verifiers rollout failed ({errors})")
        if trace.num_branches != 1:
            raise RuntimeError(f"a trace forked into {trace.num_branches} token branches")
        branch = trace.branches[-1]
        mask = [int(bool(m)) for m in branch.sampled_mask]
        result = trace.info["copes"]
        return Trajectory(
            task_id=result["task_id"],
            messages=[m.model_dump(exclude_none=True) for m in trace.messages],
            token_ids=list(branch.token_ids),
            generated_mask=mask,
            logprobs=[float(x) if m else 0.0 for x, m in zip(branch.logprobs, mask, strict=True)],
            prompt_length=mask.index(1) if 1 in mask else len(mask),
            reward=float(trace.reward),
            correct=bool(result["correct"]),
            turns=int(result["turns"]),
            tool_calls=int(result["tool_calls"]),
            end_reason=result["end_reason"],
        )
