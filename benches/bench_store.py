#!/usr/bin/env python3
"""kvstore benchmarks, each figure next to the physical limit measured in the same run.

    python benches/bench_store.py [--size-gib 1.0] [--dir DIR] [--json OUT]

One run writes the same data (default 1 GiB of random bfloat16 KV in a
Llama-3-8B-like layout: L=32, H=8, D=128, B=16, so 2 MiB per block, 512 blocks,
8192 tokens, put as sequences of 64 blocks) and measures:

1. durable put throughput (durability="sync"; durability="batch" + flush())
   against raw sequential writes of the same bytes on the same file system with
   the same fsync policy;
2. get throughput from a cold page cache against O_DIRECT reads of the
   segment files;
3. get throughput from a warm page cache against memcpy of the same bytes;
4. lookup of a 128K-token sequence (tiny layout, 8192 stored blocks);
5. Compression (zstd over byte planes, and the exponent-plane codec): put and warm
   get throughput and ratio on random and on KV-like bf16.

Every ratio is product / limit (higher is better). See benches/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvstore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagecache import drop_page_cache, resident_bytes  # noqa: E402
from peers import (  # noqa: E402
    aligned_empty,
    dd_read,
    dd_write,
    device_use,
    direct_write,
    disk_counters,
    memcpy,
    python_read,
    python_read_inflight,
    raw_write,
    torch_clone,
    torch_copy,
    total_size,
)

MiB = 1 << 20
GiB = 1 << 30
MODEL = "bench/llama-3-8b-like@0"
BIG = kvstore.Layout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
TINY = kvstore.Layout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_size=16)

now = time.perf_counter


# ---------------------------------------------------------------- results


@dataclass
class Row:
    """One line of the table. `ratio` is value / limit for throughputs."""

    section: str
    what: str
    value: float
    unit: str  # "GiB/s", "ms", "x"
    limit: float | None = None
    limit_what: str = ""
    target: float | None = None
    target_kind: str = ""  # "ratio>=" (ratio at least), "value<=" (value at most), "" (info)
    note: str = ""
    samples: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.limit is None or not self.limit:
            return None
        return self.value / self.limit

    @property
    def passed(self) -> bool | None:
        if self.target_kind == "ratio>=" and self.ratio is not None and self.target is not None:
            return self.ratio >= self.target
        if self.target_kind == "value<=" and self.target is not None:
            return self.value <= self.target
        return None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["passed"] = self.passed
        return d


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def get(self, what: str) -> Row:
        for r in self.rows:
            if r.what == what:
                return r
        raise KeyError(what)


def gibps(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / seconds


# ---------------------------------------------------------------- data


@dataclass
class Seq:
    """One sequence: its token ids and its contiguous [L, 2, T, H, D] KV."""

    tokens: np.ndarray  # uint32
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def raw(self) -> np.ndarray:
        """The KV as a flat uint8 view (no copy)."""
        return self.kv.reshape(-1).view(torch.uint8).numpy()


def as_kv(buf: np.ndarray, layout: kvstore.Layout, tokens: int) -> torch.Tensor:
    """A [L, 2, tokens, H, D] tensor of the layout's dtype over `buf` (no copy)."""
    dtype = getattr(torch, layout.dtype)
    return torch.from_numpy(buf).view(dtype).view(layout.kv_shape(tokens))


def plan_blocks(size_gib: float, layout: kvstore.Layout, blocks_per_seq: int) -> list[int]:
    """Blocks of each sequence: `size_gib` of KV split into sequences of `blocks_per_seq`."""
    total = max(1, int(size_gib * GiB) // layout.block_bytes)
    full, rest = divmod(total, blocks_per_seq)
    return [blocks_per_seq] * full + ([rest] if rest else [])


def make_seqs(layout: kvstore.Layout, blocks: Sequence[int], kind: str, seed: int = 0) -> list[Seq]:
    """`kind`: "random" (uniformly random 16-bit patterns: incompressible) or
    "kvlike" (randn * 0.05 rounded to bf16: narrow exponent range, like real K/V)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    b = layout.block_size
    seqs = []
    start = 0
    for n in blocks:
        t = n * b
        # Distinct token ids per sequence, so no block is shared (deduped) between them.
        tokens = np.arange(start, start + t, dtype=np.uint32)
        start += t
        shape = layout.kv_shape(t)
        if kind == "random":
            bits = rng.integers(0, 1 << 16, size=math.prod(shape), dtype=np.uint16)
            kv = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).view(shape)
        elif kind == "kvlike":
            kv = (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.05).to(torch.bfloat16)
        else:
            raise ValueError(kind)
        seqs.append(Seq(tokens, kv.contiguous()))
    return seqs


# ---------------------------------------------------------------- files / cache


def store_files(store_dir: Path) -> tuple[list[Path], list[Path]]:
    """(segment files, index files) of a store directory."""
    segs = sorted((store_dir / "segments").glob("*.kvseg"))
    idx = sorted(p for p in (store_dir / "index").iterdir() if p.is_file())
    return segs, idx


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------- store operations


def open_store(path: Path, layout: kvstore.Layout, **kw: Any) -> kvstore.Store:
    return kvstore.open(path, layout=layout, model=MODEL, **kw)


def put_all(
    path: Path,
    layout: kvstore.Layout,
    seqs: Sequence[Seq],
    durability: str,
    compression: str | None = None,
) -> tuple[float, dict[str, Any]]:
    """(seconds, stats) to put every sequence (one put each) into a new store at
    `path`, then flush(). Opening the store is not timed; the flush is."""
    st = open_store(path, layout, durability=durability, compression=compression)
    try:
        os.sync()
        t0 = now()
        for s in seqs:
            n = st.put(s.tokens, s.kv)
            if n != len(s.tokens):
                raise RuntimeError(f"put covered {n} of {len(s.tokens)} tokens")
        st.flush()
        dt = now() - t0
        stats = st.stats()
    finally:
        st.close()
    want = sum(len(s.tokens) for s in seqs) // layout.block_size
    if stats["blocks"] != want:
        raise RuntimeError(f"store holds {stats['blocks']} blocks, expected {want}")
    return dt, stats


def get_into(st: kvstore.Store, seqs: Sequence[Seq], outs: Sequence[torch.Tensor]) -> float:
    """Seconds of get(tokens, out=preallocated) for every sequence."""
    t0 = now()
    for s, o in zip(seqs, outs, strict=True):
        n = st.get(s.tokens, out=o)
        if n != len(s.tokens):
            raise RuntimeError(f"get served {n} of {len(s.tokens)} tokens")
    return now() - t0


def get_alloc(st: kvstore.Store, seqs: Sequence[Seq]) -> float:
    """Seconds of get(tokens) (the store allocates the result) for every sequence."""
    t0 = now()
    for s in seqs:
        kv = st.get(s.tokens)
        if kv.shape[2] != len(s.tokens):
            raise RuntimeError(f"get served {kv.shape[2]} of {len(s.tokens)} tokens")
        del kv
    return now() - t0


def check_equal(seqs: Sequence[Seq], outs: Sequence[torch.Tensor]) -> None:
    """Bit-exact round trip (compares bytes, so NaN patterns count as equal)."""
    for s, o in zip(seqs, outs, strict=True):
        if not np.array_equal(s.raw(), o.reshape(-1).view(torch.uint8).numpy()):
            raise RuntimeError("get returned different bytes than put stored")


def lookup_bench(root: Path, n_tokens: int = 131072, runs: int = 20) -> dict[str, Any]:
    """Median seconds of lookup() of `n_tokens` tokens on a TINY-layout store that
    holds all of them (hash every block + one probe per block), repeated on one
    handle ("hit") and as the first call of a freshly opened handle ("hit_fresh"),
    on an empty store (hash every block + 1 probe: a miss stops the walk), and
    from a Python list instead of a uint32 array (adds the list conversion)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128256, size=n_tokens, dtype=np.uint32)
    kv = torch.zeros(TINY.kv_shape(n_tokens), dtype=torch.bfloat16)
    res: dict[str, Any] = {"tokens": n_tokens, "blocks": n_tokens // TINY.block_size}

    def median_of(fn: Callable[[], int], want: int) -> tuple[float, list[float]]:
        for _ in range(3):
            fn()
        times = []
        for _ in range(runs):
            t0 = now()
            got = fn()
            times.append(now() - t0)
            if got != want:
                raise RuntimeError(f"lookup returned {got}, expected {want}")
        return statistics.median(times), times

    full = n_tokens // TINY.block_size * TINY.block_size
    with open_store(root / "lookup-full", TINY, durability="none") as st:
        if st.put(tokens, kv) != full:
            raise RuntimeError("lookup store: put did not cover every block")
        st.flush()
        res["stored_blocks"] = st.stats()["blocks"]
        res["hit"], res["hit_samples"] = median_of(lambda: st.lookup(tokens), full)
        as_list = tokens.tolist()
        res["hit_list"], res["hit_list_samples"] = median_of(lambda: st.lookup(as_list), full)
    # The first lookup on a newly opened handle: every probe goes to LMDB (a
    # handle may cache the locations it has seen; the index pages are in the
    # page cache).
    fresh = []
    for _ in range(runs):
        with open_store(root / "lookup-full", TINY, durability="none") as st:
            t0 = now()
            got = st.lookup(tokens)
            fresh.append(now() - t0)
            if got != full:
                raise RuntimeError(f"lookup returned {got}, expected {full}")
    res["hit_fresh"], res["hit_fresh_samples"] = statistics.median(fresh), fresh
    with open_store(root / "lookup-empty", TINY, durability="none") as st:
        res["miss"], res["miss_samples"] = median_of(lambda: st.lookup(tokens), 0)
    return res


# ---------------------------------------------------------------- the benchmark


def best(samples: Sequence[float]) -> float:
    return min(samples)


def machine_info(tmp: Path) -> dict[str, Any]:
    so = Path(kvstore._lib.__file__)  # type: ignore[attr-defined]
    try:
        rev = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        rev = ""
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    work = Path("/work")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "kvstore": kvstore.__version__,
        "git_rev": rev,
        "engine_so": str(so),
        "engine_so_md5": hashlib.md5(so.read_bytes()).hexdigest(),
        "engine_so_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(so.stat().st_mtime)),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "bench_dir": str(tmp),
        "bench_dir_dev": os.stat(tmp).st_dev,
        "work_dev": os.stat(work).st_dev if work.exists() else None,
        "same_fs_as_work": work.exists() and os.stat(tmp).st_dev == os.stat(work).st_dev,
    }


@contextlib.contextmanager
def stage(name: str, quiet: bool) -> Iterator[None]:
    t0 = now()
    if not quiet:
        print(f"  {name} ...", end="", flush=True, file=sys.stderr)
    yield
    if not quiet:
        print(f" {now() - t0:.1f}s", file=sys.stderr)


def run(
    size_gib: float = 1.0,
    base_dir: str | None = None,
    repeat: int = 3,
    warm_runs: int = 5,
    blocks_per_seq: int = 64,
    lookup_tokens: int = 131072,
    lookup_runs: int = 20,
    cold_method: str = "auto",
    compression: bool = True,
    quiet: bool = False,
    restore_tokens: int = 4096,
    only_compression: bool = False,
) -> Results:
    """Runs every measurement and returns the rows. Cleans up its temp dir.
    `only_compression`: the compression rows and their peers (puts, warm gets) only."""
    base = Path(base_dir) if base_dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=base))
    res = Results()
    try:
        _run(
            res,
            tmp,
            size_gib,
            repeat,
            warm_runs,
            blocks_per_seq,
            lookup_tokens,
            lookup_runs,
            cold_method,
            compression,
            quiet,
            restore_tokens,
            only_compression,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


@dataclass
class _Bench:
    """What the row groups share: the results, the temp dir, the options, the data
    and the buffers gets fill."""

    res: Results
    tmp: Path
    repeat: int
    warm_runs: int
    blocks_per_seq: int
    cold_method: str
    quiet: bool
    blocks: list[int]
    nbytes: int
    seqs: list[Seq]
    # The same bytes in 2 MiB-aligned huge-page buffers: the source of the
    # O_DIRECT write reference and of the memcpy reference.
    staging: list[np.ndarray]
    have_dd: bool = field(default_factory=lambda: shutil.which("dd") is not None)
    notes: list[str] = field(default_factory=list)
    # Where the sync puts go; the gets read it.
    read_store: Path = field(init=False)
    outs_raw: list[np.ndarray] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.read_store = self.tmp / "store-sync"


def _run(
    res: Results,
    tmp: Path,
    size_gib: float,
    repeat: int,
    warm_runs: int,
    blocks_per_seq: int,
    lookup_tokens: int,
    lookup_runs: int,
    cold_method: str,
    compression: bool,
    quiet: bool,
    restore_tokens: int,
    only_compression: bool = False,
) -> None:
    b = _prepare(res, tmp, size_gib, repeat, warm_runs, blocks_per_seq, cold_method, quiet)
    put_batch = _put_rows(b)
    segs, idx = store_files(b.read_store)
    b.outs_raw = [aligned_empty(s.nbytes) for s in b.seqs]
    b.outs = [as_kv(o, BIG, len(s.tokens)) for o, s in zip(b.outs_raw, b.seqs, strict=True)]
    with open_store(b.read_store, BIG, durability="sync") as st:
        if not only_compression:
            _cold_get_rows(b, st, segs, idx)
        warm_get_out = _warm_get_rows(b, st, segs)
    b.staging = []
    gc.collect()
    res.meta["notes"] = b.notes
    res.meta["loadavg_after_gets"] = os.getloadavg()
    rm(b.read_store)
    os.sync()
    if restore_tokens and not only_compression:
        _restore_rows(b, restore_tokens)
    if not only_compression:
        _lookup_rows(b, lookup_tokens, lookup_runs)
    if compression:
        _compression_rows(b, put_batch, warm_get_out)


def _prepare(
    res: Results,
    tmp: Path,
    size_gib: float,
    repeat: int,
    warm_runs: int,
    blocks_per_seq: int,
    cold_method: str,
    quiet: bool,
) -> _Bench:
    """Records the machine and the plan in `res.meta`, checks the free space and
    generates the data."""
    meta = res.meta
    meta.update(machine_info(tmp))
    meta["loadavg_start"] = os.getloadavg()
    blocks = plan_blocks(size_gib, BIG, blocks_per_seq)
    nbytes = sum(blocks) * BIG.block_bytes
    meta.update(
        layout=asdict(BIG),
        blocks=sum(blocks),
        sequences=len(blocks),
        blocks_per_seq=blocks_per_seq,
        tokens=sum(blocks) * BIG.block_size,
        kv_bytes=nbytes,
        repeat=repeat,
        warm_runs=warm_runs,
    )
    free = shutil.disk_usage(tmp).free
    if free < 2.5 * nbytes + GiB:
        raise SystemExit(
            f"need about {2.5 * nbytes / GiB:.1f} GiB free in {tmp}, have {free / GiB:.1f}"
        )
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    say(
        f"kvstore bench: {nbytes / GiB:.3f} GiB = {sum(blocks)} blocks of "
        f"{BIG.block_bytes / MiB:.0f} MiB in {len(blocks)} sequences, in {tmp}"
    )

    with stage("generating random bf16 KV", quiet):
        seqs = make_seqs(BIG, blocks, "random", seed=0)
        staging = [aligned_empty(s.nbytes) for s in seqs]
        for buf, s in zip(staging, seqs, strict=True):
            np.copyto(buf, s.raw())
    return _Bench(
        res,
        tmp,
        repeat,
        warm_runs,
        blocks_per_seq,
        cold_method,
        quiet,
        blocks,
        nbytes,
        seqs,
        staging,
    )


def _put_rows(b: _Bench) -> float:
    """1. Durable puts vs raw writes: the raw-write limits, then the put rows.
    Leaves the sync puts' store in `b.read_store`; returns the batch put's GiB/s."""
    res, tmp, quiet, repeat, seqs, nbytes = b.res, b.tmp, b.quiet, b.repeat, b.seqs, b.nbytes
    blocks_per_seq = b.blocks_per_seq
    raw_file = tmp / "raw.bin"
    w: dict[str, list[float]] = {
        k: []
        for k in (
            "raw_per_seq",
            "raw_end",
            "odirect",
            "dd_direct",
            "dd_fdatasync",
            "put_sync",
            "put_batch",
        )
    }
    put_stats: dict[str, Any] = {}
    for r in range(repeat):
        # Interleaved, so drift of the (virtual) disk hits product and limit alike.
        tag = f"[{r + 1}/{repeat}]"
        with stage(f"{tag} raw write, fdatasync per {blocks_per_seq} blocks", quiet):
            w["raw_per_seq"].append(raw_write(raw_file, [q.raw() for q in seqs], "per_seq"))
        rm(raw_file)
        rm(b.read_store)
        with stage(f"{tag} put durability=sync", quiet):
            t, put_stats = put_all(b.read_store, BIG, seqs, "sync")
            w["put_sync"].append(t)
        with stage(f"{tag} raw write, fdatasync at end", quiet):
            w["raw_end"].append(raw_write(raw_file, [q.raw() for q in seqs], "end"))
        rm(raw_file)
        with stage(f"{tag} put durability=batch + flush", quiet):
            w["put_batch"].append(put_all(tmp / "store-batch", BIG, seqs, "batch")[0])
        rm(tmp / "store-batch")
        with stage(f"{tag} raw write, O_DIRECT from huge pages", quiet):
            try:
                w["odirect"].append(direct_write(raw_file, b.staging))
            except OSError as e:  # e.g. tmpfs: no O_DIRECT
                if r == 0:
                    b.notes.append(f"O_DIRECT write unavailable in {tmp}: {e}")
        rm(raw_file)
        if b.have_dd:
            for mode in ("direct", "fdatasync"):
                with stage(
                    f"{tag} dd {'oflag=direct' if mode == 'direct' else 'conv=fdatasync'}", quiet
                ):
                    try:
                        w[f"dd_{mode}"].append(dd_write(raw_file, nbytes, mode))
                    except subprocess.CalledProcessError as e:
                        if r == 0:
                            b.notes.append(f"dd {mode} failed: {e}")
                rm(raw_file)
    os.sync()
    res.meta["put_sync_stats"] = put_stats

    def bw(key: str) -> float:
        return gibps(nbytes, best(w[key])) if w[key] else 0.0

    L = "limits"
    res.add(
        Row(
            L,
            f"raw write: pwrite 2 MiB + fdatasync every {blocks_per_seq} blocks "
            "(Python, same bytes)",
            bw("raw_per_seq"),
            "GiB/s",
            samples=w["raw_per_seq"],
        )
    )
    res.add(
        Row(
            L,
            "raw write: pwrite 2 MiB + one fdatasync at the end (Python, same bytes)",
            bw("raw_end"),
            "GiB/s",
            samples=w["raw_end"],
        )
    )
    if w["odirect"]:
        res.add(
            Row(
                L,
                "raw write: O_DIRECT pwrite 2 MiB from huge pages + fdatasync (Python)",
                bw("odirect"),
                "GiB/s",
                samples=w["odirect"],
            )
        )
    if w["dd_direct"]:
        res.add(
            Row(
                L,
                "raw write: dd if=/dev/zero bs=2M oflag=direct (no fsync)",
                bw("dd_direct"),
                "GiB/s",
                samples=w["dd_direct"],
            )
        )
    if w["dd_fdatasync"]:
        res.add(
            Row(
                L,
                "raw write: dd if=/dev/zero bs=2M conv=fdatasync",
                bw("dd_fdatasync"),
                "GiB/s",
                samples=w["dd_fdatasync"],
            )
        )
    lim_sync = bw("raw_per_seq")
    lim_batch = max(bw("raw_per_seq"), bw("raw_end"), bw("dd_fdatasync"))
    lim_any = max(bw(k) for k in ("raw_per_seq", "raw_end", "odirect", "dd_direct", "dd_fdatasync"))

    P = "put"
    res.add(
        Row(
            P,
            f"put, durability=sync, 1 put per {blocks_per_seq} blocks",
            bw("put_sync"),
            "GiB/s",
            lim_sync,
            f"pwrite + fdatasync every {blocks_per_seq} blocks (same policy)",
            0.8,
            "ratio>=",
            samples=w["put_sync"],
        )
    )
    res.add(
        Row(
            P,
            "put, durability=batch, then flush() (timed)",
            bw("put_batch"),
            "GiB/s",
            lim_batch,
            "best buffered write + fdatasync (Python per-seq / at end, dd conv=fdatasync)",
            0.8,
            "ratio>=",
            samples=w["put_batch"],
        )
    )
    res.add(
        Row(
            P,
            "put, durability=sync  vs the fastest raw write",
            bw("put_sync"),
            "GiB/s",
            lim_any,
            "best raw write of any kind (incl. O_DIRECT)",
            note="info",
        )
    )
    return bw("put_batch")


def _cold_get_rows(b: _Bench, st: kvstore.Store, segs: list[Path], idx: list[Path]) -> None:
    """2. Cold reads vs O_DIRECT reads of `st`'s segment files `segs` (`idx`: its
    index files, also evicted from the page cache): the raw-read limits, then the
    cold get rows."""
    res, quiet, repeat, seqs, nbytes = b.res, b.quiet, b.repeat, b.seqs, b.nbytes
    meta = res.meta
    seg_bytes = total_size(segs)
    meta["segments"] = len(segs)
    meta["segment_bytes"] = seg_bytes
    rd: dict[str, list[float]] = {
        k: []
        for k in (
            "odirect_huge",
            "odirect_4k",
            "odirect_inflight",
            "buffered",
            "dd_direct",
            "dd_buffered",
            "get_cold",
            "get_cold_direct",
            "get_cold_direct_sync",
        )
    }
    cold: list[dict[str, Any]] = []
    cpu: dict[str, list[float]] = {
        k: [] for k in ("get_cold", "get_cold_direct", "get_cold_direct_sync")
    }
    # How busy the device was during each cold get, and how long its reads took:
    # a get below the limit with the device idle part of the time is losing
    # between requests (its threads' CPU work, their wait for a core), one with
    # the device busy and slow reads is issuing a pattern the device serves badly.
    dev: dict[str, list[tuple[float, float]]] = {k: [] for k in cpu}
    dev["odirect_huge"] = []
    # The same store through a handle whose reads use O_DIRECT where the page
    # cache misses (the default only with a hot tier, which `st` has not; each
    # reader thread keeps 2 reads in flight through io_uring), and one that
    # makes them one at a time (KVSTORE_READ_DEPTH=0), alternated with the
    # product's in each round.
    os.environ["KVSTORE_DIRECT_READS"] = "1"
    try:
        st_direct = open_store(st.path, BIG, durability="sync")
        os.environ["KVSTORE_READ_DEPTH"] = "0"
        st_direct_sync = open_store(st.path, BIG, durability="sync")
    finally:
        del os.environ["KVSTORE_DIRECT_READS"]
        os.environ.pop("KVSTORE_READ_DEPTH", None)

    def cold_read(key: str, fn: Callable[[], tuple[float, int]]) -> None:
        drop_page_cache(segs + idx, b.cold_method)
        d0 = disk_counters(segs[0])
        try:
            t, n = fn()
        except (OSError, subprocess.CalledProcessError) as e:
            b.notes.append(f"{key} read unavailable: {e}")
            return
        rd[key].append(gibps(n, t))
        use = device_use(d0, disk_counters(segs[0]), t)
        if key in dev and use is not None:
            dev[key].append(use)

    for r in range(repeat):
        tag = f"[{r + 1}/{repeat}]"
        with stage(f"{tag} cold raw reads of the segment files", quiet):
            cold_read("odirect_huge", lambda: python_read(segs, direct=True, huge=True))
            cold_read("odirect_4k", lambda: python_read(segs, direct=True, huge=False))
            cold_read("odirect_inflight", lambda: python_read_inflight(segs))
            cold_read("buffered", lambda: python_read(segs, direct=False))
            if b.have_dd:
                cold_read("dd_direct", lambda: dd_read(segs, direct=True))
                cold_read("dd_buffered", lambda: dd_read(segs, direct=False))
        for key, handle in (
            ("get_cold", st),
            ("get_cold_direct", st_direct),
            ("get_cold_direct_sync", st_direct_sync),
        ):
            with stage(f"{tag} cold get(out=) ({key})", quiet):
                for o in b.outs_raw:
                    o.fill(0)
                method = drop_page_cache(segs + idx, b.cold_method)
                before, tool = resident_bytes(segs)
                d0 = disk_counters(segs[0])
                c0 = time.process_time()
                t = get_into(handle, seqs, b.outs)
                cpu[key].append((time.process_time() - c0) / t)
                use = device_use(d0, disk_counters(segs[0]), t)
                if use is not None:
                    dev[key].append(use)
                after, _ = resident_bytes(segs)
                rd[key].append(gibps(nbytes, t))
                cold.append(
                    {
                        "get": key,
                        "method": method,
                        "tool": tool,
                        "resident_before": before,
                        "resident_after": after,
                        "segment_bytes": seg_bytes,
                    }
                )
            check_equal(seqs, b.outs)
    # Warm (the buffered handle's gets left every page cached): the page-cache
    # check each direct-capable read makes (cachestat) against none.
    warm: dict[str, list[float]] = {"get_cold": [], "get_cold_direct": []}
    with stage("warm get(out=), direct reads on / off", quiet):
        for _ in range(max(b.warm_runs, 1)):
            for key, handle in (("get_cold", st), ("get_cold_direct", st_direct)):
                warm[key].append(gibps(nbytes, get_into(handle, seqs, b.outs)))
    check_equal(seqs, b.outs)
    st_direct.close()
    st_direct_sync.close()
    meta["cold_cache"] = cold
    meta["cold_method"] = cold[-1]["method"]
    meta["cold_verified_by"] = cold[-1]["tool"]
    meta["cold_resident_before_max"] = max(c["resident_before"] for c in cold)
    meta["cold_get_cpu_busy"] = cpu["get_cold"]
    meta["cold_get_direct_cpu_busy"] = cpu["get_cold_direct"]
    meta["cold_get_direct_sync_cpu_busy"] = cpu["get_cold_direct_sync"]
    meta["cold_device_busy_read_ms"] = dev

    def device_note(key: str) -> str:
        """The median device use of `key`'s cold reads, for a row's note."""
        if not dev[key]:
            return ""
        busy = statistics.median(u[0] for u in dev[key])
        ms = statistics.median(u[1] for u in dev[key])
        ref = dev["odirect_huge"]
        peer = (
            f" (the O_DIRECT 1-in-flight read: {100 * statistics.median(u[0] for u in ref):.0f}%, "
            f"{statistics.median(u[1] for u in ref):.2f} ms)"
            if ref
            else ""
        )
        return f"; device busy {100 * busy:.0f}% of the time, a read {ms:.2f} ms{peer}"

    def rmax(key: str) -> float:
        return max(rd[key], default=0.0)

    L = "limits"
    for key, label in (
        ("odirect_huge", "O_DIRECT preadv 2 MiB into a huge page (Python)"),
        ("odirect_4k", "O_DIRECT preadv 2 MiB into 4 KiB pages (Python)"),
        ("odirect_inflight", "O_DIRECT preadv 2 MiB, 4 in flight, huge pages (Python threads)"),
        ("dd_direct", "dd bs=2M iflag=direct"),
        ("buffered", "buffered preadv 2 MiB, kernel readahead (Python)"),
        ("dd_buffered", "dd bs=2M, buffered"),
    ):
        if rd[key]:
            res.add(
                Row(
                    L,
                    f"raw read, cold: {label}, segment files",
                    rmax(key),
                    "GiB/s",
                    samples=rd[key],
                )
            )
    lim_cold = max(
        rmax("odirect_huge"), rmax("odirect_4k"), rmax("odirect_inflight"), rmax("dd_direct")
    )
    lim_buffered = max(rmax("buffered"), rmax("dd_buffered"))
    cold_ok = meta["cold_resident_before_max"] <= 0.01 * seg_bytes
    G = "get"
    res.add(
        Row(
            G,
            "get(out=), cold page cache",
            rmax("get_cold"),
            "GiB/s",
            lim_cold,
            "best O_DIRECT read of the segment files (1 or 4 in flight)",
            0.9,
            "ratio>=",
            note=f"cache emptied with {meta['cold_method']}, checked with "
            f"{meta['cold_verified_by']}: {meta['cold_resident_before_max']} B "
            f"resident{'' if cold_ok else ' — NOT COLD'}; process CPU time / wall time "
            f"{100 * max(cpu['get_cold']):.0f}% of one core{device_note('get_cold')}",
            samples=rd["get_cold"],
        )
    )
    res.add(
        Row(
            G,
            "get(out=), cold page cache, direct reads on (KVSTORE_DIRECT_READS=1)",
            rmax("get_cold_direct"),
            "GiB/s",
            lim_cold,
            "best O_DIRECT read of the segment files (1 or 4 in flight)",
            note=f"info: O_DIRECT where the page cache misses (the default with a hot tier), "
            f"2 reads in flight per reader thread (io_uring; up to 4 threads), same store, "
            f"alternated with the row above; process CPU time / wall time "
            f"{100 * max(cpu['get_cold_direct'], default=0):.0f}% of one core"
            f"{device_note('get_cold_direct')}",
            samples=rd["get_cold_direct"],
        )
    )
    res.add(
        Row(
            G,
            "get(out=), cold page cache, direct reads one at a time (KVSTORE_READ_DEPTH=0)",
            rmax("get_cold_direct_sync"),
            "GiB/s",
            lim_cold,
            "best O_DIRECT read of the segment files (1 or 4 in flight)",
            note=f"info: the row above without io_uring (one synchronous preadv per reader "
            f"thread, straight into the destination's runs), alternated with it; process CPU "
            f"time / wall time "
            f"{100 * max(cpu['get_cold_direct_sync'], default=0):.0f}% of one core"
            f"{device_note('get_cold_direct_sync')}",
            samples=rd["get_cold_direct_sync"],
        )
    )
    res.add(
        Row(
            G,
            "get(out=), warm page cache, direct reads on vs off (alternated)",
            max(warm["get_cold_direct"]),
            "GiB/s",
            max(warm["get_cold"]),
            "the same gets with direct reads off (the default without a hot tier)",
            note="info: the cost of the page-cache check (cachestat) per record",
            samples=warm["get_cold_direct"],
        )
    )
    if lim_buffered:
        res.add(
            Row(
                G,
                "get(out=), cold  vs a buffered sequential read",
                rmax("get_cold"),
                "GiB/s",
                lim_buffered,
                "best buffered read (Python preadv, dd)",
                note="info",
            )
        )


def _warm_get_rows(b: _Bench, st: kvstore.Store, segs: list[Path]) -> float:
    """3. Warm reads vs memcpy, from `st` with its segment files `segs` in the page
    cache: the memcpy limits, then the warm get rows. Returns get(out=)'s GiB/s."""
    res, seqs, nbytes = b.res, b.seqs, b.nbytes
    with stage("warm get(out=) / get() / memcpy / clone", b.quiet):
        get_into(st, seqs, b.outs)  # make sure every segment page is cached
        res_warm, _ = resident_bytes(segs)
        res.meta["warm_resident_bytes"] = res_warm
        warm: dict[str, list[float]] = {
            "get_out": [],
            "get_alloc": [],
            "memcpy": [],
            "torch_copy": [],
            "clone": [],
        }
        src_t = [torch.from_numpy(s) for s in b.staging]
        dst_t = [torch.from_numpy(o) for o in b.outs_raw]
        for _ in range(b.warm_runs):
            warm["memcpy"].append(memcpy(b.outs_raw, b.staging))
            warm["torch_copy"].append(torch_copy(dst_t, src_t))
            warm["clone"].append(torch_clone([s.kv for s in seqs]))
            warm["get_alloc"].append(get_alloc(st, seqs))
            warm["get_out"].append(get_into(st, seqs, b.outs))  # last: outs checked below
        check_equal(seqs, b.outs)
        del src_t, dst_t

    def wbw(key: str) -> float:
        return gibps(nbytes, best(warm[key]))

    L = "limits"
    lim_mem = wbw("memcpy")
    res.add(
        Row(
            L,
            "memcpy: numpy.copyto between 2 MiB-aligned huge-page buffers (1 thread)",
            lim_mem,
            "GiB/s",
            samples=warm["memcpy"],
        )
    )
    res.add(
        Row(
            L,
            f"memcpy: torch copy_, same buffers ({torch.get_num_threads()} threads)",
            wbw("torch_copy"),
            "GiB/s",
            samples=warm["torch_copy"],
        )
    )
    res.add(
        Row(
            L,
            "alloc + copy: torch clone() (fresh memory from torch's allocator)",
            wbw("clone"),
            "GiB/s",
            samples=warm["clone"],
        )
    )
    G = "get"
    res.add(
        Row(
            G,
            "get(out=preallocated), warm page cache",
            wbw("get_out"),
            "GiB/s",
            lim_mem,
            "memcpy of the same bytes (numpy.copyto)",
            0.5,
            "ratio>=",
            samples=warm["get_out"],
        )
    )
    res.add(
        Row(
            G,
            "get() without out=, warm page cache (result in the process's reused buffers)",
            wbw("get_alloc"),
            "GiB/s",
            lim_mem,
            "memcpy of the same bytes",
            0.5,
            "ratio>=",
            samples=warm["get_alloc"],
        )
    )
    res.add(
        Row(
            G,
            "get() without out=, warm  vs torch clone()",
            wbw("get_alloc"),
            "GiB/s",
            wbw("clone"),
            "torch clone() of the same bytes (allocation + copy)",
            note="info",
        )
    )
    return wbw("get_out")


def _restore_rows(b: _Bench, tokens: int) -> None:
    """6. Restores as users do them: `hf.load` of a `tokens`-token prefix into a
    DynamicCache (bench_ttft.py's model layout, 256 KiB blocks) from the hot tier,
    warm and cold segments, and cold segments into an empty hot tier, against
    `torch.load` of the same DynamicCache in the same page-cache state
    (bench_ttft.restore_sweep, which checks every restore bitwise)."""
    import bench_ttft

    from kvstore import hf

    config = bench_ttft.build_config()
    layout = hf.layout_of(config)
    with stage(f"restores of {tokens} tokens: hf.load vs torch.load", b.quiet):
        times, notes = bench_ttft.restore_sweep(config, [tokens], b.repeat, b.tmp, b.cold_method)
    b.notes.extend(f"restore: {n}" for n in notes)
    nbytes = tokens // layout.block_size * layout.block_bytes
    for key, ref in bench_ttft.SWEEP_PAIRS:
        ours, theirs = min(times[key][tokens]), min(times[ref][tokens])
        b.res.add(
            Row(
                "restore",
                f"hf.load of {tokens} tokens ({nbytes // MiB} MiB, "
                f"{layout.block_bytes // 1024} KiB blocks), {bench_ttft.SWEEP_METHODS[key][9:]}",
                gibps(nbytes, ours),
                "GiB/s",
                gibps(nbytes, theirs),
                f"{bench_ttft.SWEEP_METHODS[ref]} of the same DynamicCache",
                1.0,
                "ratio>=",
                note=f"{ours * 1e3:.1f} ms vs {theirs * 1e3:.1f} ms",
                samples=times[key][tokens],
            )
        )


def _lookup_rows(b: _Bench, lookup_tokens: int, lookup_runs: int) -> None:
    """4. Lookup of a long prefix (tiny layout): the lookup rows."""
    res, tmp = b.res, b.tmp
    with stage(f"lookup of {lookup_tokens} tokens, tiny layout", b.quiet):
        lk = lookup_bench(tmp, lookup_tokens, lookup_runs)
    res.meta["lookup"] = {k: v for k, v in lk.items() if not k.endswith("_samples")}
    K = "lookup"
    nb = lk["blocks"]
    lo = {k: min(lk[f"{k}_samples"]) * 1e3 for k in ("hit", "hit_fresh", "miss", "hit_list")}
    res.add(
        Row(
            K,
            f"lookup, {lookup_tokens} tokens fully stored ({nb} blocks: hash + {nb} probes)",
            lk["hit"] * 1e3,
            "ms",
            target=2.0,
            target_kind="value<=",
            note=f"median of {lookup_runs} on one handle (min {lo['hit']:.3f} ms), "
            "tokens as a uint32 array",
            samples=[x * 1e3 for x in lk["hit_samples"]],
        )
    )
    res.add(
        Row(
            K,
            f"lookup, {lookup_tokens} tokens fully stored, first call on a fresh handle",
            lk["hit_fresh"] * 1e3,
            "ms",
            target=1.5,
            target_kind="value<=",
            note=f"median of {lookup_runs} handles (min {lo['hit_fresh']:.3f} ms): "
            "no location cached yet",
            samples=[x * 1e3 for x in lk["hit_fresh_samples"]],
        )
    )
    res.add(
        Row(
            K,
            f"lookup, {lookup_tokens} tokens, empty store (the walk stops after its first "
            "chunk: 64 ids hashed and probed)",
            lk["miss"] * 1e3,
            "ms",
            note=f"median of {lookup_runs} (min {lo['miss']:.3f} ms)",
            samples=[x * 1e3 for x in lk["miss_samples"]],
        )
    )
    res.add(
        Row(
            K,
            f"lookup, {lookup_tokens} tokens fully stored, tokens as a Python list",
            lk["hit_list"] * 1e3,
            "ms",
            note=f"median of {lookup_runs} (min {lo['hit_list']:.3f} ms)",
            samples=[x * 1e3 for x in lk["hit_list_samples"]],
        )
    )
    rm(tmp / "lookup-full")
    rm(tmp / "lookup-empty")


def _compression_rows(b: _Bench, put_ref: float, get_ref: float) -> None:
    """5. Compression on random and on KV-like bf16: rows for each lossless codec
    ("zstd": zstd over byte planes; "exponent": the sign/exponent plane entropy-coded,
    mantissas raw), against the uncompressed batch put (`put_ref`) and warm get(out=)
    (`get_ref`) of the same run, in GiB/s."""
    C = "compression"
    kinds = [("random", b.seqs)]
    with stage("generating KV-like bf16 (randn * 0.05)", b.quiet):
        kinds.append(("kvlike", make_seqs(BIG, b.blocks, "kvlike", seed=1)))
    b.res.meta["compression"] = {}
    for kind, data in kinds:
        for codec in ("zstd", "exponent"):
            _codec_rows(b, C, codec, kind, data, put_ref, get_ref)


def _codec_rows(
    b: _Bench, C: str, codec: str, kind: str, data: Any, put_ref: float, get_ref: float
) -> None:
    """The put, ratio and warm get rows of one codec on one kind of data."""
    res, tmp, quiet, repeat, nbytes = b.res, b.tmp, b.quiet, b.repeat, b.nbytes
    label = {"random": "random bf16 bits", "kvlike": "KV-like bf16 (randn*0.05)"}[kind]
    times = []
    store = tmp / f"store-{codec}-{kind}"
    for r in range(repeat):
        rm(store)
        with stage(f"[{r + 1}/{repeat}] put {codec}, {kind}, batch + flush", quiet):
            t, stats = put_all(store, BIG, data, "batch", compression=codec)
            times.append(t)
    ratio = stats["compression_ratio"]
    res.meta["compression"][f"{codec}/{kind}"] = {"stats": stats}
    res.add(
        Row(
            C,
            f"put {codec}, {label}, batch + flush",
            gibps(nbytes, best(times)),
            "GiB/s",
            put_ref,
            "put, compression off, batch + flush",
            note="info",
            samples=times,
        )
    )
    res.add(
        Row(
            C,
            f"compression ratio {codec}, {label}",
            ratio,
            "x",
            note=f"{stats['live_bytes'] / MiB:.0f} MiB on disk for {nbytes / MiB:.0f} MiB",
        )
    )
    with (
        stage(f"warm get(out=), {codec}, {kind}", quiet),
        open_store(store, BIG, durability="batch") as st,
    ):
        get_into(st, data, b.outs)
        tg = [get_into(st, data, b.outs) for _ in range(max(1, min(b.warm_runs, 3)))]
        check_equal(data, b.outs)
    res.add(
        Row(
            C,
            f"get(out=) {codec}, {label}, warm page cache",
            gibps(nbytes, best(tg)),
            "GiB/s",
            get_ref,
            "get(out=), compression off, warm",
            note="info",
            samples=tg,
        )
    )
    rm(store)
    os.sync()


# ---------------------------------------------------------------- output


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "GiB/s":
        return f"{v:.2f} GiB/s"
    if unit == "ms":
        return f"{v:.3f} ms"
    if unit == "x":
        return f"{v:.3f}×"
    return f"{v:g} {unit}"


def _target(r: Row) -> str:
    mark = {True: " ✓", False: " ✗", None: ""}[r.passed]
    if r.target_kind == "ratio>=":
        return f"≥ {r.target:.2f}×{mark}"
    if r.target_kind == "value<=":
        return f"< {r.target:g} {r.unit}{mark}"
    return "—"


def print_table(res: Results, file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=max(150, Console(file=file).width))
    m = res.meta
    table = Table(
        title=f"kvstore bench — {m['kv_bytes'] / GiB:.3f} GiB, {m['blocks']} blocks × "
        f"{BIG.block_bytes // MiB} MiB, {m['sequences']} puts/gets of "
        f"≤{m['blocks_per_seq']} blocks, "
        f"best of {m['repeat']} (warm: {m['warm_runs']})",
        show_lines=False,
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("limit", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    section = None
    for r in res.rows:
        if section is not None and r.section != section:
            table.add_section()
        section = r.section
        what = f"[dim]{r.section}[/] {r.what}"
        if r.limit_what:
            what += f"\n[dim]  limit: {r.limit_what}[/]"
        if r.note and r.note != "info":
            what += f"\n[dim]  {r.note}[/]"
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}×"
        style = {True: "green", False: "bold red", None: ""}[r.passed]
        table.add_row(
            what,
            _fmt(r.value, r.unit),
            _fmt(r.limit, r.unit) if r.limit is not None else "—",
            f"[{style}]{ratio}[/]" if style else ratio,
            f"[{style}]{_target(r)}[/]" if style else _target(r),
        )
    console.print(table)
    cold = m.get("cold_cache", [])
    if cold:
        c = cold[-1]
        console.print(
            f"cold cache: emptied with [bold]{c['method']}[/]"
            + (
                " (echo 3 > /proc/sys/vm/drop_caches)"
                if c["method"] == "drop_caches"
                else " (fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file)"
            )
            + f"; {c['tool']} saw {m['cold_resident_before_max']} of {c['segment_bytes']} segment "
            f"bytes resident before the cold gets, {c['resident_after']} after"
        )
    la = m.get("loadavg_start")
    if la is not None:
        busy = max(la[0], m.get("loadavg_after_gets", la)[0])
        console.print(
            f"load average at start {la[0]:.2f}, after the gets "
            f"{m.get('loadavg_after_gets', la)[0]:.2f}"
            + (
                " — [bold yellow]other work is running: absolute figures are noisy; "
                "compare ratios[/]"
                if busy > 0.5 * (m.get("cpus") or 1)
                else ""
            )
        )
    for n in m.get("notes", []):
        console.print(f"note: {n}")
    console.print(
        f"dir {m['bench_dir']} (same file system as /work: {m['same_fs_as_work']}); "
        f"{m['cpus']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}; "
        f"engine {m['engine_so_md5'][:12]} built {m['engine_so_mtime']}, git {m['git_rev']}"
    )


def main(argv: Sequence[str] | None = None) -> Results:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-gib",
        type=float,
        default=1.0,
        help="GiB of KV to put and get (default 1.0 = 512 blocks of 2 MiB)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where to make the temp dir (default: $TMPDIR or /tmp); it must be on "
        "the file system you want to measure",
    )
    p.add_argument("--json", default=None, help="also write every figure and sample here")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds of each disk measurement, best kept (default 3)",
    )
    p.add_argument("--warm-runs", type=int, default=5, help="rounds of warm gets / memcpy")
    p.add_argument("--blocks-per-seq", type=int, default=64, help="blocks per put/get (default 64)")
    p.add_argument("--lookup-tokens", type=int, default=131072)
    p.add_argument("--lookup-runs", type=int, default=20)
    p.add_argument(
        "--restore-tokens",
        type=int,
        default=4096,
        help="prefix of the hf.load vs torch.load rows (default 4096; 0: skip them)",
    )
    p.add_argument(
        "--cold-method",
        choices=("auto", "drop_caches", "fadvise"),
        default="auto",
        help="how to empty the page cache (auto: drop_caches if permitted)",
    )
    p.add_argument("--no-compression", action="store_true", help="skip the zstd measurements")
    p.add_argument(
        "--only-compression",
        action="store_true",
        help="the compression rows and the puts and warm gets they compare with, nothing else",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    res = run(
        a.size_gib,
        a.dir,
        a.repeat,
        a.warm_runs,
        a.blocks_per_seq,
        a.lookup_tokens,
        a.lookup_runs,
        a.cold_method,
        not a.no_compression,
        a.quiet,
        a.restore_tokens,
        a.only_compression,
    )
    res.meta["argv"] = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    print_table(res)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"meta": res.meta, "rows": [r.as_dict() for r in res.rows]}, indent=2, default=str
            )
        )
    return res


if __name__ == "__main__":
    main()
