"""Seeds from names: every random choice in copes derives from explicit parts through here.

``derive_seed("batch", seed, step, member)`` is a blake2b digest of the parts, identical in
every process and on every machine (never Python's salted `hash()` or global state), so a
run's tasks, sampling draws and perturbations are functions of its seed alone.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, stable across processes and machines."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
