#!/usr/bin/env python3
"""CPU decode attention: kvstore.ops.paged_attention against SDPA and memcpy.

    python benches/bench_attention.py [--dtype bfloat16] [--contexts 1024,8192,32768]
                                      [--batches 1,16] [--seconds 1.0] [--json OUT]

For each (batch, context) the KV of every sequence lies in randomly placed
pages of a paged cache ([num_blocks, B, H, D], a Llama-3-8B-like layer: 32
query heads over H=8 KV heads, D=128, B=16). One decode step (one query token
per sequence) is timed with

- paged: kvstore.ops.paged_attention over the pages;
- sdpa: torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) over
  the same KV gathered into contiguous [batch, H, T, D] tensors beforehand (the
  gather is not timed), i.e. the best case for SDPA;

and the KV bytes read per second by the paged kernel are compared with the
bandwidth of a memcpy (torch copy_ of a 256 MiB buffer, counted as bytes read
per second) measured in the same run. Ratios: sdpa time / paged time (target
>= 0.8: paged at least 0.8x SDPA's speed) and paged KV bytes/s / memcpy bytes/s.

Each call is repeated (at least 3 times, about --seconds); the table shows the
fastest and the median call. On a shared machine the median includes waits for
a descheduled OpenMP thread (multiples of the scheduler tick): the fastest call
is the kernel's own speed, the median what a busy host gives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvstore import ops

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16


def timeit(fn: Callable[[], Any], seconds: float) -> tuple[float, float]:
    """(fastest, median) seconds per call of `fn` over at least 3 calls and about
    `seconds`."""
    fn()  # warm up (first-touch page faults, lazy init)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def memcpy_bandwidth(seconds: float) -> float:
    """Bytes read per second by a large copy (the source bytes over the fastest copy)."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return src.numel() / timeit(lambda: dst.copy_(src), seconds)[0]


def case(batch: int, context: int, dtype: torch.dtype, seconds: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=g).to(dtype)
    scale = HEAD_DIM**-0.5

    # The same KV, contiguous, for SDPA: [batch, H, T, D].
    k = torch.empty(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype)
    v = torch.empty_like(k)
    for s in range(batch):
        rows = tables[s].long()
        k[s] = key_cache[rows].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
        v[s] = value_cache[rows].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
    q4 = q[:, :, None]

    def paged() -> torch.Tensor:
        return ops.paged_attention(q, key_cache, value_cache, tables, seq_lens, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    diff = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
    paged_min, paged_med = timeit(paged, seconds)
    sdpa_min, sdpa_med = timeit(sdpa, seconds)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    return {
        "batch": batch,
        "context": context,
        "paged_ms_min": paged_min * 1e3,
        "paged_ms_median": paged_med * 1e3,
        "sdpa_ms_min": sdpa_min * 1e3,
        "sdpa_ms_median": sdpa_med * 1e3,
        "speed_vs_sdpa_min": sdpa_min / paged_min,
        "speed_vs_sdpa_median": sdpa_med / paged_med,
        "kv_bytes": kv_bytes,
        "paged_bytes_per_s": kv_bytes / paged_min,
        "max_abs_diff_vs_sdpa": diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    t0 = time.perf_counter()
    ops.load()
    print(f"kvstore.ops loaded in {time.perf_counter() - t0:.1f} s (built on first use)")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"H={NUM_KV_HEADS} kv heads x {GROUP} query heads, D={HEAD_DIM}, B={BLOCK}, "
        "random page placement"
    )
    memcpy = memcpy_bandwidth(args.seconds)
    rows = []
    for batch in batches:
        for context in contexts:
            r = case(batch, context, dtype, args.seconds)
            r["memcpy_bytes_per_s"] = memcpy
            r["vs_memcpy"] = r["paged_bytes_per_s"] / memcpy
            rows.append(r)
    memcpy_after = memcpy_bandwidth(args.seconds)

    head = (
        f"{'batch':>5} {'context':>7} {'paged ms':>15} {'sdpa ms':>17} {'paged/sdpa speed':>17} "
        f"{'KV GB/s':>8} {'memcpy GB/s':>11} {'KV/memcpy':>9}"
    )
    print(head)
    print(f"{'':>13} {'fastest median':>15} {'fastest  median':>17} {'fastest median':>17}")
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context']:>7} "
            f"{r['paged_ms_min']:>7.2f} {r['paged_ms_median']:>7.2f} "
            f"{r['sdpa_ms_min']:>8.2f} {r['sdpa_ms_median']:>8.2f} "
            f"{r['speed_vs_sdpa_min']:>7.2f}x {r['speed_vs_sdpa_median']:>7.2f}x "
            f"{r['paged_bytes_per_s'] / 1e9:>8.2f} {memcpy / 1e9:>11.2f} {r['vs_memcpy']:>9.2f}"
        )
    print(
        f"memcpy GB/s (bytes read per second, fastest copy): {memcpy / 1e9:.2f} before, "
        f"{memcpy_after / 1e9:.2f} after the cases; KV GB/s from the fastest paged call"
    )
    worst = min(min(r["speed_vs_sdpa_min"], r["speed_vs_sdpa_median"]) for r in rows)
    print(f"slowest paged/sdpa speed ratio: {worst:.2f}x (target >= 0.8x)")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
