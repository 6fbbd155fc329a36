"""copes-train's machinery, one concern a module.

- `settings`: `TrainConfig` (every flag, checked before anything is built), what `--resume`
  may change, the env/benchmark defaults;
- `task_rollout`: `TaskRollout`, the rollout function the optimizers call (a step's tasks and
  seeds are a pure function of the run seed, the step and the member);
- `build`: tasks, the env factory, the policy and the optimizer from the settings;
- `loop`: `Trainer`, the loop itself: step, log, validate, checkpoint, resume.
"""

from copes.train.build import (
    build_optimizer,
    build_policy,
    build_replica_policy,
    env_factory,
    load_tasks_for,
    lora_population,
    optimizer_config,
)
from copes.train.loop import Trainer
from copes.train.settings import Budget, TrainConfig, public_settings
from copes.train.task_rollout import PlannedEpisode, TaskRollout

__all__ = [
    "Budget",
    "PlannedEpisode",
    "TaskRollout",
    "TrainConfig",
    "Trainer",
    "build_optimizer",
    "build_policy",
    "build_replica_policy",
    "env_factory",
    "load_tasks_for",
    "lora_population",
    "optimizer_config",
    "public_settings",
]
