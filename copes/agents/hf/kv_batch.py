"""KV caches of many token sequences in one batch, for a decode loop whose rows come and go
(`copes.agents.hf.engine`).

Layout: per model layer, keys and values of shape ``[rows, kv_heads, width, head_dim]`` (the
layout of a transformers `DynamicCache`). ``mask[r, c]`` is 1 where column ``c`` of row ``r``
holds a real token and 0 for padding: left padding, or a hole in front of a prefill chunk
that was shorter than the longest chunk of its forward pass. The model gets ``mask`` as its
attention mask and explicit position ids, so padding changes nothing but the work spent on
it. Where a row's tokens sit does not matter either, as long as they precede the columns
being written: attention over cached keys does not depend on their order.

Two containers:

- `KVBatch`, a plain padded batch: the rows about to be prefilled (new prompts, or what
  follows a turn), built by concatenating the caches of rows that left the decode batch.
- `SlotBatch`, the decode batch: rows live in slots of buffers with spare room, so a decode
  step writes its column in place, a row that leaves is replaced by the last row, and a row
  that joins is copied into the next free slot; nothing else moves.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

# Below this share of real tokens, `concat` re-packs the batch (a gather per tensor).
_MIN_DENSITY = 0.5


def _forward_parameters(model: Any) -> set[str]:
    """The keyword arguments `model.forward` takes; a peft wrapper passes them through to
    its base model, so that one's count."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def cache_argument(model: Any) -> str:
    """The name under which `model.forward` takes its KV cache (renamed in transformers 5)."""
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


def supports_kv_batch(model: Any) -> bool:
    """Whether `model` keeps a plain full-attention cache this module can re-arrange (not
    sliding-window, linear-attention or encoder-decoder caches; transformers >= 4.56)."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if getattr(model.config, "is_encoder_decoder", False):
            return False
        cache = DynamicCache(config=model.config)
    except Exception:  # an older transformers, or a config it cannot lay out
        return False
    layers = getattr(cache, "layers", [])
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return False
    return {"position_ids", "logits_to_keep", cache_argument(model)} <= _forward_parameters(model)


class KVBatch:
    """Rows of KV cache in one padded batch (see the module docstring).

    Attributes:
        layers: per layer ``(keys, values)``; None while the batch holds no token yet.
        mask: ``[rows, width]`` long, 1 on real tokens.
        positions: ``[rows]`` long, the position id of each row's next token (its length).
    """

    def __init__(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]] | None,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        self.layers = layers
        self.mask = mask
        self.positions = positions
        self._cache: Any = None  # the DynamicCache the model extends in place, once built

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> KVBatch:
        """`rows` sequences with no token yet (their prompts are prefilled by `forward`)."""
        mask = torch.zeros((rows, 0), dtype=torch.long, device=device)
        return cls(None, mask, torch.zeros(rows, dtype=torch.long, device=device))

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    # ------------------------------------------------------------------ the model
    def forward(self, model: Any, chunks: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
        """Feed each row its chunk of new tokens (at least one each); return the logits
        ``[rows, vocab]`` that follow each row's last token. The chunks are right-aligned,
        so a chunk shorter than the longest one leaves a hole in front of it."""
        from transformers import DynamicCache

        if len(chunks) != self.rows or any(len(chunk) == 0 for chunk in chunks):
            raise ValueError("forward needs one non-empty chunk of new tokens per row")
        device = self.mask.device
        size = max(len(chunk) for chunk in chunks)
        ids = torch.full((self.rows, size), pad_id, dtype=torch.long)
        new = torch.zeros((self.rows, size), dtype=torch.long)
        for row, chunk in enumerate(chunks):
            ids[row, size - len(chunk) :] = torch.tensor(list(chunk), dtype=torch.long)
            new[row, size - len(chunk) :] = 1
        ids, new = ids.to(device), new.to(device)
        position_ids = (self.positions[:, None] + new.cumsum(1) - 1).clamp(min=0)
        if self._cache is None:
            self._cache = DynamicCache(self.layers) if self.layers is not None else DynamicCache()
        mask = torch.cat([self.mask, new], dim=1)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument(model): self._cache},
        )
        self.layers = [(keys, values) for keys, values, *_ in self._cache]
        padding = new[:, None, :, None] == 0
        if padding.any():  # a padding query with nothing to attend to can come out NaN
            for keys, values in self.layers:
                keys[:, :, -size:].masked_fill_(padding, 0)
                values[:, :, -size:].masked_fill_(padding, 0)
        self.mask = mask
        self.positions = self.positions + new.sum(1)
        return out.logits[:, -1]

    # ------------------------------------------------------------------ re-arranging rows
    def take(self, rows: Sequence[int]) -> KVBatch:
        """A new batch of the given rows (in that order), without all-padding columns."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else mask.shape[1]
        layers = None
        if self.layers is not None and start < mask.shape[1]:
            layers = [(k[index, :, start:], v[index, :, start:]) for k, v in self.layers]
        return KVBatch(layers, mask[:, start:], self.positions[index])

    def first(self, columns: int) -> KVBatch:
        """The cache of the first `columns` tokens of this one-row batch without padding
        (a prompt's prefix: keys and values of a token depend only on the tokens before it)."""
        if self.rows != 1 or self.layers is None or not bool(self.mask.all()):
            raise ValueError("first needs one row of real tokens")
        if not 0 < columns <= self.width:
            raise ValueError(f"first needs 1 to {self.width} columns, got {columns}")
        layers = [(k[:, :, :columns], v[:, :, :columns]) for k, v in self.layers]
        positions = torch.full_like(self.positions, columns)
        return KVBatch(layers, self.mask[:, :columns], positions)

    def repeat(self, rows: int) -> KVBatch:
        """`rows` copies of this one-row batch."""
        if self.rows != 1:
            raise ValueError(f"repeat needs a one-row batch, got {self.rows} rows")
        layers = None
        if self.layers is not None:
            layers = [
                (k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.layers
            ]
        return KVBatch(layers, self.mask.expand(rows, -1).clone(), self.positions.repeat(rows))

    def compact(self) -> KVBatch:
        """The same rows with every row's real tokens moved to the right end (no holes)."""
        if self.layers is None:
            return self
        width = int(self.mask.sum(dim=1).max())
        # A stable sort of the 0/1 mask lists the padding columns first, then the real ones in
        # order: its last `width` indices are the columns to keep, left-padded.
        source = torch.sort(self.mask, dim=1, stable=True).indices[:, -width:]
        mask = self.mask.gather(1, source)
        layers = []
        for keys, values in self.layers:
            heads, dim = keys.shape[1], keys.shape[3]
            index = source[:, None, :, None].expand(-1, heads, -1, dim)
            layers.append((keys.gather(2, index), values.gather(2, index)))
        return KVBatch(layers, mask, self.positions)

    @staticmethod
    def concat(batches: Sequence[KVBatch]) -> KVBatch:
        """All rows of `batches` in one batch (left-padded to one width; re-packed when more
        than half of it would be padding)."""
        batches = [b for b in batches if b.rows]
        if not batches:
            raise ValueError("concat needs at least one row")
        width = max(b.width for b in batches)
        template = next((b.layers for b in batches if b.layers is not None), None)
        masks = [torch.nn.functional.pad(b.mask, (width - b.width, 0)) for b in batches]
        layers = None
        if template is not None:
            layers = []
            for layer, (keys, values) in enumerate(template):
                parts_k, parts_v = [], []
                for b in batches:
                    shape = (b.rows, keys.shape[1], width, keys.shape[3])
                    if b.layers is None:
                        parts_k.append(keys.new_zeros(shape))
                        parts_v.append(values.new_zeros(shape))
                        continue
                    k, v = b.layers[layer]
                    pad = (0, 0, width - b.width, 0)
                    parts_k.append(torch.nn.functional.pad(k, pad))
                    parts_v.append(torch.nn.functional.pad(v, pad))
                layers.append((torch.cat(parts_k), torch.cat(parts_v)))
        merged = KVBatch(layers, torch.cat(masks), torch.cat([b.positions for b in batches]))
        if merged.mask.numel() and merged.mask.float().mean() < _MIN_DENSITY:
            merged = merged.compact()
        return merged


@functools.cache
def _slot_classes() -> tuple[type, type]:
    """The cache classes a `SlotBatch` hands the model (transformers imported lazily)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    class SlotCache(DynamicCache):
        def __init__(self, layers: list[Any]) -> None:
            Cache.__init__(self, layers=layers)

    class SlotLayer(DynamicLayer):
        """One layer of a `SlotBatch` in a decode step: rows ``[0, rows)``, columns
        ``[start, end)`` of the buffers; `update` writes the next columns in place."""

        def __init__(
            self, keys: torch.Tensor, values: torch.Tensor, rows: int, start: int, end: int
        ):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.buffers, self.rows, self.start = (keys, values), rows, start
            self.keys, self.values = keys[:rows, :, start:end], values[:rows, :, start:end]
            self.end = end

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = self.buffers
            end = self.end + key_states.shape[2]
            keys[: self.rows, :, self.end : end] = key_states
            values[: self.rows, :, self.end : end] = value_states
            self.end = end
            self.keys = keys[: self.rows, :, self.start : end]
            self.values = values[: self.rows, :, self.start : end]
            return self.keys, self.values

    return SlotCache, SlotLayer


class SlotBatch:
    """The decode batch (see the module docstring): `rows` rows in slots ``[0, rows)`` of
    buffers ``[capacity, kv_heads, room, head_dim]`` per layer, columns ``[start, end)`` in
    use. Buffers start zeroed, and only real or padding keys and values are written there,
    so masked columns hold finite numbers (a NaN there would leak through the attention)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (keys, values)
        self.mask = torch.zeros((capacity, 0), dtype=torch.long, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.rows = self.start = self.end = 0

    def _reserve(self, front: int, back: int, like: KVBatch | None = None) -> None:
        """Make sure `front` columns exist up to `end` (a joining row of that width ends at
        `end` like the others) and `back` free columns follow it. Otherwise re-allocate with
        room to spare on both sides (columns before `start` cost nothing: no row attends to
        them) and move the columns in use; `start` and `end` move with them."""
        room = self.mask.shape[1]
        if self.layers and front <= self.end and self.end + back <= room:
            return
        width = self.end - self.start
        end = max(front, width)
        end += end // 4
        room = max(end + back + (end + back) // 2, 64)
        moved = slice(end - width, end)
        layers = []
        for keys, values in self.layers or like.layers:
            shape = (self.capacity, keys.shape[1], room, keys.shape[3])
            layers.append((keys.new_zeros(shape), values.new_zeros(shape)))
            if self.layers:
                layers[-1][0][: self.rows, :, moved] = keys[: self.rows, :, self.start : self.end]
                layers[-1][1][: self.rows, :, moved] = values[: self.rows, :, self.start : self.end]
        mask = self.mask.new_zeros((self.capacity, room))
        mask[: self.rows, moved] = self.mask[: self.rows, self.start : self.end]
        self.layers, self.mask = layers, mask
        self.start, self.end = end - width, end

    def add(self, batch: KVBatch) -> None:
        """Copy the rows of `batch` into the next free slots, in order, ending at `end`
        (right-aligned like every row, so trimming can drop what no row uses any more)."""
        if self.rows + batch.rows > self.capacity:
            raise ValueError(f"{self.rows} + {batch.rows} rows exceed capacity {self.capacity}")
        if batch.layers is None:
            raise ValueError("rows join the decode batch after their prefill")
        self._reserve(batch.width, 0, batch)
        rows = slice(self.rows, self.rows + batch.rows)
        columns = slice(self.end - batch.width, self.end)
        for (keys, values), (new_keys, new_values) in zip(self.layers, batch.layers, strict=True):
            keys[rows, :, columns] = new_keys
            values[rows, :, columns] = new_values
        self.mask[rows] = 0
        self.mask[rows, columns] = batch.mask
        self.positions[rows] = batch.positions
        self.rows += batch.rows
        self.start = min(self.start, self.end - batch.width)

    def remove(self, rows: Sequence[int]) -> tuple[KVBatch, list[int]]:
        """Take `rows` out. Returns their caches (a `KVBatch`, in the given order) and, for
        every slot still in use, the slot its row came from (the last rows fill the gaps)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        mask = self.mask[index, self.start : self.end]
        real = mask.any(dim=0).nonzero()
        first = self.start + (int(real[0]) if len(real) else 0)
        columns = slice(first, self.end)
        layers = [(k[index, :, columns], v[index, :, columns]) for k, v in self.layers]
        removed = KVBatch(layers, self.mask[index, first : self.end], self.positions[index])
        kept = self.rows - len(rows)
        gone = set(rows)
        holes = sorted(r for r in gone if r < kept)
        movers = [r for r in range(kept, self.rows) if r not in gone]
        order = list(range(kept))
        if holes:
            to = torch.tensor(holes, dtype=torch.long, device=self.device)
            source = torch.tensor(movers, dtype=torch.long, device=self.device)
            columns = slice(self.start, self.end)
            for keys, values in self.layers:
                keys[to, :, columns] = keys[source, :, columns]
                values[to, :, columns] = values[source, :, columns]
            self.mask[to] = self.mask[source]
            self.positions[to] = self.positions[source]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        self.rows = kept
        in_use = self.mask[:kept, self.start : self.end].any(dim=0).nonzero()
        self.start = self.start + int(in_use[0]) if len(in_use) else self.end
        return removed, order

    def forward(self, model: Any, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: feed each row its next token; return the logits that follow."""
        if len(tokens) != self.rows:
            raise ValueError(f"forward needs one token per row ({self.rows}), got {len(tokens)}")
        self._reserve(0, 1)
        self.mask[: self.rows, self.end] = 1
        cache_class, layer_class = _slot_classes()
        cache = cache_class(
            [layer_class(k, v, self.rows, self.start, self.end) for k, v in self.layers]
        )
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)[:, None]
        out = model(
            input_ids=ids,
            attention_mask=self.mask[: self.rows, self.start : self.end + 1],
            position_ids=self.positions[: self.rows, None],
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument(model): cache},
        )
        self.positions[: self.rows] += 1
        self.end += 1
        return out.logits[:, -1]
