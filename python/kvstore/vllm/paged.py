"""Where vLLM's attention backend keeps each value of a paged block, learnt from the
backend's own cache writer. Imports no vLLM (tested with synthetic writers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._convert import extra_bytes, tokens_array
from ..errors import KVStoreError
from ..layout import Layout
from ..store import Store


def paged_block_map(write: Any, cache: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Where the attention backend keeps each value of a block, learnt by running its
    cache writer on a probe cache of one block.

    `write(key, value, cache, slot_mapping)` is the backend's writer (`key`, `value`:
    `[T, H, D]`); `cache` one layer's paged cache, whose first dimension indexes blocks
    (vLLM's logical per-layer view). Returns, for each canonical element of a block
    (`[2, B, H, D]`, K then V), its element offset from the block's first element in
    `cache`'s storage (block `i` starts `i * cache.stride(0)` elements from block 0).
    """
    b, h, d = _run_dims(layout)
    n = 2 * b * h * d
    dtype = cache.dtype
    probe_shape = [1, *cache.shape[1:]]
    base = 64  # every digit 0..63 is exact in float16, bfloat16 and float32
    digits = 1
    while base**digits < n:
        digits += 1
    codes = torch.arange(n, dtype=torch.int64)
    decoded = torch.zeros(int(np.prod(probe_shape)), dtype=torch.int64)
    written = None
    for i in range(digits):
        digit = (codes // base**i) % base
        src = digit.to(dtype).view(2, b, h, d)
        probe = torch.full(probe_shape, -1.0, dtype=dtype)
        write(src[0].contiguous(), src[1].contiguous(), probe, torch.arange(b, dtype=torch.int64))
        flat = probe.reshape(-1).to(torch.float64)
        if written is None:
            written = flat >= 0
        elif not torch.equal(written, flat >= 0):
            raise KVStoreError("KVStoreConnector: the backend's cache writer is not deterministic")
        decoded += torch.where(flat >= 0, flat, 0).to(torch.int64) * base**i
    assert written is not None
    where = torch.nonzero(written).reshape(-1)
    codes_found = decoded[where]
    if len(where) != n or not torch.equal(torch.sort(codes_found).values, codes):
        raise KVStoreError(
            f"KVStoreConnector: the backend's cache writer put {len(where)} values for {n} "
            "written, or transformed them (quantized caches are not supported)"
        )
    # Indices in the probe (one contiguous block) -> offsets in the layer's cache, by
    # the layer's strides (which may pad or interleave what the probe packs).
    strides = torch.tensor(cache.stride(), dtype=torch.int64)
    index = torch.stack(torch.unravel_index(where, tuple(probe_shape)), dim=1)
    offsets = (index * strides).sum(dim=1)
    result = torch.empty(n, dtype=torch.int64)
    result[codes_found] = offsets
    return result


def _run_dims(layout: Layout) -> tuple[int, int, int]:
    """`(B, H, D)` of a block's runs as the engine moves them: a latent's halves are
    its K and V (`Layout.runs_shape`)."""
    _, _, b, h, d = layout.runs_shape(layout.block_size)
    return b, h, d


def affine_strides(block_map: torch.Tensor, layout: Layout) -> list[tuple[int, tuple[int, ...]]]:
    """`[(offset, (token, head, dim strides))]` for K and V when `block_map` places each
    as a strided array inside a block (every backend seen so far: on this CPU K is
    `[H][D][B]` and V `[H][B][D]`; an MLA cache's latent `[B][W]`, its halves K and
    V), else []: then values move one by one."""
    b, h, d = _run_dims(layout)
    offsets = block_map.view(2, b, h, d)
    fits = []
    for o in offsets:
        base = int(o[0, 0, 0])
        strides = tuple(
            int(o[tuple(int(i == axis) for i in range(3))]) - base if size > 1 else 0
            for axis, size in enumerate((b, h, d))
        )
        grid = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(d), indexing="ij")
        model = base + grid[0] * strides[0] + grid[1] * strides[1] + grid[2] * strides[2]
        if not torch.equal(model, o):
            return []
        fits.append((base, strides))
    return fits


_Part = tuple[int, tuple[int, int, int]]


class PagedKV:
    """Moves whole blocks between every layer's paged cache (`caches`, in layer order,
    of one shape and strides; `block_map` from `paged_block_map`) and the store.

    Where the map is affine (`strided`), `load` and `save` hand the caches to the
    engine (`Store.get_paged`/`put_paged`: each block checked in a one-block scratch,
    then permuted into place, one pass over memory). Else `move` copies between the
    caches and canonical `[L, 2, n*B, H, D]` KV by an element gather through offsets
    computed per call (bounded by the caller's chunk of blocks)."""

    def __init__(self, caches: list[torch.Tensor], block_map: torch.Tensor, layout: Layout):
        self._layout = layout
        self._map = block_map
        first = caches[0]
        self._block_stride = first.stride(0)
        # A flat view of each layer's span of storage: offsets are element offsets.
        dims = zip(first.shape, first.stride(), strict=True)
        span = sum((size - 1) * stride for size, stride in dims) + 1
        self._flat = [c.as_strided((span,), (1,)) for c in caches]
        # Where K and V are strided arrays of a block: per layer, a [blocks, B, H, D] view
        # of each, so a move is one strided copy per layer and K/V, not a gather.
        fits = affine_strides(block_map, layout)
        self._views = [
            [
                c.as_strided(
                    (c.shape[0], *_run_dims(layout)),
                    (self._block_stride, *strides),
                    c.storage_offset() + base,
                )
                for base, strides in fits
            ]
            for c in caches
        ]
        self.strided = bool(fits)
        # K's and V's (offset, (token, head, dim) strides), as the engine takes them.
        self._parts: tuple[_Part, _Part] | None = None
        if fits:
            (kb, (kt, kh, kd)), (vb, (vt, vh, vd)) = fits
            self._parts = ((kb, (kt, kh, kd)), (vb, (vt, vh, vd)))

    def _spans(self) -> list[Any]:
        """Each layer's span as a byte array on vLLM's memory, new for each call: the
        binding's borrow check then keeps a load and a background save, which touch
        different blocks, from refusing each other."""
        return [f.as_strided(f.shape, (1,)).view(torch.uint8).numpy() for f in self._flat]

    def load(
        self,
        store: Store,
        tokens: Any,
        start: int,
        extra: bytes | None,
        blocks: list[int],
        head: int | None = None,
    ) -> int:
        """Lands the stored blocks of `tokens` from `start` on in cache blocks `blocks`
        (one per token block): the stored prefix in tokens from 0, as `Store.get`.
        With `head`, `store` holds one head per block (`kvstore.heads`), landed in
        this cache's head `head`."""
        return self._engine(store._raw.get_paged, tokens, start, extra, blocks, head)

    def save(
        self,
        store: Store,
        tokens: Any,
        start: int,
        extra: bytes | None,
        blocks: list[int],
        head: int | None = None,
    ) -> int:
        """Stores the full blocks of `tokens` from `start` on out of cache blocks
        `blocks`: the tokens covered, as `Store.put`. With `head`, only this cache's
        head `head`, into a store of one head per block (`kvstore.heads`)."""
        return self._engine(store._raw.put_paged, tokens, start, extra, blocks, head)

    def _engine(
        self,
        call: Any,
        tokens: Any,
        start: int,
        extra: bytes | None,
        blocks: list[int],
        head: int | None,
    ) -> int:
        """`call` (the binding's get_paged or put_paged) on these caches, or on head
        `head` of them (its K and V one head stride further in)."""
        assert self._parts is not None, "the engine's path needs strided K and V"
        spans = self._spans()
        parts = self._parts
        if head is not None:
            (kb, ks), (vb, vs) = parts
            parts = ((kb + head * ks[1], ks), (vb + head * vs[1], vs))
        return int(
            call(
                tokens_array(tokens),
                extra_bytes(extra),
                start,
                spans,
                blocks,
                self._block_stride,
                parts,
            )
        )

    def move(self, block_ids: list[int], kv: torch.Tensor, into_cache: bool) -> None:
        """Between the blocks `block_ids` and `kv` (`[L, 2, n*B, H, D]`, each `[n*B, H,
        D]` contiguous): into the caches (a load) or out of them (a save)."""
        b, _, _ = _run_dims(self._layout)
        if self.strided:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            for views, layer in zip(self._views, kv, strict=True):
                for view, x in zip(views, layer, strict=True):
                    blocks = x.view(len(block_ids), b, *x.shape[1:])
                    if into_cache:
                        view.index_copy_(0, ids, blocks)
                    else:
                        torch.index_select(view, 0, ids, out=blocks)
            return
        idx = self._index(block_ids)
        for flat, layer in zip(self._flat, kv, strict=True):
            if into_cache:
                flat.index_copy_(0, idx, layer.reshape(-1))
            else:
                torch.index_select(flat, 0, idx, out=layer.view(-1))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """Element offsets, in canonical `[2, n*B, H, D]` order, of `block_ids` in a layer."""
        b, h, d = _run_dims(self._layout)
        blocks = torch.tensor(block_ids, dtype=torch.int64) * self._block_stride
        per_block = self._map.view(2, 1, b * h * d)
        idx = per_block + blocks.view(1, -1, 1)  # [2, n, B*H*D]
        return idx.reshape(-1)
