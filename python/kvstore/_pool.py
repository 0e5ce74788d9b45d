"""Result buffers the store handles of a process reuse: memory already faulted in.

A restore into fresh memory pays a page fault per page it first touches, which
costs about as much as the copy itself. `get()` without `out=`, `load_session`
and `kvstore.hf.load` therefore land KV in buffers this pool keeps (one pool per
process, of at most kvstore.store.RESULT_POOL_BYTES) and hands out again. A
buffer is handed out again only when nothing made from it is alive any more (no
array, tensor or view of it: CPython's reference count of the buffer says so),
so a result stays valid for as long as the caller holds it. The pool is
bounded: past its limit it drops free buffers, and when every buffer is held,
results get fresh memory of their own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
import weakref

import numpy as np

# Buffers are rounded up to 2 MiB, the huge page size, so a transparent huge
# page backs each whole 2 MiB of them.
_ALIGN = 2 << 20


def _refs(bufs: list[np.ndarray], i: int) -> int:
    """References to `bufs[i]`, counted the same way for calibration and checks."""
    return sys.getrefcount(bufs[i])


def _free_refs() -> int:
    """What `_refs` counts for a buffer that only its pool list holds."""
    probe = [np.empty(1, dtype=np.uint8)]
    return _refs(probe, 0)


_FREE = _free_refs()


# Every pool, so that a forked child gets fresh locks: one forked while another thread
# held a pool's lock (taking a buffer) would wait for it for ever.
_POOLS: weakref.WeakSet[ResultPool] = weakref.WeakSet()


def _fresh_locks_in_child() -> None:
    for pool in list(_POOLS):
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks_in_child)


def _new_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` (a multiple of 2 MiB) of anonymous memory, huge pages asked for,
    every page faulted in now."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # no THP: 4 KiB pages, still correct
        m.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(m, dtype=np.uint8)
    buf[::4096] = 0  # one write per page faults it (a huge page at its first)
    return buf


class ResultPool:
    """Reusable result buffers, at most `limit` bytes kept."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self._limit = limit
        _POOLS.add(self)

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the buffers kept (held by results or free)."""
        with self._lock:
            return sum(b.nbytes for b in self._bufs)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes`: a view of a free pooled buffer if one fits,
        else of a new one (kept in the pool while within the limit)."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self._limit:
            return _new_buffer(size)[:nbytes]  # never pooled: faulted in outside the lock
        with self._lock:
            # The view is made under the lock: from then on the buffer counts as held.
            best = -1
            for i in range(len(self._bufs)):
                have = self._bufs[i].nbytes
                fits = have >= nbytes and (best < 0 or have < self._bufs[best].nbytes)
                if fits and _refs(self._bufs, i) == _FREE:
                    best = i
            if best >= 0:
                return self._bufs[best][:nbytes]
            self._drop_free(self._limit - size)
            buf = _new_buffer(size)
            if sum(b.nbytes for b in self._bufs) + size <= self._limit:
                self._bufs.append(buf)
            return buf[:nbytes]

    def _drop_free(self, keep: int) -> None:
        """Drops free buffers, largest first, until at most `keep` bytes are kept."""
        total = sum(b.nbytes for b in self._bufs)
        order = sorted(range(len(self._bufs)), key=lambda i: -self._bufs[i].nbytes)
        drop = set()
        for i in order:
            if total <= keep:
                break
            if _refs(self._bufs, i) == _FREE:
                drop.add(i)
                total -= self._bufs[i].nbytes
        self._bufs = [b for i, b in enumerate(self._bufs) if i not in drop]
