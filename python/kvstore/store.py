"""`kvstore.open` and the `Store` handle.

This layer only turns Python values (lists, numpy arrays, torch tensors) into
contiguous byte and uint32 buffers for the Rust engine (through kvstore._convert),
and back. Checks that need Python types (dtype, shape) happen there, before
anything is written.

Arrays returned by `get`: the family is chosen by `like=` when given, else by
the `array=` argument of `open`; its default is "numpy" for float16/float32
layouts and "torch" for bfloat16/float8 layouts (numpy has no such dtypes).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _lib, fp8
from ._convert import (
    U32_MAX,
    extra_bytes,
    is_torch,
    kv_bytes,
    latent_from_runs,
    out_bytes,
    tokens_array,
    utf8,
)
from ._pool import ResultPool
from .errors import InvalidInput
from .heads import HeadParts
from .layout import Layout
from .remote import Remote

if TYPE_CHECKING:
    from ._lib import (
        CompactReport,
        GcReport,
        Manifest,
        NodeReport,
        OpenOptions,
        PushReport,
        SegmentReport,
    )

_U64_MAX = 2**64 - 1
# Durations go to Rust as f64 seconds; Duration::from_secs_f64 panics at 2**64.
_MAX_SECONDS = float(2**63)
_NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32}
# Bytes of result buffers this process keeps for reuse (see kvstore._pool), shared by
# its handles: a server that opens a handle per request still restores into memory
# already faulted in.
RESULT_POOL_BYTES = 512 << 20
_RESULTS = ResultPool(RESULT_POOL_BYTES)


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise InvalidInput(f"name: expected str, got {type(name).__name__}")
    utf8("name", name)


def _check_callable(progress: Any) -> None:
    if progress is not None and not callable(progress):
        raise InvalidInput(f"progress: expected a callable or None, got {type(progress).__name__}")


def _check_seconds(name: str, value: Any, allow_zero: bool) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
        and value < _MAX_SECONDS
    )
    if not ok:
        kind = "non-negative" if allow_zero else "positive"
        raise InvalidInput(
            f"{name}: expected a {kind} number of seconds below 2**63, got {value!r}"
        )


def _check_start(start: Any, block_size: int, tokens: int) -> int:
    """`start` of a range put or get: a block boundary within the sequence."""
    if isinstance(start, bool) or not isinstance(start, int):
        raise InvalidInput(f"start: expected an int, got {type(start).__name__}")
    if start < 0 or start % block_size or start > tokens:
        raise InvalidInput(
            f"start: expected a multiple of the block size {block_size} from 0 to {tokens} "
            f"(the token ids given), got {start}"
        )
    return start


class Store:
    """A handle on a store directory. Use as a context manager, or call `close()`.

    One handle may be shared by many threads; the GIL is released during I/O,
    hashing, compression and copies. Do not use a handle in a process forked
    after it was opened: it raises StoreClosed there; open the store again.
    """

    def __init__(
        self,
        raw: _lib.Store,
        layout: Layout,
        model: str,
        array: str,
    ) -> None:
        self._raw = raw
        self.layout = layout
        self.model = model
        self._array = array
        self._pool = _RESULTS
        # The heads store beside this one (kvstore.heads), opened on first need with
        # this handle's salt, tiers and durability (`_heads_args`, set by `open`).
        self._heads: HeadParts | None = None
        self._heads_args: dict[str, Any] | None = None
        self._heads_lock = threading.Lock()

    # -- properties -------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return Path(self._raw.path)

    @property
    def closed(self) -> bool:
        return self._raw.closed

    @property
    def durability(self) -> str:
        return self._raw.durability()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvstore.Store {str(self.path)!r} model={self.model!r} {self.layout} {state}>"

    # -- blocks -----------------------------------------------------------------------------

    def put(
        self,
        tokens: Any,
        kv: Any,
        *,
        extra: bytes | str | None = None,
        start: int = 0,
    ) -> int:
        """Stores every full block of `tokens` not stored yet; returns the tokens covered.

        `kv` is `[L, 2, T, H, D]` with T >= the full-block tokens of `tokens`, of the
        layout's dtype (bfloat16 through torch). `extra` is mixed into every block id
        (e.g. an adapter name): only a request with the same `extra` finds these blocks.
        With `start` (a multiple of block_size), `kv` holds `tokens[start:]` and only
        the blocks from `start` on are written: a chunked prefill hands over its new
        blocks alone. The blocks before `start` should be stored already: a block whose
        parent is missing is found only once the parent is stored.
        """
        toks = tokens_array(tokens)
        b = self.layout.block_size
        s = _check_start(start, b, len(toks))
        need = max(len(toks) // b * b - s, 0)
        flat, t = kv_bytes(kv, self.layout, need=need)
        if self.layout.storage == "fp8":
            flat, t = self._quantized(flat, t, need)
        return self._raw.put(toks, flat, t, extra_bytes(extra), s)

    def _quantized(self, flat: np.ndarray, t: int, need: int) -> tuple[np.ndarray, int]:
        """fp8 storage: the stored form of the full blocks of the first `need` of the
        `t` tokens of `flat` (the bytes of `[L, 2, t, H, D]` in the layout's dtype)."""
        import torch

        n = min(t, need) // self.layout.block_size * self.layout.block_size
        kv = torch.from_numpy(flat).view(getattr(torch, self.layout.dtype))
        return fp8.quantize(kv.view(self.layout.kv_shape(t)), self.layout, n), n

    def block_ids(self, tokens: Any, extra: bytes | str | None = None) -> list[bytes]:
        """The engine's ids of the full blocks of `tokens` (32 bytes each), as the store
        names them: keyed by the model fingerprint, the layout, this handle's salt and
        `extra`, each chained to its parent. Equal for equal prefixes; for pools and
        connectors that name blocks as the store does (see kvstore.torch.BlockPool)."""
        return self._raw.block_ids(tokens_array(tokens), extra_bytes(extra))

    def lookup(self, tokens: Any, *, extra: bytes | str | None = None, count: bool = True) -> int:
        """Longest stored prefix of `tokens`, in tokens (a multiple of block_size).
        With `count=False` the store's hit and miss counters are left alone (for a
        planner that asks again and again, e.g. the vLLM connector's scheduler)."""
        toks, ex = tokens_array(tokens), extra_bytes(extra)
        m = self._raw.lookup(toks, ex, bool(count))
        b = self.layout.block_size
        heads = self.heads(create=False) if m < len(toks) // b * b else None
        return max(m, heads.lookup(toks, ex)) if heads is not None else m

    def heads(self, *, create: bool) -> HeadParts | None:
        """The heads store beside this one, where tensor-parallel workers store their
        heads (`kvstore.heads`): opened on first need, created with `create`; None
        where it does not exist (or this layout has no heads to part: a latent, fp8
        storage, a handle opened without a layout's arguments)."""
        if self._heads is not None or self._heads_args is None:
            return self._heads
        if self.layout.latent or self.layout.storage != "exact" or self.layout.num_kv_heads == 1:
            return None
        if not create and not HeadParts.exists(self.path):
            return None
        with self._heads_lock:
            if self._heads is None:
                self._heads = HeadParts.open(self.path, self.layout, self.model, **self._heads_args)
        return self._heads

    def get(
        self,
        tokens: Any,
        *,
        out: Any = None,
        like: Any = None,
        extra: bytes | str | None = None,
        start: int = 0,
    ) -> Any:
        """KV of the longest stored prefix of `tokens`.

        Without `out`: returns a new `[L, 2, m, H, D]` array (m may be 0) of the family
        of `like` (a numpy array or torch tensor), else of the store's `array` setting.
        With `out` (a contiguous `[L, 2, T, H, D]` CPU array/tensor): fills its first m
        tokens and returns m (m <= T); the rest of `out` is left unspecified.
        With `start` (a multiple of block_size) only `tokens[start:m]` is read: the
        result (or `out`) holds the KV from token `start` on, and the m returned with
        `out` still counts from token 0 (below `start` when the prefix ends before it).
        """
        toks = tokens_array(tokens)
        ex = extra_bytes(extra)
        s = _check_start(start, self.layout.block_size, len(toks))
        if self.layout.latent:
            return self._get_latent(toks, ex, s, out, like)
        heads = self._heads_serving(toks, ex)
        if heads is not None:
            return self._get_heads(heads, toks, ex, s, out, like)
        if out is not None:
            flat, t = out_bytes(out, self.layout)
            if self.layout.storage != "fp8":
                return self._raw.get_into(toks, ex, flat, t, s)
            t = t // self.layout.block_size * self.layout.block_size
            stored = np.empty(fp8.buffer_bytes(self.layout, t), dtype=np.uint8)
            m = self._raw.get_into(toks, ex, stored, t, s)
            fp8.dequantize(stored, self.layout, max(m - s, 0), out)
            return m
        m = max(self._raw.lookup(toks, ex, False) - s, 0)
        result = self._empty(m, like)
        if self.layout.storage == "fp8":
            stored = np.empty(fp8.buffer_bytes(self.layout, m), dtype=np.uint8)
            n = max(self._raw.get_into(toks, ex, stored, m, s) - s, 0)
            fp8.dequantize(stored, self.layout, n, result)
            return result if n == m else _trimmed(result, n)
        flat, _ = kv_bytes(result, self.layout, "out")
        n = max(self._raw.get_into(toks, ex, flat, m, s) - s, 0)
        if n < m:  # a block turned out damaged (or was compacted away) after lookup
            result = _trimmed(result, n)
        return result

    def _heads_serving(self, toks: np.ndarray, ex: bytes) -> tuple[HeadParts, int] | None:
        """The heads store and its prefix of `toks`, where it holds more of it than
        this store (a prefix stored by tensor-parallel workers)."""
        b = self.layout.block_size
        if self._heads is None and not HeadParts.exists(self.path):
            return None
        m = self._raw.lookup(toks, ex, False)
        heads = self.heads(create=False) if m < len(toks) // b * b else None
        if heads is None:
            return None
        m_heads = heads.lookup(toks, ex)
        return (heads, m_heads) if m_heads > m else None

    def _get_heads(
        self,
        serving: tuple[HeadParts, int],
        toks: np.ndarray,
        ex: bytes,
        s: int,
        out: Any,
        like: Any,
    ) -> Any:
        """`get` of a prefix the heads store holds (see `_heads_serving`)."""
        heads, m = serving
        if out is not None:
            out_bytes(out, self.layout)  # the same checks as a get from this store
            return heads.get_into(toks, ex, s, out)
        result = self._empty(max(m - s, 0), like)
        n = max(heads.get_into(toks[:m], ex, s, result) - s, 0)
        return result if n == int(result.shape[2]) else _trimmed(result, n)

    def _get_latent(self, toks: np.ndarray, ex: bytes, s: int, out: Any, like: Any) -> Any:
        """`get` of a latent layout: the engine fills the latent's halves as runs
        (`Layout.runs_shape`), copied out as `[L, T, W]`."""
        lay = self.layout
        if out is not None:
            _, t = out_bytes(out, lay)
        else:
            t = max(self._raw.lookup(toks, ex, False) - s, 0)
        runs = np.empty(math.prod(lay.runs_shape(t)) * lay.itemsize, dtype=np.uint8)
        m = self._raw.get_into(toks, ex, runs, t, s)
        n = min(max(m - s, 0), t)
        dst = out if out is not None else self._empty(n, like)
        latent_from_runs(runs, lay, t, n, dst)
        return m if out is not None else dst

    def get_fp8(
        self, tokens: Any, *, extra: bytes | str | None = None, start: int = 0
    ) -> tuple[Any, Any]:
        """fp8 storage only: the stored prefix as kept, without dequantizing, for an
        fp8 pool: `(values, scales)`, float8_e4m3fn `[L, 2, nb, B, H, D]` and float32
        `[L, 2, nb, H]` (views of one buffer) for the `nb` blocks of `tokens[start:m]`."""
        if self.layout.storage != "fp8":
            raise InvalidInput(f"get_fp8: expected a store with fp8 storage, got {self.layout}")
        import torch

        toks = tokens_array(tokens)
        ex = extra_bytes(extra)
        s = _check_start(start, self.layout.block_size, len(toks))
        m = max(self._raw.lookup(toks, ex, False) - s, 0)
        stored = torch.empty(fp8.buffer_bytes(self.layout, m), dtype=torch.uint8)
        n = max(self._raw.get_into(toks, ex, stored.numpy(), m, s) - s, 0)
        return fp8.split(stored, self.layout, n)

    def put_fp8(
        self, tokens: Any, values: Any, scales: Any, *, extra: bytes | str | None = None
    ) -> int:
        """fp8 storage only, the inverse of `get_fp8`: stores fp8 blocks as they are
        (e.g. an fp8 `BlockPool`'s, whose scales `ops.write_kv` chose), without
        dequantizing and quantizing again: values float8_e4m3fn `[L, 2, nb, B, H, D]`,
        scales float32 `[L, 2, nb, H]`, the blocks of `tokens[: nb * B]`. Returns the
        tokens covered, as `put`."""
        if self.layout.storage != "fp8":
            raise InvalidInput(f"put_fp8: expected a store with fp8 storage, got {self.layout}")
        toks = tokens_array(tokens)
        stored = fp8.join(values, scales, self.layout)
        n = int(values.shape[2]) * self.layout.block_size
        if len(toks) < n:
            raise InvalidInput(f"tokens: expected at least {n} token ids, got {len(toks)}")
        return self._raw.put(toks[:n], stored, n, extra_bytes(extra), 0)

    def _empty(self, tokens: int, like: Any) -> Any:
        family = self._array
        if like is not None:
            family = "torch" if is_torch(like) else "numpy"
        return self._result_buffer(tokens, family)

    def _result_buffer(self, tokens: int, family: str) -> Any:
        """An uninitialized `[L, 2, tokens, H, D]` array of `family` ("torch" or
        "numpy") in memory the process reuses (see kvstore._pool): already faulted in,
        and never handed out again while anything made from it is alive."""
        shape = self.layout.kv_shape(tokens)
        if family == "torch":
            import torch

            dtype = getattr(torch, self.layout.dtype)
            if tokens == 0:  # a zero-length byte buffer cannot be viewed as another dtype
                return torch.empty(shape, dtype=dtype)
            raw = self._pool.take(math.prod(shape) * self.layout.itemsize)
            return torch.from_numpy(raw).view(dtype).view(shape)
        if self.layout.dtype not in _NUMPY_DTYPES:
            raise InvalidInput(
                f"array: numpy has no {self.layout.dtype}; use array='torch' or like=<torch tensor>"
            )
        raw = self._pool.take(math.prod(shape) * self.layout.itemsize)
        return raw.view(_NUMPY_DTYPES[self.layout.dtype]).reshape(shape)

    def pin(
        self,
        tokens: Any,
        priority: int = 100,
        ttl: float | None = None,
        *,
        extra: bytes | str | None = None,
    ) -> int:
        """Keeps the longest stored prefix of `tokens` warm: in the hot tier ahead of
        blocks pinned lower or not at all, and kept by `gc`, for `ttl` seconds (None:
        until `unpin`). Returns the tokens pinned. StoreFull if the hot tier is full of
        blocks pinned at `priority` or higher; StoreLocked if its writer lock stayed
        held for 2 s (by a stopped process): the blocks before that one stay pinned."""
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not 0 < priority <= _U64_MAX
        ):
            raise InvalidInput(f"priority: expected a positive int below 2**64, got {priority!r}")
        if ttl is not None:
            _check_seconds("ttl", ttl, allow_zero=False)
        return self._raw.pin(tokens_array(tokens), extra_bytes(extra), priority, ttl)

    def unpin(self, tokens: Any, *, extra: bytes | str | None = None) -> int:
        """Makes the blocks of `tokens` evictable again. StoreLocked as for `pin`: the
        blocks then stay pinned (in the hot tier and for `gc`) until a call succeeds."""
        return self._raw.unpin(tokens_array(tokens), extra_bytes(extra))

    def hot_blocks(
        self, tokens: Any, *, extra: bytes | str | None = None
    ) -> list[tuple[int, int, int] | None]:
        """For each full block of `tokens`: `(slot, version, offset)` of the block in the
        hot-tier file, or None. For zero-copy readers (see kvstore.torch.BlockPool): copy
        from your own mapping of the file, then check `hot_unchanged` before trusting it."""
        return self._raw.hot_blocks(tokens_array(tokens), extra_bytes(extra))

    def hot_unchanged(self, slots: list[tuple[int, int]]) -> list[bool]:
        """Whether each `(slot, version)` from `hot_blocks` still holds its block."""
        try:
            pairs = [(int(s), int(v)) for s, v in slots]
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"slots: expected (slot, version) int pairs, got {e}") from None
        if any(not (0 <= s <= _U64_MAX and 0 <= v <= _U64_MAX) for s, v in pairs):
            raise InvalidInput("slots: expected (slot, version) pairs in [0, 2**64)")
        return self._raw.hot_unchanged(pairs)

    def arena_file(self) -> tuple[str, int, int, int] | None:
        """`(path, device, inode, length)` of the hot-tier file (None without one)."""
        return self._raw.arena_file()

    def arena_region(self) -> tuple[int, int] | None:
        """`(address, length)` of the shared hot-tier mapping (None without a hot tier),
        e.g. to register it with CUDA as pinned memory (see kvstore.torch)."""
        return self._raw.arena_region()

    # -- sessions ---------------------------------------------------------------------------

    def save_session(self, name: str, tokens: Any, kv: Any) -> int:
        """Binds `name` to all of `tokens` and stores the full blocks that `kv` covers
        (shared with any other session or put of the same prefix): `kv` may be shorter
        than `tokens`, e.g. a cache that has not yet seen the last generated token.
        Returns the tokens whose KV is stored."""
        _check_name(name)
        toks = tokens_array(tokens)
        b = self.layout.block_size
        # The engine stores the full blocks of min(len(tokens), T) tokens.
        flat, t = kv_bytes(kv, self.layout, need=len(toks) // b * b)
        if self.layout.storage == "fp8":
            flat, t = self._quantized(flat, t, len(toks) // b * b)
        return self._raw.save_session(name, toks, flat, t)

    def load_session(self, name: str, *, like: Any = None) -> tuple[Any, Any]:
        """`(tokens, kv)`: the session's token ids (all of them, as saved last; with a
        remote tier, the newer of this store's copy and the server's, by version) and
        the KV of their longest stored prefix. Raises SessionNotFound (a KeyError) if
        unknown or deleted."""
        _check_name(name)
        toks = self._raw.session_tokens(name)
        kv = self.get(toks, like=like)
        if like is not None and is_torch(like) or like is None and self._array == "torch":
            import torch

            return torch.from_numpy(toks.astype(np.int64)), kv
        return toks.astype(np.int64), kv

    def session_tokens(self, name: str) -> np.ndarray:
        """The token ids bound to a session (int64). SessionNotFound if unknown."""
        _check_name(name)
        return self._raw.session_tokens(name).astype(np.int64)

    def sessions(self) -> list[str]:
        """Names of this tenant's sessions."""
        return [name for name, _ in self._raw.sessions()]

    def session_sizes(self) -> dict[str, int]:
        """This tenant's sessions and their lengths in tokens."""
        return dict(self._raw.sessions())

    def delete_session(self, name: str) -> bool:
        """Forgets a session (its blocks stay until gc); False if it did not exist here.
        With a remote tier the server gets a versioned tombstone: other hosts whose
        copy is older take the delete on their next load."""
        _check_name(name)
        return self._raw.delete_session(name)

    # -- lifecycle and maintenance -----------------------------------------------------------

    def flush(self) -> None:
        """Everything put so far is durable, and visible to other processes, on return."""
        self._raw.flush()
        if self._heads is not None:
            self._heads.flush()

    def stats(self) -> dict[str, Any]:
        """Blocks, bytes per tier, hits and misses (of this handle), dedupe, page kind.

        Hot tier: `hot_hit_blocks` / `disk_hit_blocks` (blocks this handle served from
        memory / from the segments), `hot_bytes`, `hot_slots`, `hot_slots_used`,
        `hot_slots_pinned`, `hot_evictions`, `page_kind` ("hugetlb", "thp", "normal", or
        "none" without a hot tier), `hot_path`; `hot_lock_timeouts` / `hot_fills_skipped`
        (this handle's waits for the arena's writers' lock that ran out, and its copies
        into the arena skipped because that lock was not free: a process stopped while
        holding it)."""
        s: dict[str, Any] = dict(self._raw.stats())
        live = s["live_bytes"]
        s["compression_ratio"] = (s["raw_live_bytes"] / live) if live else 1.0
        s["durability"] = self.durability
        return s

    def add_counters(self, counts: dict[str, int]) -> None:
        """Adds to named counters of the store (a connector's hit tokens, bytes moved,
        errors): saved with its hit and miss totals at flush and close, shown store-wide
        in `stats()["counters"]` and by `kvstore stats`. Names: 1 to 64 characters of
        `a-z 0-9 _ . -`, e.g. "vllm.hit_tokens"."""
        if not isinstance(counts, dict):
            kind = type(counts).__name__
            raise InvalidInput(f"counts: expected a dict of names to ints, got {kind}")
        bad = [
            (k, v)
            for k, v in counts.items()
            if not isinstance(k, str)
            or isinstance(v, bool)
            or not isinstance(v, int)
            or not 0 <= v <= _U64_MAX
        ]
        if bad:
            raise InvalidInput(
                f"counts: expected str names and int values in [0, 2**64), got {bad[0]!r}"
            )
        self._raw.add_counters(list(counts.items()))

    def segments(self) -> list[SegmentReport]:
        """Per segment file: bytes on disk, committed, live and dead, live records."""
        return self._raw.segments()

    def verify(
        self, progress: Callable[[int, int], None] | None = None, repair: bool = False
    ) -> dict[str, Any]:
        """Re-reads every record. With `repair`, damaged ones leave the index (misses
        from then on, stored again by the next put of their tokens)."""
        _check_callable(progress)
        # A plain dict: the CLI adds its verdict to it.
        return dict(self._raw.verify(progress, bool(repair)))

    def compact(self, progress: Callable[[int, int], None] | None = None) -> CompactReport:
        _check_callable(progress)
        return self._raw.compact(progress)

    def gc(
        self,
        max_bytes: int | None = None,
        older_than: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> GcReport:
        """Evicts the oldest blocks (created more than `older_than` seconds ago, and
        until the live bytes fit `max_bytes`), then compacts."""
        if max_bytes is not None and (
            isinstance(max_bytes, bool)
            or not isinstance(max_bytes, int)
            or not 0 <= max_bytes <= _U64_MAX
        ):
            raise InvalidInput(
                f"max_bytes: expected a non-negative int below 2**64 or None, got {max_bytes!r}"
            )
        if older_than is not None:
            _check_seconds("older_than", older_than, allow_zero=True)
        _check_callable(progress)
        return self._raw.gc(max_bytes, older_than, progress)

    def remote_nodes(self) -> list[NodeReport]:
        """Each node of the remote tier: its address, round trip, server `INFO` and the
        error that kept it from answering (`kvstore remote ping`). `InvalidInput` when
        the store was opened without `remote=`."""
        return self._raw.remote_nodes()

    def remote_push(self, progress: Callable[[int, int], None] | None = None) -> PushReport:
        """Uploads the blocks the remote tier lacks (`kvstore remote push`): what a
        store filled before it had a remote tier, or while the remote was down.
        `InvalidInput` when the store was opened without `remote=`."""
        _check_callable(progress)
        return self._raw.remote_push(progress)

    def manifest(self) -> Manifest:
        return self._raw.manifest()

    def close(self) -> None:
        """Commits what is pending and releases the handle. Idempotent."""
        self._raw.close()
        if self._heads is not None:
            self._heads.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(  # noqa: A001 - the name users expect (kvstore.open)
    path: str | os.PathLike[str],
    layout: Layout | None = None,
    model: str | None = None,
    *,
    salt: bytes | str | None = None,
    hot_bytes: int | None = None,
    disk_bytes: int | None = None,
    durability: str = "batch",
    array: str | None = None,
    compression: str | None = None,
    compression_level: int = 3,
    segment_bytes: int = 1 << 30,
    batch_window_ms: int = 20,
    create: bool = True,
    hot_dir: str | os.PathLike[str] | None = None,
    index_bytes: int | None = None,
    remote: Remote | None = None,
) -> Store:
    """Opens (creating if needed) the store at `path`, bound to `model` + `layout`.

    - `salt`: tenant secret; handles with different salts never see each other's blocks.
    - `durability`: "sync" (each put durable on return), "batch" (group commit within
      `batch_window_ms`; `flush()` forces it), "none" (no fsync; survives a process
      crash, not a power loss).
    - `disk_bytes`: bound on segment bytes; a put past it raises StoreFull.
    - `compression`: None (raw payloads), "zstd" (with byte-plane shuffle for 16-bit
      dtypes) at `compression_level`, or "exponent" (16-bit dtypes: the sign/exponent
      byte of each element entropy-coded, the mantissa byte stored as is; other dtypes
      raw). All lossless; README "Compression" has the figures.
    - `array`: "numpy" or "torch", the family `get` returns (see the module doc).
    - `hot_bytes`: capacity of the shared-memory hot tier (None: no hot tier). Every
      process opening the store with a hot tier maps the same arena; the first one
      sizes it. It lives in `hot_dir`, else $KVSTORE_HOT_DIR, else a hugetlbfs mount
      with room, else /dev/shm, as `kvstore-<store id>.arena`, and outlives the
      processes (that is the point); `kvstore.remove_arena(path)` deletes it. With
      one, gets read what the page cache lacks with O_DIRECT and keep it in the tier
      instead (README "Disk format"; $KVSTORE_DIRECT_READS=0 turns that off).
    - `index_bytes`: bound on the LMDB index map (at least 2 MiB; default 64 GiB,
      reserved virtually). Puts raise StoreFull at three quarters of it (all but 1 MiB
      at least), keeping the rest for gc. The first handle of a process sets it.
    - `remote`: a `kvstore.Remote` (Redis/Valkey) behind the local tiers: puts go to it
      in the background, lookups and gets continue into it (README: "Remote tier").
    - With `layout` and `model` both None, opens an existing store as its MANIFEST says.
    """
    if (layout is None) != (model is None):
        raise InvalidInput("layout and model: give both (to open or create) or neither (to open)")
    if layout is not None and not isinstance(layout, Layout):
        raise InvalidInput(f"layout: expected kvstore.Layout, got {type(layout).__name__}")
    if layout is not None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(layout, field) > U32_MAX:
                raise InvalidInput(
                    f"layout: expected {field} <= {U32_MAX}, got {getattr(layout, field)}"
                )
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidInput(f"model: expected a non-empty fingerprint string, got {model!r}")
    if model is not None:
        utf8("model", model)
    if durability not in ("sync", "batch", "none"):
        raise InvalidInput(f"durability: expected 'sync', 'batch' or 'none', got {durability!r}")
    if isinstance(salt, str):
        salt = utf8("salt", salt)
    if salt is not None and not isinstance(salt, (bytes, bytearray)):
        raise InvalidInput(f"salt: expected bytes, str or None, got {type(salt).__name__}")
    if compression not in (None, "zstd", "exponent"):
        raise InvalidInput(f"compression: expected None, 'zstd' or 'exponent', got {compression!r}")
    if array not in (None, "numpy", "torch"):
        raise InvalidInput(f"array: expected 'numpy', 'torch' or None, got {array!r}")
    for name, value in (
        ("disk_bytes", disk_bytes),
        ("hot_bytes", hot_bytes),
        ("index_bytes", index_bytes),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _U64_MAX
        ):
            raise InvalidInput(
                f"{name}: expected a positive int below 2**64 or None, got {value!r}"
            )
    for name, value in (("segment_bytes", segment_bytes), ("batch_window_ms", batch_window_ms)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
            raise InvalidInput(f"{name}: expected a non-negative int below 2**64, got {value!r}")
    level = compression_level if compression == "zstd" else 0
    if compression == "zstd" and not 1 <= level <= 22:
        raise InvalidInput(f"compression_level: expected 1 to 22, got {level}")
    options: OpenOptions = {
        "durability": durability,
        "create": create,
        "fingerprint": model,
        "layout": layout,
        "salt": bytes(salt) if salt is not None else None,
        "disk_bytes": disk_bytes,
        "compression": compression,
        "compression_level": level,
        "segment_bytes": segment_bytes,
        "batch_window_ms": batch_window_ms,
        "hot_bytes": hot_bytes,
        "hot_dir": os.fspath(hot_dir) if hot_dir is not None else None,
        "index_bytes": index_bytes,
    }
    if remote is not None:
        options["remote"] = remote._options()
    raw = _lib.Store.open(os.fspath(path), options)
    actual = Layout(*raw.layout())
    fingerprint = model if model is not None else raw.manifest()["fingerprint"]
    if array is None:
        array = "numpy" if actual.dtype in _NUMPY_DTYPES else "torch"
    store = Store(raw, actual, fingerprint, array)
    store._heads_args = {
        "salt": salt,
        "hot_bytes": hot_bytes,
        "disk_bytes": disk_bytes,
        "durability": durability,
        "array": array,
        "compression": compression,
        "compression_level": compression_level,
        "segment_bytes": segment_bytes,
        "batch_window_ms": batch_window_ms,
        "hot_dir": hot_dir,
        "index_bytes": index_bytes,
        "remote": remote,
    }
    return store


def _trimmed(result: Any, n: int) -> Any:
    """The first `n` tokens of a result, copied (the rest of its memory is not owned)."""
    return result[:, :, :n].copy() if isinstance(result, np.ndarray) else result[:, :, :n].clone()


def _arena_dirs(hot_dir: str | os.PathLike[str] | None) -> list[Path]:
    return [Path(d) for d in _lib.arena_dirs(os.fspath(hot_dir) if hot_dir is not None else None)]


def arenas(
    hot_dir: str | os.PathLike[str] | None = None,
    *,
    prune: bool = False,
    dirs: Sequence[str | os.PathLike[str]] | None = None,
) -> list[dict[str, Any]]:
    """Every kvstore arena where stores look for them (`hot_dir`, $KVSTORE_HOT_DIR,
    hugetlbfs mounts, /dev/shm), or in `dirs` only: its file, the store its header
    names, whether that store exists and still owns it (`orphan` if not), size, page
    kind, last use, and how many live processes map it. With `prune=True`, removes the
    orphans no process maps (marked `pruned`); never an arena whose store exists or
    whose header names none."""
    where = [Path(d) for d in dirs] if dirs is not None else _arena_dirs(hot_dir)
    return [dict(a) for a in _lib.arenas(where, prune)]


def remove_arena(
    path: str | os.PathLike[str], hot_dir: str | os.PathLike[str] | None = None
) -> int:
    """Deletes the shared-memory arena of the store at `path` (wherever the store's
    processes would look for it), or the arena file `path` itself
    (`.../kvstore-<store id>.arena`); returns how many files were removed. Processes
    that have it mapped keep using their mapping; the next open creates a fresh arena."""
    if Path(path).name.endswith(".arena") and not Path(path, "MANIFEST").exists():
        return int(_lib.remove_arena_file(os.fspath(path)))
    raw = _lib.Store.open(os.fspath(path), {"durability": "none", "create": False})
    store_id = raw.manifest()["store_id"]
    raw.close()
    removed = 0
    for d in dict.fromkeys(_arena_dirs(hot_dir)):
        removed += _lib.remove_arena_file(os.fspath(d / f"kvstore-{store_id}.arena"))
    return removed


def rebuild_index(
    path: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Rebuilds the store's index from its segment files, for an index that is lost or
    damaged (`CorruptStore` on open). Every handle on the store must be closed.

    Blocks come back; what only the index held does not: sessions, pins, last-use
    times, hit counters. The old index directory is kept as `index.old-<time>`.
    Returns segments, records, blocks, damaged (ranges) and old_index.
    """
    _check_callable(progress)
    return dict(_lib.rebuild_index(os.fspath(path), progress))
