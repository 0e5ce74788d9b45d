"""The references a storage bench measures the store against, in one place: raw
disk I/O with the store's fsync policies (pwrite, O_DIRECT, dd), reads of the same
files (buffered, O_DIRECT with one or several requests in flight, dd), memory copies
(glibc memcpy, torch copy and clone), and the block device's own counters. Used by
bench_store.py and bench_cold_reads.py."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

MiB = 1 << 20
ALIGN = 2 * MiB  # alignment of every buffer we time copies into / out of
IO_CHUNK = 2 * MiB  # request size of the raw-I/O references (dd bs=2M)

now = time.perf_counter


def total_size(files: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def aligned_empty(nbytes: int, align: int = ALIGN, huge: bool = True) -> np.ndarray:
    """`nbytes` of prefaulted anonymous memory starting on an `align` boundary,
    backed by transparent huge pages when `huge` (madvise MADV_HUGEPAGE; the
    kernel may still use 4 KiB pages) or by 4 KiB pages (MADV_NOHUGEPAGE).
    The array keeps its mapping alive."""
    mm = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mm.madvise(advice)
    full = np.frombuffer(mm, dtype=np.uint8)
    off = (-full.ctypes.data) % align
    a = full[off : off + nbytes]
    a.fill(1)  # fault every page in now, never inside a timed region
    return a


def disk_counters(path: Path) -> tuple[int, int, int] | None:
    """(reads completed, ms spent reading, ms with any request in flight) of the
    block device holding `path` (/sys/dev/block/MAJ:MIN/stat; the whole machine's
    I/O to it, not only this process's), or None where the kernel does not say."""
    dev = os.stat(path).st_dev
    try:
        f = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
        return int(f[0]), int(f[3]), int(f[9])
    except (OSError, IndexError, ValueError):
        return None


def device_use(
    before: tuple[int, int, int] | None, after: tuple[int, int, int] | None, seconds: float
) -> tuple[float, float] | None:
    """(fraction of `seconds` the device had a request in flight, mean ms a read
    took from submission to completion) between two `disk_counters`."""
    if before is None or after is None or seconds <= 0:
        return None
    reads, read_ms, busy_ms = (b - a for a, b in zip(before, after, strict=True))
    return busy_ms / 1e3 / seconds, read_ms / max(reads, 1)


def pwrite_chunks(fd: int, buf: np.ndarray, pos: int) -> int:
    """Writes `buf` at `pos` with pwrite of IO_CHUNK bytes (dd bs=2M); the end."""
    mv = buf.data
    for off in range(0, len(mv), IO_CHUNK):
        pos += os.pwrite(fd, mv[off : off + IO_CHUNK], pos)
    return pos


def raw_write(path: Path, bufs: Sequence[np.ndarray], sync: str) -> float:
    """Seconds to write `bufs` (each one sequence's KV bytes) sequentially to a new
    file with pwrite(2 MiB) through the page cache, then fdatasync: after every
    buffer (`sync="per_seq"`, the policy of durability="sync") or once at the end
    (`sync="end"`, the policy of "batch" + flush). Same bytes as the store's puts."""
    os.sync()
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        pos = 0
        for buf in bufs:
            pos = pwrite_chunks(fd, buf, pos)
            if sync == "per_seq":
                os.fdatasync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return now() - t0


def direct_write(path: Path, bufs: Sequence[np.ndarray]) -> float:
    """Seconds to write `bufs` (2 MiB-aligned, huge-page backed) sequentially to a
    new file with O_DIRECT pwrite of 2 MiB, then one fdatasync (for the file's
    metadata and the device cache). The fastest way this machine writes."""
    os.sync()
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        pos = 0
        for b in bufs:
            pos = pwrite_chunks(fd, b, pos)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return now() - t0


def dd_write(path: Path, nbytes: int, mode: str) -> float:
    """Seconds of `dd if=/dev/zero of=path bs=2M count=N` with `oflag=direct`
    (`mode="direct"`) or `conv=fdatasync` (`mode="fdatasync"`)."""
    flag = {"direct": "oflag=direct", "fdatasync": "conv=fdatasync"}[mode]
    count = nbytes // IO_CHUNK
    os.sync()
    t0 = now()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=2M", f"count={count}", flag, "status=none"],
        check=True,
    )
    return now() - t0


def python_read(files: Sequence[Path], direct: bool, huge: bool = True) -> tuple[float, int]:
    """(seconds, bytes) to read `files` sequentially with preadv of 2 MiB into one
    2 MiB-aligned buffer, one request in flight like the store's reads; with
    O_DIRECT (`direct`) or through the page cache. `huge`: the buffer is one
    huge page (one DMA segment per request) or 512 4 KiB pages."""
    buf = aligned_empty(IO_CHUNK, huge=huge)
    mv = buf.data
    total = 0
    t0 = now()
    for p in files:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            pos = 0
            while True:
                n = os.preadv(fd, [mv], pos)
                if n <= 0:
                    break
                pos += n
                if n < IO_CHUNK:
                    break
            total += pos
        finally:
            os.close(fd)
    return now() - t0, total


def python_read_inflight(files: Sequence[Path], depth: int = 4) -> tuple[float, int]:
    """(seconds, bytes) to read `files` with O_DIRECT preadv of 2 MiB, `depth`
    requests in flight: `depth` threads (preadv releases the GIL), each with its
    own huge-page buffer, taking the next 2 MiB of the files in order. The
    device's best with several requests queued, as the issue asks the cold gets
    to be compared against."""
    import threading

    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files]
    jobs = iter(
        [
            (fd, off)
            for fd, p in zip(fds, files, strict=True)
            for off in range(0, p.stat().st_size, IO_CHUNK)
        ]
    )
    lock = threading.Lock()
    done = [0] * depth
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        mv = aligned_empty(IO_CHUNK).data
        try:
            while True:
                with lock:
                    job = next(jobs, None)
                if job is None:
                    return
                done[i] += os.preadv(job[0], [mv], job[1])
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    try:
        t0 = now()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = now() - t0
    finally:
        for fd in fds:
            os.close(fd)
    if errors:
        raise errors[0]
    return dt, sum(done)


def dd_read(files: Sequence[Path], direct: bool) -> tuple[float, int]:
    """(seconds, bytes) of `dd if=F of=/dev/null bs=2M [iflag=direct]` over `files`."""
    t0 = now()
    for p in files:
        cmd = ["dd", f"if={p}", "of=/dev/null", "bs=2M", "status=none"]
        if direct:
            cmd.append("iflag=direct")
        subprocess.run(cmd, check=True)
    return now() - t0, total_size(files)


def torch_clone(srcs: Sequence[torch.Tensor]) -> float:
    """Seconds of Tensor.clone() (fresh memory from torch's allocator, then a copy):
    what a get() that allocates its result pays besides reading."""
    t0 = now()
    for s in srcs:
        c = s.clone()
        del c
    return now() - t0


def memcpy(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> float:
    """Seconds of numpy.copyto (glibc memcpy, one thread) of each src into its dst."""
    t0 = now()
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)
    return now() - t0


def torch_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> float:
    """Seconds of torch Tensor.copy_ (may use every intra-op thread)."""
    t0 = now()
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s)
    return now() - t0
