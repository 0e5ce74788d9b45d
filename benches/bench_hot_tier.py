"""Hot tier (shared-memory arena) against the machine's limits, in one run.

    python benches/bench_hot_tier.py [--hot-mib 512] [--tlb-gib 2] [--json OUT]

1. get of hot blocks from another process vs memcpy of the same bytes (target >= 0.8x)
2. aggregate get throughput of 1, 2, 4 processes on shared hot blocks, vs the same
   number of processes doing memcpy
3. put with the hot tier (write-through) vs the same put without it
4. TLB: random reads over a --tlb-gib arena of small blocks on huge pages vs normal
   pages (needs root to set vm.nr_hugepages and mount hugetlbfs; skipped otherwise)

Every figure is printed with the limit measured in the same run and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvstore

MODEL = "bench-hot@1"
# Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128, bf16 -> 2 MiB blocks.
BIG = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
# Small blocks for the TLB run: 16 KiB each, many of them.
SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", block_size=16)


def best(f, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def memcpy_rate(nbytes: int) -> float:
    """Bytes/s of one copy between two preallocated, touched buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return nbytes / best(lambda: np.copyto(dst, src))


def sequences(layout: kvstore.Layout, total_bytes: int, blocks_per_seq: int) -> list[np.ndarray]:
    n_seq = max(1, total_bytes // (layout.block_bytes * blocks_per_seq))
    n = blocks_per_seq * layout.block_size
    return [np.arange(n, dtype=np.int64) + 1_000_003 * i for i in range(n_seq)]


def fill(path: str, hot_dir: str, hot_bytes: int, layout: kvstore.Layout, seqs) -> None:
    rng = np.random.default_rng(0)
    n = len(seqs[0])
    kv = rng.standard_normal(layout.kv_shape(n), dtype=np.float32).astype(np.float16)
    with kvstore.open(
        path, layout=layout, model=MODEL, durability="none", hot_bytes=hot_bytes, hot_dir=hot_dir
    ) as s:
        for t in seqs:
            s.put(t, kv)


# ----------------------------------------------------------------------------- workers


def worker(args: argparse.Namespace) -> None:
    """Runs in a separate process: reads every sequence from the hot tier for
    `seconds`, or does memcpy of the same size, and prints bytes/s."""
    layout = kvstore.Layout(**json.loads(args.layout))
    seqs = sequences(layout, args.total, args.per_seq)
    n = len(seqs[0])
    seq_bytes = layout.block_bytes * args.per_seq
    if args.mode == "memcpy":
        src = np.ones(seq_bytes, dtype=np.uint8)
        dst = np.zeros(seq_bytes, dtype=np.uint8)
        go = lambda i: np.copyto(dst, src)  # noqa: E731
        store = None
    else:
        store = kvstore.open(
            args.path, layout=layout, model=MODEL, durability="none",
            hot_bytes=args.hot_bytes, hot_dir=args.hot_dir,
        )  # fmt: skip
        out = np.empty(layout.kv_shape(n), dtype=np.float16)
        order = np.random.default_rng(os.getpid()).permutation(len(seqs))

        def go(i: int) -> None:
            assert store.get(seqs[order[i % len(seqs)]], out=out) == n

    for i in range(len(seqs)):  # warm up: every page touched once
        go(i)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.readline()  # all workers start together
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        go(done)
        done += 1
    elapsed = time.perf_counter() - t0
    stats = store.stats() if store else {"hot_hit_blocks": 0, "disk_hit_blocks": 0}
    print(json.dumps({"rate": done * seq_bytes / elapsed, "hot": stats["hot_hit_blocks"],
                      "disk": stats["disk_hit_blocks"]}))  # fmt: skip


def run_workers(n: int, mode: str, common: list[str]) -> dict[str, float]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--mode", mode, *common],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    return {
        "rate": sum(r["rate"] for r in results),
        "hot": sum(r["hot"] for r in results),
        "disk": sum(r["disk"] for r in results),
    }


# ----------------------------------------------------------------------------- benches


def bench_shared_get(tmp: str, hot_mib: int, seconds: float) -> list[dict]:
    layout = kvstore.Layout(**BIG)
    total = hot_mib << 20
    # Twice the data: a block may only live in its two sets, so a fuller arena
    # evicts some blocks while other sets still have room.
    hot_bytes = 2 * total + (8 << 20)
    path, hot_dir = os.path.join(tmp, "shared"), os.path.join(tmp, "hot-shared")
    os.makedirs(hot_dir)
    seqs = sequences(layout, total, 16)
    fill(path, hot_dir, hot_bytes, layout, seqs)
    common = [
        "--path", path, "--hot-dir", hot_dir, "--hot-bytes", str(hot_bytes),
        "--layout", json.dumps(BIG), "--total", str(total), "--per-seq", "16",
        "--seconds", str(seconds),
    ]  # fmt: skip
    rows = []
    for n in (1, 2, 4):
        got = run_workers(n, "get", common)
        limit = run_workers(n, "memcpy", common)
        assert got["disk"] == 0, "every block must come from the arena"
        rows.append(
            {
                "what": f"hot get, {n} process{'es' if n > 1 else ''} (other than the writer)",
                "value": got["rate"],
                "limit": limit["rate"],
                "limit_what": f"memcpy, {n} process{'es' if n > 1 else ''}",
                "target": 0.8 if n == 1 else None,
            }
        )
    return rows


def bench_put_cost(tmp: str, hot_mib: int) -> dict:
    layout = kvstore.Layout(**BIG)
    total = min(hot_mib, 256) << 20
    seqs = sequences(layout, total, 16)
    kv = np.ones(layout.kv_shape(len(seqs[0])), dtype=np.float16)
    nbytes = len(seqs) * len(seqs[0]) // layout.block_size * layout.block_bytes

    def put_all(hot: bool, k: int) -> float:
        path = os.path.join(tmp, f"put-{hot}-{k}")
        hot_dir = os.path.join(tmp, f"hot-put-{hot}-{k}")
        os.makedirs(hot_dir)
        with kvstore.open(
            path, layout=layout, model=MODEL, durability="none",
            hot_bytes=(total * 2 + (8 << 20)) if hot else None, hot_dir=hot_dir,
        ) as s:  # fmt: skip
            t = time.perf_counter()
            for q in seqs:
                s.put(q, kv)
            return time.perf_counter() - t

    # Compared directly: a difference of two disk-bound timings is mostly noise.
    with_hot = min(put_all(True, k) for k in range(3))
    without = min(put_all(False, k) for k in range(3))
    return {
        "what": "put with the hot tier (write-through, durability none)",
        "value": nbytes / with_hot,
        "limit": nbytes / without,
        "limit_what": "same put without the hot tier",
        "target": None,
    }


def bench_tlb(tmp: str, gib: float, seconds: float) -> list[dict]:
    if os.geteuid() != 0:
        return [{"what": "TLB: huge vs normal pages", "skipped": "needs root (vm.nr_hugepages)"}]
    layout = kvstore.Layout(**SMALL)
    total = int(gib * (1 << 30))
    hot_bytes = total + total // 8 + (8 << 20)
    nr = Path("/proc/sys/vm/nr_hugepages")
    before = nr.read_text().strip()
    mnt = os.path.join(tmp, "hugetlbfs")
    os.makedirs(mnt)
    rows = []
    try:
        need = hot_bytes // (2 << 20) + 8
        nr.write_text(str(int(before) + need))
        if int(nr.read_text()) < int(before) + need:
            return [{"what": "TLB", "skipped": f"kernel gave fewer than {need} huge pages"}]
        if subprocess.run(["mount", "-t", "hugetlbfs", "none", mnt]).returncode != 0:
            return [{"what": "TLB", "skipped": "cannot mount hugetlbfs"}]
        try:
            seqs = sequences(layout, total, 64)
            for kind, hot_dir in (("normal", os.path.join(tmp, "hot-tlb")), ("hugetlb", mnt)):
                os.makedirs(hot_dir, exist_ok=True)
                path = os.path.join(tmp, f"tlb-{kind}")
                fill(path, hot_dir, hot_bytes, layout, seqs)
                with kvstore.open(path, layout=layout, model=MODEL, durability="none",
                                  hot_bytes=hot_bytes, hot_dir=hot_dir) as s:  # fmt: skip
                    got_kind = s.stats()["page_kind"]
                common = [
                    "--path", path, "--hot-dir", hot_dir, "--hot-bytes", str(hot_bytes),
                    "--layout", json.dumps(SMALL), "--total", str(total), "--per-seq", "64",
                    "--seconds", str(seconds),
                ]  # fmt: skip
                r = run_workers(1, "get", common)
                rows.append({"what": f"random hot get, {gib:g} GiB arena, {got_kind} pages",
                             "value": r["rate"], "kind": got_kind})  # fmt: skip
                kvstore.remove_arena(path, hot_dir=hot_dir)
        finally:
            # Workers that just exited may still hold the mount for a moment.
            for _ in range(40):
                if subprocess.run(["umount", mnt], stderr=subprocess.DEVNULL).returncode == 0:
                    break
                time.sleep(0.25)
    finally:
        nr.write_text(before)
    if len(rows) == 2:
        rows[1]["limit"], rows[1]["limit_what"] = rows[0]["value"], "same on normal pages"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hot-mib", type=int, default=512, help="hot data for the get/put runs")
    ap.add_argument("--tlb-gib", type=float, default=2.0, help="arena size for the TLB run")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each timed run")
    ap.add_argument("--no-tlb", action="store_true")
    ap.add_argument("--json", help="also write the figures here")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--hot-dir", help=argparse.SUPPRESS)
    ap.add_argument("--hot-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--per-seq", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="kvstore-bench-hot-", dir="/dev/shm") as tmp:
        rows = bench_shared_get(tmp, args.hot_mib, args.seconds)
        rows.append(bench_put_cost(tmp, args.hot_mib))
        if not args.no_tlb:
            rows += bench_tlb(tmp, args.tlb_gib, args.seconds)
    table = Table(title=f"kvstore hot tier ({os.cpu_count()} cores)", title_justify="left")
    for col in ("what", "value", "limit", "ratio", "target"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for r in rows:
        if "skipped" in r:
            table.add_row(r["what"], "skipped", r["skipped"], "", "")
            continue
        limit = r.get("limit")
        ratio = r["value"] / limit if limit else None
        table.add_row(
            r["what"],
            f"{r['value'] / 2**30:.2f} GiB/s",
            f"{limit / 2**30:.2f} GiB/s ({r['limit_what']})" if limit else "",
            f"{ratio:.2f}x" if ratio else "",
            f">= {r['target']}x" if r.get("target") else "",
        )
        r["ratio"] = ratio
    Console().print(table)
    for r in rows:
        if r.get("note"):
            print(f"note: {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
