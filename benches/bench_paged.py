#!/usr/bin/env python3
"""The engine's paged path alone (no vLLM): `get_paged`/`put_paged` between a store and
per-layer paged caches laid out as vLLM's CPU backend lays them (per block, K
`[H][D][B]` and V `[H][B][D]`), against memcpy of the same bytes in the same run, and
against the connector's previous path (canonical `get` into a staging buffer, then
torch's scatter into the caches).

    python benches/bench_paged.py [--tokens 2048] [--cache-blocks 1024] [--repeat 7]

The layout is bench_vllm.py's (bfloat16, 8 layers, 4 KV heads of 64, blocks of 32
tokens: 256 KiB a block, 16 MiB for 2K tokens). The caches hold `--cache-blocks`
blocks per layer (2 GiB at 1024: far more than a CPU cache) and each round lands the
request in a different random set of them. Loads are timed with the hot tier (the
shared-memory arena), without it (the segments in the page cache), and from the page
cache with a full hot tier that does not hold the request (loads before 2026-11-24's
vload3 promoted each block into it; they no longer do); the peers are
copies of the same number of bytes between two buffers as large as the request, a
different pair each round: glibc's memcpy on one thread (numpy.copyto), the same cut
across as many threads as a load of this size uses (min(cores, 4)), and torch's copy_
(all intra-op threads); ratios are to the one-thread memcpy and to the threaded one.
Best of `--repeat`.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import kvstore
from kvstore.vllm.paged import PagedKV

L, H, D, B = 8, 4, 64, 32


def cpu_block_map() -> torch.Tensor:
    """Element offsets of a block's canonical `[2, B, H, D]` values in a `[N, 2, H, B*D]`
    layer cache: K at `[kv, h, d*B + t]`, V at `[kv, h, t*D + d]`."""
    kv, t, h, d = torch.meshgrid(
        torch.arange(2), torch.arange(B), torch.arange(H), torch.arange(D), indexing="ij"
    )
    inner = torch.where(kv == 0, d * B + t, t * D + d)
    return (kv * H * B * D + h * B * D + inner).reshape(-1)


THREADS = min(os.cpu_count() or 1, 4)


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """glibc's memcpy on one thread."""
    np.copyto(dst.view(torch.int16).numpy(), src.view(torch.int16).numpy())


def memcpy_threads(pool: ThreadPoolExecutor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """`memcpy` in THREADS consecutive pieces, one thread each (copyto releases the GIL)."""
    d, s = dst.view(-1), src.view(-1)
    cuts = [len(s) * k // THREADS for k in range(THREADS + 1)]
    spans = zip(cuts, cuts[1:], strict=False)
    list(pool.map(lambda c: memcpy(d[c[0] : c[1]], s[c[0] : c[1]]), spans))


def best(f, repeat: int) -> float:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cache-blocks", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    lay = kvstore.Layout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16", block_size=B)
    n = a.tokens // B
    nbytes = n * lay.block_bytes
    caches = [torch.zeros(a.cache_blocks, 2, H, B * D, dtype=torch.bfloat16) for _ in range(L)]
    paged = PagedKV(caches, cpu_block_map(), lay)
    assert paged.strided
    rng = random.Random(0)
    picks = [rng.sample(range(a.cache_blocks), n) for _ in range(a.repeat)]
    tokens = list(range(1, a.tokens + 1))
    kv = torch.randn(lay.kv_shape(a.tokens)).to(torch.bfloat16)
    staging = torch.empty_like(kv)
    pairs = [(torch.ones_like(kv), torch.zeros_like(kv)) for _ in range(4)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as hot:
        path = Path(tmp) / "s"
        others = [[t + (r + 1) * 100_000 for t in tokens] for r in range(a.repeat + 2)]
        with kvstore.open(path, lay, "bench-paged@1", durability="none") as s:
            for t in [tokens, *others]:
                s.put(t, kv)
        with ThreadPoolExecutor(THREADS) as pool:
            peers = [
                ("memcpy (glibc, one thread)", lambda d, s: memcpy(d, s)),
                (f"memcpy (glibc, {THREADS} threads)", lambda d, s: memcpy_threads(pool, d, s)),
                ("torch copy_ (intra-op threads)", lambda d, s: d.copy_(s)),
            ]
            copies = [
                (name, best(lambda i, c=c: c(pairs[i % 4][1], pairs[i % 4][0]), a.repeat * 2))
                for name, c in peers
            ]
        one, many = copies[0][1], copies[1][1]
        for tier, hot_bytes in (("page cache", None), ("hot tier", 64 << 20)):
            with kvstore.open(
                path, lay, "bench-paged@1", hot_bytes=hot_bytes, hot_dir=hot if hot_bytes else None
            ) as s:
                s.get(tokens, out=staging)  # promotion, with a hot tier (a paged load does not)
                paged.load(s, tokens, 0, None, picks[0])  # warm-up
                t = best(lambda i, s=s: paged.load(s, tokens, 0, None, picks[i]), a.repeat)
                rows.append((f"get_paged, {tier}", t))

                def old(i: int, s=s) -> None:
                    s.get(tokens, out=staging)
                    paged.move(picks[i], staging, True)

                rows.append((f"get + torch scatter (previous), {tier}", best(old, a.repeat)))

        # Each round another request, from the page cache, with a hot tier that holds
        # two requests and is full of others (its memory faulted in): where a load
        # promotes, it evicts and reuses slots, as in a hot tier that is full.
        with (
            tempfile.TemporaryDirectory() as warm,
            kvstore.open(
                path, lay, "bench-paged@1", hot_bytes=(2 * nbytes * 17) // 16, hot_dir=warm
            ) as s,
        ):
            s.get(others[-1], out=staging)  # a canonical get promotes
            s.get(others[-2], out=staging)

            def hot_full(i: int, s=s) -> None:
                paged.load(s, others[i], 0, None, picks[i])

            rows.append(("get_paged, page cache, hot tier full", best(hot_full, a.repeat)))
        # The caches hold what was loaded: the last round's blocks, gathered back.
        back = torch.empty_like(kv)
        paged.move(picks[-1], back, False)
        assert torch.equal(back, kv), "a load landed wrong values"

        def put(i: int) -> None:
            with kvstore.open(Path(tmp) / f"p{i}", lay, "bench-paged@1", durability="none") as s:
                t0 = time.perf_counter()
                paged.save(s, tokens, 0, None, picks[-1])
                put.t = min(getattr(put, "t", float("inf")), time.perf_counter() - t0)

        for i in range(a.repeat):
            put(i)
        rows.append(("put_paged (durability none)", put.t))

        def put_old(i: int) -> None:
            with kvstore.open(Path(tmp) / f"q{i}", lay, "bench-paged@1", durability="none") as s:
                t0 = time.perf_counter()
                paged.move(picks[-1], staging, False)
                s.put(tokens, staging)
                put_old.t = min(getattr(put_old, "t", float("inf")), time.perf_counter() - t0)

        for i in range(a.repeat):
            put_old(i)
        rows.append(("torch gather + put (previous)", put_old.t))
    load = os.getloadavg()
    gib = nbytes / (1 << 30)
    print(f"{a.tokens} tokens, {nbytes >> 20} MiB of KV; load average {load[0]:.2f}")
    for name, t in copies:
        print(f"{name:44s} {gib / t:7.2f} GiB/s")
    for name, t in rows:
        print(
            f"{name:44s} {gib / t:7.2f} GiB/s  {one / t:5.2f}x memcpy"
            f"  {many / t:5.2f}x memcpy on {THREADS} threads"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
