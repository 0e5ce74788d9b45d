"""The GIL is released around I/O, hashing, compression and copying (README,
Concurrency).

Two threads run large CPU-bound calls (64 MiB puts with zstd; then 64 MiB gets)
at once, while the main thread, in pure Python, keeps taking samples of which calls
are in progress (each thread marks its call in progress just before it and done
just after). A call that held the GIL would let the main thread run at most at its
edges (the moment between a mark and the call, when the GIL changes hands): so many
samples that see a call in progress show it ran without the GIL, and many that see
both in progress show the two ran at once. Events, not clocks: no time is compared."""

from __future__ import annotations

import threading
import time

import numpy as np
from conftest import assert_kv_equal, seq

import kvstore

LAYOUT = kvstore.Layout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
TOKENS = 256 * 16  # 256 blocks of 256 KiB: 64 MiB per call

# Samples that must see a call in progress. Its edges give the main thread at most a
# sample or two each (it sleeps between samples, handing the GIL straight back).
MANY = 10


def _concurrently(calls):
    """Runs each call in its own thread, all released at once; returns the samples
    the main thread took meanwhile: one tuple per sample, whether each call was in
    progress."""
    n = len(calls)
    barrier = threading.Barrier(n + 1)
    running = [False] * n
    finished = [False] * n
    errors = []

    def run(k):
        try:
            barrier.wait()
            running[k] = True
            calls[k]()
            running[k] = False
        except BaseException as e:
            errors.append(e)
        finally:
            running[k] = False
            finished[k] = True

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    samples = []
    while not all(finished):
        samples.append(tuple(running))
        time.sleep(0.0002)  # releases the GIL: a waiting thread takes it
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return samples


def _assert_released(samples, what):
    for k in range(2):
        inside = sum(s[k] for s in samples)
        assert inside >= MANY, (
            f"{what}: the main thread ran {inside} times during call {k}: the GIL is held"
        )
    both = sum(all(s) for s in samples)
    assert both >= MANY, f"{what}: the two calls were in progress together {both} times"


def test_large_puts_and_gets_overlap(tmp_path):
    rng = np.random.default_rng(0)
    kvs = [
        rng.integers(0, 2**16, size=LAYOUT.kv_shape(TOKENS), dtype=np.uint16).view(np.float16)
        for _ in range(2)
    ]
    toks = [seq(k * 1_000_000, TOKENS) for k in range(2)]
    with kvstore.open(
        tmp_path / "s", layout=LAYOUT, model="m", durability="none", compression="zstd"
    ) as s:
        samples = _concurrently([lambda k=k: s.put(toks[k], kvs[k]) for k in range(2)])
        _assert_released(samples, "put")
        assert s.stats()["blocks"] == 512

        outs = [np.empty(LAYOUT.kv_shape(TOKENS), np.float16) for _ in range(2)]
        got = [0, 0]

        def get(k):
            got[k] = s.get(toks[k], out=outs[k])

        samples = _concurrently([lambda k=k: get(k) for k in range(2)])
        _assert_released(samples, "get")
        for k in range(2):
            assert got[k] == TOKENS
            assert_kv_equal(outs[k], kvs[k])
