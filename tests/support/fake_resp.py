"""A fake RESP2 server on 127.0.0.1 (a thread per connection) whose replies a
handler may craft, to make a server slow, frozen or refusing in ways a real one
is only by accident: handler(conn, args) returns the reply bytes, `None` for
the default reply, or `True` when it answered (or chose not to) itself."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


CLUSTER_INFO = bulk(b"# Cluster\r\ncluster_enabled:1\r\n")
"""The reply to `INFO` of a node that is in a cluster."""


def cluster_slots(ranges: list[tuple[int, int, str]]) -> bytes:
    """The reply to `CLUSTER SLOTS` for `(first slot, last slot, "host:port")`
    ranges, each served by that node alone."""
    out = b"*%d\r\n" % len(ranges)
    for lo, hi, node in ranges:
        host, port = node.rsplit(":", 1)
        out += b"*3\r\n:%d\r\n:%d\r\n*2\r\n" % (lo, hi) + bulk(host.encode())
        out += b":%s\r\n" % port.encode()
    return out


def default_reply(args: list[bytes]) -> bytes:
    c = args[0].upper()
    if c == b"INFO":
        return bulk(b"# Cluster\r\ncluster_enabled:0\r\n")
    if c == b"CONFIG":
        return b"*2\r\n" + bulk(b"proto-max-bulk-len") + bulk(b"536870912")
    if c in (b"EXISTS", b"STRLEN", b"PEXPIRE", b"DEL"):
        return b":0\r\n"
    if c == b"GETRANGE":
        return bulk(b"")
    if c == b"PING":
        return b"+PONG\r\n"
    return b"+OK\r\n"


def trickle(conn: socket.socket, reply: bytes, gap: float) -> bool:
    """Sends `reply` a byte at a time, `gap` seconds apart (each gap inside a
    socket timeout, the whole far past it); stops when the client has gone."""
    try:
        for ch in reply:
            conn.sendall(bytes([ch]))
            time.sleep(gap)
    except OSError:
        pass
    return True


def _read_cmd(f) -> list[bytes] | None:
    line = f.readline()
    if not line:
        return None
    n = int(line[1:])
    out = []
    for _ in range(n):
        size = int(f.readline()[1:])
        out.append(f.read(size + 2)[:-2])
    return out


def accept_each(s: socket.socket, serve: Callable[[socket.socket], None]) -> None:
    """Serves each connection to the listening `s` on a thread of its own, until
    `s` is closed."""
    while True:
        try:
            c, _ = s.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(c,), daemon=True).start()


class FakeServer:
    def __init__(self, handler: Callable[[socket.socket, list[bytes]], bytes | bool | None]):
        self.handler = handler
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(64)
        self.node = f"127.0.0.1:{self.s.getsockname()[1]}"
        threading.Thread(target=accept_each, args=(self.s, self._serve), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while (a := _read_cmd(f)) is not None:
                r = self.handler(c, a)
                if r is None:
                    c.sendall(default_reply(a))
                elif r is not True:
                    c.sendall(r)
        except (OSError, ValueError):
            pass
        finally:
            c.close()

    def close(self) -> None:
        self.s.close()
