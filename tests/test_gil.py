"""The GIL is released around I/O, hashing, compression and copying (README,
Concurrency).

Two threads run large CPU-bound calls (64 MiB puts with zstd; then 64 MiB gets)
at once. Their (start, end) intervals must overlap — the one timing-shaped
assertion of the suite; it checks that the GIL is released, not speed. To rule
out an overlap that is only one thread waiting for the GIL while the other
holds it, a third, pure-Python thread keeps sampling the clock: it must get to
run in the middle of each call, which it cannot if the call holds the GIL."""

from __future__ import annotations

import threading
import time

import numpy as np
from conftest import assert_kv_equal, seq

import kvstore

LAYOUT = kvstore.Layout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
TOKENS = 256 * 16  # 256 blocks of 256 KiB: 64 MiB per call


def _concurrently(calls):
    """Runs each call in its own thread, all released at once; returns their
    (start, end) intervals and the heartbeat samples taken meanwhile."""
    n = len(calls)
    barrier = threading.Barrier(n + 1)
    intervals = [None] * n
    errors = []
    done = threading.Event()
    remaining = [n]
    lock = threading.Lock()

    def run(k):
        try:
            barrier.wait()
            t0 = time.perf_counter()
            calls[k]()
            intervals[k] = (t0, time.perf_counter())
        except BaseException as e:
            errors.append(e)
        finally:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    samples = []
    while not done.is_set():
        samples.append(time.perf_counter())
        time.sleep(0.0005)
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return intervals, samples


def _assert_released(intervals, samples, what):
    (a0, a1), (b0, b1) = intervals
    assert max(a0, b0) < min(a1, b1), f"{what}: calls did not overlap: {intervals}"
    for t0, t1 in intervals:
        lo, hi = t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)
        inside = [t for t in samples if lo < t < hi]
        assert inside, f"{what}: no Python thread ran during the middle of a call: the GIL is held"


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
        intervals, samples = _concurrently([lambda k=k: s.put(toks[k], kvs[k]) for k in range(2)])
        _assert_released(intervals, samples, "put")
        assert s.stats()["blocks"] == 512

        outs = [np.empty(LAYOUT.kv_shape(TOKENS), np.float16) for _ in range(2)]
        got = [0, 0]

        def get(k):
            got[k] = s.get(toks[k], out=outs[k])

        intervals, samples = _concurrently([lambda k=k: get(k) for k in range(2)])
        _assert_released(intervals, samples, "get")
        for k in range(2):
            assert got[k] == TOKENS
            assert_kv_equal(outs[k], kvs[k])
