"""Helpers shared by tests/test_hot_tier.py and the child processes it starts."""

from __future__ import annotations

import sys

import numpy as np

import kvstore

# 8 KiB blocks: a 4 MiB arena holds about 250 of them.
LAYOUT = kvstore.Layout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_size=16)
MODEL = "hot-tier-test@1"


def seq(i: int, n: int = 64) -> np.ndarray:
    return np.arange(n, dtype=np.int64) + 100_003 * i


def kv_of(tokens: np.ndarray) -> np.ndarray:
    """A pure function of (position, token): any process recomputes it."""
    pos = np.arange(len(tokens), dtype=np.float32)
    base = (tokens % 997).astype(np.float32) * 0.01 + pos * 0.001
    grid = np.arange(2 * 2 * 2 * 32, dtype=np.float32).reshape(2, 2, 1, 2, 32) * 0.25
    return (base[None, None, :, None, None] + grid).astype(np.float16)


def check(store: kvstore.Store, tokens: np.ndarray) -> int:
    """Gets `tokens`; exits the process with 3 (printing WRONG) on any wrong byte."""
    got = store.get(tokens)
    m = got.shape[2]
    if not np.array_equal(got, kv_of(tokens)[:, :, :m]):
        print("WRONG", flush=True)
        sys.exit(3)
    return m
