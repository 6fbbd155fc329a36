"""A whole ES population in one batch: every batch row computes with its own member's weights.

Sequential ES evaluation runs N rollouts one after another, each bound by the decode steps of
its longest episode. Here the N perturbed copies of the weights are stacked (``[N, *shape]``
per parameter) and one episode loop runs every member's episodes together; before each
forward pass the engine says which member each batch row belongs to (`StackedModel.select`),
and the model's layers compute row by row with that member's copy:

- `nn.Linear`: the rows are dealt into an ``[N, width, in]`` grid (width = most rows any
  member has in the batch; empty cells are never read back), multiplied by the stacked
  weights in one batched matmul (`torch.bmm`), and gathered back into batch order;
- `nn.Embedding`: a gather from the stacked tables by (member, token);
- modules whose own parameters are all 1-D (RMSNorm/LayerNorm-style scales and biases): the
  parameter is replaced, for the call, by the row's copy shaped to broadcast over the row.

Anything else (a subclass of Linear/Embedding with its own forward, such as Gemma's scaled
embedding, or a module holding 2-D+ parameters, such as fused MoE experts) is refused when
the model is wrapped: computing it with one member's weights for all rows would be silently
wrong. The arithmetic is the same as per-member evaluation up to the kernels' rounding (a
batched matmul may sum in another order), so greedy tokens are identical in float64 and
almost always in float32 (`benchmarks/population_batch.py` reports the fraction).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from copes.agents.adapters import adapter_targets
from copes.agents.episodes import EpisodeFeed

if TYPE_CHECKING:
    from copes.agents.chat import ChatFormat
    from copes.agents.policy import Generation, SamplingConfig
    from copes.weights import Perturbation


class MemberHost(Protocol):
    """What a population reads of the policy it batches (`HFPolicy`): declared here so that
    the backend's policy can build its populations without an import circle."""

    model: Any
    chat: ChatFormat
    tokenizer: Any
    eos_ids: set[int]

    @property
    def device(self) -> torch.device: ...

    @property
    def max_context(self) -> int: ...

    @property
    def supports_episodes(self) -> bool: ...

    def weights(self) -> Any: ...


def _own_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_floating_point()]


def _kind(module: torch.nn.Module) -> str | None:
    """How `module`'s own parameters are batched per row (None: it has none); raises for a
    module that cannot be batched exactly."""
    params = _own_parameters(module)
    if not params:
        return None
    cls = type(module)
    if isinstance(module, torch.nn.Linear):
        if cls.forward is not torch.nn.Linear.forward:
            raise TypeError(f"{cls.__name__} is a Linear with its own forward")
        return "linear"
    if isinstance(module, torch.nn.Embedding):
        if cls.forward is not torch.nn.Embedding.forward:
            raise TypeError(f"{cls.__name__} is an Embedding with its own forward")
        return "embedding"
    if all(p.dim() == 1 for _, p in params):
        return "elementwise"
    shapes = {n: tuple(p.shape) for n, p in params}
    raise TypeError(f"{cls.__name__} holds parameters {shapes} outside a Linear")


class _RowMembers:
    """The member of each batch row of the next forward pass, and the ``[N, width]`` grid
    the rows are dealt into for per-member batched matmuls."""

    members: int

    def _init_rows(self) -> None:
        self._rows: torch.Tensor | None = None
        self._grids: dict[tuple[Any, ...], torch.Tensor] = {}
        self._flat: torch.Tensor | None = None
        self._width = 0
        self._undo: Callable[[], None] | None = None  # set while `active()`

    def _device(self) -> torch.device:
        raise NotImplementedError

    # ------------------------------------------------------------------ rows
    def select(self, members: Sequence[int]) -> None:
        """The member of each row of the next forward pass, in batch order."""
        device = self._device()
        rows = torch.as_tensor(list(members), dtype=torch.long, device=device)
        if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= self.members:
            raise ValueError(f"row members must lie in [0, {self.members}), got {list(members)}")
        counts = torch.bincount(rows, minlength=self.members)
        width = int(counts.max())
        order = torch.argsort(rows, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(rows)
        rank[order] = torch.arange(rows.numel(), device=device) - starts[rows[order]]
        self._rows, self._flat, self._width = rows, rows * width + rank, width

    def _current(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self._rows is None or self._flat is None:
            raise RuntimeError("select(members) must precede every forward pass")
        if self._rows.numel() != batch:
            raise RuntimeError(
                f"{self._rows.numel()} row members selected for a batch of {batch} rows"
            )
        return self._rows, self._flat, self._width

    # ------------------------------------------------------------------ per-row layers
    def _grid(self, xs: torch.Tensor, width: int) -> torch.Tensor:
        """A reused ``[N * width, T, in]`` buffer for `xs`'s rows. Cells no row fills this
        time keep earlier activations (finite numbers, unlike fresh memory, whose denormals
        slow a matmul down): a matmul's output row depends on its input row alone, and those
        rows are never gathered back."""
        key = (width, xs.shape[1], xs.shape[2], xs.dtype, xs.device)
        grid = self._grids.get(key)
        if grid is None:
            grid = self._grids[key] = xs.new_zeros((self.members * width, *xs.shape[1:]))
        return grid

    def _grouped_matmul(
        self, xs: torch.Tensor, rhs: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Row b of `xs` ([B, T, in]) times its member's ``rhs[m]`` ([N, in, out]), plus
        its ``bias[m]`` ([N, 1, out]): one batched matmul over the member grid."""
        _, flat, width = self._current(xs.shape[0])
        tokens = xs.shape[1]
        grid = self._grid(xs, width)
        grid[flat] = xs
        grid = grid.view(self.members, width * tokens, xs.shape[-1])
        out = torch.bmm(grid, rhs) if bias is None else torch.baddbmm(bias, grid, rhs)
        return out.view(self.members * width, tokens, -1)[flat]

    def _clear_rows(self) -> None:
        self._rows = self._flat = None
        self._grids.clear()

    # ------------------------------------------------------------------ patching
    def _patch(self) -> Callable[[], None]:
        """Make the model compute each row with its member; returns the undo."""
        raise NotImplementedError

    @contextmanager
    def active(self) -> Iterator[Any]:
        """The model computes each row with its member inside; undone on exit (always)."""
        self._undo = self._patch()
        try:
            yield self
        finally:
            undo, self._undo = self._undo, None
            if undo is not None:
                undo()
            self._clear_rows()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The model's own weights for a while inside `active()` (a sessionless request
        interjected into a population's loop); the rows' weights come back after."""
        undo = self._undo
        if undo is None:
            yield
            return
        undo()
        self._undo = None
        try:
            yield
        finally:
            self._undo = self._patch()


class StackedModel(_RowMembers):
    """`members` copies of a model's floating parameters, and the patch that makes each
    batch row of a forward pass compute with its member's copy.

    Fill copy i with `fill(i)` (the model's current parameters: perturb, fill, restore);
    inside `with stacked.active():`, call `select(members)` before every forward pass.
    """

    def __init__(self, model: torch.nn.Module, members: int) -> None:
        if members < 1:
            raise ValueError(f"a population needs at least one member, got {members}")
        self.model = model
        self.members = members
        self.modules: list[tuple[str, torch.nn.Module, str]] = []
        for name, module in model.named_modules():
            try:
                kind = _kind(module)
            except TypeError as exc:
                raise ValueError(
                    f"batched population evaluation cannot run {name or 'the model'}: {exc}, "
                    "so it cannot compute each batch row with its own member's weights; use "
                    "--population-eval sequential"
                ) from None
            if kind is not None:
                self.modules.append((name, module, kind))
        # One stack per parameter object: tied weights (embeddings = lm_head) share it.
        self.stacks: dict[int, torch.Tensor] = {}
        for _, module, _ in self.modules:
            for _, p in _own_parameters(module):
                if id(p) not in self.stacks:
                    self.stacks[id(p)] = p.detach().new_empty((members, *p.shape))
        self._init_rows()

    def _device(self) -> torch.device:
        return next(iter(self.stacks.values())).device

    @staticmethod
    def bytes_needed(model: torch.nn.Module, members: int) -> int:
        """Memory the stacked copies take (the model's own weights not included)."""
        seen: dict[int, torch.Tensor] = {}
        for p in model.parameters():
            if p.is_floating_point():
                seen[id(p)] = p
        return members * sum(p.numel() * p.element_size() for p in seen.values())

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.stacks.values())

    @torch.no_grad()
    def fill(self, index: int) -> None:
        """Copy `index` <- the model's current parameters (e.g. while a member is applied)."""
        for _, module, _ in self.modules:
            for _, p in _own_parameters(module):
                self.stacks[id(p)][index].copy_(p.detach())

    def _linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = self.stacks[id(module.weight)]  # [N, out, in]
        shape = x.shape
        xs = x.reshape(shape[0], -1, shape[-1])  # [B, T, in]
        bias = None if module.bias is None else self.stacks[id(module.bias)][:, None, :]
        out = self._grouped_matmul(xs, weight.transpose(1, 2), bias)
        return out.reshape(*shape[:-1], out.shape[-1])

    def _embedding(self, module: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        rows, _, _ = self._current(ids.shape[0])
        table = self.stacks[id(module.weight)]  # [N, V, d]
        index = rows.view(-1, *([1] * (ids.dim() - 1))).expand_as(ids)
        return table[index, ids]

    def _patch(self) -> Callable[[], None]:
        """Patch the model so every row uses its member's copy; returns the undo."""
        undo: list[Callable[[], None]] = []

        def restore_all() -> None:
            for restore in reversed(undo):
                restore()

        try:
            for _, module, kind in self.modules:
                if kind == "linear":
                    module.forward = types.MethodType(  # type: ignore[method-assign]
                        lambda mod, x: self._linear(mod, x), module
                    )
                    undo.append(lambda m=module: m.__dict__.pop("forward", None))
                elif kind == "embedding":
                    module.forward = types.MethodType(  # type: ignore[method-assign]
                        lambda mod, ids: self._embedding(mod, ids), module
                    )
                    undo.append(lambda m=module: m.__dict__.pop("forward", None))
                else:
                    undo.append(self._patch_elementwise(module))
        except BaseException:
            restore_all()
            raise
        return restore_all

    def _patch_elementwise(self, module: torch.nn.Module) -> Callable[[], None]:
        """Swap the module's 1-D parameters for the rows' copies, shaped [B, 1.., d] after
        the input's batch dimension, for each call (a forward pre-hook)."""
        params = dict(_own_parameters(module))
        for name in params:
            del module._parameters[name]

        def before(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            rows, _, _ = self._current(x.shape[0])
            for name, p in params.items():
                copies = self.stacks[id(p)][rows]  # [B, d]
                shape = (x.shape[0], *([1] * (x.dim() - 1 - p.dim())), *p.shape)
                object.__setattr__(mod, name, copies.view(shape))

        handle = module.register_forward_pre_hook(before)

        def restore() -> None:
            handle.remove()
            for name, p in params.items():
                module.__dict__.pop(name, None)
                module._parameters[name] = p

        return restore


class LowRankPopulation(_RowMembers):
    """N low-rank members (`--noise lowrank`) served as per-row adapters on the model's own,
    unperturbed weights: no weight copies, only each member's factors.

    A member's delta of matrix W is A B^T (`WeightSpace.low_rank_factors`, sign and sigma in
    A), so a Linear row computes ``W x + A_m (B_m^T x)`` and an Embedding row adds
    ``A_m[token] B_m^T``; 1-D tensors hold still in this family, so nothing else changes.
    This is the sequential family's arithmetic reassociated (W + A B^T is never formed):
    float64 runs agree to rounding, float32 ones to the reported fraction of episodes.
    Refused, naming the module: a perturbed matrix outside a plain Linear/Embedding (fused
    MoE experts, Gemma's scaled embedding), whose adapter would be wrong.
    """

    def __init__(self, model: torch.nn.Module, weights: Any, members: int, rank: int) -> None:
        if members < 1:
            raise ValueError(f"a population needs at least one member, got {members}")
        self.model, self.members, self.rank = model, members, rank
        targets = adapter_targets(model)
        modules = dict(model.named_modules())
        # (module, matrix, kind): a tied LM head is a second module on its embedding's matrix
        self.modules = [(modules[t.module], t.matrix, t.kind) for t in targets]
        covered = {t.matrix for t in targets}
        evolving = {n for n, t in weights.named_tensors() if t.dim() >= 2}
        if evolving != covered:
            raise ValueError(
                "the weight space and the model disagree on the matrices: "
                f"{sorted(evolving ^ covered)[:3]}"
            )
        shapes = {n: t.view(t.shape[0], -1).shape for n, t in weights.named_tensors()}
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.a = {
            n: torch.zeros(members, shapes[n][0], rank, dtype=dtype, device=device) for n in covered
        }
        self.b = {
            n: torch.zeros(members, shapes[n][1], rank, dtype=dtype, device=device) for n in covered
        }
        self._init_rows()

    @staticmethod
    def bytes_needed(model: torch.nn.Module, members: int, rank: int) -> int:
        """Memory of N members' factors: (rows + cols) x r per matrix, in the model's dtype."""
        seen = {p.data_ptr(): p for p in model.parameters() if p.dim() >= 2}
        per = sum((p.shape[0] + p[0].numel()) * p.element_size() for p in seen.values())
        return members * rank * per

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def _device(self) -> torch.device:
        return next(iter(self.a.values())).device

    @torch.no_grad()
    def load(self, index: int, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `index` <- one member's factors (`WeightSpace.low_rank_factors`)."""
        if set(factors) != set(self.a):
            raise ValueError("factors must cover exactly the matrices this population serves")
        for name, (a, b) in factors.items():
            self.a[name][index].copy_(a)
            self.b[name][index].copy_(b)

    def _linear_delta(self, matrix: str, x: torch.Tensor) -> torch.Tensor:
        rows, _, _ = self._current(x.shape[0])
        xs = x.reshape(x.shape[0], -1, x.shape[-1])  # [B, T, in]
        projected = torch.bmm(xs, self.b[matrix][rows])  # [B, T, r]: B_m^T x, row by row
        out = self._grouped_matmul(projected, self.a[matrix].transpose(1, 2))  # [B, T, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _embedding_delta(self, matrix: str, ids: torch.Tensor) -> torch.Tensor:
        rows, _, _ = self._current(ids.shape[0])
        index = rows.view(-1, *([1] * (ids.dim() - 1))).expand_as(ids)
        picked = self.a[matrix][index, ids]  # [B, T, r]: A_m[token]
        flat = picked.reshape(ids.shape[0], -1, self.rank)
        out = torch.bmm(flat, self.b[matrix][rows].transpose(1, 2))  # [B, T, d]
        return out.reshape(*ids.shape, out.shape[-1])

    def _patch(self) -> Callable[[], None]:
        """Add every row's adapter to the outputs (forward hooks); returns the undo."""
        handles = []
        for module, matrix, kind in self.modules:
            delta = self._linear_delta if kind == "linear" else self._embedding_delta

            def hook(_: Any, args: tuple[Any, ...], out: Any, m: str = matrix, f=delta) -> Any:
                return out + f(m, args[0])

            handles.append(module.register_forward_hook(hook))

        def undo() -> None:
            for handle in handles:
                handle.remove()

        return undo


class PopulationPolicy:
    """An `EpisodePolicy` view of an `HFPolicy` whose episode loop serves a whole population:
    episode e runs with member ``members[e]``'s weights and samples from its own stream
    ``streams[e]`` (so a member's episode draws exactly what it would alone).

    Set both per rollout with `assign`; `rollout(...)` then drives it like any policy.
    """

    supports_episodes = True
    serves_members = True
    trainable = False

    def __init__(
        self, base: MemberHost, stacked: StackedModel | LowRankPopulation, batch_size: int
    ) -> None:
        self.base = base
        self.stacked = stacked
        self.batch_size = batch_size
        self.chat = base.chat
        self.tokenizer = base.tokenizer
        self.eos_ids = base.eos_ids
        self._members: list[int] = []
        self._streams: list[int] = []

    @property
    def model(self) -> Any:
        return self.base.model

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def max_context(self) -> int:
        return self.base.max_context

    def assign(self, members: Sequence[int], streams: Sequence[int]) -> None:
        """The member and sampling-stream seed of each episode of the next rollout."""
        if len(members) != len(streams):
            raise ValueError("one member and one stream per episode")
        self._members, self._streams = list(members), list(streams)

    def generate_ids(self, *args: Any, **kwargs: Any) -> list[Generation]:
        raise NotImplementedError("a population is served through its episode loop only")

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]] | EpisodeFeed,
        sampling: SamplingConfig,
        next_turn: Callable[[int, Generation], Any],
        *,
        threads: int = 16,
        turn_limits: Any = None,
    ) -> dict[str, float]:
        from copes.agents.hf.engine import EpisodeEngine

        feed = prompts if isinstance(prompts, EpisodeFeed) else EpisodeFeed.of(prompts)
        if feed.count != len(self._members):
            raise ValueError(
                f"{feed.count} episodes but {len(self._members)} assigned members: "
                "call assign() before each rollout"
            )
        feed.suspend = self.stacked.suspended  # interjections run on the model's own weights
        engine = EpisodeEngine(
            self, sampling, next_turn, members=self._members, select=self.stacked.select,
            streams=self._streams, turn_limits=turn_limits,
        )  # fmt: skip
        with self.stacked.active():
            return engine.run(feed, threads)


# Of the free memory, what the stacked copies may take (the rest: KV caches, activations).
MEMORY_FRACTION = 0.8


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device` (CUDA: the driver's count; CPU: MemAvailable)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not on Linux: ask psutil (a transformers/accelerate dependency)

    return int(psutil.virtual_memory().available)


def check_population_fits(
    model: Any, members: int, free_bytes: int | None = None, rank: int = 0
) -> tuple[int, int]:
    """(bytes the N copies, or with `rank` > 0 the N members' low-rank factors, need; bytes
    free); raises ValueError when they do not fit."""
    if rank:
        need = LowRankPopulation.bytes_needed(model, members, rank)
        what = f"{members} members' rank-{rank} factors"
    else:
        need, what = StackedModel.bytes_needed(model, members), f"{members} copies of the weights"
    device = next(model.parameters()).device
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    if need > MEMORY_FRACTION * free:
        gib = 1024**3
        raise ValueError(
            f"--population-eval batched holds {what} "
            f"({need / gib:.2f} GiB) but {device.type} has {free / gib:.2f} GiB free (at most "
            f"{MEMORY_FRACTION:.0%} of it may go to them); use --population-eval sequential "
            "or a smaller --population-size"
        )
    return need, free


class HFMemberBatch:
    """A step's members in the transformers episode loop (`HFPolicy.member_batch`): N stacked
    weight copies, or with `rank` > 0 N rank-r adapters on the model's own weights, and the
    `PopulationPolicy` whose every row computes with its own member. Each member's weights
    are built exactly as sequential evaluation builds them (the same `WeightSpace.perturb`
    of the same seed and subspace, copied into its slot, then restored)."""

    def __init__(
        self, policy: MemberHost, members: int, rank: int, rows: int, free_bytes: int | None
    ) -> None:
        if not policy.supports_episodes:
            raise ValueError(
                "--population-eval batched runs members in the transformers episode loop, "
                f"whose KV cache does not support {type(policy.model).__name__} (use "
                "--population-eval sequential)"
            )
        check_population_fits(policy.model, members, free_bytes, rank)
        self.base, self.members, self.rank = policy, members, rank
        self.slots: StackedModel | LowRankPopulation = (
            LowRankPopulation(policy.model, policy.weights(), members, rank)
            if rank
            else StackedModel(policy.model, members)
        )
        self._policy = PopulationPolicy(policy, self.slots, rows)

    @property
    def policy(self) -> PopulationPolicy:
        return self._policy

    def load(self, members: Sequence[Perturbation]) -> list[float]:
        weights = self.base.weights()
        seconds = []
        for slot, member in enumerate(members):
            start = time.perf_counter()
            if isinstance(self.slots, LowRankPopulation):  # the adapter: no weight change
                self.slots.load(slot, weights.low_rank_factors(member))
            else:
                weights.perturb(member)
                try:
                    self.slots.fill(slot)
                finally:
                    weights.restore()
            seconds.append(time.perf_counter() - start)
        return seconds

    def unload(self) -> None:
        """Nothing to do: the slots are refilled from the updated weights next step."""

    def close(self) -> None:
        """Nothing outside this process."""
