"""Files of models on disk: where copes caches what it builds, and the digests that say a
folder holds what it should (the shipped agent, a converted GGUF model)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def default_cache_dir() -> Path:
    """`$COPES_CACHE` or `~/.cache/copes`: rebuilt agents and converted GGUF models."""
    return Path(os.environ.get("COPES_CACHE", Path.home() / ".cache" / "copes"))


def weights_digest(folder: str | Path) -> str:
    """sha256 over the tensors of `folder`'s safetensors files (one or several shards):
    names sorted, raw bytes."""
    import hashlib
    from contextlib import ExitStack

    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    digest = hashlib.sha256()
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
        for name in sorted(where):
            digest.update(name.encode())
            tensor = where[name].get_tensor(name)
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def files_digest(folder: str | Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over every file of `folder` (relative names sorted, contents), but `exclude`."""
    import hashlib

    root = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name in exclude:
            continue
        digest.update(name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()
