"""Real Redis servers on 127.0.0.1 for the remote-tier tests: a single node or a
3-master cluster, started in a temp dir on free ports and stopped by the tests,
and a minimal RESP client (binary-safe, follows MOVED) to inspect and tamper."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")


class RespError(Exception):
    pass


def _read_line(f) -> bytes:
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    return line[:-2]


def _read(f) -> Any:
    line = _read_line(f)
    kind, rest = line[:1], line[1:]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RespError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read(f) for _ in range(n)]
    raise RespError(f"bad reply {line!r}")


def cmd(port: int, *args: Any, password: str | None = None, timeout: float = 5) -> Any:
    """One command to the node on `port`; a server error is raised as RespError."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        f = s.makefile("rb")
        calls = ([("AUTH", password)] if password else []) + [args]
        for c in calls:
            parts = [a if isinstance(a, bytes) else str(a).encode() for a in c]
            s.sendall(
                b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
            )
            r = _read(f)
        if isinstance(r, RespError):
            raise r
        return r


class Cluster:
    """Nodes on `ports` (plain TCP, which these helpers use); with `tls` (the server
    options of `support.redis_tls.Certs`) each also serves TLS on a port of
    `tls_ports`, and a cluster's bus runs over TLS. A cluster is created with
    `replicas` replicas per master."""

    def __init__(
        self,
        root: Path,
        ports: list[int],
        cluster: bool,
        extra: list[str],
        tls: list[str] | None = None,
        replicas: int = 0,
    ):
        self.root, self.ports, self.cluster, self.extra = root, ports, cluster, extra
        self.tls, self.replicas = tls, replicas
        self.tls_ports = free_ports(len(ports)) if tls else []
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def tls_nodes(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.tls_ports]

    def start_node(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        if self.tls:
            args += ["--tls-port", str(self.tls_ports[self.ports.index(port)]), *self.tls]
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-require-full-coverage", "no"]
            args += ["--cluster-allow-reads-when-down", "yes", "--cluster-node-timeout", "2000"]
        log = open(d / "server.log", "ab")  # noqa: SIM115 - the server keeps it
        self.procs[port] = subprocess.Popen(args + self.extra, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                if cmd(port, "PING") == "PONG":
                    return
            except RespError as e:
                if "NOAUTH" in str(e):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = (d / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis on {port} did not start:\n{tail}")
            time.sleep(0.05)

    def start(self) -> None:
        for p in self.ports:
            self.start_node(p)
        if self.cluster:
            subprocess.run(
                [CLI, "--cluster", "create", *self.nodes, "--cluster-replicas",
                 str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self.wait_ok()

    def wait_ok(self, timeout: float = 20) -> None:
        self.wait_ok_on(self.ports, timeout)

    def wait_ok_on(self, ports: list[int], timeout: float = 20) -> None:
        """Waits until each node of `ports` sees the cluster ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(b"cluster_state:ok" in cmd(p, "CLUSTER", "INFO") for p in ports):
                    return
            except (OSError, RespError):
                pass
            time.sleep(0.1)
        raise RuntimeError("cluster not ok")

    def wait_synced(self, timeout: float = 30) -> None:
        """Waits until every replica has synced with its master (a replica that
        never has refuses to take over when its master dies)."""
        want = len(self.ports) * self.replicas // (self.replicas + 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [cmd(p, "INFO", "replication") for p in self.ports]
            linked = [b"master_link_status:up" in x for x in infos if b"role:slave" in x]
            if len(linked) == want and all(linked):
                return
            time.sleep(0.1)
        raise RuntimeError("replicas not synced")

    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        self.procs[port].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[port].wait()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()

    def call(self, key: bytes | str, *args: Any) -> Any:
        """A command about `key`, sent to the node that serves it."""
        port = self.ports[0]
        for _ in range(3):
            try:
                return cmd(port, *args)
            except RespError as e:
                if not str(e).startswith("MOVED"):
                    raise
                port = int(str(e).split()[2].rsplit(":", 1)[1])
        raise RuntimeError("too many redirects")

    def port_of(self, key: bytes | str) -> int:
        """The port of the node that serves `key`."""
        slot = cmd(self.ports[0], "CLUSTER", "KEYSLOT", key)
        for r in cmd(self.ports[0], "CLUSTER", "SLOTS"):
            if r[0] <= slot <= r[1]:
                return int(r[2][1])
        raise RuntimeError(f"slot {slot} is not served")

    def move_slot(self, slot: int, src: int, dst: int) -> int:
        """Reshards one slot from node `src` to node `dst` as `redis-cli --cluster
        reshard` does (IMPORTING/MIGRATING, MIGRATE of its keys, SETSLOT NODE on
        every node); the keys moved."""
        self.start_move(slot, src, dst)
        moved = self.migrate(slot, src, dst)
        self.end_move(slot, dst)
        return moved

    def start_move(self, slot: int, src: int, dst: int) -> None:
        """Marks `slot` as migrating from `src` and importing into `dst`: `src`
        answers for the keys it still has and sends the rest to `dst` (`ASK`)."""
        src_id, dst_id = cmd(src, "CLUSTER", "MYID"), cmd(dst, "CLUSTER", "MYID")
        cmd(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        cmd(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)

    def migrate(self, slot: int, src: int, dst: int, most: int | None = None) -> int:
        """MIGRATEs the keys of `slot` (at most `most`) from `src` to `dst`; how
        many."""
        moved = 0
        while True:
            batch = 100 if most is None else min(100, most - moved)
            if batch == 0 or not (keys := cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, batch)):
                return moved
            cmd(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)

    def end_move(self, slot: int, dst: int) -> None:
        """Gives `slot` to `dst` on every node (ends a `start_move`)."""
        dst_id = cmd(dst, "CLUSTER", "MYID")
        for p in self.ports:
            cmd(p, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def keys(self, pattern: str = "*") -> list[bytes]:
        out: list[bytes] = []
        for p in self.ports:
            if self.procs[p].poll() is None:
                out += cmd(p, "KEYS", pattern)
        return out

    def flushall(self) -> None:
        for p in self.ports:
            cmd(p, "FLUSHALL")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` free ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 55000 and p not in ports and _free(p + 10000):
            ports.append(p)
    return ports


def env_ok() -> bool:
    return SERVER is not None and CLI is not None and os.name == "posix"
