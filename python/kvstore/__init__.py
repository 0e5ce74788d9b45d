"""kvstore: a persistent, shared, content-addressed store for transformer KV caches.

    import kvstore
    layout = kvstore.Layout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    with kvstore.open("/data/kv", layout=layout, model="org/model@rev") as store:
        store.put(tokens, kv)            # kv: [L, 2, T, H, D]
        kv = store.get(tokens)           # KV of the longest stored prefix
    model = kvstore.checkpoint_fingerprint("/models/llama")  # a model fingerprint, from its files

See README.md for durability, concurrency and the disk format.
"""

from ._lib import FORMAT_VERSION, __version__
from .errors import (
    CorruptStore,
    InvalidInput,
    KVStoreError,
    LayoutMismatch,
    RemoteError,
    SessionNotFound,
    StoreClosed,
    StoreFull,
    StoreIOError,
    StoreLocked,
)
from .fingerprint import checkpoint_fingerprint
from .layout import Layout
from .remote import Remote
from .store import Store, arenas, open, rebuild_index, remove_arena

__all__ = [
    "FORMAT_VERSION",
    "__version__",
    "CorruptStore",
    "InvalidInput",
    "KVStoreError",
    "Layout",
    "LayoutMismatch",
    "Remote",
    "RemoteError",
    "SessionNotFound",
    "Store",
    "StoreClosed",
    "StoreFull",
    "StoreIOError",
    "StoreLocked",
    "arenas",
    "checkpoint_fingerprint",
    "open",
    "rebuild_index",
    "remove_arena",
]
