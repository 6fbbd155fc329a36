"""copes inside other trainers and env frameworks (docs/integrations.md).

- `copes.integrations.trl`: TRL's `GRPOTrainer` over any copes env (`CopesRollout` as its
  `rollout_func`, or `environment_factory`).

Each submodule imports its library only when used; copes does not depend on them.
"""
