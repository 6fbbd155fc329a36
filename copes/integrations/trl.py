"""Train a copes env with TRL's `GRPOTrainer`: a `rollout_func` and an `environment_factory`.

Two ways in, tested against TRL 1.16 (docs/integrations.md):

- `CopesRollout` (``GRPOTrainer(rollout_func=...)``): copes runs the whole multi-turn
  episode (its parser, tools, sandbox and grader) with the trainer's own model, and hands TRL
  the token ids: the prompt, the completion (model turns *and* tool outputs), an `env_mask`
  that is 1 only on the model's tokens (TRL trains on those alone), the sampling log-probs,
  and each episode's copes reward for `copes_reward`. An episode that ended with an answer
  ends on an eos token, so TRL does not count it as clipped; one that ran out of turns or
  context ends on whatever was last (a tool output, or the model's own eos after an invalid
  last turn), so TRL counts it as clipped unless that was an eos
  (``mask_truncated_completions`` drops the clipped ones).
- `environment_factory(env)`: a class TRL instantiates per rollout, whose methods are the
  env's tools (the signatures and docstrings TRL turns into the same JSON schemas) plus
  ``answer``, which grades; TRL then generates and parses tool calls itself.

`task_dataset` builds the `datasets.Dataset` both read: one row per task, the prompt the
env would show, and the task id the rollout resets the env to.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from copes.envs.tasks.base import Task

REWARD_FIELD = "copes_reward"


def _copes_env(env: Any) -> Any:
    from copes.envs.core import ToolEnv

    base = getattr(env, "unwrapped", env)
    if not isinstance(base, ToolEnv):
        raise TypeError(f"expected a copes ToolEnv or a wrapper of one, got {type(base).__name__}")
    return base


def task_dataset(
    env: Any, tasks: Sequence[Task] | None = None, *, conversational: bool = True
) -> Any:
    """One row per task: ``prompt`` (the env's first message; as a chat when
    `conversational`) and ``task_id``. `tasks` defaults to the env's own."""
    import datasets

    base = _copes_env(env)
    tasks = list(base.tasks if tasks is None else tasks)
    rows, seen = [], set()
    for task in tasks:
        if task.id in seen:
            raise ValueError(f"two tasks share the id {task.id!r}; task ids must be unique")
        seen.add(task.id)
        first, _ = env.reset(options={"task": task})
        prompt: Any = [{"role": "user", "content": first}] if conversational else first
        rows.append({"prompt": prompt, "task_id": task.id})
    return datasets.Dataset.from_list(rows)


def copes_reward(prompts: Any = None, completions: Any = None, **fields: Any) -> list[float]:
    """The reward function to pass with `CopesRollout`: each episode's copes reward."""
    if REWARD_FIELD not in fields:
        raise KeyError(
            f"no {REWARD_FIELD!r} field: use copes_reward with rollout_func=CopesRollout(...)"
        )
    return [float(r) for r in fields[REWARD_FIELD]]


@dataclass
class CopesRollout:
    """``GRPOTrainer(rollout_func=CopesRollout(make_env, tasks), reward_funcs=copes_reward)``.

    Args:
        make_env: builds one copes env (e.g. ``lambda: gym.make("ToolMath-v0")``); one per
            concurrent episode, kept across calls.
        tasks: the tasks the dataset's ``task_id`` refer to (default: the first env's).
        max_new_tokens: longest turn in tokens (TRL's `max_completion_length` bounds nothing
            here: copes ends episodes by turns and by `max_context`).
        temperature / top_p: default: the trainer's `args.temperature` / `args.top_p`.
        max_context: tokens per episode, prompt included (default: the model's context).
        chat_template_kwargs: passed to the chat template (e.g. ``{"enable_thinking": False}``).
    """

    make_env: Callable[[], Any]
    tasks: Sequence[Task] | None = None
    max_new_tokens: int = 96
    temperature: float | None = None
    top_p: float | None = None
    max_context: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _envs: list[Any] = field(default_factory=list, init=False, repr=False)
    _by_id: dict[str, Task] = field(default_factory=dict, init=False, repr=False)
    _calls: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        first = self.make_env()
        _copes_env(first)
        self._envs.append(first)
        tasks = _copes_env(first).tasks if self.tasks is None else self.tasks
        self._by_id = {t.id: t for t in tasks}
        self._by_prompt: dict[str, list[str]] | None = None  # built on the first call

    def dataset(self, conversational: bool = True) -> Any:
        """`task_dataset` over this rollout's tasks."""
        tasks = list(self._by_id.values())
        return task_dataset(self._envs[0], tasks, conversational=conversational)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        from copes.agents.hf.policy import HFPolicy
        from copes.agents.policy import SamplingConfig
        from copes.agents.rollout import rollout
        from copes.seeding import derive_seed

        task_ids = self._task_ids(prompts, trainer)
        mode = "train" if trainer.model.training else "eval"
        per_prompt = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        # TRL repeats each prompt `num_generations` times in the batch (its RepeatSampler);
        # a slice that already holds every copy needs one episode per entry.
        repeats = 1 if _already_repeated(task_ids, per_prompt) else per_prompt
        options = [{"task": self._by_id[i]} for i in task_ids for _ in range(repeats)]
        while len(self._envs) < len(options):
            self._envs.append(self.make_env())
        args = trainer.args
        self._calls += 1
        sampling = SamplingConfig(
            self.max_new_tokens,
            temperature=args.temperature if self.temperature is None else self.temperature,
            top_p=args.top_p if self.top_p is None else self.top_p,
            seed=derive_seed("trl", args.seed, trainer.state.global_step, self._calls),
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        try:
            policy = HFPolicy(
                model, trainer.processing_class, chat_template_kwargs=self.chat_template_kwargs
            )
            episodes = rollout(
                policy, self._envs[: len(options)], sampling, options=options,
                max_context=self.max_context,
            )  # fmt: skip
        finally:
            model.train(was_training)
        eos = list(trainer.eos_token_ids)
        out: dict[str, list[Any]] = {
            "prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
            REWARD_FIELD: [], "copes_correct": [], "copes_end_reason": [],
        }  # fmt: skip
        for episode in episodes:
            start = episode.prompt_length
            completion = list(episode.token_ids[start:])
            mask = list(episode.generated_mask[start:])
            logprobs = list(episode.logprobs[start:])
            if episode.end_reason == "answer" and (not completion or completion[-1] not in eos):
                completion.append(eos[0])  # the end of an answered episode, not trained on
                mask.append(0)
                logprobs.append(0.0)
            out["prompt_ids"].append(list(episode.token_ids[:start]))
            out["completion_ids"].append(completion)
            out["logprobs"].append(logprobs)
            out["env_mask"].append(mask)
            out[REWARD_FIELD].append(float(episode.reward))
            out["copes_correct"].append(bool(episode.correct))
            out["copes_end_reason"].append(episode.end_reason)
        return out

    def _task_ids(self, prompts: list[Any], trainer: Any) -> list[str]:
        """The task id of each prompt (rows built by `task_dataset`)."""
        by_prompt = self._by_prompt
        if by_prompt is None:
            by_prompt = {}
            for task in self._by_id.values():
                first, _ = self._envs[0].reset(options={"task": task})
                by_prompt.setdefault(first, []).append(task.id)
            self._by_prompt = by_prompt
        ids = []
        for prompt in prompts:
            text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            matches = by_prompt.get(text, [])
            if len(matches) != 1:
                raise ValueError(
                    f"prompt {str(text)[:60]!r} is the first message of {len(matches)} tasks; "
                    "build the dataset with task_dataset(...) from the same tasks, whose "
                    "prompts must differ"
                )
            ids.append(matches[0])
        return ids

    def close(self) -> None:
        for env in self._envs:
            env.close()


def _already_repeated(task_ids: list[str], per_prompt: int) -> bool:
    """True when `task_ids` holds each id in runs of `per_prompt` (TRL's repeated batch)."""
    if per_prompt <= 1 or len(task_ids) % per_prompt:
        return per_prompt <= 1
    return all(
        len(set(task_ids[i : i + per_prompt])) == 1 for i in range(0, len(task_ids), per_prompt)
    )


# ---------------------------------------------------------------------- environment_factory
_JSON_TYPES = {
    "string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict,
}  # fmt: skip


def _tool_method(name: str, schema: dict[str, Any]) -> Callable[..., str]:
    """A method named `name` whose signature and docstring say what `schema` says (TRL reads
    them with transformers' `get_json_schema`); calling it runs the copes tool."""
    function = schema["function"]
    params = function.get("parameters", {})
    props, required = params.get("properties", {}), set(params.get("required", []))
    signature = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    doc_args = []
    for arg, spec in props.items():
        kind: Any = _JSON_TYPES.get(spec.get("type", "string"), str)
        if arg in required:
            default = inspect.Parameter.empty
        elif "default" in spec:
            default = spec["default"]
        else:  # optional without a default: None means "not given" (TRL: nullable)
            default, kind = None, kind | None
        signature.append(
            inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
        )
        annotations[arg] = kind
        doc_args.append(f"    {arg}: {spec.get('description', arg)}")

    def method(self: Any, **arguments: Any) -> str:
        return self._call_tool(name, {k: v for k, v in arguments.items() if v is not None})

    method.__name__ = name
    method.__qualname__ = name
    method.__signature__ = inspect.Signature(signature)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    description = " ".join(str(function.get("description") or name).split())
    method.__doc__ = description + ("\n\nArgs:\n" + "\n".join(doc_args) if doc_args else "")
    return method


def environment_factory(make_env: Callable[[], Any], tasks: Sequence[Task] | None = None) -> type:
    """A class for ``GRPOTrainer(environment_factory=...)`` over a copes env.

    Each instance holds one env. ``reset(task_id=...)`` (the dataset row's fields) starts its
    episode; the env's tools are methods; ``answer(answer)`` grades the final answer, and
    ``get_reward()`` returns that grade's reward (0 without an answer).
    """
    probe = make_env()
    base = _copes_env(probe)
    schemas = base.tool_schemas
    by_id = {t.id: t for t in (base.tasks if tasks is None else tasks)}
    probe.close()
    if "answer" in {s["function"]["name"] for s in schemas}:
        raise ValueError("the env has a tool named 'answer', which the factory uses to grade")

    class CopesEnvironment:
        def __init__(self) -> None:
            self.env = make_env()
            self.base = _copes_env(self.env)
            self.reward = 0.0
            self.correct = False

        def reset(self, task_id: str | None = None, **row: Any) -> None:
            if task_id not in by_id:
                raise KeyError(f"no task {task_id!r}: build the dataset with task_dataset(...)")
            self.env.reset(options={"task": by_id[task_id]})
            self.reward, self.correct = 0.0, False
            return None  # the dataset's prompt is already the env's first message

        def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
            from copes.envs.parsing import ParsedTurn
            from copes.envs.tools.base import check_arguments

            problem = check_arguments(self.base.tools[name], arguments)
            if problem is not None:  # the same observation copes' own parser gives
                return problem
            turn = ParsedTurn(kind="tool_call", tool_name=name, arguments=arguments)
            output, _ = self.base._run_tool(turn)
            return output

        def answer(self, answer: str) -> str:
            """Submit the final answer; it is graded and ends the episode.

            Args:
                answer: the final answer, e.g. a number or a short phrase.
            """
            grade = self.base._grade(str(answer))
            self.reward, self.correct = float(grade.reward), bool(grade.correct)
            return "correct" if grade.correct else "graded"

        def get_reward(self) -> float:
            return self.reward

    for schema in schemas:
        name = schema["function"]["name"]
        setattr(CopesEnvironment, name, _tool_method(name, schema))
    CopesEnvironment.__name__ = CopesEnvironment.__qualname__ = "CopesEnvironment"
    return CopesEnvironment
