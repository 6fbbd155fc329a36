"""The weight engine: what ES/CoPES do to a model's parameters, below agents and optimizers.

`perturbation` says what a member is (seed, subspace, sign, sigma, rank; a tensor-parallel
`Shard`); `space` turns members into weight changes (seeded noise, the stratified partition,
restore from an fp32 master, the update). It depends on torch and `copes.seeding` only, so a
transformers model, a vLLM worker and a Ray actor run the same code, and the backends in
`copes.agents` use it without importing an optimizer.
"""

from copes.weights.perturbation import (
    FULL_SPACE,
    Perturbation,
    Shard,
    Subspace,
    sigma_for_subspaces,
)
from copes.weights.space import DEFAULT_CHUNK_SIZE, KEEP_PARTITION_BYTES, WeightSpace

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FULL_SPACE",
    "KEEP_PARTITION_BYTES",
    "Perturbation",
    "Shard",
    "Subspace",
    "WeightSpace",
    "sigma_for_subspaces",
]
