#!/usr/bin/env python3
"""CPU decode attention: kvstore.ops.paged_attention at the memory wall.

    python benches/bench_attention.py [--dtype bfloat16] [--contexts 1024,8192,32768,131072]
                                      [--batches 1,16] [--seconds 1.0] [--max-kv-gib 4]
                                      [--sdpa-max-gib 1] [--rounds 5] [--json OUT]

For each (batch, context) the KV of every sequence lies in randomly placed
pages of a paged cache ([num_blocks, B, H, D], a Llama-3-8B-like layer: 32
query heads over H=8 KV heads, D=128, B=16). One decode step (one query token
per sequence) is timed with

- paged 4k: kvstore.ops.paged_attention over a cache on 4 KiB pages (torch.empty);
- paged huge: the same over a cache from kvstore.torch.host_pages (what a CPU
  BlockPool uses: hugetlb, else transparent huge pages; the kind is printed);
- sdpa: torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) over
  the same KV gathered into contiguous [batch, H, T, D] tensors beforehand (the
  gather is not timed), i.e. the best case for SDPA; only up to --sdpa-max-gib
  of KV (the copy doubles the memory);
- vllm: vLLM's CPU decode kernel (`vllm._custom_ops.cpu_attention_with_kv_cache`,
  what its CPU attention backend calls, ISA "vec") over the same K and V, same lengths,
  same threads, written by its own `cpu_attn_reshape_and_cache` into its own paged
  layout (`[num_blocks, H, 32, 2 D]`: block size 32, the smallest it takes, blocks
  placed at random like ours, 4 KiB pages), where vLLM's CPU build is installed (run
  this script with the python that `bash scripts/vllm_env.sh` prints and
  PYTHONPATH=python); paged/vllm is its fastest call over our fastest paged 4k call;
  vllm fp8 is the same with its fp8 KV cache ("fp8_e4m3", one scale per tensor for
  K and for V), and fp8/vllm fp8 its fastest call over our fastest fp8 call;
- fp8: paged_attention over the same KV quantized to float8_e4m3fn by write_kv
  (fp32 scales per block and kv head; 4 KiB pages like "paged 4k"): half the
  bytes of bf16 per token. Its KV/stream counts its own (fp8) bytes, and
  bf16/fp8 is the speed-up of the fastest fp8 call over the fastest paged 4k one;
- fp8 huge: the same fp8 KV on huge pages (as paged huge), and huge/fp8h the speed-up
  of its fastest call over paged huge's.

Bytes or instructions: each case's step (bf16 and fp8) also runs over a table whose
entries all point at 4 blocks, which stay in each core's L2 ("hot": the kernel's own
speed, same threads); a second table gives both over the read stream and what binds the
step: instructions where hot is below the stream, bytes where the step reaches 0.8 of
it, else latency (misses not overlapped).

The limit of a decode step is the machine's read bandwidth: every KV byte is
read once. It is measured in the same run, with the same threads, as a torch
sum over a float32 buffer of --stream-gib (larger than the caches), one
--stream-slice-mib slice per call (each slice comes from DRAM: it was last read a
whole buffer ago; a call lasts about as long as a 32K step, so on a busy host an
uninterrupted call is as likely for the stream as for the op). Stream and op are
interleaved: each case runs --rounds rounds of (stream, paged 4k, paged huge, fp8,
fp8 huge),
so a host whose load changes moves both alike, and KV/stream (huge/stream,
fp8/stream) is a ratio of medians: the median over the rounds of the op's fastest
call's bytes per second over the median of the stream's fastest calls; the fastest
stream of the run is printed beside it. At 1K the KV (4 MiB per sequence) fits in
the last-level cache, so ratios above 1 are possible there.
A case whose KV exceeds --max-kv-gib runs at the largest batch that fits (the
row says so).

Each call is repeated (at least 3 times, about --seconds); the table shows the
fastest and the median call. On a shared machine the median includes waits for
a descheduled OpenMP thread (multiples of the scheduler tick): the fastest call
is the kernel's own speed, the median what a busy host gives. The load average
(/proc/loadavg) is printed with the figures.
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
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32
# Blocks of the "hot" step (bytes or instructions): 4 blocks of K and V, 256 KiB in
# bfloat16, stay in a core's L2.
HOT_BLOCKS = 4


def calls(fn: Callable[[], Any], seconds: float, warm: bool = True) -> list[float]:
    """Seconds of each call of `fn` over at least 3 calls and about `seconds`."""
    if warm:
        fn()  # warm up (first-touch page faults, lazy init)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def timeit(fn: Callable[[], Any], seconds: float) -> tuple[float, float]:
    """(fastest, median) seconds per call of `fn` over at least 3 calls and about
    `seconds`."""
    times = calls(fn, seconds)
    return min(times), statistics.median(times)


class ReadStream:
    """The limit: a read-only stream, a torch sum (same threads as the op) over a float32
    buffer of `nbytes` (larger than the caches), one `slice_bytes` slice per call, the
    slices in turn: each call reads from DRAM (the slice was last read a whole buffer
    ago) and lasts about as long as a long decode step, so a call that the scheduler
    does not interrupt can be found on a busy host as it can for the op."""

    def __init__(self, nbytes: int, slice_bytes: int) -> None:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        n = max(min(slice_bytes, nbytes) // 4, 1)
        self.slices = list(buf.split(n))[: max(buf.numel() // n, 1)]
        self.nbytes = self.slices[0].numel() * 4
        self.next = 0

    def __call__(self) -> torch.Tensor:
        s = self.slices[self.next]
        self.next = (self.next + 1) % len(self.slices)
        return s.sum()

    def rate(self, seconds: float) -> float:
        """Bytes per second of the fastest call over about `seconds`."""
        return self.nbytes / min(calls(self, seconds))


def paired(
    stream: ReadStream, fns: dict[str, Callable[[], Any]], rounds: int, seconds: float
) -> tuple[list[float], dict[str, list[float]], dict[str, list[float]]]:
    """The stream and each of `fns` in turn, `rounds` times (stream, fns, stream, fns,
    ...), so that a host whose load changes moves the limit and the op alike: the
    stream's fastest call per round (bytes per second), each fn's fastest call per round
    and all its calls (seconds)."""
    for fn in fns.values():
        fn()  # warm up
    streams: list[float] = []
    fastest: dict[str, list[float]] = {k: [] for k in fns}
    every: dict[str, list[float]] = {k: [] for k in fns}
    per = seconds / rounds
    for _ in range(rounds):
        streams.append(stream.rate(per))
        for k, fn in fns.items():
            times = calls(fn, per, warm=False)
            fastest[k].append(min(times))
            every[k].extend(times)
    return streams, fastest, every


def vllm_ops() -> Any:
    """vLLM's custom ops module (its CPU build), or None where vLLM is not installed."""
    try:
        import vllm._custom_ops as vops
    except ImportError:
        return None
    return vops


def vllm_decode(
    vops: Any,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    g: torch.Generator,
    fp8_scales: tuple[float, float] | None = None,
) -> Callable[[], torch.Tensor]:
    """A decode step of vLLM's CPU kernel over the K and V our cache holds for each
    sequence (copied by vLLM's own writer into its layout, one sequence at a time);
    with `fp8_scales` (its per-tensor K and V scales), quantized by that writer to
    e4m3 (vLLM's "fp8_e4m3" KV cache)."""
    batch, num_heads, head_dim = q.shape
    context = int(seq_lens.max())
    bs = VLLM_BLOCK
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq + 1  # block 0 is vLLM's null block
    cache_dtype = "fp8_e4m3" if fp8_scales else "auto"
    k_scale, v_scale = fp8_scales or (1.0, 1.0)
    kv = torch.zeros(
        num_blocks, NUM_KV_HEADS, bs, 2 * head_dim, dtype=torch.uint8 if fp8_scales else q.dtype
    )
    # The backend's own views: [blocks, H, 2 bs, D] split into K and V halves.
    kc, vc = kv.view(num_blocks, NUM_KV_HEADS, 2 * bs, head_dim).chunk(2, dim=2)
    table = (torch.randperm(num_blocks - 1, generator=g) + 1).int().view(batch, blocks_per_seq)
    t = torch.arange(context)
    for s in range(batch):
        rows = tables[s].long()
        k = key_cache[rows].reshape(-1, NUM_KV_HEADS, head_dim)[:context]
        v = value_cache[rows].reshape(-1, NUM_KV_HEADS, head_dim)[:context]
        slots = table[s].long()[t // bs] * bs + t % bs
        vops.cpu_attn_reshape_and_cache(
            k, v, kc, vc, slots, "vec", k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=cache_dtype
        )
    start = torch.arange(batch + 1, dtype=torch.int32)
    meta = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch,
        num_heads=num_heads,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=q.dtype,
        query_start_loc=start,
        causal=True,
        sliding_window_size=-1,
        isa="vec",
        enable_kv_split=True,
        kv_cache_dtype=cache_dtype,
    )
    out = torch.empty_like(q)

    def step() -> torch.Tensor:
        vops.cpu_attention_with_kv_cache(
            q,
            kc,
            vc,
            out,
            start,
            seq_lens,
            scale,
            True,
            None,
            -1,
            table,
            0.0,
            meta,
            None,
            None,
            k_scale,
            v_scale,
            cache_dtype,
        )
        return out

    return step


def vllm_fp8_refusal(vops: Any, dtype: torch.dtype) -> str | None:
    """Why vLLM's fp8 KV cache does not run on this CPU (its writer refuses it without
    AVX-512 or AMX: "Unsupported CPU attention configuration"), or None where it runs:
    asked once, on a one-block case, not by every row after allocating its cache."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 1, BLOCK, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(1, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=g).to(dtype)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    seq_lens = torch.tensor([BLOCK], dtype=torch.int32)
    try:
        vllm_decode(vops, q, cache[0], cache[1], tables, seq_lens, 1.0, g, (1.0, 1.0))()
    except RuntimeError as e:
        return str(e)
    return None


def vops_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except (ImportError, AttributeError):
        return "?"


def bound(step: float, hot: float) -> str:
    """What binds a step that reads KV at `step` of the read stream and runs at `hot` of
    it with the KV in L2."""
    if hot < 1.0:
        return "instructions"
    return "bytes" if step >= 0.8 else "latency"


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def case(
    batch: int,
    context: int,
    dtype: torch.dtype,
    seconds: float,
    sdpa_max_bytes: int,
    stream: ReadStream,
    rounds: int,
    vops: Any = None,
    vllm_fp8_refused: str | None = None,
) -> dict[str, Any]:
    from kvstore.torch import host_pages

    g = torch.Generator().manual_seed(0)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    # Random content from 64 random blocks (generating GiBs of randn would dominate).
    src = torch.randn((2, 64, *shape[1:]), generator=g).to(dtype)
    pick = torch.randint(0, 64, (num_blocks,), generator=g)
    key_cache, value_cache = src[0][pick], src[1][pick]
    elem = key_cache.element_size()
    raw, page_kind = host_pages(2 * key_cache.numel() * elem)
    huge = raw.view(dtype).view(2, *shape)
    huge[0].copy_(key_cache)
    huge[1].copy_(value_cache)
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=g).to(dtype)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem

    # fp8: the 64 source blocks quantized once by write_kv, picked like the others.
    fp8 = torch.float8_e4m3fn
    src8 = torch.zeros((2, 64, *shape[1:]), dtype=torch.uint8).view(fp8)
    scales8 = torch.zeros(2, 64, NUM_KV_HEADS)
    flat = src.float().view(2, 64 * BLOCK, NUM_KV_HEADS, HEAD_DIM)
    ops.write_kv(flat[0], flat[1], src8[0], src8[1], torch.arange(64 * BLOCK), *scales8)
    key8, value8 = src8[0][pick], src8[1][pick]
    kscale8, vscale8 = scales8[0][pick], scales8[1][pick]
    fp8_bytes = kv_bytes // elem
    raw8, _ = host_pages(2 * key8.numel())
    huge8 = raw8.view(fp8).view(2, *shape)
    huge8[0].copy_(key8)
    huge8[1].copy_(value8)

    def paged() -> torch.Tensor:
        return ops.paged_attention(q, key_cache, value_cache, tables, seq_lens, scale)

    def paged_fp8() -> torch.Tensor:
        return ops.paged_attention(
            q, key8, value8, tables, seq_lens, scale, key_scales=kscale8, value_scales=vscale8
        )

    def paged_huge() -> torch.Tensor:
        return ops.paged_attention(q, huge[0], huge[1], tables, seq_lens, scale)

    def fp8_huge() -> torch.Tensor:
        return ops.paged_attention(
            q, huge8[0], huge8[1], tables, seq_lens, scale, key_scales=kscale8, value_scales=vscale8
        )

    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    out = paged()
    row["kernel"] = ops.last_kernel()
    assert torch.equal(out, paged_huge())
    row["fp8_max_abs_diff"] = (paged_fp8().float() - out.float()).abs().max().item()
    assert torch.equal(paged_fp8(), fp8_huge())
    # The stream and the four paged steps interleaved, round by round: each ratio to the
    # stream is a ratio of medians over the rounds (fastest call per round, both sides).
    streams, fastest, every = paired(
        stream,
        {"paged": paged, "huge": paged_huge, "fp8": paged_fp8, "fp8huge": fp8_huge},
        rounds,
        3 * seconds,
    )
    row["page_kind"] = page_kind
    row["streams"] = streams
    row["read_stream_bytes_per_s"] = statistics.median(streams)
    named = (("paged", kv_bytes), ("huge", kv_bytes), ("fp8", fp8_bytes), ("fp8huge", fp8_bytes))
    for name, nbytes in named:
        row[f"{name}_ms_min"] = min(fastest[name]) * 1e3
        row[f"{name}_ms_median"] = statistics.median(every[name]) * 1e3
        row[f"{name}_bytes_per_s"] = nbytes / min(fastest[name])
        rate = statistics.median(nbytes / t for t in fastest[name])
        row[f"{name}_vs_stream"] = rate / row["read_stream_bytes_per_s"]
    row["fp8_speedup"] = row["paged_ms_min"] / row["fp8_ms_min"]
    row["fp8_huge_speedup"] = row["huge_ms_min"] / row["fp8huge_ms_min"]
    # Bytes or instructions: the same step over HOT_BLOCKS blocks that stay in each
    # core's L2 (every table entry points at one of them) is the kernel's own speed;
    # where it is below the read stream, the step is bound by instructions, not bytes.
    hot_tables = tables % HOT_BLOCKS
    row["hot_ms_min"] = (
        timeit(
            lambda: ops.paged_attention(q, key_cache, value_cache, hot_tables, seq_lens, scale),
            seconds,
        )[0]
        * 1e3
    )
    row["fp8_hot_ms_min"] = (
        timeit(
            lambda: ops.paged_attention(
                q,
                key8,
                value8,
                hot_tables,
                seq_lens,
                scale,
                key_scales=kscale8,
                value_scales=vscale8,
            ),
            seconds,
        )[0]
        * 1e3
    )
    row["hot_bytes_per_s"] = kv_bytes / row["hot_ms_min"] * 1e3
    row["fp8_hot_bytes_per_s"] = fp8_bytes / row["fp8_hot_ms_min"] * 1e3
    if vops is not None and dtype != torch.float32:
        vllm = vllm_decode(vops, q, key_cache, value_cache, tables, seq_lens, scale, g)
        row["vllm_max_abs_diff"] = (vllm().float() - out.float()).abs().max().item()
        row["vllm_ms_min"], row["vllm_ms_median"] = (t * 1e3 for t in timeit(vllm, seconds))
        row["vllm_bytes_per_s"] = kv_bytes / row["vllm_ms_min"] * 1e3
        row["speed_vs_vllm"] = row["vllm_ms_min"] / row["paged_ms_min"]
        del vllm
        # vLLM's fp8: one scale per tensor (K, V), from the largest |value|.
        scales = (float(src[0].abs().max()) / ops.FP8_MAX, float(src[1].abs().max()) / ops.FP8_MAX)
        if vllm_fp8_refused is not None:
            row["vllm_fp8_unsupported"] = vllm_fp8_refused  # the row says so, not a figure
        else:
            vllm8 = vllm_decode(vops, q, key_cache, value_cache, tables, seq_lens, scale, g, scales)
            row["vllm_fp8_max_abs_diff"] = (vllm8().float() - out.float()).abs().max().item()
            row["vllm_fp8_ms_min"], row["vllm_fp8_ms_median"] = (
                t * 1e3 for t in timeit(vllm8, seconds)
            )
            row["speed_fp8_vs_vllm_fp8"] = row["vllm_fp8_ms_min"] / row["fp8_ms_min"]
            del vllm8
    if kv_bytes <= sdpa_max_bytes:
        # The same KV, contiguous, for SDPA: [batch, H, T, D].
        k = torch.empty(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype)
        v = torch.empty_like(k)
        for s in range(batch):
            rows = tables[s].long()
            k[s] = key_cache[rows].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
            v[s] = value_cache[rows].reshape(context, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1)
        q4 = q[:, :, None]

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        row["max_abs_diff_vs_sdpa"] = (out.float() - sdpa()[:, :, 0].float()).abs().max().item()
        sdpa_min, sdpa_med = timeit(sdpa, seconds)
        row["sdpa_ms_min"], row["sdpa_ms_median"] = sdpa_min * 1e3, sdpa_med * 1e3
        row["speed_vs_sdpa_min"] = row["sdpa_ms_min"] / row["paged_ms_min"]
        row["speed_vs_sdpa_median"] = row["sdpa_ms_median"] / row["paged_ms_median"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="1024,8192,32768,131072")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--max-kv-gib", type=float, default=4.0, help="largest KV of a case")
    parser.add_argument("--sdpa-max-gib", type=float, default=1.0, help="largest KV for SDPA")
    parser.add_argument("--stream-gib", type=float, default=1.0, help="read-stream buffer")
    parser.add_argument(
        "--stream-slice-mib", type=float, default=64.0, help="bytes a stream call reads"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="stream/op rounds per case (ratio of medians)"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's kernel")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    gib = 1 << 30

    t0 = time.perf_counter()
    ops.load()
    print(f"kvstore.ops loaded in {time.perf_counter() - t0:.1f} s (built on first use)")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"H={NUM_KV_HEADS} kv heads x {GROUP} query heads, D={HEAD_DIM}, B={BLOCK}, "
        f"random page placement; load average {load_average()} (before)"
    )
    vops = None if args.no_vllm else vllm_ops()
    if vops is None:
        print(
            "vLLM's CPU kernel: not installed here (the peer runs under the python that "
            "`bash scripts/vllm_env.sh` prints, with PYTHONPATH=python)"
        )
    refused = vllm_fp8_refusal(vops, dtype) if vops is not None and dtype != torch.float32 else None
    stream = ReadStream(int(args.stream_gib * gib), int(args.stream_slice_mib * (1 << 20)))
    streams: list[float] = []
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    for batch in batches:
        for context in contexts:
            per_seq = 2 * context * NUM_KV_HEADS * HEAD_DIM * elem
            fits = max(1, min(batch, int(args.max_kv_gib * gib) // per_seq))
            r = case(
                fits,
                context,
                dtype,
                args.seconds,
                int(args.sdpa_max_gib * gib),
                stream,
                args.rounds,
                vops,
                refused,
            )
            r["batch_asked"] = batch
            rows.append(r)
            streams.extend(r["streams"])
    load_after = load_average()
    for r in rows:
        # The paged steps against the stream of their own rounds (ratio of medians); the
        # rest (hot, vLLM: measured apart) against the same median stream of the case.
        limit = r["read_stream_bytes_per_s"]
        r["vs_read_stream"] = r["paged_vs_stream"]
        r["huge_vs_read_stream"] = r["huge_vs_stream"]
        r["fp8_vs_read_stream"] = r["fp8_vs_stream"]
        r["hot_vs_read_stream"] = r["hot_bytes_per_s"] / limit
        r["fp8_hot_vs_read_stream"] = r["fp8_hot_bytes_per_s"] / limit
        if "vllm_bytes_per_s" in r:
            r["vllm_vs_read_stream"] = r["vllm_bytes_per_s"] / limit

    head = (
        f"{'batch':>7} {'context':>7} {'paged 4k ms':>15} {'paged huge ms':>15} "
        f"{'sdpa ms':>15} {'paged/sdpa':>10} {'KV/stream':>9} {'huge/stream':>11} "
        f"{'fp8 ms':>15} {'fp8/stream':>10} {'bf16/fp8':>8} "
        f"{'fp8 huge ms':>15} {'huge/fp8h':>9} "
        f"{'vllm ms':>15} {'vllm/stream':>11} {'paged/vllm':>10} "
        f"{'vllm fp8 ms':>15} {'fp8/vllm fp8':>12}"
    )
    print(head)
    print(
        f"{'':>15} {'fastest median':>15} {'fastest median':>15} {'fastest median':>15}"
        f"{'':>33} {'fastest median':>15}{'':>21}{'fastest median':>15}{'':>10}"
        f"{'fastest median':>15}"
        f"{'':>24}{'fastest median':>15}"
    )
    print("-" * len(head))
    for r in rows:
        batch = f"{r['batch']}" if r["batch"] == r["batch_asked"] else f"{r['batch']}*"
        sdpa = (
            f"{r['sdpa_ms_min']:>7.2f} {r['sdpa_ms_median']:>7.2f} {r['speed_vs_sdpa_min']:>9.2f}x"
            if "sdpa_ms_min" in r
            else f"{'-':>7} {'-':>7} {'-':>10}"
        )
        vllm = (
            f"{r['vllm_ms_min']:>7.2f} {r['vllm_ms_median']:>7.2f} "
            f"{r['vllm_vs_read_stream']:>11.2f} {r['speed_vs_vllm']:>9.2f}x "
            if "vllm_ms_min" in r
            else f"{'-':>7} {'-':>7} {'-':>11} {'-':>10} "
        ) + (
            f"{r['vllm_fp8_ms_min']:>7.2f} {r['vllm_fp8_ms_median']:>7.2f} "
            f"{r['speed_fp8_vs_vllm_fp8']:>11.2f}x"
            if "vllm_fp8_ms_min" in r
            else f"{'-':>7} {'-':>7} {'-':>12}"
        )
        print(
            f"{batch:>7} {r['context']:>7} "
            f"{r['paged_ms_min']:>7.2f} {r['paged_ms_median']:>7.2f} "
            f"{r['huge_ms_min']:>7.2f} {r['huge_ms_median']:>7.2f} {sdpa} "
            f"{r['vs_read_stream']:>9.2f} {r['huge_vs_read_stream']:>11.2f} "
            f"{r['fp8_ms_min']:>7.2f} {r['fp8_ms_median']:>7.2f} "
            f"{r['fp8_vs_read_stream']:>10.2f} {r['fp8_speedup']:>7.2f}x "
            f"{r['fp8huge_ms_min']:>7.2f} {r['fp8huge_ms_median']:>7.2f} "
            f"{r['fp8_huge_speedup']:>8.2f}x {vllm}"
        )
    reduced = sorted(
        {
            (r["batch_asked"], r["batch"], r["context"])
            for r in rows
            if r["batch"] != r["batch_asked"]
        }
    )
    print(
        "\nbytes or instructions (same KV bytes per second over the read stream; hot: the "
        f"same step over {HOT_BLOCKS} blocks in L2, the kernel's own speed; bound: "
        "instructions where hot < 1, bytes where the step reaches 0.8, else latency)"
    )
    print(
        f"{'batch':>7} {'context':>7} {'KV':>6} {'hot':>6} {'bound':>12}   "
        f"{'fp8':>6} {'fp8 hot':>7} {'bound':>12}"
    )
    for r in rows:
        batch = f"{r['batch']}" if r["batch"] == r["batch_asked"] else f"{r['batch']}*"
        print(
            f"{batch:>7} {r['context']:>7} {r['vs_read_stream']:>6.2f} "
            f"{r['hot_vs_read_stream']:>6.2f} "
            f"{bound(r['vs_read_stream'], r['hot_vs_read_stream']):>12}   "
            f"{r['fp8_vs_read_stream']:>6.2f} {r['fp8_hot_vs_read_stream']:>7.2f} "
            f"{bound(r['fp8_vs_read_stream'], r['fp8_hot_vs_read_stream']):>12}"
        )
    for asked, got, context in reduced:
        print(
            f"* batch {asked} x {context} reduced to {got} (KV over --max-kv-gib {args.max_kv_gib})"
        )
    kernels = sorted({f"{r['kernel']['isa']} x{r['kernel']['partitions']}" for r in rows})
    print(f"kvstore kernel (isa x split-K partitions of the paged call): {', '.join(kernels)}")
    kinds = sorted({r["page_kind"] for r in rows})
    print(
        f"read stream (sum over {args.stream_gib:g} GiB, {args.stream_slice_mib:g} MiB a "
        f"call, {torch.get_num_threads()} threads): median {statistics.median(streams) / 1e9:.2f}"
        f" GB/s, fastest {max(streams) / 1e9:.2f}, slowest {min(streams) / 1e9:.2f} "
        f"({len(streams)} rounds, {args.rounds} per case interleaved with its paged, huge "
        "and fp8 steps); KV/stream, huge/stream, fp8/stream: median over a case's rounds of "
        "the op's fastest call over the median of its streams' fastest calls; hot and "
        f"vLLM over that median stream; huge pages: {', '.join(kinds)}; "
        f"load average {load_after} (after)"
    )
    ratios = [
        min(r["speed_vs_sdpa_min"], r["speed_vs_sdpa_median"])
        for r in rows
        if "speed_vs_sdpa_min" in r
    ]
    if ratios:
        print(f"slowest paged/sdpa speed ratio: {min(ratios):.2f}x (target >= 0.8x)")
    at32 = [r for r in rows if r["context"] == 32768]
    if at32:
        print(
            f"{args.dtype} KV/stream at 32K: "
            + ", ".join(
                f"batch {r['batch']} {r['vs_read_stream']:.2f} "
                f"(huge {r['huge_vs_read_stream']:.2f}; fastest call over the fastest "
                f"stream {r['paged_bytes_per_s'] / max(streams):.2f})"
                for r in at32
            )
            + " (target >= 0.8; on a busy host the stream suffers more than the op)"
        )
    long = [r["fp8_speedup"] for r in rows if r["context"] >= 32768]
    long_huge = [r["fp8_huge_speedup"] for r in rows if r["context"] >= 32768]
    if long:
        print(
            f"fp8 over {args.dtype} at >= 32K: {min(long):.2f}x to {max(long):.2f}x "
            f"(huge pages {min(long_huge):.2f}x to {max(long_huge):.2f}x; "
            "fastest calls; target >= 1.6x); largest |fp8 - paged| "
            f"{max(r['fp8_max_abs_diff'] for r in rows):.3g}"
        )
    peer = [r["speed_vs_vllm"] for r in rows if "speed_vs_vllm" in r]
    peer8 = [r["speed_fp8_vs_vllm_fp8"] for r in rows if "speed_fp8_vs_vllm_fp8" in r]
    if peer8:
        print(
            f"fp8/vllm fp8 (its per-tensor-scale fp8 KV): {min(peer8):.2f}x to {max(peer8):.2f}x; "
            "largest |vllm fp8 - paged| "
            f"{max(r['vllm_fp8_max_abs_diff'] for r in rows if 'vllm_fp8_max_abs_diff' in r):.3g}"
        )
    unsupported = {r["vllm_fp8_unsupported"] for r in rows if "vllm_fp8_unsupported" in r}
    for why in unsupported:
        print(f"vllm fp8: not on this CPU ({why})")
    if peer:
        print(
            f"paged/vllm (vLLM {vops_version()}'s CPU kernel, fastest calls): {min(peer):.2f}x to "
            f"{max(peer):.2f}x (target >= 1x); largest |vllm - paged| "
            f"{max(r['vllm_max_abs_diff'] for r in rows if 'vllm_max_abs_diff' in r):.3g}"
        )
    print(f"run time {time.perf_counter() - t0:.0f} s")
    if args.json:
        doc = {"dtype": args.dtype, "load_average": [load_after], "streams": streams, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
