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

With `--direct-replay`, the requests a get with direct reads on could issue
over a format-v2 segment (records of a 4 KiB head and a 2 MiB payload, back to
back from offset 4096, so not 2 MiB-aligned on disk), all `O_DIRECT` into
huge-page buffers, each in flight count one thread per request:

- (a) one stream of whole records in file order, 1 and 2 in flight;
- (b) two streams (a get's two reader threads: contiguous halves) x 2;
- (c) 2 and 4 adjacent records coalesced into one request, 1 and 2 in flight;
- (d) plain 2 MiB requests aligned to 2 MiB on disk vs shifted by 4 KiB;
- (e) whole records read straight into a get's destination: the head into a
  buffer of its own and the payload scattered into 64 runs of 32 KiB, 2 MiB
  apart (a block's share of each layer's K or V in a `[L, 2, T, H, D]` tensor
  of bench_store.py's layout), 1 stream x 1 and x 2, 4 streams x 1 (the
  engine's direct reads with `KVSTORE_READ_DEPTH=0`); against (a) and (b),
  which read the same records into one buffer (the engine's queued reads,
  which then copy the payload out).

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
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagecache import drop_page_cache, mincore_resident  # noqa: E402
from peers import IO_CHUNK, aligned_empty, python_read, python_read_inflight  # noqa: E402

SEGMENT_HEADER = 32
V2_HEAD = 4096  # format v2: a record's head pads its payload to 4 KiB
RECORD_META = 80 + 16 * 4  # record header + 16 token ids (bench_ttft.py's B=16)
V2_RECORD = V2_HEAD + (2 << 20)  # a replayed record: its head, then a 2 MiB payload


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


def run_threads(fn: Callable[[int], None], args: Iterable[int]) -> None:
    """Runs `fn(a)` for every `a` of `args`, each on its own thread, all at once;
    raises the first error a thread raised."""
    errors: list[BaseException] = []

    def run(a: int) -> None:
        try:
            fn(a)
        except BaseException as e:  # noqa: BLE001 - raised again below, on the caller's thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(a,)) for a in args]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def read_exactly(fd: int, bufs: list[memoryview], off: int) -> int:
    """`os.preadv` that must fill `bufs` (every request here lies inside the file)."""
    want = sum(len(b) for b in bufs)
    got = os.preadv(fd, bufs, off)
    if got != want:
        raise RuntimeError(f"read {got} of {want} bytes at {off}")
    return got


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
                done[t] += read_exactly(fd, [memoryview(buf)[:n]], off)

        run_threads(reader, range(threads))
        return sum(done)
    finally:
        os.close(fd)


PLANES = 64  # a block's runs in a [L, 2, T, H, D] destination of bench_store.py's layout
MAX_THREADS = 8  # the most threads a replay pattern runs (4 streams x 2)


class Buffers:
    """Every buffer the replay's reader threads read into, made (and every page
    faulted in) once, before anything is timed: one huge-page buffer per thread
    for whole requests of up to `largest` bytes, and for the scattered reads a
    head buffer and a destination of PLANES planes of IO_CHUNK per thread."""

    def __init__(self, largest: int, scatter_threads: int) -> None:
        self.whole = [aligned_empty(largest).data for _ in range(MAX_THREADS)]
        self.heads = [aligned_empty(V2_HEAD).data for _ in range(scatter_threads)]
        self.dests = [aligned_empty(PLANES * IO_CHUNK) for _ in range(scatter_threads)]


def direct_streams(
    path: Path,
    streams: list[list[tuple[int, int]]],
    depth: int,
    bufs: Buffers,
    scatter: bool = False,
) -> int:
    """Reads every stream of (offset, length) requests with O_DIRECT, each
    stream in order with `depth` requests in flight (one thread per request,
    each with its own huge-page buffer of `bufs`, taking the stream's next
    request); the streams at once. `scatter`: each request is a v2 record (a
    head of V2_HEAD bytes, then 2 MiB), its head read into a buffer and its
    payload into PLANES runs, 2 MiB apart, of a destination of the thread's
    own, each record at the next run of every plane. Bytes read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        lock = threading.Lock()
        jobs = [iter(s) for s in streams]
        done: list[int] = []
        run = IO_CHUNK // PLANES

        def reader(t: int) -> None:
            stream = t // depth
            got = 0
            k = 0
            while True:
                with lock:
                    job = next(jobs[stream], None)
                if job is None:
                    break
                if scatter:
                    dest, at = bufs.dests[t], (k % PLANES) * run
                    k += 1
                    runs = [dest[p * IO_CHUNK + at :][:run].data for p in range(PLANES)]
                    got += read_exactly(fd, [bufs.heads[t], *runs], job[0])
                else:
                    got += read_exactly(fd, [bufs.whole[t][: job[1]]], job[0])
            with lock:
                done.append(got)

        run_threads(reader, range(len(streams) * depth))
        return sum(done)
    finally:
        os.close(fd)


def replay_patterns(path: Path, size: int, bufs: Buffers) -> dict[str, Callable[[], int]]:
    """The direct-read request patterns of `--direct-replay` over `path`, each
    reading into `bufs` (made for records of V2_RECORD, up to 4 a request)."""
    rec = V2_RECORD
    records = [(off, rec) for off in range(V2_HEAD, size - rec + 1, rec)]
    half = len(records) // 2
    q = -(-len(records) // 4)
    quarters = [records[i : i + q] for i in range(0, len(records), q)]
    aligned = [(off, IO_CHUNK) for off in range(0, size - IO_CHUNK + 1, IO_CHUNK)]
    shifted = [(off + V2_HEAD, n) for off, n in aligned[:-1]]
    pats: dict[str, Callable[[], int]] = {
        "(d) O_DIRECT 2 MiB aligned, 1 in flight": lambda: direct_streams(path, [aligned], 1, bufs),
        "(d) O_DIRECT 2 MiB aligned, 2 in flight": lambda: direct_streams(path, [aligned], 2, bufs),
        "(d) O_DIRECT 2 MiB shifted 4K, 1 in flight": lambda: direct_streams(
            path, [shifted], 1, bufs
        ),
        "(a) records, 1 stream x 1": lambda: direct_streams(path, [records], 1, bufs),
        "(a) records, 1 stream x 2": lambda: direct_streams(path, [records], 2, bufs),
        "(b) records, 2 streams (halves) x 2": lambda: direct_streams(
            path, [records[:half], records[half:]], 2, bufs
        ),
        "(b) records, 2 streams (halves) x 1": lambda: direct_streams(
            path, [records[:half], records[half:]], 1, bufs
        ),
        "(b) records, 4 streams (quarters) x 2": lambda: direct_streams(path, quarters, 2, bufs),
        "(b) records, 4 streams (quarters) x 1": lambda: direct_streams(path, quarters, 1, bufs),
        "(e) records scattered, 1 stream x 1": lambda: direct_streams(
            path, [records], 1, bufs, True
        ),
        "(e) records scattered, 1 stream x 2": lambda: direct_streams(
            path, [records], 2, bufs, True
        ),
        "(e) records scattered, 4 streams x 1": lambda: direct_streams(
            path, quarters, 1, bufs, True
        ),
    }
    for k in (2, 4):
        big = coalesce(records, k * rec)
        for depth in (1, 2):
            pats[f"(c) {k} records a request, x {depth}"] = lambda big=big, depth=depth: (
                direct_streams(path, [big], depth, bufs)
            )
    return pats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="file size (default 256 MiB)")
    p.add_argument("--record-kib", type=int, default=256, help="payload per record (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="rounds, best kept (default 3)")
    p.add_argument("--dir", help="where the file goes (default $TMPDIR)")
    p.add_argument(
        "--direct-replay",
        action="store_true",
        help="replay a direct-read get's request patterns over a v2-like segment instead",
    )
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
        patterns: dict[str, Callable[[], int]] = (
            {}
            if args.direct_replay
            else {
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
        )
        if args.direct_replay:
            limit4 = "O_DIRECT 2 MiB, 4 in flight (limit)"
            patterns[limit4] = lambda: python_read_inflight([path])[1]
            bufs = Buffers(4 * V2_RECORD, scatter_threads=4)
            patterns.update(replay_patterns(path, size, bufs))
        best: dict[str, float] = {k: float("inf") for k in patterns}
        resident = 0
        for _ in range(args.repeat):
            for name, fn in patterns.items():  # round-robin: bursts of load hit all alike
                drop_page_cache([path], "fadvise")
                resident = max(resident, mincore_resident(path))
                t0 = time.perf_counter()
                n = fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                assert n >= size - max(record, V2_HEAD) - 2 * IO_CHUNK, (name, n, size)
    limit = size / min(best[k] for k in best if "O_DIRECT" in k)
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
