"""Blocks stored one KV head at a time, for tensor-parallel writers (private).

Under tensor parallelism each worker holds only some of the model's KV heads, so
no process has a whole block to put. Each worker stores its heads instead, one
record per (block, head), in a store of its own beside the main one:
`<store>/heads/`, laid out `[L, 2, B, 1, D]`, bound to `"<model>#kv-head-of-<H>"`,
with the head's index in every block id (`head_extra`). Any reader finds any head
range there: a TP=4 rank reads its 2 of 8 heads, a TP=1 process (or `kvstore.hf`)
all 8, whatever TP size wrote them. A prefix is stored for a reader when every
head it needs is, each a prefix-closed chain of its own.

Whole blocks (TP=1 writers, `kvstore.hf`) stay in the main store; readers take a
prefix from whichever of the two holds more of it. The README's vLLM section has
the rules; its "Disk format" section ("Heads store") has the ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._convert import is_torch
from .layout import Layout

if TYPE_CHECKING:
    from .store import Store

HEADS_DIR = "heads"
_TAG = b"kvstore.head/1\0"


def head_extra(extra: bytes, head: int) -> bytes:
    """The `extra` key bytes of head `head`'s part of a block whose own extra is
    `extra` (a fixed-length prefix, so no two (head, extra) pairs give one value)."""
    return _TAG + head.to_bytes(4, "little") + extra


def head_layout(layout: Layout) -> Layout:
    """The layout of one head's part of a block of `layout`."""
    return Layout(
        num_layers=layout.num_layers,
        num_kv_heads=1,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_size=layout.block_size,
    )


def head_model(model: str, layout: Layout) -> str:
    """The fingerprint the heads store is bound to: the model's, and that its blocks
    are parts of `num_kv_heads`-head blocks."""
    return f"{model}#kv-head-of-{layout.num_kv_heads}"


class HeadParts:
    """The heads store of a main store (see the module doc)."""

    def __init__(self, store: Store, num_heads: int) -> None:
        self.store = store
        self.num_heads = num_heads

    @staticmethod
    def path_of(main: str | os.PathLike[str]) -> Path:
        return Path(main) / HEADS_DIR

    @staticmethod
    def exists(main: str | os.PathLike[str]) -> bool:
        return (HeadParts.path_of(main) / "MANIFEST").exists()

    @classmethod
    def open(
        cls, main: str | os.PathLike[str], layout: Layout, model: str, **open_kwargs: Any
    ) -> HeadParts:
        """Opens (creating if needed) the heads store of the store at `main`, whose
        blocks are `layout` for `model`; `open_kwargs` as `kvstore.open` takes them
        (the main store's salt, tiers and durability)."""
        from .store import open as open_store

        store = open_store(
            cls.path_of(main),
            layout=head_layout(layout),
            model=head_model(model, layout),
            **open_kwargs,
        )
        return cls(store, layout.num_kv_heads)

    def lookup(self, tokens: Any, extra: bytes) -> int:
        """The prefix of `tokens` stored for every head."""
        best: int | None = None
        for h in range(self.num_heads):
            m = self.store.lookup(tokens, extra=head_extra(extra, h), count=False)
            best = m if best is None else min(best, m)
            if best == 0:
                break
        return best or 0

    def get_into(self, tokens: Any, extra: bytes, start: int, dst: Any) -> int:
        """Fills `dst` (`[L, 2, T, H, D]`, every head, tokens from `start`) from the
        heads' records; returns the prefix of `tokens` every head served, counted from
        0 as `Store.get(out=)` does."""
        shape = (dst.shape[0], 2, dst.shape[2], 1, dst.shape[4])
        if is_torch(dst):
            import torch

            buf: Any = torch.empty(shape, dtype=dst.dtype)
        else:
            buf = np.empty(shape, dtype=dst.dtype)
        served = None
        for h in range(self.num_heads):
            m = self.store.get(tokens, out=buf, extra=head_extra(extra, h), start=start)
            n = max(m - start, 0)
            dst[:, :, :n, h : h + 1] = buf[:, :, :n]
            served = m if served is None else min(served, m)
            if m <= start:
                break
        return served or 0

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()
