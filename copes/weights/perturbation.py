"""What a population member is, as data: a subspace of a seeded partition, a perturbation
(seed, subspace, sign, sigma, rank) and where a tensor-parallel shard sits in its full tensor.

Plain frozen dataclasses: the optimizers make them, the weight engine (`copes.weights.space`)
turns them into weight changes, and only these seeds cross processes (vLLM workers, Ray).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Subspace:
    """Subspace `index` of the `num_subspaces`-way partition drawn from `partition_seed`."""

    partition_seed: int
    num_subspaces: int
    index: int

    def __post_init__(self) -> None:
        if self.num_subspaces < 1:
            raise ValueError(f"num_subspaces must be >= 1, got {self.num_subspaces}")
        if not 0 <= self.index < self.num_subspaces:
            raise ValueError(f"subspace index {self.index} not in [0, {self.num_subspaces})")


FULL_SPACE = Subspace(partition_seed=0, num_subspaces=1, index=0)


@dataclass(frozen=True)
class Perturbation:
    """One population member: noise `sign * sigma * eps(seed)` inside `subspace`."""

    member: int
    seed: int
    subspace: Subspace = FULL_SPACE
    sign: int = 1  # -1 for the mirrored half of an antithetic pair
    sigma: float = 1e-3
    rank: int = 0  # 0: full-rank Gaussian noise (the paper's); r > 0: rank-r per matrix

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"perturbation rank must be >= 0 (0 = full rank), got {self.rank}")


@dataclass(frozen=True)
class Shard:
    """Where a local tensor sits in its full tensor: `full[start:stop]` along `dim`.

    Tensor parallelism splits a weight by rows (dim 0: q/k/v, gate/up, embeddings) or by
    columns (dim 1: o_proj, down_proj); the local tensor is that block, contiguous.
    """

    full_shape: tuple[int, ...]
    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < min(2, len(self.full_shape)):
            raise ValueError(f"shard dim must be 0 or 1 of a 1-D/2-D tensor, got {self}")
        if not 0 <= self.start < self.stop <= self.full_shape[self.dim]:
            raise ValueError(f"shard range [{self.start}, {self.stop}) outside {self.full_shape}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    def locate(
        self, start: int, end: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions inside the full-tensor chunk [start, end), local flat indices) of the
        coordinates this shard holds; None when it holds none of them."""
        if self.dim == 0:
            inner = math.prod(self.full_shape[1:])
            low, high = max(start, self.start * inner), min(end, self.stop * inner)
            if low >= high:
                return None
            inside = torch.arange(low - start, high - start, device=device)
            return inside, inside + (start - self.start * inner)
        cols = self.full_shape[1]
        flat = torch.arange(start, end, device=device)
        row, col = flat // cols, flat % cols
        keep = (col >= self.start) & (col < self.stop)
        if not bool(keep.any()):
            return None
        inside = keep.nonzero()[:, 0]
        local = row[keep] * (self.stop - self.start) + col[keep] - self.start
        return inside, local


def sigma_for_subspaces(sigma: float, num_subspaces: int, scale: bool = True) -> float:
    """sigma_k = sqrt(K) * sigma: a subspace perturbation with the full-space squared norm."""
    return sigma * math.sqrt(num_subspaces) if scale else sigma
