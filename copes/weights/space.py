"""The weight-space engine of ES and CoPES: seeded noise, subspaces, backup/restore, update.

Pure torch over a list of named tensors, so the same code runs inside a transformers model,
a vLLM worker or a Ray actor. Nothing of size d is ever stored besides one master copy (and,
on a CPU, the step's partition as int32, kept for its members and its update: drawing it
costs more there than the noise itself; see `WeightSpace`):

- **Noise is regenerated from seeds.** The noise of a tensor is produced chunk by chunk, each
  chunk from its own generator seeded by (member seed, tensor name, chunk index), so it is
  i.i.d. across tensors, independent of tensor order, and peak extra memory is one chunk.
- **Subspaces are a stratified random partition.** Inside every chunk a random permutation
  (seeded by the step's partition seed) deals the coordinates to the K subspaces in turn,
  continuing the deal across chunks, so the K subspaces are disjoint, cover every coordinate
  and differ in size by at most one (exactly equal when K divides d). K = 1 is the full space
  in natural order: ES is CoPES with K = 1, bit for bit.
- **Restore copies from a master copy, never subtracts.** The master is fp32 (on CPU by
  default), so restore is exact and updates of 1e-5 that bf16 weights would swallow
  accumulate in the master; the working weights are the master cast to their dtype.
- **Low-rank members are a second noise family** (`Perturbation.rank` > 0, EGGROLL-style:
  Sarkar et al., "Evolution Strategies at the Hyperscale", arXiv 2511.16652): the noise of an
  m x n matrix is A B^T / sqrt(r) with A (m x r) and B (n x r) standard normal, regenerated
  from seeds like the full-rank noise. CoPES's subspaces are then a stratified random
  partition of each matrix's rows (the deal continues across matrices), so a member's delta
  stays rank r and it can be served as an adapter (`copes.agents.hf.population`). 1-D tensors
  (norm scales, biases) hold still in this family: no adapter can carry them per member.
- **Tensors may be shards.** Noise and partition are defined on each full (Hugging Face)
  tensor; a tensor-parallel engine that holds rows or columns of it (`Shard`) applies exactly
  the coordinates it holds, so every TP degree sees the same perturbation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from copes.seeding import derive_seed
from copes.weights.perturbation import Perturbation, Shard, Subspace

DEFAULT_CHUNK_SIZE = 1 << 20  # coordinates per chunk: bounds the extra memory of every op
# On a CPU the step's whole partition (4 bytes a coordinate) is kept while it fits in this
# much; a larger space keeps only the current subspace's positions (4 bytes x d / K).
KEEP_PARTITION_BYTES = 1 << 30


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class _Entry:
    name: str
    tensor: torch.Tensor  # the live parameter (working weights)
    master: torch.Tensor  # fp32 copy on the backup device
    offset: int  # coordinates of all earlier (full) tensors
    shard: Shard | None = None  # None: the tensor is the whole of `name`
    row_offset: int = 0  # rows of all earlier matrices (the low-rank family's subspace deal)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape) if self.shard is None else self.shard.full_shape

    @property
    def numel(self) -> int:
        """Coordinates of the full tensor `name` (noise and partition are defined on it)."""
        return self.tensor.numel() if self.shard is None else self.shard.full_numel

    @property
    def is_matrix(self) -> bool:
        """Perturbed by the low-rank family (rows x the product of the other dimensions)."""
        return len(self.full_shape) >= 2


class WeightSpace:
    """The parameters ES perturbs, with their master copy.

    Args:
        named_tensors: (name, tensor) pairs; tensors are modified in place, so they must be
            contiguous (a row slice of a fused tensor is; a transposed view is not). Names
            must be unique: they seed the noise, so use the Hugging Face parameter names, in
            the Hugging Face parameter order (the order sets the subspace deal).
        chunk_size: coordinates processed at a time.
        backup_device: where the fp32 master copy lives ("cpu" by default, as in the paper).
        shards: for tensors that are only part of their named tensor (tensor parallelism),
            which part; the others are whole.
        keep_partition_bytes: on a CPU, the most memory the step's kept partition may take
            (4 bytes a coordinate). Drawing a chunk's permutation costs several times its
            noise there (randperm of 1M coordinates: about 10 ms), so the partition is drawn
            once a step and serves every member and the update; a space too large for this
            keeps only the current subspace's positions (d / K), which its next member reuses
            (a step's members come subspace by subspace: `CoPES.ask`). 0 keeps only those.
            Nothing is kept on an accelerator, where drawing is cheap and memory is not.
    """

    def __init__(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        backup_device: str | torch.device = "cpu",
        shards: Mapping[str, Shard] | None = None,
        keep_partition_bytes: int = KEEP_PARTITION_BYTES,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        names = [n for n, _ in named_tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique: they seed the noise")
        if not named_tensors:
            raise ValueError("a WeightSpace needs at least one tensor")
        self.chunk_size = chunk_size
        self.backup_device = torch.device(backup_device)
        self._entries: list[_Entry] = []
        shards = dict(shards or {})
        if unknown := set(shards) - set(names):
            raise ValueError(f"shards given for tensors not in the space: {sorted(unknown)}")
        offset = rows = 0
        for name, tensor in named_tensors:
            if not tensor.is_floating_point():
                raise TypeError(f"tensor {name} is {tensor.dtype}; only floating tensors evolve")
            if not tensor.is_contiguous():
                raise ValueError(
                    f"tensor {name} is not contiguous: in-place updates through a flat view "
                    "would land in a copy; pass a contiguous view (e.g. a row slice)"
                )
            shard = shards.get(name)
            if shard is not None and tuple(tensor.shape) != shard.local_shape:
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)} but its shard {shard} "
                    f"expects {shard.local_shape}"
                )
            master = tensor.detach().to(self.backup_device, torch.float32, copy=True)
            entry = _Entry(name, tensor, master, offset, shard, rows)
            self._entries.append(entry)
            offset += entry.numel
            rows += entry.full_shape[0] if entry.is_matrix else 0
        self.num_coordinates = offset
        self.num_matrix_rows = rows  # what the low-rank family partitions into subspaces
        cpu_coordinates = sum(e.numel for e in self._entries if e.tensor.device.type == "cpu")
        self._keep_partition = 0 < 4 * cpu_coordinates <= keep_partition_bytes
        # The step's partition, per (tensor, chunk): each subspace's positions, contiguous.
        self._kept_partition: tuple[int, int] | None = None  # (partition seed, K)
        self._kept_orders: dict[tuple[str, int], list[torch.Tensor]] = {}
        # Too large for that: the current subspace's positions, for its next member.
        self._kept_subspace: Subspace | None = None
        self._kept_positions: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def from_module(cls, module: torch.nn.Module, **kwargs: object) -> WeightSpace:
        """All floating parameters of `module` (tied weights once), by their HF names."""
        params = [(n, p.data) for n, p in module.named_parameters() if p.is_floating_point()]
        return cls(params, **kwargs)  # type: ignore[arg-type]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The live (working) tensors by name."""
        return [(e.name, e.tensor) for e in self._entries]

    # ------------------------------------------------------------------ noise and subspaces
    def _chunks(self, entry: _Entry) -> Iterator[tuple[int, int, int]]:
        """(chunk index, start, end) over the flat full tensor."""
        n = entry.numel
        for index, start in enumerate(range(0, n, self.chunk_size)):
            yield index, start, min(start + self.chunk_size, n)

    def _positions(
        self,
        entry: _Entry,
        chunk: int,
        start: int,
        end: int,
        subspace: Subspace,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Positions (within the chunk) that belong to `subspace`; None means all of them.
        `order`: the chunk's permutation when the caller already drew it (`_order`)."""
        k = subspace.num_subspaces
        if k == 1:
            return None
        if order is None:
            order = self._order(entry, chunk, start, end, subspace.partition_seed)
        first = self._first_dealt(entry, start, subspace)
        return order[first::k]

    def _order(
        self, entry: _Entry, chunk: int, start: int, end: int, partition_seed: int
    ) -> torch.Tensor:
        """The chunk's random permutation that deals its coordinates to the subspaces: the
        same for every subspace of a step (so one draw serves all its members)."""
        device = entry.tensor.device
        gen = _generator(device, derive_seed("partition", partition_seed, entry.name, chunk))
        return torch.randperm(end - start, generator=gen, device=device)

    def _member_positions(
        self, entry: _Entry, chunk: int, start: int, end: int, subspace: Subspace
    ) -> torch.Tensor | None:
        """`_positions`, from what is kept on a CPU (see `keep_partition_bytes`)."""
        if subspace.num_subspaces == 1 or entry.tensor.device.type != "cpu":
            return self._positions(entry, chunk, start, end, subspace)
        if self._keep_partition:
            return self._kept_subspace_positions(entry, chunk, start, end, subspace)
        if self._kept_subspace != subspace:
            self._kept_subspace, self._kept_positions = subspace, {}
        key = (entry.name, chunk)
        kept = self._kept_positions.get(key)
        if kept is None:
            positions = self._positions(entry, chunk, start, end, subspace)
            assert positions is not None
            kept = self._kept_positions[key] = positions.to(torch.int32)
        return kept

    def _kept_subspace_positions(
        self, entry: _Entry, chunk: int, start: int, end: int, subspace: Subspace
    ) -> torch.Tensor:
        """The chunk's positions of `subspace` from the kept partition (drawn on first use):
        the chunk's permutation split by subspace, int32, each part contiguous."""
        partition = (subspace.partition_seed, subspace.num_subspaces)
        if self._kept_partition != partition:
            self._kept_partition, self._kept_orders = partition, {}
        key = (entry.name, chunk)
        parts = self._kept_orders.get(key)
        if parts is None:
            order = self._order(entry, chunk, start, end, subspace.partition_seed)
            k = subspace.num_subspaces
            parts = [order[first::k].to(torch.int32) for first in range(k)]
            self._kept_orders[key] = parts
        return parts[self._first_dealt(entry, start, subspace)]

    @staticmethod
    def _first_dealt(entry: _Entry, start: int, subspace: Subspace) -> int:
        """The first position of the chunk's permutation dealt to `subspace` (then every
        K-th): the deal continues across chunks and tensors."""
        return (subspace.index - (entry.offset + start)) % subspace.num_subspaces

    @staticmethod
    def _add_at(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        """flat[index] += values (fp32 values; distinct indices), rounded once to flat's dtype.

        fp32 weights on a CPU add in place (`index_add_`: no gathered copy, bit for bit the
        gather-add-scatter, as each index occurs once); other dtypes add in fp32 and round.
        On an accelerator index_add_ is an atomic add (flagged nondeterministic), so there
        the gather-add-scatter stays."""
        if flat.dtype == torch.float32 and flat.device.type == "cpu":
            flat.index_add_(0, index, values)
        else:
            flat[index] = (flat[index].float() + values).to(flat.dtype)

    def _noise(
        self, entry: _Entry, chunk: int, size: int, seed: int, device: torch.device
    ) -> torch.Tensor:
        gen = _generator(device, derive_seed("noise", seed, entry.name, chunk))
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32)

    def subspace_sizes(self, partition_seed: int, num_subspaces: int) -> list[int]:
        """Coordinates in each subspace (for checks and logs)."""
        sizes = [0] * num_subspaces
        for entry in self._entries:
            for chunk, start, end in self._chunks(entry):
                for k in range(num_subspaces):
                    pos = self._positions(
                        entry, chunk, start, end, Subspace(partition_seed, num_subspaces, k)
                    )
                    sizes[k] += end - start if pos is None else pos.numel()
        return sizes

    def subspace_mask(self, name: str, subspace: Subspace) -> torch.Tensor:
        """Boolean mask (shape of tensor `name`) of the coordinates in `subspace`."""
        entry = next(e for e in self._entries if e.name == name)
        device = entry.tensor.device
        mask = torch.zeros(entry.tensor.numel(), dtype=torch.bool, device=device)
        for chunk, start, end in self._chunks(entry):
            pos = self._positions(entry, chunk, start, end, subspace)
            inside = torch.ones(end - start, dtype=torch.bool, device=device)
            if pos is not None:
                inside.zero_()[pos] = True
            where = self._local(entry, start, end)
            if where is not None:
                sel, loc = where
                mask[loc] = inside[sel]
        return mask.view_as(entry.tensor)

    def _local(
        self, entry: _Entry, start: int, end: int
    ) -> tuple[torch.Tensor | slice, torch.Tensor | slice] | None:
        """(positions in the full-tensor chunk [start, end), local flat indices) held here."""
        if entry.shard is None:
            return slice(0, end - start), slice(start, end)
        return entry.shard.locate(start, end, entry.tensor.device)

    # ------------------------------------------------------------------ the low-rank family
    def _row_positions(self, entry: _Entry, subspace: Subspace) -> torch.Tensor | None:
        """Rows of the full matrix `entry` in `subspace` (sorted); None means all of them."""
        k = subspace.num_subspaces
        if k == 1:
            return None
        device = entry.tensor.device
        gen = _generator(device, derive_seed("row-partition", subspace.partition_seed, entry.name))
        order = torch.randperm(entry.full_shape[0], generator=gen, device=device)
        first = (subspace.index - entry.row_offset) % k  # the deal continues across matrices
        return order[first::k].sort().values

    def _factors(
        self, entry: _Entry, perturbation: Perturbation, full: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(A, B, rows) of a low-rank member's unit noise on the local matrix (rows x cols),
        or with `full` on the whole HF matrix this shard is part of: eps = A @ B^T, A zero
        outside `rows` (row indices; None: every row) and already divided by sqrt(r)."""
        rank, device = perturbation.rank, entry.tensor.device
        full_rows = entry.full_shape[0]
        full_cols = math.prod(entry.full_shape[1:])
        gen = _generator(device, derive_seed("lowrank-A", perturbation.seed, entry.name))
        a = torch.randn(full_rows, rank, generator=gen, device=device, dtype=torch.float32)
        gen = _generator(device, derive_seed("lowrank-B", perturbation.seed, entry.name))
        b = torch.randn(full_cols, rank, generator=gen, device=device, dtype=torch.float32)
        a /= math.sqrt(rank)
        rows = self._row_positions(entry, perturbation.subspace)
        if rows is not None:
            keep = torch.zeros(full_rows, dtype=torch.bool, device=device)
            keep[rows] = True
            a[~keep] = 0.0
        shard = None if full else entry.shard
        if shard is not None and shard.dim == 0:
            a = a[shard.start : shard.stop]
            if rows is not None:
                rows = rows[(rows >= shard.start) & (rows < shard.stop)] - shard.start
        elif shard is not None:
            b = b[shard.start : shard.stop]
        return a, b, rows

    def low_rank_factors(
        self, perturbation: Perturbation, full: bool = False
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each matrix's delta of a low-rank member as (A, B), delta = A @ B^T on the tensor
        viewed as (rows, cols), sign and sigma folded into A: what an adapter serves. With
        `full`, the factors of each whole HF matrix, also where this space holds a shard of it
        (what a LoRA adapter file holds: the engine shards it itself)."""
        if perturbation.rank < 1:
            raise ValueError("low_rank_factors needs a low-rank perturbation (rank >= 1)")
        scale = perturbation.sign * perturbation.sigma
        factors = {}
        for entry in self._entries:
            if entry.is_matrix:
                a, b, _ = self._factors(entry, perturbation, full)
                factors[entry.name] = (a * scale, b)
        return factors

    def row_mask(self, name: str, subspace: Subspace) -> torch.Tensor:
        """Boolean mask over the local rows of matrix `name` that lie in `subspace` (the
        low-rank family's partition)."""
        entry = next(e for e in self._entries if e.name == name)
        if not entry.is_matrix:
            raise ValueError(f"{name} is not a matrix: the low-rank family leaves it unperturbed")
        rows = self._row_positions(entry, subspace)
        local = entry.tensor.shape[0]
        mask = torch.ones(entry.full_shape[0], dtype=torch.bool, device=entry.tensor.device)
        if rows is not None:
            mask.zero_()[rows] = True
        if entry.shard is not None and entry.shard.dim == 0:
            mask = mask[entry.shard.start : entry.shard.stop]
        return mask[:local]

    def _row_chunks(
        self, entry: _Entry, rows: torch.Tensor | None
    ) -> Iterator[slice | torch.Tensor]:
        """The local rows `rows` (None: all) in pieces of about `chunk_size` coordinates."""
        cols = entry.tensor[0].numel()
        step = max(1, self.chunk_size // max(cols, 1))
        if rows is None:
            for start in range(0, entry.tensor.shape[0], step):
                yield slice(start, min(start + step, entry.tensor.shape[0]))
        else:
            for start in range(0, rows.numel(), step):
                yield rows[start : start + step]

    def _perturb_low_rank(self, entry: _Entry, perturbation: Perturbation) -> None:
        if not entry.is_matrix:
            return  # 1-D tensors hold still in the low-rank family
        a, b, rows = self._factors(entry, perturbation)
        matrix = entry.tensor.view(entry.tensor.shape[0], -1)
        # The factors' values are those `low_rank_factors` serves (sign and sigma applied in
        # fp32); the product and the sum run in fp32, or in the weights' own dtype if wider,
        # so a float64 model's member equals its adapter up to summation order.
        work = torch.promote_types(matrix.dtype, torch.float32)
        a = (a * (perturbation.sign * perturbation.sigma)).to(work)
        b = b.to(work)
        for index in self._row_chunks(entry, rows):
            matrix[index] = (matrix[index].to(work) + a[index] @ b.T).to(matrix.dtype)

    def _update_low_rank(
        self,
        entry: _Entry,
        perturbations: Sequence[Perturbation],
        coefficients: Sequence[float],
        learning_rate: float,
    ) -> None:
        """master += lr * sum_m c_m sign_m A_m B_m^T, as one product of the members' factors
        concatenated along the rank (the same order on every replica)."""
        if not entry.is_matrix:
            return
        parts_a, parts_b = [], []
        for p, c in zip(perturbations, coefficients, strict=True):
            weight = float(c) * p.sign
            if weight != 0.0:
                a, b, _ = self._factors(entry, p)
                parts_a.append(a * weight)
                parts_b.append(b)
        if not parts_a:
            return
        a, b = torch.cat(parts_a, dim=1), torch.cat(parts_b, dim=1)
        device = entry.tensor.device
        master = entry.master.view(entry.master.shape[0], -1)
        for index in self._row_chunks(entry, None):
            new = master[index].to(device) + learning_rate * (a[index] @ b.T)
            master[index] = new.to(master.device)

    # ------------------------------------------------------------------ in-place operations
    @torch.no_grad()
    def perturb(self, perturbation: Perturbation) -> None:
        """Add `sign * sigma * eps` to the working weights inside the member's subspace.

        Expects restored weights (call `restore()` between members).
        """
        if perturbation.rank:
            for entry in self._entries:
                self._perturb_low_rank(entry, perturbation)
            return
        scale = perturbation.sign * perturbation.sigma
        for entry in self._entries:
            flat = entry.tensor.view(-1)
            for chunk, start, end in self._chunks(entry):
                pos = self._member_positions(entry, chunk, start, end, perturbation.subspace)
                if entry.shard is not None:
                    self._perturb_shard(entry, flat, chunk, start, end, pos, perturbation)
                elif pos is None:
                    eps = self._noise(entry, chunk, end - start, perturbation.seed, flat.device)
                    view = flat[start:end]
                    if view.dtype == torch.float32:  # in place: no staging copy
                        view.add_(eps.mul_(scale))
                    else:
                        view.copy_((view.float() + scale * eps).to(view.dtype))
                else:
                    eps = self._noise(entry, chunk, pos.numel(), perturbation.seed, flat.device)
                    self._add_at(flat[start:end], pos, eps.mul_(scale))

    def _perturb_shard(
        self,
        entry: _Entry,
        flat: torch.Tensor,
        chunk: int,
        start: int,
        end: int,
        pos: torch.Tensor | None,
        perturbation: Perturbation,
    ) -> None:
        """The full chunk's noise, as an unsharded space draws it, applied where held."""
        where = self._local(entry, start, end)
        if where is None:
            return
        sel, loc = where
        size = end - start if pos is None else pos.numel()
        eps = self._noise(entry, chunk, size, perturbation.seed, flat.device)
        if pos is not None:  # scatter into the chunk, keep the held coordinates of the subspace
            dense = torch.zeros(end - start, dtype=torch.float32, device=flat.device)
            inside = torch.zeros(end - start, dtype=torch.bool, device=flat.device)
            dense[pos], inside[pos] = eps, True
            keep = inside[sel]
            sel, loc, eps = sel[keep], loc[keep], dense
        scale = perturbation.sign * perturbation.sigma
        flat[loc] = (flat[loc].float() + scale * eps[sel]).to(flat.dtype)

    @torch.no_grad()
    def restore(self) -> None:
        """Working weights <- master (cast to their dtype): exact, no subtraction."""
        for entry in self._entries:
            flat, master = entry.tensor.view(-1), entry.master.view(-1)
            n = flat.numel()
            for start in range(0, n, self.chunk_size):  # chunked: no full-tensor staging copy
                end = min(start + self.chunk_size, n)
                flat[start:end].copy_(master[start:end].to(flat.device, flat.dtype))

    @torch.no_grad()
    def update(
        self,
        perturbations: Sequence[Perturbation],
        coefficients: Sequence[float],
        learning_rate: float,
    ) -> None:
        """master += learning_rate * sum_m coefficients[m] * sign_m * eps_m (fp32), then
        restore the working weights from the new master.

        The per-member noise is regenerated chunk by chunk and accumulated in fp32 in member
        order, so every replica (and every shard) computes bit-identical weights from seeds
        and coefficients.
        """
        if len(perturbations) != len(coefficients):
            raise ValueError("one coefficient per perturbation is required")
        self._kept_subspace, self._kept_positions = None, {}
        low = [(p, c) for p, c in zip(perturbations, coefficients, strict=True) if p.rank]
        if low:
            members, values = zip(*low, strict=True)
            for entry in self._entries:
                self._update_low_rank(entry, members, values, learning_rate)
            pairs = [(p, c) for p, c in zip(perturbations, coefficients, strict=True) if not p.rank]
            perturbations = [p for p, _ in pairs]
            coefficients = [c for _, c in pairs]
        if perturbations:
            for entry in self._entries:
                self._update_full(entry, perturbations, coefficients, learning_rate)
        self._kept_partition, self._kept_orders = None, {}  # the step is done
        self.restore()

    def _update_full(
        self,
        entry: _Entry,
        perturbations: Sequence[Perturbation],
        coefficients: Sequence[float],
        learning_rate: float,
    ) -> None:
        """master += lr * sum_m c_m sign_m eps_m on `entry`, chunk by chunk (full-rank noise)."""
        device = entry.tensor.device
        master = entry.master.view(-1)
        for chunk, start, end in self._chunks(entry):
            where = self._local(entry, start, end)
            if where is None:
                continue
            sel, loc = where
            acc = torch.zeros(end - start, dtype=torch.float32, device=device)
            orders: dict[int, torch.Tensor] = {}  # one draw per partition, for all members
            for p, c in zip(perturbations, coefficients, strict=True):
                weight = float(c) * p.sign
                if weight == 0.0:
                    continue
                pos = self._update_positions(entry, chunk, start, end, p.subspace, orders)
                if pos is None:
                    acc += weight * self._noise(entry, chunk, end - start, p.seed, device)
                else:
                    noise = self._noise(entry, chunk, pos.numel(), p.seed, device)
                    self._add_at(acc, pos, noise.mul_(weight))
            acc.mul_(learning_rate)
            if isinstance(loc, slice) and master.device == device:
                master[loc].add_(acc)  # in place: no gathered copy
                continue
            if isinstance(loc, torch.Tensor):
                loc = loc.to(master.device)
            new = master[loc].to(device) + acc[sel]
            master[loc] = new.to(master.device)

    def _update_positions(
        self,
        entry: _Entry,
        chunk: int,
        start: int,
        end: int,
        subspace: Subspace,
        orders: dict[int, torch.Tensor],
    ) -> torch.Tensor | None:
        """A member's positions for the update: from the kept partition when it is this
        member's, else from `orders` (each partition drawn once per chunk, for all members)."""
        if subspace.num_subspaces == 1:
            return None
        if self._kept_partition == (subspace.partition_seed, subspace.num_subspaces):
            return self._kept_subspace_positions(entry, chunk, start, end, subspace)
        seed = subspace.partition_seed
        if seed not in orders:
            orders[seed] = self._order(entry, chunk, start, end, seed)
        return self._positions(entry, chunk, start, end, subspace, orders[seed])

    # ------------------------------------------------------------------ inspection
    def checksum(self) -> str:
        """sha256 over the master weights: equal on replicas that applied the same updates."""
        digest = hashlib.sha256()
        for entry in self._entries:
            digest.update(entry.name.encode())
            digest.update(entry.master.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return digest.hexdigest()

    def master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by name (views; copy before mutating)."""
        return {e.name: e.master.view_as(e.tensor) for e in self._entries}

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the master weights (e.g. from a checkpoint) and restore."""
        for entry in self._entries:
            if entry.name not in state:
                raise KeyError(f"state has no tensor {entry.name!r}")
            entry.master.copy_(state[entry.name].reshape(entry.master.shape))
        self.restore()

    def sync_from_working(self) -> None:
        """Master <- working weights, after something else (e.g. GRPO) changed them."""
        for entry in self._entries:
            entry.master.copy_(entry.tensor.detach().to(self.backup_device, torch.float32))

    def memory_bytes(self) -> int:
        """Bytes held by the master copy (of the coordinates held here)."""
        return 4 * sum(e.master.numel() for e in self._entries)

    def kept_bytes(self) -> int:
        """Bytes of partition positions kept for the step's members (0 after an update)."""
        parts = [t for ts in self._kept_orders.values() for t in ts]
        parts += self._kept_positions.values()
        return sum(t.numel() * t.element_size() for t in parts)
