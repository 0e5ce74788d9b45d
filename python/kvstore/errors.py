"""The exception tree of kvstore. Every error the store raises is a KVStoreError.

Defined in Python so the classes pickle (their module is importable) and so
InvalidInput can also be a ValueError. The Rust binding maps each engine error
to one of these classes in one place (rust/kvstore-py/src/error.rs).
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "LayoutMismatch",
    "InvalidInput",
    "StoreFull",
    "StoreClosed",
    "StoreLocked",
    "CorruptStore",
    "SessionNotFound",
    "StoreIOError",
    "RemoteError",
]


class KVStoreError(Exception):
    """Base class of every kvstore error."""


class LayoutMismatch(KVStoreError):
    """The store was created for another model fingerprint or KV layout."""


class InvalidInput(KVStoreError, ValueError):
    """A bad argument (shape, dtype, token id, option). Nothing was written."""


class StoreFull(KVStoreError):
    """A configured capacity would be exceeded and nothing can be evicted."""


class StoreClosed(KVStoreError):
    """The handle is closed, or was opened before a fork() in another process, or the
    store is reopened in a child forked while the parent had it open."""


class StoreLocked(KVStoreError):
    """Another process holds a lock this operation needs."""


class CorruptStore(KVStoreError):
    """The store's metadata (MANIFEST, index) is damaged. A damaged block is a miss, not this."""


class SessionNotFound(KVStoreError, KeyError):
    """No session of that name (for this tenant)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StoreIOError(KVStoreError, OSError):
    """An I/O error of the operating system, or writes disabled after a failed fdatasync."""


class RemoteError(KVStoreError):
    """The remote tier could not be opened: no node reachable, or authentication,
    permission or TLS failed. Names the node and the user, never the password. After
    open, remote failures are misses counted in `stats()["remote"]`, never this."""
