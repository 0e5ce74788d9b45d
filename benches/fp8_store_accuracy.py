#!/usr/bin/env python3
"""fp8 storage end to end: the demo model restored from a store with
`storage="fp8"` against the same model restored from an exact (bfloat16) store.

    python benches/fp8_store_accuracy.py [--prompt 1024] [--steps 64] [--quick]

The model is `kvstore.demo`'s (a Llama with seeded random weights, or
$KVSTORE_DEMO_MODEL), run in bfloat16. One prefill of a synthetic prompt is saved
into both stores (`hf.save`); each restore (`hf.load`) then continues with the
prompt's tail and --steps decode steps teacher-forced on the exact restore's greedy
tokens, so every step compares the same context. Printed: the share of steps whose
greedy token agrees with the exact restore's, the largest |logit difference| over
all steps and the vocabulary (and the largest logit, for scale), how many leading
free-running greedy tokens equal the exact restore's, and the bytes each store
keeps. The exact restore is bitwise the in-memory cache (SPEC 5.7), so it is the
reference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import kvstore
from kvstore import demo, hf


@torch.inference_mode()
def restored_run(
    model: Any, store: kvstore.Store, ids: torch.Tensor, forced: list[int] | None, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and logits of each step after restoring the prefix of `ids`."""
    cache, n = hf.load(store, ids)
    assert n > 0, "nothing restored"
    logits = model(input_ids=ids[None, n:], past_key_values=cache).logits[0, -1]
    tokens, out = [], []
    for step in range(steps):
        tokens.append(int(logits.argmax()))
        out.append(logits.float().clone())
        nxt = forced[step] if forced else tokens[-1]
        logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache).logits[0, -1]
    return tokens, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=64, help="decode steps compared")
    parser.add_argument("--quick", action="store_true", help="the demo's small model")
    args = parser.parse_args(argv)
    model, what = demo.load_model(args.quick)
    model = model.to(torch.bfloat16)
    model.set_attn_implementation("eager")
    vocab = model.config.vocab_size
    ids = demo.tokens(args.prompt + 1, 1, vocab)[0]
    print(f"model: {what}, bfloat16; prompt {args.prompt} tokens, {args.steps} decode steps")
    base = hf.layout_of(model)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        from transformers import DynamicCache

        cache = DynamicCache()
        model(input_ids=ids[None, : args.prompt], past_key_values=cache)
        stores = {}
        for storage in ("exact", "fp8"):
            layout = kvstore.Layout(
                base.num_layers,
                base.num_kv_heads,
                base.head_dim,
                base.dtype,
                base.block_size,
                storage,
            )
            st = kvstore.open(Path(tmp) / storage, layout=layout, model="fp8-store-accuracy")
            hf.save(st, ids[: args.prompt], cache)
            st.flush()
            stores[storage] = st
        ref_tokens, ref_logits = restored_run(model, stores["exact"], ids, None, args.steps)
        tokens, logits = restored_run(model, stores["fp8"], ids, ref_tokens, args.steps)
        free, _ = restored_run(model, stores["fp8"], ids, None, args.steps)
        agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / args.steps
        diff = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True))
        scale = max(float(x.abs().max()) for x in ref_logits)
        same = next(
            (i for i, (a, b) in enumerate(zip(free, ref_tokens, strict=True)) if a != b),
            args.steps,
        )
        sizes = {k: s.stats()["live_bytes"] for k, s in stores.items()}
        for s in stores.values():
            s.close()
    print(
        f"{'restore':>8} {'greedy agree':>12} {'max |dlogit|':>12} "
        f"{'max |logit|':>11} {'bytes':>12}"
    )
    print(f"{'exact':>8} {1.0:>12.3f} {0.0:>12.4g} {scale:>11.3g} {sizes['exact']:>12}")
    print(f"{'fp8':>8} {agree:>12.3f} {diff:>12.4g} {scale:>11.3g} {sizes['fp8']:>12}")
    print(
        f"fp8 free-running greedy: the first {same} of {args.steps} tokens equal the exact "
        f"restore's; the fp8 store keeps {sizes['exact'] / sizes['fp8']:.2f}x fewer bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
