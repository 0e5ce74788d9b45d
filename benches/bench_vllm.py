#!/usr/bin/env python3
"""vLLM with the kvstore connector: time to first token of a request whose prefix is
stored, in a freshly started vLLM, against the same request recomputed; and the
connector's load and save throughput against memcpy of the same bytes.

    python benches/bench_vllm.py [--prefix 2048] [--suffix 16] [--repeat 3] [--json OUT]

vLLM 0.32's CPU build runs in its own virtualenv (scripts/vllm_env.sh,
$KVSTORE_VLLM_PYTHON), three processes one after another, on a Llama-architecture
model with seeded random weights (bfloat16; hidden 1024, 8 layers, 16 heads,
4 KV heads of 64: 8 KiB of KV per token, 16 MiB for the 2K prefix):

1. a writer (hot tier on) serves the prompt once: the prefix lands in the segments
   and in the shared-memory arena;
2. a fresh vLLM without a hot tier and without vLLM's own prefix cache:
   - recompute: the prompt under another `cache_salt` (no stored prefix);
   - cold: the prompt after evicting the store's files from the page cache
     (fsync + posix_fadvise(DONTNEED), done by the vLLM process between requests);
   - warm: the prompt again (the segments now in the page cache);
3. a fresh vLLM with the hot tier: the prompt, its prefix loaded from the arena.

TTFT is the wall time of `generate(max_tokens=1)` of one prompt of `--prefix` +
`--suffix` tokens, best of `--repeat` (each after a warm-up request of other
tokens). Load throughput: the connector's own counters (bytes it landed in vLLM's
paged cache / microseconds in its loads: store read + scatter), best of the repeats
of each kind; save throughput likewise (gather + put, in the background) in the
writer. The peer is glibc's memcpy (numpy.copyto, one thread, as in bench_store.py)
of the same number of bytes between buffers larger than the CPU caches, in this
process. A load of 2 MiB or more runs on up to min(cores, 4) threads (the store's
reader threads), so the same memcpy cut across that many threads is printed too, with
the load's ratio to it; torch's copy_ (all intra-op threads) is printed for information.
Targets (issue 14): TTFT with the prefix loaded <= 1/5 of recompute; load >= 0.5x
memcpy.

Shapes (issue 45): `--tp 2` runs every vLLM tensor-parallel over two workers (each
stores and loads its KV heads, one record per block and head); `--mla` serves a
DeepSeek-V3-style model with MLA (its latent stored once, vLLM's CPU MLA backend:
block size 16, its own prefix cache off). A fourth vLLM without the connector, its
own prefix cache on, serves the prompt twice: the second TTFT is vLLM's own
prefix-cache hit, the best a store can approach (goal: the stored prefix <= 1.5x
it). vLLM's CPU MLA backend has no prefix cache, so `--mla` has no such row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvstore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import build_model  # noqa: E402
from support import vllm_run  # noqa: E402


def save_model(path: Path, hidden: int, layers: int, mla: bool) -> None:
    """bench_ttft.py's model (seeded random Llama weights), in bfloat16, for vLLM; with
    `mla`, a DeepSeek-V3 with MLA (tests/support/hf_models.py) of `layers` layers."""
    if mla:
        from support.hf_models import tiny_deepseek

        tiny_deepseek("bfloat16", layers=layers).save_pretrained(path)
        return
    build_model(hidden, layers, vocab=1000).to(torch.bfloat16).save_pretrained(path)


def copy_seconds(
    nbytes: int, copy: Callable[[torch.Tensor, torch.Tensor], None], repeat: int = 5
) -> float:
    """Best time of `copy(dst, src)` of `nbytes` (bfloat16) between touched buffers in
    this process, a different pair each time (8 pairs: more than a CPU cache holds, as
    a load's source and vLLM's cache are)."""
    n = max(nbytes // 2, 1)
    pairs = [
        (torch.ones(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16))
        for _ in range(8)
    ]
    best = float("inf")
    for i in range(repeat * len(pairs)):
        src, dst = pairs[i % len(pairs)]
        t0 = time.perf_counter()
        copy(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """glibc's memcpy on one thread (numpy.copyto), bench_store.py's peer."""
    np.copyto(dst.view(torch.int16).numpy(), src.view(torch.int16).numpy())


LOAD_THREADS = min(os.cpu_count() or 1, 4)


def memcpy_threads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`memcpy` cut into LOAD_THREADS consecutive pieces, one thread each (numpy.copyto
    releases the GIL), as a load's reader threads share its blocks."""
    cuts = [len(src) * k // LOAD_THREADS for k in range(LOAD_THREADS + 1)]
    pieces = [(dst[a:b], src[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        list(pool.map(lambda p: memcpy(*p), pieces))


def torch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """torch's copy_, which splits a large copy across the intra-op threads."""
    dst.copy_(src)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every vLLM")
    p.add_argument("--mla", action="store_true", help="a DeepSeek-V3-style model (MLA)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    py = vllm_run.vllm_python()
    if py is None:
        print("no vLLM virtualenv: run scripts/vllm_env.sh or set KVSTORE_VLLM_PYTHON")
        return 2

    rng = random.Random(2048)
    prefix = [rng.randrange(3, 1000) for _ in range(args.prefix)]
    prompt = prefix + [rng.randrange(3, 1000) for _ in range(args.suffix)]
    warm = [[rng.randrange(3, 1000) for _ in range(64)]]
    kv_bytes = 1 << 30
    max_len = args.prefix + args.suffix + 64

    with tempfile.TemporaryDirectory(prefix="bench_vllm-") as tmp:
        root = Path(tmp)
        save_model(root / "model", args.hidden, args.layers, args.mla)
        store = root / "store"
        hot = {"hot_bytes": 256 << 20}

        def spec(extra: dict[str, Any], phases: list[Any], caching: bool) -> dict[str, Any]:
            return {
                "model": str(root / "model"),
                "store": str(store),
                "extra": extra,
                "phases": phases,
                "prefix_caching": caching,
                "batched_tokens": max_len,
                "max_model_len": max_len,
                "kv_bytes": kv_bytes,
                "tp": args.tp,
                **({"block_size": 16} if args.mla else {}),
            }

        def one(name: str, **kw: Any) -> dict[str, Any]:
            return {"name": name, "prompts": [prompt], "max_tokens": 1, **kw}

        def runs(name: str, n: int, **kw: Any) -> list[dict[str, Any]]:
            return [one(f"{name}{i}", **kw) for i in range(n)]

        logs = root / "logs"
        logs.mkdir()
        print(f"model: hidden {args.hidden}, {args.layers} layers; prompt {len(prompt)} tokens")
        warm_up = [{"name": "warm-up", "prompts": warm, "max_tokens": 1}]
        # "settle": after the background save of the prompt is done, a step reports it.
        settle = [{"name": "settle", "prompts": warm, "max_tokens": 1, "sleep": 3}]
        writer = vllm_run.run(
            py, spec(hot, warm_up + [one("write")] + settle, True), logs / "writer.log"
        )
        time.sleep(1)
        r = args.repeat
        evict = {"evict": str(store)}
        disk = vllm_run.run(
            py,
            spec(
                {},
                warm_up
                # A salt of its own each time: nothing stored, not even by the last one.
                + [one(f"recompute{i}", cache_salt=f"bench-{i}") for i in range(r)]
                + [x for i in range(r) for x in [one(f"cold{i}", **evict)]]
                + runs("warm", r),
                False,
            ),
            logs / "disk.log",
        )
        hot_run = vllm_run.run(py, spec(hot, warm_up + runs("hot", r), False), logs / "hot.log")
        kvstore.remove_arena(store)
        native: list[dict[str, Any]] = []
        if not args.mla:  # vLLM's own prefix cache, without the connector
            native = vllm_run.run(
                py,
                spec({}, warm_up + [one("first")] + runs("native", r), True) | {"store": None},
                logs / "native.log",
            )

    def best(results: list[dict[str, Any]], name: str) -> float:
        return min(x["seconds"] for x in results if x["name"].startswith(name))

    def phase_delta(results: list[dict[str, Any]], name: str) -> dict[str, float]:
        i = [x["name"] for x in results].index(name)
        return vllm_run.counters_delta(results[i - 1]["counters"], results[i]["counters"])

    recompute = best(disk, "recompute")
    rows = [
        ("recompute (no stored prefix)", recompute),
        ("stored prefix, cold page cache", best(disk, "cold")),
        ("stored prefix, warm page cache", best(disk, "warm")),
        ("stored prefix, hot tier", best(hot_run, "hot")),
    ]

    def load_rate(results: list[dict[str, Any]], name: str) -> float:
        """Best bytes/s of the connector's loads in the phases `name`0, 1, ..."""
        rates = []
        for i in range(r):
            d = phase_delta(results, f"{name}{i}")
            if d["load_us"]:
                rates.append(d["load_bytes"] / d["load_us"] * 1e6)
        return max(rates, default=0.0)

    loads = [
        ("load, hot tier", load_rate(hot_run, "hot")),
        ("load, warm page cache", load_rate(disk, "warm")),
        ("load, cold page cache", load_rate(disk, "cold")),
    ]
    save = phase_delta(writer, "settle")
    save = {k: save[k] + phase_delta(writer, "write")[k] for k in save}
    save_bps = save["save_bytes"] / save["save_us"] * 1e6 if save["save_us"] else 0.0
    load_bytes = phase_delta(hot_run, "hot0")["load_bytes"]
    mem_bps = load_bytes / copy_seconds(int(load_bytes) or 1, memcpy)
    mem_n_bps = load_bytes / copy_seconds(int(load_bytes) or 1, memcpy_threads)
    torch_bps = load_bytes / copy_seconds(int(load_bytes) or 1, torch_copy)

    load_avg = os.getloadavg()
    print(f"\nTTFT, {len(prompt)}-token prompt, {args.prefix} stored, best of {r}:")
    print(f"{'':34} {'ms':>9} {'recompute/x':>12}")
    for name, s in rows:
        print(f"{name:34} {s * 1e3:9.1f} {recompute / s:12.2f}")
    print("target: stored <= 1/5 of recompute (ratio >= 5)")
    if native:
        own = best(native, "native")
        print(f"{'vLLM prefix-cache hit (no store)':34} {own * 1e3:9.1f} {recompute / own:12.2f}")
        for name, sec in rows[1:]:
            print(f"  {name:32} {sec / own:6.2f}x vLLM's own hit")
        print("goal: stored <= 1.5x vLLM's own hit")
    shape = f"TP={args.tp}" + (", MLA" if args.mla else "")
    print(f"shape: {shape}")
    print(f"\nconnector throughput ({load_bytes / 2**20:.0f} MiB per load, best of {r}):")
    n = LOAD_THREADS
    for name, bps in [*loads, ("save (gather + put)", save_bps)]:
        print(
            f"  {name:24} {bps / 2**30:7.2f} GiB/s  {bps / mem_bps:5.2f}x memcpy"
            f"  {bps / mem_n_bps:5.2f}x memcpy on {n} threads"
        )
    print(f"  {'memcpy':24} {mem_bps / 2**30:7.2f} GiB/s  (glibc, one thread, this run)")
    print(f"  {f'memcpy, {n} threads':24} {mem_n_bps / 2**30:7.2f} GiB/s  (the same, cut in {n})")
    print(f"  {'torch copy_':24} {torch_bps / 2**30:7.2f} GiB/s  (all intra-op threads; info)")
    print("target: load >= 0.5x memcpy")
    avg = " ".join(f"{x:.2f}" for x in load_avg)
    print(f"\nload average {avg}, {platform.node()}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "ttft_s": dict(rows),
                    "load_Bps": dict(loads),
                    "save_Bps": save_bps,
                    "memcpy_Bps": mem_bps,
                    "memcpy_threads_Bps": mem_n_bps,
                    "load_threads": LOAD_THREADS,
                    "torch_copy_Bps": torch_bps,
                    "loadavg": load_avg,
                    "native_hit_s": best(native, "native") if native else None,
                    "tp": args.tp,
                    "mla": args.mla,
                    "phases": {"writer": writer, "disk": disk, "hot": hot_run, "native": native},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
