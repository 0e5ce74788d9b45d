#!/usr/bin/env python3
"""The vLLM connector's save path alone: gather blocks out of a paged KV cache and
put them durably, with no forward pass running, against a raw write + fdatasync of
the same bytes in the same run.

    python benches/bench_save_path.py [--mib 512] [--repeat 3] [--dir DIR] [--json OUT]

The cache is laid out as vLLM 0.32's CPU attention backend lays it (per layer
`[blocks, H, B, 2 * D]`, K transposed `[D][B]` then V `[B][D]` inside a (block,
head)), learnt through the connector's own probe (`paged_block_map`) from a writer
that stores that way, and moved by the connector's code (`PagedKV.save`: the
engine's `put_paged`, which gathers each block and appends it to a segment). Three
shapes: a whole-block store (one worker), the per-head records of a tensor-parallel
rank (`kvstore.heads`, each rank's heads into the heads store), and an MLA latent
(`kind="latent"`, `[blocks, B, 576]`).

Peer: `raw_write` of benches/peers.py, the same number of bytes through the page
cache with pwrite(2 MiB) and fdatasync, once per save call ("sync") or once at the
end ("batch" + flush()). Goal (issue 45): the save path >= 0.8x the raw write.
A prefill on a GPU server makes KV at GB/s per device; a save path slower than
the disk drops saves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvstore
from kvstore.heads import head_extra
from kvstore.vllm.paged import PagedKV, paged_block_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import raw_write  # noqa: E402

L, H, D, B = 8, 4, 128, 32  # 256 KiB of bf16 KV a block (an 8-layer, 4-KV-head model)
LATENT_W, LATENT_B = 576, 16


def cpu_backend_writer(key: Any, value: Any, cache: Any, slots: Any) -> None:
    """Writes as vLLM's CPU backend does: per (block, head), `2 * B * D` elements,
    K as `[D][B]`, then V as `[B][D]`."""
    b, d = cache.shape[2], key.shape[2]
    for i, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, b)
        for h in range(cache.shape[1]):
            flat = cache[blk, h].view(-1)
            flat[: b * d].view(d, b)[:, off] = key[i, h]
            flat[b * d :].view(b, d)[off] = value[i, h]


def latent_writer(key: Any, value: Any, cache: Any, slots: Any) -> None:
    flat = cache.view(-1, cache.shape[-1])
    flat[slots] = torch.cat([key, value], dim=-1).squeeze(1)


def make_cache(shape: str, blocks: int) -> tuple[list[torch.Tensor], kvstore.Layout, Any]:
    g = torch.Generator().manual_seed(1)
    if shape == "latent":
        lay = kvstore.Layout(L, 1, LATENT_W, "bfloat16", LATENT_B, kind="latent")
        caches = [
            torch.randn(blocks + 1, LATENT_B, LATENT_W, generator=g).to(torch.bfloat16)
            for _ in range(L)
        ]
        return caches, lay, latent_writer
    lay = kvstore.Layout(L, H, D, "bfloat16", B)
    caches = [
        torch.randn(blocks + 1, H, B, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)
    ]
    return caches, lay, cpu_backend_writer


def save_once(
    shape: str,
    root: Path,
    durability: str,
    caches: list[torch.Tensor],
    lay: kvstore.Layout,
    writer: Any,
    blocks: int,
    per_call: int,
) -> tuple[float, int, list[int]]:
    """Seconds to save `blocks` blocks (`per_call` a call, as a step hands them over)
    and make them durable; the payload bytes stored; the tokens they were stored
    under (cache block `k + 1` holds token block `k`)."""
    paged = PagedKV(caches, paged_block_map(writer, caches[0], lay), lay)
    assert paged.strided
    b = lay.block_size
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, 30000, size=blocks * b).tolist()
    store = kvstore.open(root / "store", layout=lay, model="bench", durability=durability)
    try:
        target, extras = store, [(None, None)]
        if shape == "heads":  # a TP=2 rank: its 2 of 4 heads, one record each
            parts = store.heads(create=True)
            assert parts is not None
            target = parts.store
            paged = PagedKV(caches, paged_block_map(writer, caches[0], lay), lay)
            extras = [(head_extra(b"", h), h) for h in range(2)]
        ids = list(range(1, blocks + 1))
        t0 = time.perf_counter()
        for at in range(0, blocks, per_call):
            for extra, head in extras:
                paged.save(
                    target,
                    tokens[: (at + per_call) * b],
                    at * b,
                    extra,
                    ids[at : at + per_call],
                    head,
                )
        store.flush()
        seconds = time.perf_counter() - t0
        nbytes = blocks * lay.block_bytes * len(extras) // (H if shape == "heads" else 1)
        return seconds, nbytes, tokens
    finally:
        store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="KV saved per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--per-call", type=int, default=16, help="blocks a save call hands over")
    p.add_argument("--dir", type=Path, default=None, help="where the stores go (a real disk)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows: dict[str, dict[str, float]] = {}
    for shape in ("whole", "heads", "latent"):
        probe_lay = make_cache(shape, 1)[1]
        blocks = max(args.mib * 2**20 // probe_lay.block_bytes, args.per_call)
        if shape == "heads":
            blocks *= 2  # the rank stores half of each block
        caches, lay, writer = make_cache(shape, blocks)
        for durability in ("batch", "sync"):
            best, best_raw, nbytes = float("inf"), float("inf"), 0
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="bench_save-", dir=args.dir) as tmp:
                    root = Path(tmp)
                    os.sync()
                    seconds, nbytes, _ = save_once(
                        shape, root, durability, caches, lay, writer, blocks, args.per_call
                    )
                    best = min(best, seconds)
                    calls = -(-blocks // args.per_call)
                    chunk = np.frombuffer(os.urandom(nbytes // calls), dtype=np.uint8)
                    sync = "per_seq" if durability == "sync" else "end"
                    best_raw = min(best_raw, raw_write(root / "raw", [chunk] * calls, sync))
                    shutil.rmtree(root / "store", ignore_errors=True)
            rows[f"{shape}/{durability}"] = {
                "bytes": nbytes,
                "save_GiBps": nbytes / best / 2**30,
                "raw_GiBps": nbytes / best_raw / 2**30,
                "ratio": best_raw / best,
            }
    print(
        f"save path alone, {args.mib} MiB per run, {args.per_call} blocks a call, "
        f"best of {args.repeat}:"
    )
    print(f"{'shape/durability':18} {'save GiB/s':>11} {'raw GiB/s':>10} {'ratio':>7}")
    for name, r in rows.items():
        print(f"{name:18} {r['save_GiBps']:11.2f} {r['raw_GiBps']:10.2f} {r['ratio']:7.2f}")
    print("goal: ratio >= 0.8 (raw: pwrite + fdatasync of the same bytes, same policy)")
    avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {avg}, {platform.node()}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
