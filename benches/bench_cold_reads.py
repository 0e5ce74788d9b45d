#!/usr/bin/env python3
"""Cold-read access patterns, each against O_DIRECT reads of the same file in the same run.

    python benches/bench_cold_reads.py [--mib 256] [--record-kib 256] [--repeat 3] [--dir DIR]

Answers "what would pay for cold gets" without changing the engine: a file of
random bytes laid out like a segment (records of `--record-kib` KiB of payload
plus the 144-byte header and token ids of bench_ttft.py's layout, back to back
after a 32-byte segment header) is read whole, from a cold page cache (fsync +
posix_fadvise(DONTNEED), residency checked with mincore), with:

- records one `preadv` each, 1 thread (the store's one-thread walk);
- the same with 2 and 4 threads, each on a contiguous share (the store's
  reader threads: each range a sequential stream);
- records coalesced into 2 MiB reads (8 records per syscall), 1 and 2 threads;
- `posix_fadvise(WILLNEED)` of the whole file first, then records, 1 thread;
- `posix_fadvise(SEQUENTIAL)` first (a doubled readahead window), then records;
- limits: O_DIRECT 2 MiB into a huge page, 1 and 4 in flight (bench_store.py's).

Python's `os.preadv` releases the GIL, so threads overlap their reads as the
engine's do. O_DIRECT of the records themselves is not measured: they are not
4 KiB-aligned (format v1), so it would mean a bounce copy or format v2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import IO_CHUNK, python_read, python_read_inflight  # noqa: E402
from pagecache import drop_page_cache, mincore_resident  # noqa: E402

SEGMENT_HEADER = 32
RECORD_META = 80 + 16 * 4  # record header + 16 token ids (bench_ttft.py's B=16)


def record_spans(size: int, record: int) -> list[tuple[int, int]]:
    """(offset, length) of every record of a file of `size` bytes."""
    return [(off, record) for off in range(SEGMENT_HEADER, size - record + 1, record)]


def coalesce(spans: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Adjacent spans merged into reads of at most `limit` bytes."""
    out: list[tuple[int, int]] = []
    for off, n in spans:
        if out and out[-1][0] + out[-1][1] == off and out[-1][1] + n <= limit:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def read_spans(path: Path, spans: list[tuple[int, int]], threads: int, advice: int | None) -> int:
    """Reads `spans` of `path`, split into `threads` contiguous shares; bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if advice is not None:
            os.posix_fadvise(fd, 0, 0, advice)
        per = -(-len(spans) // threads)
        done = [0] * threads

        def reader(t: int) -> None:
            buf = bytearray(max(n for _, n in spans))
            for off, n in spans[t * per : (t + 1) * per]:
                done[t] += os.preadv(fd, [memoryview(buf)[:n]], off)

        workers = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(done)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="file size (default 256 MiB)")
    p.add_argument("--record-kib", type=int, default=256, help="payload per record (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="rounds, best kept (default 3)")
    p.add_argument("--dir", help="where the file goes (default $TMPDIR)")
    args = p.parse_args(argv)
    record = args.record_kib * 1024 + RECORD_META
    base = Path(args.dir or tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="kvstore-coldreads-", dir=base) as tmp:
        path = Path(tmp) / "segment.kvseg"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(args.mib // 8):
                f.write(rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
            os.fsync(f.fileno())
        size = path.stat().st_size
        spans = record_spans(size, record)
        big = coalesce(spans, IO_CHUNK)
        seq = os.POSIX_FADV_SEQUENTIAL
        will = os.POSIX_FADV_WILLNEED
        patterns: dict[str, Callable[[], int]] = {
            "O_DIRECT 2 MiB, 1 in flight (limit)": lambda: python_read([path], direct=True)[1],
            "O_DIRECT 2 MiB, 4 in flight (limit)": lambda: python_read_inflight([path])[1],
            "records, 1 thread (one-thread get)": lambda: read_spans(path, spans, 1, None),
            "records, 2 threads (reader threads)": lambda: read_spans(path, spans, 2, None),
            "records, 4 threads": lambda: read_spans(path, spans, 4, None),
            "records coalesced to 2 MiB, 1 thread": lambda: read_spans(path, big, 1, None),
            "records coalesced to 2 MiB, 2 threads": lambda: read_spans(path, big, 2, None),
            "WILLNEED, then records, 1 thread": lambda: read_spans(path, spans, 1, will),
            "SEQUENTIAL, then records, 1 thread": lambda: read_spans(path, spans, 1, seq),
        }
        best: dict[str, float] = {k: float("inf") for k in patterns}
        resident = 0
        for _ in range(args.repeat):
            for name, fn in patterns.items():  # round-robin: bursts of load hit all alike
                drop_page_cache([path], "fadvise")
                resident = max(resident, mincore_resident(path))
                t0 = time.perf_counter()
                n = fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                assert n >= size - record - IO_CHUNK, (name, n, size)
    limit = size / min(best[k] for k in best if k.startswith("O_DIRECT"))
    print(
        f"cold reads of a {size / 2**20:.0f} MiB segment-like file, records of "
        f"{record} B, best of {args.repeat}; at most {resident} B resident before a read; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for name, t in best.items():
        bw = size / t
        print(f"  {name:42s} {bw / 2**30:6.2f} GiB/s  {bw / limit:5.2f}x of best O_DIRECT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
