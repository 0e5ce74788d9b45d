"""The remote tier: a Redis or Valkey server or cluster shared by every host.

    store = kvstore.open(path, layout, model,
                         remote=kvstore.Remote(nodes=["10.0.0.5:6379", "10.0.0.6:6379"],
                                               username="kv", password_env="KV_REDIS_PASSWORD"))

The local store stays the first tier and the source of durability; see README.md,
"Remote tier", for the key and value format and the server settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .errors import InvalidInput

if TYPE_CHECKING:
    from ._lib import RemoteOptions

__all__ = ["Remote"]


@dataclass(frozen=True)
class Remote:
    """Where the remote tier is and how to use it.

    - `nodes`: "host:port" of one node or of some cluster nodes (the cluster is
      discovered from the first that answers).
    - `username`: ACL user (None: "default").
    - `password_env` / `password_file`: the environment variable or file holding the
      password (never the password itself, so it is never in a repr or a log).
    - `tls_ca`: CA certificate (PEM) to trust: connect with TLS (a "rediss://host:port"
      node asks for TLS too, trusting the system's roots without `tls_ca`).
    - `prefix`: key namespace on the server (and the root of ACL key patterns).
    - `write`: "behind" (background, bounded queue; full: dropped and counted) or
      "through" (before put returns; a failure is counted, never raised).
    - `ttl`: seconds a value lives, renewed on read (None: server eviction only).
    - `timeout`: seconds, connection and response timeout of every call.
    - `breaker`: seconds a node that timed out or could not be reached is skipped (a
      miss, counted in `breaker_skips`) before one call tries it again.
    """

    nodes: list[str] | tuple[str, ...]
    username: str | None = None
    password_env: str | None = None
    tls_ca: str | os.PathLike[str] | None = None
    prefix: str = "kvstore"
    write: str = "behind"
    ttl: float | None = None
    timeout: float = 1.0
    breaker: float = 3.0
    password_file: str | os.PathLike[str] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # A password in a node URL would be in every repr and message naming the
        # node: refused before the object exists, without echoing the node.
        nodes = [self.nodes] if isinstance(self.nodes, str) else self.nodes
        if any(isinstance(n, str) and "@" in n for n in nodes):
            raise InvalidInput(
                "remote nodes: a user or password in a node URL is not accepted; "
                "give username= and password_env= or password_file="
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Remote:
        """A `Remote` from a plain mapping of the same option names, as in a config
        file or the vLLM connector's `kv_connector_extra_config`. `nodes` may also be
        one comma-separated string. An unknown key is `InvalidInput` naming it (a
        typo must not silently drop an option, least of all `password_env`)."""
        if not isinstance(d, Mapping):
            raise InvalidInput(f"remote: expected a mapping of options, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise InvalidInput(
                f"remote: unknown option(s) {', '.join(unknown)}; "
                f"expected some of {', '.join(sorted(known))}"
            )
        if "nodes" not in d:
            raise InvalidInput("remote: 'nodes' is required")
        args = dict(d)
        if isinstance(args["nodes"], str):
            args["nodes"] = [n.strip() for n in args["nodes"].split(",") if n.strip()]
        r = cls(**args)
        r._options()  # every value checked now, not at open
        return r

    def _options(self) -> RemoteOptions:
        nodes = [self.nodes] if isinstance(self.nodes, str) else list(self.nodes)
        if not nodes or not all(isinstance(n, str) and n for n in nodes):
            raise InvalidInput(f"remote nodes: expected a list of 'host:port', got {self.nodes!r}")
        if self.write not in ("behind", "through"):
            raise InvalidInput(f"remote write: expected 'behind' or 'through', got {self.write!r}")
        for name, value in (
            ("ttl", self.ttl),
            ("timeout", self.timeout),
            ("breaker", self.breaker),
        ):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < 2**63 / 1000  # milliseconds, as an unsigned 64-bit count
            ):
                raise InvalidInput(
                    f"remote {name}: expected positive seconds (below 2**63 ms), got {value!r}"
                )
        return {
            "nodes": nodes,
            "username": self.username,
            "password_env": self.password_env,
            "password_file": os.fspath(self.password_file) if self.password_file else None,
            "tls_ca": os.fspath(self.tls_ca) if self.tls_ca is not None else None,
            "prefix": self.prefix,
            "write": self.write,
            "ttl_ms": None if self.ttl is None else max(1, round(self.ttl * 1000)),
            "timeout_ms": max(1, round(self.timeout * 1000)),
            "breaker_ms": max(1, round(self.breaker * 1000)),
        }
