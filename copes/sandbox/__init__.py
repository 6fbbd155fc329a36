"""The Python sandbox: untrusted code in an isolated, resource-limited interpreter.

One component with one face. The trainer's side (`client`: `shared_server`, `Session`) talks
to a zygote server (`server`, started as ``python -I server.py``, standard library only) that
forks one supervised worker per episode (`session`): namespaces, mounts, limits and dropped
privileges (`isolation`), a read-eval-print loop (`repl`), length-prefixed JSON frames
(`wire`), and a limit on CPU seconds, not wall time (`cpu_time`). docs/sandbox.md has the
threat model; `copes.envs.tools.python.PythonTool` is the tool built on it.
"""

from copes.sandbox.client import (
    SandboxError,
    SandboxServer,
    Session,
    SessionLimits,
    WorkerLost,
    shared_server,
)

__all__ = [
    "SandboxError",
    "SandboxServer",
    "Session",
    "SessionLimits",
    "WorkerLost",
    "shared_server",
]
