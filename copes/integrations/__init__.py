"""copes inside other trainers and env frameworks (docs/integrations.md).

- `copes.integrations.trl`: TRL's `GRPOTrainer` over any copes env (`CopesRollout` as its
  `rollout_func`, or `environment_factory`).
- `copes.integrations.openenv`: copes envs behind an OpenEnv server, and OpenEnv sessions as
  Gymnasium envs for copes' rollouts.
- `copes.integrations.verifiers`: copes envs as a verifiers taskset and harness, copes
  policies as verifiers' client, and `VerifiersRollout` to train on verifiers' traces.

Each submodule needs its library (not a copes dependency) only when imported.
"""
