"""Sharing (README, Concurrency): N processes put and get overlapping sequences
on one store at once; every get is bit-exact against the KV recomputed from the
token ids; each process sees the blocks the others put and flushed. Also: one
handle shared by many threads; and opening the store (which runs recovery) while
other processes write and roll segments must not touch their segments."""

from __future__ import annotations

import json
import subprocess
import threading

from conftest import assert_kv_equal, child_argv, kv_for, seq, small_layout

import kvstore

N_WORKERS = 4
# Iterations of each worker's loop (about 3 s of puts and gets on 2 cores).
ITERS = 300
# Puts of each writer in the opener test: 2 blocks of 128 KiB each, so a 1 MiB
# segment rolls every 4 puts.
ROLL_PUTS = 40

# Sequences of the workload: prefix a (2 blocks) + middle b (1..2 blocks) + tail c
# (0..2 blocks and a partial one). Every worker draws from the same small
# universe, so prefixes are shared and the same blocks are put concurrently.
UNIVERSE = """
B = 8
def sequence(a, b, c, k):
    pre = [a * 100 + i for i in range(2 * B)]
    mid = [5000 + b * 100 + i for i in range((1 + b % 2) * B)]
    tail = [9000 + c * 100 + i for i in range(k)]
    return pre + mid + tail

def unique(w):
    return [500_000 + w * 1000 + i for i in range(3 * B)]
"""

WORKER = (
    UNIVERSE
    + """
import json, os, random, sys, time
from pathlib import Path
import kvstore
from conftest import kv_for, small_layout, raw_bytes

path, w, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
iters, markers = int(sys.argv[4]), Path(sys.argv[5])
layout = small_layout("float16", block_size=B)
rng = random.Random(1234 + w)
s = kvstore.open(path, layout=layout, model="test/concurrency@1", durability="batch",
                 batch_window_ms=10)

def check(toks, what):
    got = s.get(toks)
    m = got.shape[2]
    assert m % B == 0 and m <= len(toks) // B * B, (what, m)
    want = kv_for(layout, toks)[:, :, :m]
    if raw_bytes(got) != raw_bytes(want):
        print(f"WRONG BYTES worker {w} {what} m={m}", flush=True)
        sys.exit(3)
    return m

# 1. a sequence nobody else puts; announce it once flushed
mine = unique(w)
s.put(mine, kv_for(layout, mine))
s.flush()
(markers / f"ready-{w}").write_text("1")

stats = dict(iters=0, gets=0, hit_tokens=0, puts=0, seen=[], foreign_hits=0)
put_by_me = set()
seen = set()

def look_at_others():
    for v in range(n):
        if v == w or v in seen or not (markers / f"ready-{v}").exists():
            continue
        theirs = unique(v)
        assert s.lookup(theirs) == 3 * B, ("worker", w, "cannot see", v, s.lookup(theirs))
        assert check(theirs, f"unique-{v}") == 3 * B
        seen.add(v)

for _ in range(iters):
    a, b, c, k = rng.randrange(3), rng.randrange(4), rng.randrange(4), rng.randrange(0, 2 * B + 5)
    toks = sequence(a, b, c, k)
    m = check(toks, (a, b, c, k))
    stats["gets"] += 1
    stats["hit_tokens"] += m
    if m and (a, b) not in put_by_me:
        stats["foreign_hits"] += 1
    if rng.random() < 0.7:
        n_put = s.put(toks, kv_for(layout, toks))
        assert n_put == len(toks) // B * B
        put_by_me.add((a, b))
        stats["puts"] += 1
        # own puts are visible at once (pending or committed)
        assert s.lookup(toks) == n_put
    if stats["iters"] % 10 == 0:
        s.flush()
        look_at_others()
    stats["iters"] += 1

# 2. wait until every other worker's sequence has been seen (the deadline only ends
# a wait that would hang: the test then fails on "seen")
deadline = time.monotonic() + 120
while len(seen) < n - 1 and time.monotonic() < deadline:
    look_at_others()
    time.sleep(0.05)
stats["seen"] = sorted(seen)
s.flush()
s.close()
print(json.dumps(stats), flush=True)
"""
)


def test_processes_share_one_store(tmp_path):
    path = tmp_path / "store"
    markers = tmp_path / "markers"
    markers.mkdir()
    procs = [
        subprocess.Popen(
            child_argv(WORKER, path, w, N_WORKERS, ITERS, markers),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(N_WORKERS)
    ]
    results = []
    try:
        for w, p in enumerate(procs):
            out, err = p.communicate(timeout=600)  # only ends a hung worker
            assert p.returncode == 0, f"worker {w} exited {p.returncode}\n{out}\n{err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for w, r in enumerate(results):
        assert r["seen"] == [v for v in range(N_WORKERS) if v != w], r
        assert r["iters"] == ITERS and r["gets"] == ITERS and r["puts"] > 0, r
    assert sum(r["hit_tokens"] for r in results) > 0
    assert sum(r["foreign_hits"] for r in results) > 0, results

    # Afterwards: everything anyone put reads back bit-exact in a fresh handle,
    # and the store is clean.
    ns = {}
    exec(UNIVERSE, ns)
    sequence, unique, B = ns["sequence"], ns["unique"], ns["B"]
    layout = small_layout("float16", block_size=B)
    with kvstore.open(path, layout=layout, model="test/concurrency@1", durability="none") as s:
        for w in range(N_WORKERS):
            u = unique(w)
            assert s.lookup(u) == 3 * B
            assert_kv_equal(s.get(u), kv_for(layout, u))
        for a in range(3):
            for b in range(4):
                for c in range(4):
                    toks = sequence(a, b, c, 2 * B + 4)
                    got = s.get(toks)
                    assert_kv_equal(got, kv_for(layout, toks)[:, :, : got.shape[2]])
        v = s.verify()
        assert v["damaged"] == [], v
        assert v["problems"] == [], v
        st = s.stats()
        # content addressing: never more blocks than distinct ones in the universe
        distinct = 3 * 2 + 3 * 4 * 2 + 3 * 4 * 4 * 2 + N_WORKERS * 3  # generous upper bound
        assert st["blocks"] <= distinct


def test_threads_share_one_handle(tmp_path):
    """8 threads, one handle: overlapping puts and gets, all bit-exact."""
    layout = small_layout("float16", block_size=8)
    B = layout.block_size
    errors: list[BaseException] = []
    with kvstore.open(
        tmp_path / "s", layout=layout, model="m", durability="batch", batch_window_ms=5
    ) as s:

        def work(t: int) -> None:
            try:
                for i in range(40):
                    toks = seq(0, 2 * B) + seq(1000 * ((t + i) % 5), B * (1 + i % 3)) + [7]
                    got = s.get(toks)
                    assert_kv_equal(got, kv_for(layout, toks)[:, :, : got.shape[2]])
                    s.put(toks, kv_for(layout, toks))
                    assert s.lookup(toks) == len(toks) // B * B
                    if i % 7 == 0:
                        s.flush()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)  # only ends a hang
        assert not any(th.is_alive() for th in threads), "threads hang"
        assert not errors, errors[0]
        s.flush()
        st = s.stats()
        assert st["blocks"] == 2 + 5 * 3  # 2 shared + 5 middles of up to 3 blocks


# Writers that roll segments often (1 MiB segments of 128 KiB blocks), while
# another process keeps opening the store (every open runs recovery, which
# seals and truncates segments whose writer is gone). Recovery must never touch
# a live writer's segment: no put fails, nothing acknowledged goes missing.
ROLL_LAYOUT = dict(dtype="float16", block_size=16, L=2, H=8, D=128)

# The opener counts its completed opens in a file; after every put a writer waits
# until a whole open (so a whole recovery) has run since: recovery meets every state
# of the writers' segments by construction, not by how many opens a time window held.
ROLL_WRITER = """
import json, sys, time
from pathlib import Path
import kvstore
from conftest import kv_for, small_layout

path, w, puts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layout = small_layout(**json.loads(sys.argv[4]))
opens = Path(sys.argv[5])

def opened():
    try:
        return int(opens.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0

def wait_for_an_open():
    seen = opened()
    deadline = time.monotonic() + 120  # only ends a wait on a dead opener
    while opened() < seen + 2:
        assert time.monotonic() < deadline, "the opener stopped opening"
        time.sleep(0.002)

s = kvstore.open(path, layout=layout, model="test/roll@1", durability="none",
                 segment_bytes=1 << 20)
acks, errors = [], []
for i in range(puts):
    toks = [w * 10_000_000 + i * 32 + j for j in range(32)]
    try:
        s.put(toks, kv_for(layout, toks))
        acks.append(i)
    except Exception as e:
        errors.append(repr(e))
    wait_for_an_open()
s.close()
print(json.dumps({"acks": acks, "errors": errors[:3], "n_errors": len(errors)}), flush=True)
"""

OPENER = """
import json, os, sys
from pathlib import Path
import kvstore
from conftest import small_layout

path, stop, opens = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[4])
layout = small_layout(**json.loads(sys.argv[3]))
n = 0
while not stop.exists():
    kvstore.open(path, layout=layout, model="test/roll@1", durability="none").close()
    n += 1
    tmp = opens.with_suffix(".tmp")
    tmp.write_text(str(n))
    os.replace(tmp, opens)
print(n, flush=True)
"""


def test_opening_while_others_write_loses_nothing(tmp_path):
    import random

    path = tmp_path / "store"
    spec = json.dumps(ROLL_LAYOUT)
    layout = small_layout(**ROLL_LAYOUT)
    kvstore.open(path, layout=layout, model="test/roll@1", durability="none").close()
    stop, opens = tmp_path / "stop", tmp_path / "opens"
    opener = subprocess.Popen(
        child_argv(OPENER, path, stop, spec, opens),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writers = [
        subprocess.Popen(
            child_argv(ROLL_WRITER, path, w, ROLL_PUTS, spec, opens),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(2)
    ]
    try:
        results = []
        for p in writers:
            out, err = p.communicate(timeout=600)  # only ends a hung writer
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        stop.touch()
        out, err = opener.communicate(timeout=120)
        assert opener.returncode == 0, err
    finally:
        for p in [*writers, opener]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert int(out.split()[-1]) >= 2 * ROLL_PUTS  # at least one open after every put
    for r in results:
        assert r["n_errors"] == 0, f"puts failed while another process opened the store: {r}"
        assert len(r["acks"]) == ROLL_PUTS, r
    rnd = random.Random(0)
    with kvstore.open(path, layout=layout, model="test/roll@1", durability="none") as s:
        short = []
        for w, r in enumerate(results):
            assert r["acks"]
            for i in r["acks"]:
                toks = [w * 10_000_000 + i * 32 + j for j in range(32)]
                got = s.get(toks)
                if got.shape[2] != 32:
                    short.append((w, i, got.shape[2]))
                elif rnd.random() < 0.05:
                    assert_kv_equal(got, kv_for(layout, toks))
        total = sum(len(r["acks"]) for r in results)
        v = s.verify()
        assert not short, (
            f"{len(short)} of {total} acknowledged puts unreadable, e.g. {short[:3]}; "
            f"verify: {len(v['damaged'])} damaged, problems {v['problems'][:3]}"
        )
        assert v["damaged"] == [] and v["problems"] == [], v
