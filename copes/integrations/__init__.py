"""copes inside other trainers and env frameworks (docs/integrations.md).

- `copes.integrations.trl`: TRL's `GRPOTrainer` over any copes env (`CopesRollout` as its
  `rollout_func`, or `environment_factory`).
- `copes.integrations.openenv`: copes envs behind an OpenEnv server, and OpenEnv sessions as
  Gymnasium envs for copes' rollouts.

Each submodule needs its library (not a copes dependency) only when imported.
"""
