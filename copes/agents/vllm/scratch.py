"""Where weight files for the vLLM workers are written (the policy's checks, the members'
weights, the low-rank members' adapters): one helper, imported by each of them."""

from __future__ import annotations

import os
import shutil


def scratch_dir(needed_bytes: int) -> str | None:
    """Shared memory when it has room (containers often give /dev/shm 64 MiB), else the
    temporary directory (`TMPDIR`, returned as None for `tempfile`)."""
    shm = "/dev/shm"
    writable = os.path.isdir(shm) and os.access(shm, os.W_OK)
    return shm if writable and shutil.disk_usage(shm).free > 1.2 * needed_bytes else None
