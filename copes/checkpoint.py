"""Checkpoints: Hugging Face folders plus a small JSON of trainer/optimizer state.

A checkpoint `checkpoints/step-000120/` is a normal `save_pretrained` folder (loadable by
transformers and vLLM) with `trainer_state.json` beside the weights, `optimizer.pt` when the
optimizer has tensors (GRPO's AdamW) and `es_master.safetensors` when ES keeps an fp32
master that the saved (e.g. bf16) weights cannot represent. Writes are atomic: the folder
is built under a temporary name and renamed, then `checkpoints/latest` is replaced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
MASTER_FILE = "es_master.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    optimizer_tensors: dict[str, Any] | None = None,
    master_state: dict[str, torch.Tensor] | None = None,
    keep: int = 3,
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` of them."""
    if keep < 1:  # 0 or -1 would delete the checkpoint just written
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        if optimizer_tensors is not None:
            torch.save(optimizer_tensors, tmp / OPTIMIZER_FILE)
        if master_state is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in master_state.items()}, str(tmp / MASTER_FILE))
    except Exception as exc:  # a full disk shows up as safetensors', torch's or an OSError
        shutil.rmtree(tmp, ignore_errors=True)  # `latest` still names a complete checkpoint
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OSError(
            f"could not write checkpoint {final.name} in {root} ({detail}); the previous "
            "checkpoint is intact: free space (or move the run folder) and --resume"
        ) from exc
    for file in tmp.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(
            f"{pointer} names {path.name}, which is incomplete or missing; remove the pointer "
            "to resume from an earlier checkpoint"
        )
    return path


def load_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def load_optimizer_tensors(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / OPTIMIZER_FILE
    return torch.load(path, weights_only=False) if path.exists() else None


def load_master_state(checkpoint: Path) -> dict[str, torch.Tensor] | None:
    path = checkpoint / MASTER_FILE
    if not path.exists():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))
