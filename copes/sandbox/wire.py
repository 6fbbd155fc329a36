"""Length-prefixed JSON frames over a stream socket, shared by the sandbox client and server.

Each side treats the other's bytes as untrusted: frames are JSON, never pickle (unpickling
what sandboxed code wrote would run it in the trainer), and a frame's declared size is
checked against a cap before its body is read. Standard library only: the sandbox server
loads this file by path, without importing `copes`.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("!I")


class FrameError(ConnectionError):
    """The peer closed the connection or sent something that is not a valid frame."""


def send_frame(sock: socket.socket, message: Any) -> None:
    """Send `message` (JSON-serializable) as one frame."""
    body = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    data = body.encode("utf-8", "surrogatepass")
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(
    sock: socket.socket,
    deadline: float | None,
    max_bytes: int,
    watch: Callable[[], float] | None = None,
) -> Any:
    """Receive one frame; `deadline` is a `time.monotonic()` value (None waits forever).

    `watch`, if given, is called first and then whenever the seconds it last returned pass
    without a frame; it raises to give up waiting (the client's CPU-time limit).
    Raises TimeoutError when the deadline passes and FrameError on EOF, an oversized frame or
    a body that is not JSON.
    """
    watcher = _Watcher(watch) if watch is not None else None
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline, watcher))
    if size > max_bytes:
        raise FrameError(f"peer sent a {size}-byte frame; at most {max_bytes} bytes are accepted")
    body = _recv_exactly(sock, size, deadline, watcher)
    try:
        return json.loads(body.decode("utf-8", "replace"))
    except ValueError as exc:
        raise FrameError(f"peer sent a frame that is not JSON: {exc}") from None


class _Watcher:
    """Calls `watch` again once the seconds of its last answer have passed."""

    def __init__(self, watch: Callable[[], float]) -> None:
        self.watch = watch
        self.due = time.monotonic() + watch()

    def wait(self, now: float) -> float:
        """Seconds to block before the next call."""
        if now >= self.due:
            self.due = now + self.watch()
        return max(self.due - now, 0.001)


def _recv_exactly(
    sock: socket.socket, size: int, deadline: float | None, watcher: _Watcher | None = None
) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        now = time.monotonic()
        wait = None if deadline is None else deadline - now
        if wait is not None and wait <= 0:
            raise TimeoutError("no complete frame before the deadline")
        if watcher is not None:
            wait = watcher.wait(now) if wait is None else min(wait, watcher.wait(now))
        sock.settimeout(wait)
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        except TimeoutError:
            if watcher is not None:
                continue  # the loop asks `watch` and checks the deadline again
            raise TimeoutError("no complete frame before the deadline") from None
        except OSError as exc:  # ECONNRESET and friends: the peer is gone
            raise FrameError(f"connection to the peer failed: {exc}") from None
        if n == 0:
            raise FrameError("the peer closed the connection")
        got += n
    return bytes(buf)
