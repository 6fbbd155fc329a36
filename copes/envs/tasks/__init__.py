"""Tasks: the `Task` dataclass, benchmark loaders and synthetic generators."""

from copes.envs.tasks.base import Passage, Task, TaskKind

__all__ = ["Passage", "Task", "TaskKind"]
