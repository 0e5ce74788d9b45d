"""CPU time of one paged decode step, for A/B runs of kernel builds on a busy host.

bench_attention.py's layer (8 kv heads x 4 query heads, D 128, block 16, bf16 query),
one configuration per process: the KV from DRAM (blocks at random places, one copy per
sequence; --huge: on huge pages, from kvstore.torch.host_pages, as bench_attention's
"paged huge") or "hot" (every table entry points at one of 4 blocks, which stay in L2:
the kernel's own speed). Prints the fastest call's process CPU time, which a descheduled
thread does not inflate (wall time beside it), so old and new kernels can be compared
in alternating processes while other work runs:

    for v in /tmp/old /tmp/new; do
        KVSTORE_CSRC=$v python benches/attention_cpu_time.py --cache bf16 --hot --threads 1
    done

(`KVSTORE_CSRC` picks the kernel sources; see kvstore.ops.source_dir.)
"""

from __future__ import annotations

import argparse
import time

import torch

from kvstore import ops

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16
HOT_BLOCKS = 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--hot", action="store_true", help="KV in L2 (4 blocks)")
    ap.add_argument("--huge", action="store_true", help="KV on huge pages")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    num_blocks = args.batch * args.context // BLOCK
    # Random content from 64 random blocks, as bench_attention.py.
    src = torch.randn((2, 64, BLOCK, NUM_KV_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16)
    pick = torch.randint(0, 64, (num_blocks,), generator=g)
    key_cache, value_cache = src[0][pick], src[1][pick]
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(args.batch, -1)
    if args.hot:
        tables = tables % HOT_BLOCKS
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=g).to(torch.bfloat16)
    scales: dict[str, torch.Tensor] = {}
    if args.cache == "fp8":
        fp8 = torch.zeros((2, 64, BLOCK, NUM_KV_HEADS, HEAD_DIM), dtype=torch.uint8)
        fp8 = fp8.view(torch.float8_e4m3fn)
        s = torch.zeros(2, 64, NUM_KV_HEADS)
        flat = src.float().view(2, 64 * BLOCK, NUM_KV_HEADS, HEAD_DIM)
        ops.write_kv(flat[0], flat[1], fp8[0], fp8[1], torch.arange(64 * BLOCK), s[0], s[1])
        key_cache, value_cache = fp8[0][pick], fp8[1][pick]
        scales = {"key_scales": s[0][pick], "value_scales": s[1][pick]}

    if args.huge:
        from kvstore.torch import host_pages

        caches = []
        for c in (key_cache, value_cache):
            raw, kind = host_pages(c.numel() * c.element_size())
            caches.append(raw.view(c.dtype).view(c.shape).copy_(c))
        key_cache, value_cache = caches

    def step() -> torch.Tensor:
        return ops.paged_attention(
            q, key_cache, value_cache, tables, seq_lens, HEAD_DIM**-0.5, **scales
        )

    step()
    step()
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(args.calls):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    where = "L2" if args.hot else f"DRAM ({kind} pages)" if args.huge else "DRAM"
    print(
        f"{args.cache} {where} threads {args.threads} batch {args.batch} context {args.context}: "
        f"CPU ms fastest {min(cpu) * 1e3:.2f}, wall ms fastest {min(wall) * 1e3:.2f} "
        f"median {sorted(wall)[len(wall) // 2] * 1e3:.2f}; {ops.last_kernel()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
