"""`copes-demo`: one scripted episode of each environment, printed turn by turn.

Shows the real tools at work (sandboxed Python, BM25 search) and the graders, offline, in a
second. The scripted expert plays the agent's part.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from copes.agents.scripted import ScriptedExpert
from copes.envs.presets import tool_math_env, tool_qa_env
from copes.envs.tasks.synthetic import synthetic_math_tasks, synthetic_qa_tasks


def run_episode(env, task, expert: ScriptedExpert) -> float:
    obs, info = env.reset(options={"task": task})
    print(f"[user]\n{obs}\n")
    total, done = 0.0, False
    while not done:
        turn = expert.act(task, info["messages"])
        obs, reward, terminated, truncated, info = env.step(turn)
        print(f"[agent]\n{turn}\n")
        if obs:
            print(f"[{info.get('tool') or 'env'}]\n{obs}\n")
        total += reward
        done = terminated or truncated
    print(f"reward={total}  correct={info.get('correct')}  gold={list(task.answers)}\n")
    return total


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="which synthetic tasks to show")
    args = parser.parse_args(argv)
    expert = ScriptedExpert(mistake_rate=0.0)
    for title, make_env, tasks in (
        ("ToolMath-v0", tool_math_env, synthetic_math_tasks("test", 1, seed=args.seed)),
        ("ToolQA-v0", tool_qa_env, synthetic_qa_tasks("test", 1, seed=args.seed)),
    ):
        print(f"=== {title} ===\n")
        env = make_env(tasks=tasks)
        try:
            run_episode(env, tasks[0], expert)
        finally:
            env.close()


if __name__ == "__main__":
    main()
