"""fp8 storage: a store opened with `Layout(..., storage="fp8")` keeps each block as
float8_e4m3fn values and one float32 scale per (layer, K/V, kv head), half the bytes of
bfloat16 (plus 4 bytes per head and layer). It is lossy and opt-in; its block ids
differ from an exact store's, so it never serves a request for exact KV.

The engine sees opaque runs; this module makes and reads them. A block's run for one
(layer, K/V) is its `[B, H, D]` e4m3 bytes, then its `H` little-endian float32 scales,
so a buffer of `T` tokens (a multiple of B) is `[L, 2, T / B, B*H*D + 4*H]` bytes.

`quantize` is the paged-attention ops' own quantizer (`ops.write_kv` into an fp8
cache, tokens in order from offset 0; see `kvstore.ops` for the scale policy and the
error bound): a block read from the store into an fp8 `BlockPool` is copied byte for
byte with its scales, as if `write_kv` had written it there; and an fp8 pool's
blocks are saved the same way back (`join`, `Store.put_fp8`), never quantized twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidInput
from .layout import Layout


def run_bytes(layout: Layout) -> int:
    """Bytes of one (layer, K/V) run of one block: values, then scales."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim + 4 * layout.num_kv_heads


def buffer_bytes(layout: Layout, tokens: int) -> int:
    """Bytes of the stored form of `tokens` tokens (a multiple of the block size)."""
    return layout.num_layers * 2 * (tokens // layout.block_size) * run_bytes(layout)


def split(buf: Any, layout: Layout, tokens: int) -> tuple[Any, Any]:
    """Views of a stored-form uint8 tensor: values `[L, 2, nb, B, H, D]` float8_e4m3fn
    and scales `[L, 2, nb, H]` float32 (`nb = tokens / B`)."""
    import torch

    L, H, D, B = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    nb = tokens // B
    runs = buf[: buffer_bytes(layout, tokens)].view(L, 2, nb, run_bytes(layout))
    values = runs[..., : B * H * D].view(torch.float8_e4m3fn).view(L, 2, nb, B, H, D)
    scales = runs[..., B * H * D :].view(torch.float32).view(L, 2, nb, H)
    return values, scales


def join(values: Any, scales: Any, layout: Layout) -> np.ndarray:
    """The stored form (uint8, flat) of fp8 blocks as they are, the inverse of `split`:
    values `[L, 2, nb, B, H, D]` float8_e4m3fn and scales `[L, 2, nb, H]` float32 (e.g.
    an fp8 `BlockPool`'s blocks), bytes and scales unchanged."""
    import torch

    L, H, D, B = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    nb = values.shape[2] if values.dim() == 6 else -1
    if (
        values.dtype != torch.float8_e4m3fn
        or tuple(values.shape) != (L, 2, nb, B, H, D)
        or scales.dtype != torch.float32
        or tuple(scales.shape) != (L, 2, nb, H)
    ):
        raise InvalidInput(
            f"fp8 blocks: expected float8_e4m3fn values [{L}, 2, nb, {B}, {H}, {D}] and "
            f"float32 scales [{L}, 2, nb, {H}], got {values.dtype} {list(values.shape)} and "
            f"{scales.dtype} {list(scales.shape)}"
        )
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise InvalidInput("fp8 blocks: scales must be finite and not negative")
    out = torch.empty(buffer_bytes(layout, nb * B), dtype=torch.uint8)
    v, s = split(out, layout, nb * B)
    # As bytes: float8 copies are not implemented everywhere.
    v.view(torch.uint8).copy_(values.view(torch.uint8))
    s.copy_(scales)
    return out.numpy()


def quantize(kv: Any, layout: Layout, tokens: int) -> np.ndarray:
    """The stored form (uint8, flat) of the first `tokens` tokens (a multiple of the
    block size) of `kv` `[L, 2, T, H, D]` (a float tensor or numpy array)."""
    import torch

    from . import ops

    if isinstance(kv, np.ndarray):
        kv = torch.from_numpy(kv)
    L, H, D, B = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    nb = tokens // B
    out = torch.empty(buffer_bytes(layout, tokens), dtype=torch.uint8)
    if nb == 0:
        return out.numpy()
    values, scales = split(out, layout, tokens)
    caches = torch.empty((2, nb, B, H, D), dtype=torch.float8_e4m3fn)
    cache_scales = torch.ones((2, nb, H), dtype=torch.float32)
    slots = torch.arange(tokens, dtype=torch.int64)
    kv = kv.cpu()
    for layer in range(L):
        k, v = kv[layer, 0, :tokens], kv[layer, 1, :tokens]
        ops.write_kv(k, v, caches[0], caches[1], slots, cache_scales[0], cache_scales[1])
        values[layer].copy_(caches)
        scales[layer].copy_(cache_scales)
    return out.numpy()


def dequantize(buf: Any, layout: Layout, tokens: int, out: Any) -> None:
    """Writes the values of a stored-form buffer, times their scales, into `out`
    `[L, 2, >= tokens, H, D]` (a tensor or numpy array of the layout's dtype)."""
    import torch

    values, scales = split(torch.as_tensor(buf), layout, tokens)
    x = values.float() * scales[:, :, :, None, :, None]
    shape = layout.kv_shape(tokens)
    dst = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    # e4m3 rounds up as well as down: a value just under the dtype's largest
    # finite one can come back past it, which the dtype holds as inf.
    big = torch.finfo(dst.dtype).max
    dst[:, :, :tokens].copy_(x.reshape(shape).clamp_(-big, big))
