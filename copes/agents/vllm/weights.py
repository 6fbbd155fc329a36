"""`VLLMWeights`: the `WeightSpace` of a `VLLMPolicy`, living in the vLLM workers.

The optimizers call perturb/restore/update/checksum on it exactly as on a `WeightSpace`; each
call runs `copes.agents.vllm.worker.CopesWorkerExtension` in every worker through
`collective_rpc`, and every change resets the engine's prefix cache.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from copes.agents.vllm.scratch import scratch_dir
from copes.weights import DEFAULT_CHUNK_SIZE, Perturbation, Shard


class EngineHost(Protocol):
    """What `VLLMWeights` needs of its policy (`VLLMPolicy` declares all of it): the engine
    whose workers hold the weights, their layout, each rank's shards, and the prefix cache to
    drop when they change."""

    llm: Any
    layout: Sequence[tuple[str, Sequence[int]]]  # `weight_map.Layout` (it imports vLLM)
    rank_shards: list[dict[str, Shard]]

    def reset_cache(self) -> None: ...


class VLLMWeights:
    """The `WeightSpace` of a `VLLMPolicy`: same methods, run in every worker on its shards.

    Only seeds, coefficients and file paths cross the process boundary; every worker
    regenerates the same noise, so replicas and shards stay bit-identical.
    """

    def __init__(
        self,
        policy: EngineHost,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        backup_device: str = "cpu",
    ) -> None:
        self.policy = policy
        self.chunk_size = chunk_size
        sizes = policy.llm.collective_rpc("copes_init_space", args=(chunk_size, backup_device))
        self.num_coordinates, self.num_matrix_rows = (int(v) for v in sizes[0])
        self.names = [n for n, _ in policy.layout]

    def _call(self, method: str, *args: Any) -> list[Any]:
        return self.policy.llm.collective_rpc(method, args=args)

    def _changed(self) -> None:
        self.policy.reset_cache()

    def perturb(self, perturbation: Perturbation) -> None:
        from copes.agents.vllm.worker import encode_perturbation

        self._call("copes_perturb", encode_perturbation(perturbation))
        self._changed()

    def restore(self) -> None:
        self._call("copes_restore")
        self._changed()

    def update(
        self,
        perturbations: Sequence[Perturbation],
        coefficients: Sequence[float],
        learning_rate: float,
    ) -> None:
        from copes.agents.vllm.worker import encode_perturbation

        if len(perturbations) != len(coefficients):
            raise ValueError("one coefficient per perturbation is required")
        encoded = [encode_perturbation(p) for p in perturbations]
        self._call("copes_update", encoded, [float(c) for c in coefficients], float(learning_rate))
        self._changed()

    def checksum(self) -> str:
        """With one worker, exactly `WeightSpace.checksum()` of the same weights (so it equals
        the transformers backend's); with several, a digest of their checksums."""
        sums = self._call("copes_checksum")
        if len(sums) == 1:
            return sums[0]
        return hashlib.sha256("".join(sums).encode()).hexdigest()

    def subspace_sizes(self, partition_seed: int, num_subspaces: int) -> list[int]:
        return self._call("copes_subspace_sizes", partition_seed, num_subspaces)[0]

    def sync_from_working(self) -> None:
        self._call("copes_sync_from_working")

    def master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 master as full HF tensors (shards of every worker put together)."""
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(dir=scratch_dir(self.memory_bytes())) as folder:
            parts = [load_file(p) for p in self._call("copes_save_master", folder)]
        state = {}
        for name, shape in self.policy.layout:
            if name not in self.policy.rank_shards[0]:  # rank 0 holds it whole: no copy
                state[name] = parts[0][name]
                continue
            full = torch.empty(shape, dtype=torch.float32)
            for part, shards in zip(parts, self.policy.rank_shards, strict=True):
                shard = shards.get(name)
                target = (
                    full
                    if shard is None
                    else full.narrow(shard.dim, shard.start, shard.stop - shard.start)
                )
                target.copy_(part[name])
            state[name] = full
        return state

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the master (full HF tensors, e.g. from a checkpoint) and restore."""
        from safetensors.torch import save_file

        if missing := [n for n in self.names if n not in state]:
            raise KeyError(f"state has no tensor {missing[0]!r}")
        full = {n: state[n].float().reshape(s).contiguous() for n, s in self.policy.layout}
        with tempfile.TemporaryDirectory(dir=scratch_dir(self.memory_bytes())) as folder:
            path = str(Path(folder) / "master.safetensors")
            save_file(full, path)
            self._call("copes_load_master", path)
        self._changed()

    def memory_bytes(self) -> int:
        """Bytes of fp32 master, all workers together."""
        return 4 * self.num_coordinates
