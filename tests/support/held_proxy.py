"""A TCP proxy on 127.0.0.1 in front of one server whose client-to-server
direction can be held: what a client sends while held reaches the server
only on `release`, after whatever other clients sent meanwhile (a request
delayed in the network). Replies always pass."""

from __future__ import annotations

import contextlib
import socket
import threading

from support.fake_resp import accept_each


class HeldProxy:
    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.flowing = threading.Event()
        self.flowing.set()
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(16)
        self.node = f"127.0.0.1:{self.s.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        threading.Thread(target=accept_each, args=(self.s, self._connect), daemon=True).start()

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def _connect(self, c: socket.socket) -> None:
        up = socket.create_connection(self.target)
        self.socks += [c, up]
        threading.Thread(target=self._pipe, args=(up, c, False), daemon=True).start()
        self._pipe(c, up, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if held:
                    self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.release()
        self.s.close()
        for s in self.socks:
            s.close()
