#!/usr/bin/env python3
"""The lossless codecs on real KV: the demo model's cache of a synthetic prompt, in
bfloat16 and float16, put and read back through stores without compression, with
"zstd" and with "exponent", in one run.

    python benches/codec_real_kv.py [--tokens 4096] [--repeat 3] [--quick]

Per dtype and codec: the size ratio (`stats()["compression_ratio"]`), put + flush
GiB/s and warm `get(out=)` GiB/s (best of --repeat, KV bytes over wall time), each
beside the uncompressed store's figure of the same run. Every get is checked
bit-exact. The model is `kvstore.demo`'s (seeded random weights unless
$KVSTORE_DEMO_MODEL names a checkpoint), so its activations are a random network's:
a trained model's exponents may spread differently.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvstore
from kvstore import demo, hf

GiB = 1 << 30


def measure(
    path: Path,
    layout: kvstore.Layout,
    toks: torch.Tensor,
    kv: torch.Tensor,
    codec: str | None,
    repeat: int,
) -> tuple[float, float, float]:
    """(ratio, put GiB/s, warm get GiB/s) of one codec."""
    nbytes = kv.numel() * kv.element_size()
    puts, gets = [], []
    out = torch.empty_like(kv)
    for r in range(repeat):
        store = path / f"{layout.dtype}-{codec}-{r}"
        with kvstore.open(
            store, layout=layout, model="codec-real-kv", compression=codec, durability="batch"
        ) as s:
            t0 = time.perf_counter()
            s.put(toks, kv)
            s.flush()
            puts.append(time.perf_counter() - t0)
            ratio = s.stats()["compression_ratio"]
            s.get(toks, out=out)
            for _ in range(2):
                t0 = time.perf_counter()
                s.get(toks, out=out)
                gets.append(time.perf_counter() - t0)
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "not bit-exact"
    return ratio, nbytes / min(puts) / GiB, nbytes / min(gets) / GiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the demo's small model")
    args = parser.parse_args(argv)
    model, what = demo.load_model(args.quick)
    ids = demo.tokens(args.tokens, 1, model.config.vocab_size)[0]
    print(f"model: {what}; {args.tokens} tokens; load average {os.getloadavg()[0]:.2f}")
    print(
        f"{'dtype':>9} {'codec':>9} {'ratio':>7} {'put GiB/s':>10} {'(raw)':>7} "
        f"{'get GiB/s':>10} {'(raw)':>7}"
    )
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        from transformers import DynamicCache

        for dtype in (torch.bfloat16, torch.float16):
            m = model.to(dtype)
            cache = DynamicCache()
            m(input_ids=ids[None], past_key_values=cache)
            kv = hf.cache_to_kv(cache, args.tokens).contiguous()
            layout = hf.layout_of(m)
            base = measure(Path(tmp), layout, ids, kv, None, args.repeat)
            for codec in ("zstd", "exponent"):
                ratio, put, get = measure(Path(tmp), layout, ids, kv, codec, args.repeat)
                print(
                    f"{str(dtype)[6:]:>9} {codec:>9} {ratio:>6.3f}x {put:>10.2f} "
                    f"{base[1]:>7.2f} {get:>10.2f} {base[2]:>7.2f}"
                )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
