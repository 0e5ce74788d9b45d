"""Where vLLM's attention backend keeps each value of a paged block, learnt from the
backend's own cache writer. Imports no vLLM (tested with synthetic writers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import KVStoreError
from ..layout import Layout


def paged_block_map(write: Any, cache: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Where the attention backend keeps each value of a block, learnt by running its
    cache writer on a probe cache of one block.

    `write(key, value, cache, slot_mapping)` is the backend's writer (`key`, `value`:
    `[T, H, D]`); `cache` one layer's paged cache, whose first dimension indexes blocks
    (vLLM's logical per-layer view). Returns, for each canonical element of a block
    (`[2, B, H, D]`, K then V), its element offset from the block's first element in
    `cache`'s storage (block `i` starts `i * cache.stride(0)` elements from block 0).
    """
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
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


def affine_strides(block_map: torch.Tensor, layout: Layout) -> list[tuple[int, tuple[int, ...]]]:
    """`[(offset, (token, head, dim strides))]` for K and V when `block_map` places each
    as a strided array inside a block (every backend seen so far: on this CPU K is
    `[H][D][B]` and V `[H][B][D]`), else []: then values move one by one."""
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
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
