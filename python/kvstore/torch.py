"""Device block pools that paged attention runs over: `kvstore.torch.BlockPool`.

```python
pool = kvstore.torch.BlockPool(layout, num_blocks=4096, device="cuda")
with pool.load(store, tokens) as seq:       # store -> pool blocks (reused when resident)
    table, n = seq                          # int32 block table, tokens covered
    out = kvstore.ops.paged_attention(q, pool.key_cache(l), pool.value_cache(l),
                                      table[None], torch.tensor([n], dtype=torch.int32), scale)
```

A pool holds `num_blocks` blocks of `block_size` tokens for every layer, in one
tensor `[L, 2, num_blocks, B, H, D]` (`pool.kv`); `pool.key_cache(l)` and
`pool.value_cache(l)` are the `[num_blocks, B, H, D]` views the ops take.

Blocks are content-addressed: a block loaded from a store is keyed by the
store's own block id (`Store.block_ids`: a hash chain over the token ids of its
prefix, keyed by the model fingerprint, layout, salt and `extra`), so a second
`load` of a sequence sharing that prefix reuses the resident block instead of
reading and copying it again. Blocks are refcounted:
`seq.release()` (or leaving the `with`) drops the sequence's references. A
block nobody uses is free for reuse; one that came from a store keeps its
content until the space is needed (least recently released first), so a later
`load` of the same prefix still finds it.

Blocks added by decoding (`seq.reserve`, then `ops.write_kv` at
`seq.slot_mapping`) belong to their sequence only; `pool.save(store, seq,
tokens)` puts them into the store. Loaded blocks are read-only: `slot_mapping`
refuses positions in them. `save` and `gather` refuse a released table (its
blocks may hold another sequence's KV by now) and another pool's.

fp8 pools (`layout.dtype == "float8_e4m3fn"`) hold e4m3 KV and, beside it,
`pool.scales`, float32 `[L, 2, num_blocks, H]`: one scale per (block, kv head), the
`key_scales(l)`/`value_scales(l)` views that `ops.paged_attention` and
`ops.write_kv` take (which quantize and choose the scales, see `kvstore.ops`).
Blocks read from a store whose layout dtype is float8_e4m3fn are raw e4m3 values
(that store keeps no scales), so they get scale 1; `save` of blocks whose scales are
not all 1 raises InvalidInput rather than store values the store could not scale
back. A store with `storage="fp8"` (see `kvstore.fp8`) keeps the scales: an fp8 pool
loads its blocks' bytes and scales as they are, and saves them as they are
(`Store.put_fp8`), never quantizing again. A pool of the store's own dtype (e.g.
bfloat16) loads from such a store too: its blocks come dequantized (`Store.get`),
keyed by the fp8 store's block ids, so they are never taken for exact KV; such a
sequence is `lossy`, and `save` refuses it into a store without fp8 storage.

The store's block ids are salted, so tenants with different salts sharing one
pool never reuse each other's blocks (as in the store itself); `namespace` (any
hashable value) separates further when needed.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from ._convert import extra_bytes, protect_read_only, tokens_array
from .errors import InvalidInput, KVStoreError
from .layout import Layout
from .store import Store

__all__ = ["BlockPool", "BlockTable", "PoolFull", "arena_view", "host_pages", "register_arena"]

# struct flock for a whole-file read lock (l_type, l_whence, l_start, l_len, l_pid;
# the layout of x86-64 and aarch64 Linux).
_SHARED_LOCK = struct.pack("hh4xqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)

# Per store: a read-only mapping of its hot-tier file, as a uint8 tensor. The
# tensor's storage keeps the mmap (its owner) alive; the entry goes with the store.
_ARENA_VIEWS: weakref.WeakKeyDictionary[Store, torch.Tensor] = weakref.WeakKeyDictionary()
_REGISTERED: weakref.WeakKeyDictionary[Store, bool] = weakref.WeakKeyDictionary()
# A pool's key of a block from a store: (namespace, the store's block id).
BlockKey = tuple[Hashable, bytes]


def arena_view(store: Store) -> torch.Tensor | None:
    """The store's hot tier as a read-only uint8 CPU tensor over this process's own
    mapping of the arena file (None without a hot tier). Bytes read from it are only
    good if `store.hot_unchanged` confirms their slot afterwards."""
    if store in _ARENA_VIEWS:
        return _ARENA_VIEWS[store]
    info = store.arena_file()
    if info is None:
        return None
    path, dev, ino, length = info
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            # Replaced since the store mapped it: slot versions would not match these bytes.
            raise KVStoreError(f"hot-tier file {path} was replaced; reopen the store")
        # The arena's lifetime lock (see rust/kvstore/src/arena.rs), shared: mmap keeps
        # its own duplicate of this descriptor, so the lock lives as long as the view,
        # and no pruner removes the file under a view that outlives its store.
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _SHARED_LOCK)
        except OSError as e:
            raise KVStoreError(f"hot-tier file {path} is being removed ({e}); reopen") from None
        mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is read-only: we never write
        view = torch.frombuffer(mm, dtype=torch.uint8)
    # `store.get(out=)` must refuse to write there: torch tensors carry no read-only
    # flag, and the write would kill the process with SIGSEGV.
    protect_read_only(mm, view.data_ptr(), length)
    _ARENA_VIEWS[store] = view
    return view


def register_arena(store: Store) -> bool:
    """Registers the store's hot tier with CUDA as (read-only) pinned host memory, so
    host-to-device copies of hot blocks are DMA straight from the arena. A no-op (False)
    without CUDA or without a hot tier."""
    if store in _REGISTERED:
        return _REGISTERED[store]
    view = arena_view(store)
    ok = False
    if view is not None and torch.cuda.is_available():
        cuda_host_register_read_only = 8  # cudaHostRegisterReadOnly
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(view.data_ptr(), view.numel(), cuda_host_register_read_only)
        ok = int(err) == 0
        if ok:
            # Undone when the view goes (its finalizer runs before its storage, the
            # mapping's owner, is freed): pages registered past their unmapping stay
            # pinned, and a later mapping at the same address could not register.
            weakref.finalize(view, cudart.cudaHostUnregister, view.data_ptr())
    _REGISTERED[store] = ok
    return ok


_HUGE_PAGE = 2 << 20
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000 if sys.platform.startswith("linux") else 0)
# 2 MiB pages explicitly: without a size, MAP_HUGETLB takes the system's default huge
# page, which may be 1 GiB (the mapping would then be rounded up past `rounded`).
_MAP_HUGE_2MB = 21 << 26
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise", "never" (or "never"
    where there is no THP at all)."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


def host_pages(nbytes: int, huge_pages: bool = True) -> tuple[torch.Tensor, str]:
    """A zero-filled, writable uint8 CPU tensor of `nbytes` and the kind of pages
    under it: "hugetlb" (explicit 2 MiB pages, `MAP_HUGETLB`), "thp" (transparent
    huge pages asked for with `MADV_HUGEPAGE` on a 2 MiB-aligned range) or "normal"
    (4 KiB pages; also where huge pages are off or `huge_pages` is False) — the
    same kinds as a store's hot tier.

    Huge pages widen the TLB's reach: a pool's blocks sit at random addresses, so a
    decode step over 4 KiB pages takes a TLB miss every 4 KiB it reads.
    The tensor's storage owns the mapping (unmapped when the last view goes).
    """
    if not huge_pages or nbytes < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.zeros(nbytes, dtype=torch.uint8), "normal"
    rounded = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if _MAP_HUGETLB:
        try:
            m = mmap.mmap(-1, rounded, flags=anon | _MAP_HUGETLB | _MAP_HUGE_2MB)
        except OSError:  # no hugetlb pages reserved (vm.nr_hugepages), or not enough
            pass
        else:
            return _tensor_of(m, 0, nbytes), "hugetlb"
    # One spare huge page to start the tensor on a 2 MiB boundary: THP maps only
    # whole aligned 2 MiB ranges.
    m = mmap.mmap(-1, rounded + _HUGE_PAGE, flags=anon)
    kind = "normal"
    base = _tensor_of(m, 0, 1).data_ptr()
    start = -base % _HUGE_PAGE
    if _thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
        else:
            # Asked is not given: fault in the first aligned 2 MiB and report "thp"
            # only if the kernel backed it with a huge page.
            m[start] = 0
            kind = "thp" if _anon_huge_bytes(base + start) > 0 else "normal"
    return _tensor_of(m, start, nbytes), kind


def _anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr`, from /proc/self/smaps (0 if
    it cannot be read)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    inside = int(lo, 16) <= addr < int(hi, 16)
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _tensor_of(m: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)


class PoolFull(KVStoreError):
    """Every block of the pool is in use by some sequence; nothing can be evicted."""


class BlockTable:
    """A sequence's blocks in a pool: iterate as `(table, length)`.

    `table` is an int32 tensor of block ids on the pool's device; the KV of token
    `t < length` is at block `table[t // B]`, offset `t % B`. Release with
    `release()` or by using the object as a context manager.
    """

    def __init__(
        self, pool: BlockPool, blocks: list[int], length: int, lossy: bool = False
    ) -> None:
        self.pool = pool
        self.blocks = blocks
        self.length = length
        # Loaded dequantized from an fp8 store: neither its blocks nor what is computed
        # over them is exact KV (`save` refuses an exact store).
        self.lossy = lossy
        self._released = False
        self._table: torch.Tensor | None = None
        # The tokens and extra its blocks were loaded for: the blocks hold their KV, so
        # `save` refuses to store them under other tokens or another extra.
        self._loaded: tuple[np.ndarray, bytes] | None = None

    @property
    def table(self) -> torch.Tensor:
        """The block ids, int32, on the pool's device."""
        if self._table is None or self._table.numel() != len(self.blocks):
            self._table = torch.tensor(self.blocks, dtype=torch.int32).to(self.pool.device)
        return self._table

    @property
    def capacity(self) -> int:
        """Tokens the sequence's blocks can hold."""
        return len(self.blocks) * self.pool.layout.block_size

    @property
    def released(self) -> bool:
        return self._released

    def reserve(self, tokens: int) -> None:
        """Allocates private blocks until the sequence can hold `tokens` tokens."""
        self._check_live()
        b = self.pool.layout.block_size
        missing = -(-tokens // b) - len(self.blocks)
        if missing > 0:
            self.blocks.extend(self.pool._allocate(missing))

    def slot_mapping(self, start: int, count: int) -> torch.Tensor:
        """int64 slots (`block * B + offset`) of positions `start .. start + count - 1`,
        on the pool's device, for `ops.write_kv`. Reserve the capacity first."""
        self._check_live()
        if start < 0 or count < 0 or start + count > self.capacity:
            raise InvalidInput(
                f"positions {start}..{start + count}: expected within the reserved capacity "
                f"{self.capacity}; call reserve() first"
            )
        b = self.pool.layout.block_size
        if self.pool._shared(self.blocks[start // b : -(-(start + count) // b)]):
            # A block loaded from a store is keyed by its content and shared by every
            # sequence of that prefix: writing it would change their KV too.
            raise InvalidInput(
                f"positions {start}..{start + count}: a loaded block (shared by its content) "
                "is read-only; write past the loaded prefix"
            )
        pos = torch.arange(start, start + count)
        blocks = torch.tensor(self.blocks, dtype=torch.int64)
        return (blocks[pos // b] * b + pos % b).to(self.pool.device)

    def release(self) -> None:
        """Drops this sequence's references to its blocks. Idempotent."""
        if not self._released:
            self._released = True
            self.pool._release(self.blocks)

    def _check_live(self) -> None:
        if self._released:
            raise InvalidInput("this BlockTable was released")

    def __iter__(self) -> Any:
        yield self.table
        yield self.length

    def __enter__(self) -> BlockTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{len(self.blocks)} blocks"
        return f"<kvstore.torch.BlockTable length={self.length} {state}>"


class BlockPool:
    """Per-layer K/V block pools for paged attention; see the module doc.

    `device` defaults to "cuda" when available, else "cpu". A CPU pool lives on huge
    pages where the system has them (`page_kind`: "hugetlb", else "thp", else
    "normal"; `huge_pages=False` asks for 4 KiB pages); a CUDA pool's `page_kind` is
    "device". On CUDA, blocks read
    from a store pass through a pinned host buffer, so the copies to the device
    are DMA transfers (`non_blocking=True`) on the current stream.
    """

    def __init__(
        self,
        layout: Layout,
        num_blocks: int,
        device: str | torch.device | None = None,
        huge_pages: bool = True,
    ):
        if not isinstance(layout, Layout):
            raise InvalidInput(f"layout: expected kvstore.Layout, got {type(layout).__name__}")
        if layout.latent:
            raise InvalidInput(
                "layout: a BlockPool holds K/V blocks for kvstore's paged-attention ops, "
                "which have no MLA kernel; got kind 'latent'"
            )
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise InvalidInput(f"num_blocks: expected a positive int, got {num_blocks!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        L, H, D, B = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
        shape = (L, 2, num_blocks, B, H, D)
        if self.device.type == "cpu":
            nbytes = L * 2 * num_blocks * B * H * D * layout.itemsize
            raw, self.page_kind = host_pages(nbytes, huge_pages)
            self.kv = raw.view(self.dtype).view(shape)
        else:
            self.kv = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.page_kind = "device"
        # fp8: a scale per (layer, K/V, block, kv head); 1 until write_kv sets it.
        self.scales: torch.Tensor | None = None
        if self.dtype == torch.float8_e4m3fn:
            self.scales = torch.ones((L, 2, num_blocks, H), dtype=torch.float32, device=self.device)
        self._lock = threading.Lock()
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self._key_of: dict[int, BlockKey] = {}  # block -> content key, for blocks from a store
        self._block_of: dict[BlockKey, int] = {}  # content key -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, keyed; LRU first
        self._staging_lock = threading.Lock()
        self._staging: torch.Tensor | None = None  # pinned bytes for store -> device copies
        # Blocks copied straight from a hot tier (no staging through store.get).
        self.hot_loads = 0
        self._staging_done: torch.cuda.Event | None = None

    # -- views ------------------------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        """`[num_blocks, B, H, D]` keys of `layer` (a view of `kv`)."""
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """`[num_blocks, B, H, D]` values of `layer` (a view of `kv`)."""
        return self.kv[layer, 1]

    def key_scales(self, layer: int) -> torch.Tensor:
        """fp8 pools: `[num_blocks, H]` float32 key scales of `layer` (a view of `scales`)."""
        return self._scales()[layer, 0]

    def value_scales(self, layer: int) -> torch.Tensor:
        """fp8 pools: `[num_blocks, H]` float32 value scales of `layer`."""
        return self._scales()[layer, 1]

    def _scales(self) -> torch.Tensor:
        if self.scales is None:
            raise InvalidInput(
                f"scales: only an fp8 pool (dtype float8_e4m3fn) has them, this one is {self.dtype}"
            )
        return self.scales

    def _unit_scales(self, blocks: list[int]) -> None:
        """Blocks filled from a store hold raw e4m3 values: scale 1."""
        if self.scales is not None and blocks:
            idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            self.scales.index_fill_(2, idx, 1.0)

    @property
    def num_free(self) -> int:
        """Blocks no sequence uses (including those still holding reusable content)."""
        with self._lock:
            return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unused blocks that still hold content a `load` can reuse."""
        with self._lock:
            return len(self._cached)

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def __repr__(self) -> str:
        return (
            f"<kvstore.torch.BlockPool {self.layout} blocks={self.num_blocks} "
            f"free={self.num_free} device={self.device}>"
        )

    # -- loading ----------------------------------------------------------------------------

    def block_keys(
        self,
        store: Store,
        tokens: Any,
        *,
        extra: bytes | str | None = None,
        namespace: Hashable = None,
    ) -> list[BlockKey]:
        """Content keys of the full blocks of `tokens`: `(namespace, block id)`, with the
        store's own block ids (`store.block_ids(tokens, extra)`, which are keyed by the
        model fingerprint, layout and the handle's salt)."""
        try:
            hash(namespace)
        except TypeError:
            raise InvalidInput(
                f"namespace: expected a hashable value, got {type(namespace).__name__}"
            ) from None
        return [(namespace, i) for i in store.block_ids(tokens, extra)]

    def load(
        self,
        store: Store,
        tokens: Any,
        *,
        extra: bytes | str | None = None,
        namespace: Hashable = None,
    ) -> BlockTable:
        """The blocks of the longest prefix of `tokens` that is resident or stored.

        Resident blocks (same content key) are shared and refcounted; the rest of
        the stored prefix is read with `store.get(..., out=<host buffer>)` and copied
        into free blocks. Returns a BlockTable whose `length` is the prefix length (a
        multiple of block_size; 0 when nothing is found). Raises PoolFull when there
        are not enough free blocks (then nothing is held).
        """
        if (
            store.layout != self.layout
            and not self._takes_fp8_of(store.layout)
            and not self._dequantizes(store.layout)
        ):
            raise InvalidInput(f"store: expected layout {self.layout}, got {store.layout}")
        toks = tokens_array(tokens)
        b = self.layout.block_size
        keys = self.block_keys(store, toks, extra=extra, namespace=namespace)
        with self._lock:
            blocks: list[int] = []
            for key in keys:
                blk = self._block_of.get(key)
                if blk is None:
                    break
                self._ref(blk)
                blocks.append(blk)
        resident = len(blocks)
        try:
            if resident < len(keys):
                stored = store.lookup(toks[: len(keys) * b], extra=extra) // b
                if stored > resident:
                    blocks += self._read_blocks(store, toks, keys, resident, stored, extra)
        except BaseException:
            self._release(blocks)
            raise
        seq = BlockTable(self, blocks, len(blocks) * b, lossy=self._dequantizes(store.layout))
        seq._loaded = (toks[: seq.length].copy(), extra_bytes(extra))
        return seq

    def _takes_fp8_of(self, layout: Layout) -> bool:
        """An fp8 pool loads from a store with fp8 storage of the same shape: its
        values and scales as stored, without quantizing again."""
        mine = self.layout
        return (
            layout.storage == "fp8"
            and mine.dtype == "float8_e4m3fn"
            and (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
            == (mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.block_size)
        )

    def _dequantizes(self, layout: Layout) -> bool:
        """A pool that is not fp8 loads from a store with fp8 storage of its own dtype
        and shape: the store dequantizes on the way (`Store.get`)."""
        mine = self.layout
        return (
            layout.storage == "fp8"
            and self.scales is None
            and (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
            == (mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.block_size)
            and layout.dtype == mine.dtype
        )

    def _take_fp8(self, values: Any, scales: Any, blocks: list[int]) -> None:
        """Copies the first `len(blocks)` blocks of a store's fp8 values
        `[L, 2, n, B, H, D]` and scales `[L, 2, n, H]` (`store.get_fp8`) into `blocks`,
        bytes as they are."""
        if not blocks:
            return
        got = len(blocks)
        assert self.scales is not None
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        # As bytes: index_copy_ has no float8 kernel on the CPU.
        self.kv.view(torch.uint8).index_copy_(
            2, idx, values[:, :, :got].view(torch.uint8).to(self.device)
        )
        self.scales.index_copy_(2, idx, scales[:, :, :got].to(self.device))

    def _read_blocks(
        self,
        store: Store,
        toks: np.ndarray,
        keys: list[BlockKey],
        first: int,
        stop: int,
        extra: bytes | str | None,
    ) -> list[int]:
        """Reads blocks `first .. stop - 1` of `toks` from the store into new blocks:
        allocated before anything is read (PoolFull costs no read), and only those
        blocks read (`start=`), not the resident ones before them. Blocks the store
        no longer has (damaged, gc'd since lookup) are given back."""
        fp8_store = store.layout.storage == "fp8"
        # An fp8 store's hot tier holds the stored form: only get() dequantizes it.
        if not fp8_store:
            direct = self._read_hot_blocks(store, toks, keys, first, stop, extra)
            if direct is not None:
                return direct
        lay = self.layout
        L, H, D, B = lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size
        new = self._allocate(stop - first)
        try:
            if fp8_store and self.scales is not None:
                values, scales = store.get_fp8(toks[: stop * B], extra=extra, start=first * B)
                got = min(values.shape[2], len(new))
                self._take_fp8(values, scales, new[:got])
            else:
                # The pool lock is not held during the read; the staging lock keeps the
                # pinned buffer to one reader at a time.
                with self._staging_lock:
                    host = self._host_buffer((stop - first) * B)
                    m = store.get(toks[: stop * B], out=host, extra=extra, start=first * B)
                    got = min(max(m // B - first, 0), len(new))
                    if got:
                        self._copy_in(host.view(L, 2, stop - first, B, H, D)[:, :, :got], new[:got])
        except BaseException:
            self._release(new)
            raise
        self._release(new[got:])
        self._publish(keys[first : first + got], new[:got])
        return new[:got]

    def _copy_in(self, src: torch.Tensor, new: list[int]) -> None:
        """Copies `src` `[L, 2, n, B, H, D]` (the host buffer) into blocks `new`, with
        unit scales in an fp8 pool. Called with the staging lock held."""
        dst_index = torch.tensor(new, dtype=torch.int64, device=self.device)
        dst = self.kv
        if self.scales is not None:  # as bytes: index_copy_ has no float8 kernel on the CPU
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        if self.device.type == "cuda":
            staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            if src.is_contiguous():
                staged.copy_(src, non_blocking=True)
            else:  # each (layer, K/V) plane of the range is contiguous: one DMA each
                for layer in range(src.shape[0]):
                    for kv in range(2):
                        staged[layer, kv].copy_(src[layer, kv], non_blocking=True)
            dst.index_copy_(2, dst_index, staged)
            # The next read into the pinned buffer must wait for these copies.
            assert self._staging_done is not None
            self._staging_done.record()
        else:
            dst.index_copy_(2, dst_index, src)
        self._unit_scales(new)

    def _publish(self, keys: list[BlockKey], blocks: list[int]) -> None:
        """Makes freshly filled blocks findable by content key for later loads."""
        with self._lock:
            for key, blk in zip(keys, blocks, strict=False):
                if key not in self._block_of:  # else another load won the race: stay private
                    self._block_of[key] = blk
                    self._key_of[blk] = key

    def _read_hot_blocks(
        self,
        store: Store,
        toks: np.ndarray,
        keys: list[BlockKey],
        first: int,
        stop: int,
        extra: bytes | str | None,
    ) -> list[int] | None:
        """Copies blocks `first .. stop - 1` straight from the store's hot tier (one copy
        per block; a DMA from pinned memory on CUDA, see `register_arena`). None when a
        block is not hot or changed during the copy: the caller then reads the store."""
        try:
            view = arena_view(store)
        except (OSError, KVStoreError):
            # The arena file was removed or replaced since the store mapped it (a tmp
            # cleaner, RemoveIPC): the store still reads its own mapping.
            return None
        if view is None:
            return None
        lay = self.layout
        L, H, D, B = lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size
        hot = store.hot_blocks(toks[: stop * B], extra=extra)[first:stop]
        if any(h is None for h in hot):
            return None
        if self.device.type == "cuda":
            register_arena(store)
        new = self._allocate(stop - first)
        try:
            for blk, (_, _, offset) in zip(new, hot, strict=True):  # type: ignore[misc]
                src = view[offset : offset + lay.block_bytes].view(self.dtype).view(L, 2, B, H, D)
                self.kv[:, :, blk].copy_(src, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            # A slot evicted or rewritten during the copy may have given torn bytes.
            if not all(store.hot_unchanged([(s, v) for s, v, _ in hot])):  # type: ignore[misc]
                self._release(new)
                return None
        except BaseException:
            self._release(new)
            raise
        self._unit_scales(new)
        self._publish(keys[first:], new)
        self.hot_loads += len(new)
        return new

    def _host_buffer(self, tokens: int) -> torch.Tensor:
        """A contiguous `[L, 2, tokens, H, D]` host tensor for `store.get(out=)`: pinned
        and reused on CUDA (after the previous copies out of it finish). Called with
        the staging lock held."""
        shape = self.layout.kv_shape(tokens)
        if self.device.type != "cuda":
            return torch.empty(shape, dtype=self.dtype)
        # The pool's dtype, not the store's storage (an fp8 store's block_bytes).
        nbytes = math.prod(shape) * self.layout.itemsize
        if self._staging_done is not None:
            self._staging_done.synchronize()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._staging_done = torch.cuda.Event()
        return self._staging[:nbytes].view(self.dtype).view(shape)

    def save(self, store: Store, seq: BlockTable, tokens: Any, *, extra: Any = None) -> int:
        """Puts the KV of the full blocks of `seq` (token ids `tokens`, at least
        `seq.length` of them) into `store`; returns the tokens covered. An fp8 pool
        saves into a store with fp8 storage its blocks' bytes and scales as they are."""
        self._check_seq(seq)
        seq._check_live()
        toks = tokens_array(tokens)
        n = min(seq.length, len(toks)) // self.layout.block_size * self.layout.block_size
        if n == 0:
            return 0
        if seq.lossy and store.layout.storage != "fp8":
            raise InvalidInput(
                "save: this sequence was loaded dequantized from an fp8 store, so its KV "
                "is not exact; save it into a store with storage='fp8'"
            )
        self._check_loaded_for(seq, toks[:n], extra)
        if self.scales is not None and store.layout.storage == "fp8":
            if not self._takes_fp8_of(store.layout):
                raise InvalidInput(
                    f"store: expected fp8 storage of {self.layout}, got {store.layout}"
                )
            idx = torch.tensor(seq.blocks[: n // self.layout.block_size], device=self.device)
            # As bytes: index_select has no float8 kernel on the CPU.
            values = self.kv.view(torch.uint8).index_select(2, idx).view(torch.float8_e4m3fn)
            scales = self.scales.index_select(2, idx)
            return store.put_fp8(toks[:n], values.cpu(), scales.cpu(), extra=extra)
        if self.scales is not None:
            idx = torch.tensor(seq.blocks[: n // self.layout.block_size], device=self.device)
            if not bool((self.scales.index_select(2, idx) == 1).all()):
                raise InvalidInput(
                    "save: these fp8 blocks have per-block scales (from write_kv) and the "
                    "store keeps raw e4m3 values only: save into a store with storage='fp8' "
                    "(it keeps the scales) or save the unquantized KV"
                )
        kv = self.gather(seq, n).cpu()
        return store.put(toks[:n], kv, extra=extra)

    @staticmethod
    def _check_loaded_for(seq: BlockTable, toks: np.ndarray, extra: Any) -> None:
        """InvalidInput unless `toks` and `extra` are those `seq`'s loaded blocks hold the
        KV of: saved under other ones, that KV would serve requests it is not the KV of."""
        if seq._loaded is None:
            return
        loaded, loaded_extra = seq._loaded
        k = min(len(loaded), len(toks))
        if not np.array_equal(toks[:k], loaded[:k]):
            raise InvalidInput(
                "tokens: the sequence's first blocks were loaded for other token ids; save "
                "the tokens it was loaded (and then extended) with"
            )
        if extra_bytes(extra) != loaded_extra:
            raise InvalidInput(
                "extra: the sequence was loaded with another extra; save with the same one"
            )

    def gather(self, seq: BlockTable, tokens: int | None = None) -> torch.Tensor:
        """The KV of the first `tokens` (default: `seq.length`) tokens of `seq` as a
        contiguous `[L, 2, tokens, H, D]` tensor on the pool's device."""
        self._check_seq(seq)
        seq._check_live()  # a released table's blocks may hold another sequence's KV
        n = seq.length if tokens is None else tokens
        if not 0 <= n <= min(seq.length, seq.capacity):
            raise InvalidInput(
                f"tokens: expected 0 to {min(seq.length, seq.capacity)} (the sequence's "
                f"length within its blocks), got {n}"
            )
        b = self.layout.block_size
        nb = -(-n // b)
        idx = torch.tensor(seq.blocks[:nb], dtype=torch.int64, device=self.device)
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        out = self.kv.index_select(2, idx).reshape(L, 2, nb * b, H, D)
        return out if n == nb * b else out[:, :, :n].contiguous()

    def release(self, seq: BlockTable) -> None:
        """Same as `seq.release()`."""
        self._check_seq(seq)
        seq.release()

    def _check_seq(self, seq: BlockTable) -> None:
        """InvalidInput unless `seq` is a BlockTable of this pool."""
        if not isinstance(seq, BlockTable) or seq.pool is not self:
            raise InvalidInput("seq: expected a BlockTable of this pool")

    def _shared(self, blocks: list[int]) -> bool:
        """Whether any of `blocks` is keyed by its content (loaded, shared)."""
        with self._lock:
            return any(blk in self._key_of for blk in blocks)

    def new_sequence(self) -> BlockTable:
        """An empty sequence (no blocks yet), e.g. to prefill without a store."""
        return BlockTable(self, [], 0)

    # -- allocation -------------------------------------------------------------------------

    def _ref(self, blk: int) -> None:
        if self._refs[blk] == 0:
            self._cached.pop(blk, None)
        self._refs[blk] += 1

    def _allocate(self, n: int) -> list[int]:
        with self._lock:
            return self._allocate_locked(n)

    def _allocate_locked(self, n: int) -> list[int]:
        if n > len(self._free) + len(self._cached):
            raise PoolFull(
                f"BlockPool: expected {n} free blocks, got {len(self._free) + len(self._cached)} "
                f"of {self.num_blocks} (release sequences or make the pool bigger)"
            )
        out = []
        for _ in range(n):
            if self._free:
                blk = self._free.pop()
            else:  # evict the least recently released block that still holds content
                blk, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(blk)]
            self._refs[blk] = 1
            out.append(blk)
        return out

    def _release(self, blocks: list[int]) -> None:
        with self._lock:
            for blk in blocks:
                self._refs[blk] -= 1
                if self._refs[blk] == 0:
                    if blk in self._key_of:
                        self._cached[blk] = None
                    else:
                        self._free.append(blk)
