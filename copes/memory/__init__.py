"""The theoretical memory of a training step, for `copes-train --dry-run` and docs/memory.md:
`shapes` (what a model is, from its config alone) and `plan` (what each optimizer holds)."""

from copes.memory.plan import (
    MemoryEstimate,
    compare_optimizers,
    estimate_memory,
    format_memory_table,
    matrix_rows_and_cols,
    memory_table,
)
from copes.memory.shapes import GIB, PRESETS, QWEN3_4B, ModelShape

__all__ = [
    "GIB",
    "PRESETS",
    "QWEN3_4B",
    "MemoryEstimate",
    "ModelShape",
    "compare_optimizers",
    "estimate_memory",
    "format_memory_table",
    "matrix_rows_and_cols",
    "memory_table",
]
