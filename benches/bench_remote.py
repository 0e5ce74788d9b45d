#!/usr/bin/env python3
"""The remote tier on loopback, one run: a 3-master Redis cluster started here.

    python benches/bench_remote.py [--prefix 2048] [--tput-mib 64] [--upload-gib 1] [--json OUT]

1. **A prefix into a fresh host.** The demo model (`kvstore demo`'s seeded Llama,
   float32 on the CPU) prefills `--prefix` tokens; host A saves the KV and uploads
   it. Then, for the same tokens: `get` on a fresh host B (empty store, remote
   tier: the blocks come from the cluster, are checked and promoted into B's
   segments) against `get` from A's own segments with a cold page cache (a handle
   opened after fsync + POSIX_FADV_DONTNEED on its files) and against recomputing
   the KV (the model's prefill). Ratios: remote / local cold, recompute / remote.
2. **Throughput against a raw client.** `--tput-mib` of KV in chains of distinct
   blocks (values as large as the demo model's blocks): `put` with
   `write="through"` (each put returns after the cluster acknowledged; the local
   write is inside the timing), `put`s then `flush()` with `write="behind"` (the
   default: uploads overlap the next local writes) and `get` on a fresh host
   (fetch, check, promote into its segments).
   Peer: `redis-benchmark --cluster -t set,get -d <value bytes> -P 16` on the same
   cluster, one connection (what the store's uploader and reader each hold) and
   the best of 1, 4 and 16 connections. Value bytes per second; target >= 0.7x.
3. **Memory per node while uploading a store.** `--upload-gib` of random KV put
   into a store without a remote tier, then `kvstore remote push` of it in a child
   process while a sampler reads `INFO memory` (used_memory) and the RSS of every
   node, and the RSS of the pushing process, every 0.1 s. Bounded: each node's
   peak used memory against the bytes of the values it holds at the end, and the
   push's peak RSS against the store's size.

Prints the load average beside the figures. Timings are single runs unless
`--repeat` says otherwise (best kept), on a machine shared with others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvstore

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))
from pagecache import drop_page_cache, mincore_resident  # noqa: E402
from support.redis_cluster import CLI, Cluster, cmd, env_ok, free_ports  # noqa: E402

MODEL = "bench/remote@1"


def load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def best(f: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return min(times), out


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


class Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def note(self, section: str, text: str) -> None:
        self.notes.append(f"[{section}] {text}")
        print(self.notes[-1], flush=True)

    def add(self, section: str, name: str, value: float, unit: str, **extra: Any) -> None:
        row = {"section": section, "name": name, "value": value, "unit": unit, **extra}
        self.rows.append(row)
        ratio = f"  ratio {extra['ratio']:.2f}x" if "ratio" in extra else ""
        note = f"  ({extra['note']})" if "note" in extra else ""
        print(f"[{section}] {name}: {value:.4g} {unit}{ratio}{note}  [{load()}]", flush=True)


# ------------------------------------------------------------------------ 1. prefix get


def prefix_get(c: Cluster, root: Path, args: argparse.Namespace, rows: Rows) -> None:
    import torch

    from kvstore import hf
    from kvstore.demo import load_model

    torch.set_grad_enabled(False)
    model, what = load_model(quick=args.quick)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.prefix), generator=torch.Generator().manual_seed(1))
    model(ids[:, :32], use_cache=True)  # first-call costs off the clock
    t_recompute, out = best(lambda: model(ids, use_cache=True, logits_to_keep=1), args.repeat)
    cache = out.past_key_values
    remote = kvstore.Remote(nodes=c.nodes)
    fp = hf.fingerprint(model)
    with hf.open(root / "a", model, fingerprint=fp, durability="batch", remote=remote) as a:
        assert hf.save(a, ids, cache) == args.prefix
        a.flush()
        assert a.stats()["remote"]["blocks_uploaded"] == args.prefix // a.layout.block_size
        want = a.get(ids[0].numpy())
    kv_mib = want.nbytes / 2**20
    tokens = ids[0].numpy()

    resident = []

    def cold_local() -> tuple[Any, float]:
        files = files_under(root / "a")
        drop_page_cache(files, "fadvise")
        with hf.open(root / "a", model, fingerprint=fp) as s:  # no hot tier
            segs = [f for f in files if f.suffix == ".kvseg"]
            resident.append(sum(mincore_resident(f) for f in segs))
            t0 = time.perf_counter()
            got = s.get(tokens)
            return got, time.perf_counter() - t0

    def fresh_remote() -> Any:
        d = root / f"b{time.monotonic_ns()}"
        with hf.open(d, model, fingerprint=fp, durability="batch", remote=remote) as b:
            t0 = time.perf_counter()
            got = b.get(tokens)
            dt = time.perf_counter() - t0
            assert b.stats()["remote"]["hits"] == len(tokens) // b.layout.block_size
        return got, dt

    def timed(f: Callable[[], tuple[Any, float]]) -> float:
        times = []
        for _ in range(args.repeat):
            got, dt = f()
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
            times.append(dt)
        return min(times)

    t_local, t_remote = timed(cold_local), timed(fresh_remote)
    sec = "prefix"
    rows.note(sec, f"model: {what}; {args.prefix} tokens, KV {kv_mib:.0f} MiB")
    rows.add(sec, "recompute (prefill)", t_recompute * 1e3, "ms")
    rows.add(sec, "get, local segments, cold page cache", t_local * 1e3, "ms",
             note=f"{kv_mib / t_local:.0f} MiB/s; handle opened after the eviction; "
             f"{min(resident) / 2**20:.1f} MiB of segments still resident")  # fmt: skip
    rows.add(sec, "get, fresh host from the cluster", t_remote * 1e3, "ms",
             note=f"{kv_mib / t_remote:.0f} MiB/s; fetch, check, promote")  # fmt: skip
    rows.add(sec, "remote get / local cold get (time)", t_remote / t_local, "x",
             ratio=t_remote / t_local)  # fmt: skip
    rows.add(sec, "recompute / remote get (speed-up)", t_recompute / t_remote, "x",
             ratio=t_recompute / t_remote)  # fmt: skip


# ---------------------------------------------------------------------- 2. throughput


def layout_for_tput() -> kvstore.Layout:
    # The demo model's blocks: 8 layers, 4 KV heads of 64, float32, 16 tokens = 256 KiB.
    return kvstore.Layout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float32",
                          block_size=16)  # fmt: skip


def random_chains(layout: kvstore.Layout, total: int, blocks_per_chain: int, seed: int):
    rng = np.random.default_rng(seed)
    n_chains = max(1, total // (layout.block_bytes * blocks_per_chain))
    t = blocks_per_chain * layout.block_size
    for k in range(n_chains):
        tokens = np.arange(t, dtype=np.uint32) + np.uint32(seed * 10_000_000 + k * t)
        kv = rng.integers(0, 2**32, size=layout.block_bytes * blocks_per_chain // 4,
                          dtype=np.uint32)  # fmt: skip
        shape = (layout.num_layers, 2, t, layout.num_kv_heads, layout.head_dim)
        yield tokens, kv.view(np.float32).reshape(shape)


def redis_benchmark(c: Cluster, value: int, clients: int, n: int) -> dict[str, float]:
    """Requests/s of SET and GET of `value`-byte values, `-P 16`, on the cluster. The
    keyspace (`-r`) is a quarter of the requests, so the SETs leave ~98% of the keys
    the GETs ask for (a GET of a missing key moves no value)."""
    bench = Path(CLI).with_name(Path(CLI).name.replace("-cli", "-benchmark"))
    p = subprocess.run(
        [str(bench), "-h", "127.0.0.1", "-p", str(c.ports[0]), "--cluster", "-t", "set,get",
         "-d", str(value), "-P", "16", "-c", str(clients), "-n", str(n), "-r", str(n // 4),
         "--csv"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(f"redis-benchmark failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rps = {}
    for line in p.stdout.splitlines():
        parts = [p.strip('"') for p in line.split(",")]
        if parts[0] in ("SET", "GET"):
            rps[parts[0]] = float(parts[1])
    return rps


def throughput(c: Cluster, root: Path, args: argparse.Namespace, rows: Rows) -> None:
    layout = layout_for_tput()
    total = int(args.tput_mib * 2**20)
    chains = list(random_chains(layout, total, 16, seed=7))
    c.flushall()
    remote = kvstore.Remote(nodes=c.nodes, write="through")
    with kvstore.open(root / "tl", layout, MODEL, durability="none") as s:
        t0 = time.perf_counter()
        for t, kv in chains:
            s.put(t, kv)
        t_local_put = time.perf_counter() - t0
    with kvstore.open(root / "tp", layout, MODEL, durability="none", remote=remote) as s:
        t0 = time.perf_counter()
        for t, kv in chains:
            s.put(t, kv)
        t_put = time.perf_counter() - t0
        r = s.stats()["remote"]
        assert r["blocks_uploaded"] == 16 * len(chains) and r["write_failures"] == 0, r
        value = r["bytes_written"] // r["blocks_uploaded"]
        moved = r["bytes_written"]
    c.flushall()
    with kvstore.open(root / "tb", layout, MODEL, durability="none",
                      remote=kvstore.Remote(nodes=c.nodes)) as s:  # fmt: skip
        t0 = time.perf_counter()
        for t, kv in chains:
            s.put(t, kv)
        s.flush()
        t_behind = time.perf_counter() - t0
        r = s.stats()["remote"]
        assert r["blocks_uploaded"] == 16 * len(chains) and r["writes_dropped"] == 0, r
    with kvstore.open(root / "tg", layout, MODEL, durability="none",
                      remote=kvstore.Remote(nodes=c.nodes)) as s:  # fmt: skip
        t0 = time.perf_counter()
        for t, _ in chains:
            s.get(t)
        t_get = time.perf_counter() - t0
        r = s.stats()["remote"]
        assert r["hits"] == 16 * len(chains), r
    c.flushall()
    n = max(512, 2 * (moved // value))
    peers = {k: redis_benchmark(c, value, k, n) for k in (1, 4, 16)}
    c.flushall()
    sec = "throughput"
    mib = moved / 2**20
    rows.note(sec, f"values: {value} bytes, {len(chains) * 16} blocks, {mib:.0f} MiB")
    rows.add(sec, "local put only (no remote)", mib / t_local_put, "MiB/s")
    for op, t in (
        ("put, write=through", t_put),
        ("put + flush, write=behind", t_behind),
        ("get, fresh host", t_get),
    ):
        mine = mib / t
        raw = "SET" if op.startswith("put") else "GET"
        one = peers[1][raw] * value / 2**20
        top = max(p[raw] for p in peers.values()) * value / 2**20
        rows.add(sec, f"kvstore {op}", mine, "MiB/s")
        rows.add(sec, f"redis-benchmark {raw} -P 16 -c 1", one, "MiB/s")
        rows.add(sec, f"kvstore {op} / redis-benchmark -c 1 (target >= 0.7)", mine / one, "x",
                 ratio=mine / one)  # fmt: skip
        rows.add(sec, f"kvstore {op} / best redis-benchmark -c 1|4|16", mine / top, "x",
                 ratio=mine / top, note=f"best {top:.0f} MiB/s")  # fmt: skip


# ---------------------------------------------------------------- 3. memory while uploading


def upload_memory(c: Cluster, root: Path, args: argparse.Namespace, rows: Rows) -> None:
    layout = layout_for_tput()
    total = int(args.upload_gib * 2**30)
    c.flushall()
    path = root / "big"
    with kvstore.open(path, layout, MODEL, durability="none") as s:
        for t, kv in random_chains(layout, total, 64, seed=11):
            s.put(t, kv)
        blocks = s.stats()["blocks"]
    store_bytes = sum(p.stat().st_size for p in files_under(path))
    base = {p: int(cmd(p, "INFO", "memory").split(b"used_memory:")[1].split()[0]) for p in c.ports}
    peak_used = dict(base)
    peak_rss = {p: rss_bytes(c.procs[p].pid) for p in c.ports}
    peak_push = 0
    push = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "remote", "push", str(path), "--json",
         "--node", ",".join(c.nodes), "--timeout", "5s"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_push
        while not stop.is_set():
            for p in c.ports:
                used = int(cmd(p, "INFO", "memory").split(b"used_memory:")[1].split()[0])
                peak_used[p] = max(peak_used[p], used)
                peak_rss[p] = max(peak_rss[p], rss_bytes(c.procs[p].pid))
            peak_push = max(peak_push, rss_bytes(push.pid))
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    th.start()
    out, _ = push.communicate(timeout=3600)
    t_push = time.perf_counter() - t0
    stop.set()
    th.join()
    report = json.loads(out)
    assert report["uploaded"] == blocks and report["failed"] == 0, report
    sec = "upload"
    rows.add(sec, f"kvstore remote push of {store_bytes / 2**30:.2f} GiB ({blocks} blocks)",
             store_bytes / 2**20 / t_push, "MiB/s", note=f"{t_push:.1f} s")  # fmt: skip
    rows.add(sec, "push process peak RSS / store size", peak_push / store_bytes, "x",
             ratio=peak_push / store_bytes, note=f"{peak_push / 2**20:.0f} MiB")  # fmt: skip
    for p in c.ports:
        held = sum(int(cmd(p, "MEMORY", "USAGE", k) or 0) for k in cmd(p, "KEYS", "kvstore:*"))
        grown = peak_used[p] - base[p]
        rows.add(sec, f"node {p}: peak used_memory growth / its values' MEMORY USAGE",
                 grown / max(held, 1), "x", ratio=grown / max(held, 1),
                 note=f"peak used {peak_used[p] / 2**20:.0f} MiB, RSS "
                 f"{peak_rss[p] / 2**20:.0f} MiB, holds {held / 2**20:.0f} MiB")  # fmt: skip
    c.flushall()


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> Rows:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix", type=int, default=2048, help="tokens of the prefix (default 2048)")
    p.add_argument("--tput-mib", type=float, default=64, help="MiB moved per throughput row")
    p.add_argument("--upload-gib", type=float, default=1.0, help="store pushed (default 1 GiB)")
    p.add_argument("--repeat", type=int, default=1, help="runs of the prefix rows; best kept")
    p.add_argument("--quick", action="store_true", help="the demo's quick (smaller) model")
    p.add_argument("--dir", help="where temporary stores go (default $TMPDIR)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if not env_ok():
        raise SystemExit("needs redis-server and redis-cli")
    rows = Rows()
    print(f"bench_remote: 3-master cluster on 127.0.0.1, {os.cpu_count()} CPUs, {load()}")
    with tempfile.TemporaryDirectory(prefix="kvstore-remote-", dir=args.dir) as tmp:
        root = Path(tmp)
        c = Cluster(root / "redis", free_ports(3), True, [])
        try:
            c.start()
            prefix_get(c, root, args, rows)
            throughput(c, root, args, rows)
            upload_memory(c, root, args, rows)
        finally:
            c.stop()
    if args.json:
        data = {"load": os.getloadavg(), "notes": rows.notes, "rows": rows.rows}
        Path(args.json).write_text(json.dumps(data))
    return rows


if __name__ == "__main__":
    main()
