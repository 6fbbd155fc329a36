"""Fixtures of the served tests: a task rollout of ToolMath (tags) on synthetic tasks."""

import pytest

from copes.agents.policy import SamplingConfig


def task_rollout(samples: int = 1, tasks: int = 4, temperature: float = 0.0):
    """(TaskRollout, its env factory): `tasks` synthetic math tasks a step, `samples` each."""
    from copes.envs.presets import tool_math_env
    from copes.envs.tasks.synthetic_math import synthetic_math_tasks
    from copes.train import TaskRollout

    pool = synthetic_math_tasks("train", 40, seed=5)
    sampling = SamplingConfig(max_new_tokens=48, temperature=temperature)
    make_env = lambda: tool_math_env(tasks=pool[:1], invalid_penalty=0.2)  # noqa: E731
    return TaskRollout(make_env, pool, tasks, samples, sampling, 7), make_env


@pytest.fixture
def make_task_rollout():
    return task_rollout
