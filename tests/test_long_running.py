"""Long-running safety: a process doing 10^5 put/get/lookup calls keeps a flat
resident memory, and SIGINT (KeyboardInterrupt) at any moment of a stream of
puts leaves the store consistent, with every acknowledged put present.

fork() after open (the child's handle raises StoreClosed) is tested in
test_fork.py."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

from conftest import assert_kv_equal, child_argv, kv_for, run_child, small_layout

import kvstore

# A put/get/lookup mix over a fixed working set (dedupe hits, reads into new and
# preallocated arrays, sessions, errors) plus fresh puts that keep the store
# growing, as an agent's does (10^4 new blocks). Measured on a 2-core box: VmRSS
# +1.2 MiB from call 10^3 to 10^5, all of it file-backed pages of the growing LMDB
# index; anonymous memory +0. A leak of 200 bytes per call would add 19 MiB.
RSS_BOUND_MIB = 16
ANON_BOUND_MIB = 8

MEMORY = """
import sys
import numpy as np
import kvstore
from conftest import small_layout

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0])  # kB
    return out

path, total = sys.argv[1], int(sys.argv[2])
layout = small_layout(dtype="float16", block_size=4, L=1, H=1, D=8)  # 128-byte blocks
rng = np.random.default_rng(0)
system = list(range(100_000, 100_032))
pool = [system + rng.integers(0, 50_000, 32).tolist() for _ in range(256)]
kvs = [rng.standard_normal(layout.kv_shape(64)).astype(np.float16) for _ in range(256)]
out = np.empty(layout.kv_shape(64), np.float16)
bad = np.zeros(layout.kv_shape(64), np.float32)
fresh = 200_000
marks = {}
with kvstore.open(path, layout=layout, model="m", durability="batch") as s:
    for toks, kv in zip(pool, kvs):
        s.put(toks, kv)
    for i in range(total):
        j = i % 256
        op = i % 10
        if op in (0, 1):
            s.put(pool[j], kvs[j])
        elif op in (2, 3):
            assert s.get(pool[j]).shape[2] == 64
        elif op in (4, 5):
            assert s.get(pool[j], out=out) == 64
        elif op in (6, 7):
            assert s.lookup(pool[j]) == 64
        elif op == 8:
            toks = system + list(range(fresh, fresh + 4))  # one new block
            fresh += 4
            s.put(toks, kvs[j][:, :, :36])
        elif i % 20 == 9:
            s.save_session(f"agent-{j % 8}", pool[j], kvs[j])
            s.load_session(f"agent-{j % 8}")
        else:
            try:
                s.put(pool[j], bad)
            except kvstore.InvalidInput:
                pass
        if i + 1 in (1_000, total):
            marks[i + 1] = status()
    blocks = s.stats()["blocks"]
print("RESULT", marks[1_000]["VmRSS"], marks[total]["VmRSS"],
      marks[1_000]["RssAnon"], marks[total]["RssAnon"], blocks, flush=True)
"""


def test_resident_memory_is_flat_over_1e5_calls(tmp_path: Path) -> None:
    p = run_child(MEMORY, tmp_path / "s", 100_000, timeout=240)
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
    rss0, rss1, anon0, anon1, blocks = map(int, line.split()[1:])
    assert blocks >= 10_000  # the store grew: every fresh put was one new block
    grew, anon_grew = (rss1 - rss0) / 1024, (anon1 - anon0) / 1024
    assert grew <= RSS_BOUND_MIB, (
        f"VmRSS grew {grew:.1f} MiB from call 10^3 ({rss0} kB) to 10^5 ({rss1} kB); "
        f"bound {RSS_BOUND_MIB} MiB"
    )
    assert anon_grew <= ANON_BOUND_MIB, f"RssAnon grew {anon_grew:.1f} MiB ({anon0} -> {anon1} kB)"


# ----------------------------------------------------------------------------- SIGINT

# Puts with durability="sync" and prints "ACK i" once put i has returned. On
# KeyboardInterrupt: mode "catch" checks that the handle still works and closes
# it; mode "raise" lets the interrupt kill the interpreter; mode "exit" leaves at
# once with os._exit (no close, no cleanup).
PUTTER = """
import os, signal, sys
import kvstore
from conftest import kv_for, small_layout, assert_kv_equal

# A background job of a non-interactive shell (`bash scripts/test.sh &`, nohup)
# starts with SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler: install it whatever the disposition inherited.
signal.signal(signal.SIGINT, signal.default_int_handler)

path, first, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = small_layout(dtype="float16", block_size=16, L=4, H=4, D=64)  # 64 KiB blocks

def tokens(i):
    return list(range(i * 1000, i * 1000 + 128))  # 8 blocks, distinct per put

# KV computed up front, so the loop spends its time inside put() (GIL released),
# where the signal should land: put i stores POOL[i % 64].
POOL = [kv_for(layout, tokens(j)) for j in range(64)]
s = kvstore.open(path, layout=layout, model="m", durability="sync")
print("READY", flush=True)
i = first
try:
    while True:
        s.put(tokens(i), POOL[i % 64])
        print(f"ACK {i}", flush=True)
        i += 1
except KeyboardInterrupt:
    if mode == "raise":
        raise
    if mode == "exit":
        os._exit(3)
    t = tokens(10**6)
    s.put(t, POOL[0])
    assert_kv_equal(s.get(t), POOL[0])
    if i > first:
        assert_kv_equal(s.get(tokens(i - 1)), POOL[(i - 1) % 64])
    s.close()
    print("CLEAN", flush=True)
"""


def pool_tokens(i: int) -> list[int]:
    """The tokens whose KV the putter stored for put i (its POOL[i % 64])."""
    j = i % 64
    return list(range(j * 1000, j * 1000 + 128))


def test_sigint_during_puts_leaves_the_store_consistent(tmp_path: Path) -> None:
    path = tmp_path / "s"
    layout = small_layout(dtype="float16", block_size=16, L=4, H=4, D=64)
    rng = random.Random(1234)
    acked: list[int] = []
    attempted: list[int] = []
    modes = ["catch", "raise", "exit"] * 2
    for round_, mode in enumerate(modes):
        first = round_ * 10_000
        p = subprocess.Popen(
            child_argv(PUTTER, path, first, mode),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "READY"
        for _ in range(rng.randint(1, 6)):  # some puts acknowledged first
            p.stdout.readline()
        time.sleep(rng.uniform(0, 0.05))  # then a random moment, usually mid-put
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        lines = p.stdout and out.splitlines()
        acks = [int(x.split()[1]) for x in lines or [] if x.startswith("ACK ") and x[4:].isdigit()]
        acked.extend(acks)
        attempted.append(max(acks, default=first - 1) + 1)  # interrupted, or never started
        if mode == "catch":
            assert p.returncode == 0 and "CLEAN" in out, (p.returncode, out[-500:], err[-2000:])
        elif mode == "raise":
            assert p.returncode in (-signal.SIGINT, 1, 130), (p.returncode, err[-2000:])
            assert "KeyboardInterrupt" in err or p.returncode == -signal.SIGINT, err[-2000:]
        else:
            assert p.returncode == 3, (p.returncode, err[-2000:])
    assert len(acked) >= len(modes)

    with kvstore.open(path, layout=layout, model="m", durability="sync") as s:
        report = s.verify()
        assert not report["damaged"] and not report["problems"], report
        for i in acked:
            t = list(range(i * 1000, i * 1000 + 128))
            assert s.lookup(t) == 128, f"acknowledged put {i} is missing"
            assert_kv_equal(s.get(t), kv_for(layout, pool_tokens(i)), f"put {i}")
        for i in attempted:  # present or not, never wrong
            t = list(range(i * 1000, i * 1000 + 128))
            m = s.lookup(t)
            assert m % 16 == 0
            assert_kv_equal(s.get(t), kv_for(layout, pool_tokens(i))[:, :, :m], f"put {i}")
