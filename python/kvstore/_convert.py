"""Python values -> the buffers the engine takes, in one place (private).

Token ids become a contiguous uint32 array, KV tensors/arrays a flat uint8 view
(or copy), `extra` bytes. Checks that need Python types (dtype, shape, range)
happen here, before the engine sees anything, so bad input is refused before
anything is written. `kvstore.store` and `kvstore.torch` both convert through
this module.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

from .errors import InvalidInput
from .layout import Layout

__all__ = [
    "U32_MAX",
    "extra_bytes",
    "is_torch",
    "kv_bytes",
    "out_bytes",
    "protect_read_only",
    "tokens_array",
    "utf8",
]

U32_MAX = 2**32 - 1

# Address ranges of read-only mappings of a hot tier (kvstore.torch.arena_view),
# for as long as each mapping lives (slices of a view outlive the view object and
# its store): `out_bytes` refuses to hand them to the engine to write into (torch
# tensors carry no read-only flag; the write would kill the process with SIGSEGV).
_READ_ONLY: list[tuple[weakref.ref[mmap.mmap], int, int]] = []
_READ_ONLY_LOCK = threading.Lock()


def _reset_read_only_lock() -> None:
    # A child forked while another thread held it would wait for ever.
    global _READ_ONLY_LOCK
    _READ_ONLY_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_read_only_lock)


def is_torch(x: Any) -> bool:
    """Whether `x` is a torch tensor, without importing torch when nobody has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _check_dense_torch(x: Any, what: str) -> None:
    """A strided tensor with data: sparse and meta tensors cannot be copied as bytes."""
    import torch

    if x.layout != torch.strided:
        raise InvalidInput(f"{what}: expected a dense (strided) tensor, got layout {x.layout}")
    if x.device.type == "meta":
        raise InvalidInput(f"{what}: expected a tensor with data, got device {x.device}")


def tokens_array(tokens: Any) -> np.ndarray:
    """Token ids as a contiguous uint32 array; raises InvalidInput otherwise."""
    if is_torch(tokens):
        _check_dense_torch(tokens, "tokens")
        import torch

        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InvalidInput(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    try:
        a = np.asarray(tokens)
    except (OverflowError, ValueError) as e:
        raise InvalidInput(f"tokens: expected integers in [0, {U32_MAX}], got {e}") from None
    if a.ndim != 1:
        raise InvalidInput(f"tokens: expected a 1-D sequence of token ids, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if a.dtype == object:
        # Python ints too large for int64 (e.g. 2**64) land here: name the value.
        bad = next((t for t in a.tolist() if not isinstance(t, int) or not 0 <= t <= U32_MAX), None)
        if isinstance(bad, int) and not isinstance(bad, bool):
            raise InvalidInput(f"tokens: expected ids in [0, {U32_MAX}], got {bad}")
    if a.dtype == np.uint32:
        return np.ascontiguousarray(a)  # every uint32 is a token id: no range scan
    if a.dtype.kind not in "iu":
        raise InvalidInput(f"tokens: expected integer token ids, got dtype {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi > U32_MAX:
        bad = lo if lo < 0 else hi
        raise InvalidInput(f"tokens: expected ids in [0, {U32_MAX}], got {bad}")
    return np.ascontiguousarray(a, dtype=np.uint32)


def utf8(what: str, text: str) -> bytes:
    """`text` as UTF-8; InvalidInput naming `what` where it has none (a lone
    surrogate)."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise InvalidInput(
            f"{what}: expected text UTF-8 can encode, got {text!r} ({e.reason})"
        ) from None


def extra_bytes(extra: bytes | str | None) -> bytes:
    """The `extra` key bytes of a block id: str as UTF-8, None as empty."""
    if extra is None:
        return b""
    if isinstance(extra, str):
        return utf8("extra", extra)
    if isinstance(extra, (bytes, bytearray, memoryview)):
        return bytes(extra)
    raise InvalidInput(f"extra: expected bytes, str or None, got {type(extra).__name__}")


def _check_shape(shape: tuple[int, ...], layout: Layout, what: str) -> int:
    if layout.latent:
        ok = len(shape) == 3 and shape[0] == layout.num_layers and shape[2] == layout.head_dim
        if not ok:
            expected = f"[{layout.num_layers}, T, {layout.head_dim}] (L, T, W)"
            raise InvalidInput(f"{what}: expected shape {expected}, got {list(shape)}")
        return int(shape[1])
    want = (layout.num_layers, 2, "T", layout.num_kv_heads, layout.head_dim)
    ok = len(shape) == 5 and all(w == "T" or s == w for s, w in zip(shape, want, strict=False))
    if not ok:
        expected = "[{}, 2, T, {}, {}]".format(*[want[0], want[3], want[4]])
        raise InvalidInput(f"{what}: expected shape {expected} (L, 2, T, H, D), got {list(shape)}")
    return int(shape[2])


def kv_bytes(
    kv: Any, layout: Layout, what: str = "kv", need: int | None = None
) -> tuple[np.ndarray, int]:
    """A `[L, 2, T, H, D]` tensor/array as a flat contiguous uint8 view (or copy) and T.

    `need`: the tokens the caller will read. When a copy is needed anyway (not
    contiguous, not on the CPU), only those are copied: a broadcast view of a huge T
    must not be materialised whole.
    """
    if is_torch(kv):
        import torch

        _check_dense_torch(kv, what)
        want = getattr(torch, layout.dtype, None)
        if kv.dtype != want:
            raise InvalidInput(f"{what}: expected dtype torch.{layout.dtype}, got {kv.dtype}")
        t = _check_shape(tuple(kv.shape), layout, what)
        if layout.latent:  # [L, T, W] -> its halves as runs, [L, 2, T, W / 2]
            kv = kv[:, : min(t, need)] if need is not None else kv
            t = int(kv.shape[1])
            kv = kv.detach().to("cpu").unflatten(2, (2, -1)).transpose(1, 2)
        elif need is not None and t > need and not (kv.device.type == "cpu" and kv.is_contiguous()):
            kv, t = kv[:, :, :need], need
        cpu = kv.detach().to("cpu").contiguous()
        return cpu.reshape(-1).view(torch.uint8).numpy(), t
    if isinstance(kv, np.ndarray):
        if kv.dtype.name != layout.dtype:
            raise InvalidInput(f"{what}: expected dtype {layout.dtype}, got {kv.dtype}")
        t = _check_shape(kv.shape, layout, what)
        if layout.latent:  # [L, T, W] -> its halves as runs, [L, 2, T, W / 2]
            kv = kv[:, : min(t, need)] if need is not None else kv
            t = int(kv.shape[1])
            kv = kv.reshape(kv.shape[0], t, 2, -1).transpose(0, 2, 1, 3)
        elif need is not None and t > need and not kv.flags.c_contiguous:
            kv, t = kv[:, :, :need], need
        # Big-endian input: store the values in native order (what get returns).
        native = kv.dtype.newbyteorder("=")
        return np.ascontiguousarray(kv, dtype=native).reshape(-1).view(np.uint8), t
    raise InvalidInput(f"{what}: expected a numpy array or torch tensor, got {type(kv).__name__}")


def latent_from_runs(runs: np.ndarray, layout: Layout, t: int, n: int, dst: Any) -> None:
    """Copies the first `n` tokens of a latent layout's runs (`runs`: the bytes of
    `[L, 2, t, W / 2]`, as the engine fills them) into `dst` (`[L, >= n, W]`)."""
    lay = layout
    if is_torch(dst):
        import torch

        src = torch.from_numpy(runs).view(getattr(torch, lay.dtype))
        halves = src.view(lay.num_layers, 2, t, lay.head_dim // 2)[:, :, :n]
        dst[:, :n].unflatten(2, (2, -1)).copy_(halves.transpose(1, 2))
        return
    halves = runs.view(dst.dtype).reshape(lay.num_layers, 2, t, lay.head_dim // 2)[:, :, :n]
    dst[:, :n] = halves.transpose(0, 2, 1, 3).reshape(lay.num_layers, n, lay.head_dim)


def protect_read_only(mapping: mmap.mmap, start: int, nbytes: int) -> None:
    """Marks `start .. start + nbytes`, the address range of `mapping` (read-only),
    as memory `out_bytes` must refuse, for as long as `mapping` lives."""
    with _READ_ONLY_LOCK:
        _READ_ONLY.append((weakref.ref(mapping), start, start + nbytes))


def _read_only_overlap(start: int, nbytes: int) -> bool:
    """Whether bytes `start .. start + nbytes` overlap a range of `protect_read_only`."""
    end = start + nbytes
    with _READ_ONLY_LOCK:
        _READ_ONLY[:] = [r for r in _READ_ONLY if r[0]() is not None]
        return any(start < hi and lo < end for _, lo, hi in _READ_ONLY)


def out_bytes(out: Any, layout: Layout) -> tuple[np.ndarray, int]:
    """A writable flat uint8 view of a preallocated `[L, 2, T, H, D]` output, and T;
    refuses anything that would need a copy."""
    if is_torch(out):
        _check_dense_torch(out, "out")
        if out.device.type != "cpu":
            raise InvalidInput(f"out: expected a CPU tensor, got device {out.device}")
        if not out.is_contiguous():
            raise InvalidInput("out: expected a contiguous tensor")
        start, nbytes = out.data_ptr(), out.numel() * out.element_size()
    elif isinstance(out, np.ndarray):
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise InvalidInput("out: expected a writable C-contiguous array")
        if not out.dtype.isnative:
            raise InvalidInput(f"out: expected native byte order, got dtype {out.dtype.str}")
        start, nbytes = out.__array_interface__["data"][0], out.nbytes
    else:
        start = nbytes = 0
    # A tensor over the hot tier's read-only mapping (kvstore.torch.arena_view), or
    # `.numpy()` of one, says it is writable: writing would kill the process.
    if nbytes and _read_only_overlap(start, nbytes):
        raise InvalidInput(
            "out: expected writable memory, got a view of the read-only hot-tier mapping"
        )
    return kv_bytes(out, layout, "out")
