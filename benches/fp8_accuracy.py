#!/usr/bin/env python3
"""fp8 KV end to end: the demo model decoding over an fp8 BlockPool against the same
model without kvstore (transformers' eager attention and its own float32 cache).

    python benches/fp8_accuracy.py [--prompt 1024] [--steps 64] [--quick]

The model is `kvstore.demo`'s (a Llama with seeded random weights, or
$KVSTORE_DEMO_MODEL). Both runs prefill the same synthetic prompt, then decode
--steps tokens teacher-forced on the reference's greedy tokens, so every step
compares the same context: the table gives the share of steps whose greedy token
agrees, the largest |logit difference| over all steps and vocabulary, and the
largest logit itself for scale. A float32 pool (kvstore's ops, no quantization) is
run too, to tell fp8's error from the kernel's, and a bfloat16 pool for scale. Also:
free-running greedy tokens of the fp8 run, and how many leading ones equal the
reference's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from kvstore import attention, demo, hf
from kvstore.layout import Layout
from kvstore.torch import BlockPool


@torch.inference_mode()
def reference_run(
    model: Any, prompt: torch.Tensor, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and last-position logits of each decode step, eager attention."""
    model.set_attn_implementation("eager")
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(input_ids=prompt[None], past_key_values=cache).logits[0, -1]
    tokens, out = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        out.append(logits.float().clone())
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[0, -1]
    return tokens, out


@torch.inference_mode()
def pool_run(
    model: Any, layout: Layout, prompt: torch.Tensor, forced: list[int] | None, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """The same over a BlockPool of `layout` (teacher-forced on `forced` when given)."""
    model.set_attn_implementation(attention.register())
    blocks = -(-(len(prompt) + steps) // layout.block_size) + 1
    pool = BlockPool(layout, num_blocks=blocks)
    seq = pool.new_sequence()
    cache = attention.PagedCache(pool, [seq])
    ids = prompt[None]
    tokens, out = [], []
    for step in range(steps):
        pos = cache.position_ids(ids.shape[1])
        logits = model(input_ids=ids, position_ids=pos, past_key_values=cache).logits[0, -1]
        tokens.append(int(logits.argmax()))
        out.append(logits.float().clone())
        ids = torch.tensor([[forced[step] if forced else tokens[-1]]])
    seq.release()
    return tokens, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=64, help="decode steps compared")
    parser.add_argument("--quick", action="store_true", help="the demo's small model")
    args = parser.parse_args(argv)
    model, what = demo.load_model(args.quick)
    vocab = model.config.vocab_size
    prompt = demo.tokens(args.prompt, 1, vocab)[0]
    print(f"model: {what}; prompt {args.prompt} tokens, {args.steps} decode steps")
    ref_tokens, ref_logits = reference_run(model, prompt, args.steps)
    base = hf.layout_of(model)
    scale = max(float(x.abs().max()) for x in ref_logits)
    print(f"{'KV':>10} {'greedy agree':>12} {'max |dlogit|':>12} {'max |logit|':>11}")
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        layout = Layout(base.num_layers, base.num_kv_heads, base.head_dim, dtype, base.block_size)
        tokens, logits = pool_run(model, layout, prompt, ref_tokens, args.steps)
        agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True)) / args.steps
        diff = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True))
        print(f"{dtype:>10} {agree:>12.3f} {diff:>12.4g} {scale:>11.3g}")
    layout = Layout(
        base.num_layers, base.num_kv_heads, base.head_dim, "float8_e4m3fn", base.block_size
    )
    free, _ = pool_run(model, layout, prompt, None, args.steps)
    same = next(
        (i for i, (a, b) in enumerate(zip(free, ref_tokens, strict=True)) if a != b), args.steps
    )
    print(f"fp8 free-running greedy: the first {same} of {args.steps} tokens equal the reference's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
