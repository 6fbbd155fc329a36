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
from typing import Any

_HEADER = struct.Struct("!I")


class FrameError(ConnectionError):
    """The peer closed the connection or sent something that is not a valid frame."""


def send_frame(sock: socket.socket, message: Any) -> None:
    """Send `message` (JSON-serializable) as one frame."""
    body = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    data = body.encode("utf-8", "surrogatepass")
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket, deadline: float | None, max_bytes: int) -> Any:
    """Receive one frame; `deadline` is a `time.monotonic()` value (None waits forever).

    Raises TimeoutError when the deadline passes and FrameError on EOF, an oversized frame or
    a body that is not JSON.
    """
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, deadline))
    if size > max_bytes:
        raise FrameError(f"peer sent a {size}-byte frame; at most {max_bytes} bytes are accepted")
    body = _recv_exactly(sock, size, deadline)
    try:
        return json.loads(body.decode("utf-8", "replace"))
    except ValueError as exc:
        raise FrameError(f"peer sent a frame that is not JSON: {exc}") from None


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is None:
            sock.settimeout(None)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete frame before the deadline")
            sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 20))
        except TimeoutError:
            raise TimeoutError("no complete frame before the deadline") from None
        except OSError as exc:  # ECONNRESET and friends: the peer is gone
            raise FrameError(f"connection to the peer failed: {exc}") from None
        if n == 0:
            raise FrameError("the peer closed the connection")
        got += n
    return bytes(buf)
