#!/usr/bin/env python3
"""CUDA decode attention: kvstore.ops.paged_attention against the GPU's memory rate.

    python benches/bench_attention_cuda.py [--contexts 1024,8192,32768,131072]
                                           [--batches 1,16,64] [--max-kv-gib 16]
                                           [--json OUT]

Each case is one decode step (one query token per sequence) of a Llama-3-8B-like
layer: 32 query heads over H=8 kv heads, D=128, blocks of B=16 tokens placed at
random in a paged cache `[num_blocks, B, H, D]`. Rows:

- bf16: kvstore.ops.paged_attention over a bfloat16 cache;
- fp8: the same KV as float8_e4m3fn with a float32 scale per (block, kv head), half
  the bytes per token; bf16/fp8 is the speed-up of its step over bf16's;
- sdpa: torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) over the
  same bfloat16 KV gathered into contiguous `[batch, H, T, D]` tensors beforehand
  (whatever backend torch picks; the gather is not timed), the peer a user without a
  paged kernel has; only up to --sdpa-max-gib of KV.

The limit is the device's memory rate, measured in the same run: "read" is a torch
sum over a bfloat16 buffer of --stream-gib (bytes read per second), "copy" a
device-to-device copy of the same size (bytes read plus bytes written per second,
as the device's copy rate is usually quoted). KV/read is the KV bytes a step reads
over its time, over the read rate.

Times are the device's: each step is captured --graph-steps times in a CUDA graph and
the graph replayed; the fastest replay over about --seconds gives the time per step
(eager launches add the host's dispatch, about 10-20 us, which hides the kernel at
small sizes; the eager time is printed beside it). The L2 cache (50-60 MB on a Hopper)
would hold a small case's KV: a case whose KV is below --l2-guard-mib is laid out in
several copies, and successive steps in a graph read successive copies, so every step
reads its KV from device memory.

Each case's bf16 output is checked against SDPA in float32 over the same KV, and its
fp8 output against SDPA over the dequantized KV (max abs difference printed).
The load average is printed with the memory rates and again at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
FP8 = torch.float8_e4m3fn


def kv_bytes(batch: int, context: int) -> int:
    """Bytes of bfloat16 K and V a step over `batch` sequences of `context` tokens reads."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2


def device_seconds(fn: Callable[[], Any], seconds: float) -> list[float]:
    """Seconds per run of `fn` (which enqueues device work) over at least 5 runs and
    about `seconds`, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def memory_rates(nbytes: int, seconds: float) -> tuple[float, float]:
    """(read, copy) bytes per second of the device: a sum over `nbytes` of bfloat16,
    and a copy of `nbytes` counting bytes read and written."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    read = nbytes / min(device_seconds(lambda: src.sum(dtype=torch.float32), seconds))
    copy = 2 * nbytes / min(device_seconds(lambda: dst.copy_(src), seconds))
    return read, copy


class Case:
    """`copies` independent copies of a batch of `batch` sequences of `context`
    tokens in one paged cache (blocks at random), bf16 and fp8, and the contiguous KV
    of copy 0 for SDPA."""

    def __init__(self, batch: int, context: int, copies: int, with_sdpa: bool) -> None:
        g = torch.Generator(device="cuda").manual_seed(batch * 7919 + context)
        per_seq = -(-context // BLOCK)
        num_blocks = copies * batch * per_seq + 1
        shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
        self.kc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        self.vc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        perm = torch.randperm(num_blocks, generator=g, device="cuda").int()
        self.tables = perm[: copies * batch * per_seq].view(copies, batch, per_seq)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(
            batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=g, device="cuda"
        ).bfloat16()
        self.kc8, self.ks = quantize(self.kc)
        self.vc8, self.vs = quantize(self.vc)
        self.kv_bytes = kv_bytes(batch, context)
        self.kv_bytes_fp8 = self.kv_bytes // 2 + 2 * batch * per_seq * NUM_KV_HEADS * 4
        self.copies = copies
        self.k = self.v = None
        if with_sdpa:
            self.k, self.v = (self.gather(c, 0) for c in (self.kc, self.vc))

    def gather(self, cache: torch.Tensor, copy: int) -> torch.Tensor:
        """Copy `copy`'s KV as contiguous `[batch, H, T, D]`."""
        t = cache[self.tables[copy].long()].flatten(1, 2)  # [batch, T', H, D]
        return t[:, : int(self.lens[0])].transpose(1, 2).contiguous()

    def bf16(self, copy: int) -> torch.Tensor:
        scale = 1 / math.sqrt(HEAD_DIM)
        return ops.paged_attention(self.q, self.kc, self.vc, self.tables[copy], self.lens, scale)

    def fp8(self, copy: int) -> torch.Tensor:
        scale = 1 / math.sqrt(HEAD_DIM)
        return ops.paged_attention(
            self.q, self.kc8, self.vc8, self.tables[copy], self.lens, scale, self.ks, self.vs
        )

    def sdpa(self, _copy: int) -> torch.Tensor:
        q = self.q[:, :, None]  # [batch, heads, 1, D]
        return F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=True)


def quantize(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 bytes and float32 scales per (block, kv head): the block's largest magnitude
    maps to 448 (the bench needs realistic bytes, not write_kv's token-order policy)."""
    amax = cache.float().abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scales = amax / 448
    return (cache.float() / scales[:, None, :, None]).to(FP8), scales


def max_diff(case: Case, fp8: bool, seqs: int = 2) -> float:
    """Largest difference of the op's output for copy 0's first `seqs` sequences from
    float32 SDPA over their KV (dequantized for fp8)."""
    t = case.tables[0, :seqs].long()
    n = int(case.lens[0])
    if fp8:
        k = case.kc8[t].float() * case.ks[t][:, :, None, :, None]
        v = case.vc8[t].float() * case.vs[t][:, :, None, :, None]
    else:
        k, v = case.kc[t].float(), case.vc[t].float()
    k, v = (x.flatten(1, 2)[:, :n].transpose(1, 2) for x in (k, v))
    q = case.q[:seqs].float()[:, :, None]
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
    got = (case.fp8(0) if fp8 else case.bf16(0))[:seqs].float()
    return (got - ref).abs().max().item()


def step_seconds(
    step: Callable[[int], torch.Tensor], copies: int, graph_steps: int, seconds: float
) -> tuple[float, float]:
    """(graph, eager) seconds per step: the fastest replay of a CUDA graph of
    `graph_steps` steps (over the copies in turn) per step, and the median eager step."""
    eager = statistics.median(device_seconds(lambda: step(0), seconds / 4))
    n = max(graph_steps, copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            step(i % copies)  # warm the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(n):
                step(i % copies)
    except RuntimeError as e:  # a step that cannot be captured is timed eagerly
        print(f"  (not captured: {str(e).splitlines()[0]}; eager time instead)")
        return eager, eager
    replay = min(device_seconds(graph.replay, seconds)) / n
    del graph
    return replay, eager


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,8192,32768,131072")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--max-kv-gib", type=float, default=16.0, help="largest bf16 KV")
    parser.add_argument("--sdpa-max-gib", type=float, default=4.0, help="largest KV for SDPA")
    parser.add_argument("--stream-gib", type=float, default=4.0, help="memory-rate buffer")
    parser.add_argument("--l2-guard-mib", type=float, default=512.0)
    parser.add_argument("--graph-steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_cuda: needs a CUDA device (none available)", file=sys.stderr)
        return 2
    ops.load()
    props = torch.cuda.get_device_properties(0)
    read, copy = memory_rates(int(args.stream_gib * 2**30), args.seconds)
    torch.cuda.empty_cache()
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}: "
        f"read {read / 1e12:.2f} TB/s, copy {copy / 1e12:.2f} TB/s (read + write), "
        "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    )
    head = (
        f"{'batch':>5} {'context':>7} {'copies':>6} | {'bf16 us':>8} {'KV/read':>7} "
        f"{'KV/copy':>7} {'eager us':>8} | {'fp8 us':>7} {'KV/read':>7} {'bf16/fp8':>8} | "
        f"{'sdpa us':>7} {'sdpa/ours':>9} | {'diff bf16':>9} {'diff fp8':>8}"
    )
    print(head)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            kv = kv_bytes(batch, context)
            if kv > args.max_kv_gib * 2**30:
                print(f"{batch:>5} {context:>7}: KV {kv / 2**30:.1f} GiB > --max-kv-gib, skipped")
                continue
            copies = max(1, math.ceil(args.l2_guard_mib * 2**20 / kv))
            with_sdpa = kv <= args.sdpa_max_gib * 2**30
            case = Case(batch, context, copies, with_sdpa)
            diff, diff8 = max_diff(case, False), max_diff(case, True)
            t, eager = step_seconds(case.bf16, copies, args.graph_steps, args.seconds)
            t8, _ = step_seconds(case.fp8, copies, args.graph_steps, args.seconds)
            ts = step_seconds(case.sdpa, 1, args.graph_steps, args.seconds)[0] if with_sdpa else 0
            row = {
                "batch": batch,
                "context": context,
                "copies": copies,
                "bf16_s": t,
                "bf16_eager_s": eager,
                "fp8_s": t8,
                "sdpa_s": ts or None,
                "kv_over_read": case.kv_bytes / t / read,
                "kv_over_copy": case.kv_bytes / t / copy,
                "fp8_kv_over_read": case.kv_bytes_fp8 / t8 / read,
                "bf16_over_fp8": t / t8,
                "max_abs_diff_bf16": diff,
                "max_abs_diff_fp8": diff8,
            }
            rows.append(row)
            sdpa = f"{ts * 1e6:>7.1f} {ts / t:>8.2f}x" if ts else f"{'-':>7} {'-':>9}"
            print(
                f"{batch:>5} {context:>7} {copies:>6} | {t * 1e6:>8.1f} "
                f"{row['kv_over_read']:>7.2f} {row['kv_over_copy']:>7.2f} {eager * 1e6:>8.1f} | "
                f"{t8 * 1e6:>7.1f} {row['fp8_kv_over_read']:>7.2f} {t / t8:>7.2f}x | {sdpa} | "
                f"{diff:>9.2e} {diff8:>8.2e}",
                flush=True,
            )
            del case
            torch.cuda.empty_cache()
    print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.json:
        meta = {"device": props.name, "read_Bps": read, "copy_Bps": copy}
        meta["load_average_end"] = os.getloadavg()
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
