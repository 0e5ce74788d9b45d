"""Crash (README, Durability): a writer with durability="sync" is killed with
SIGKILL at random moments, over and over. After every kill the store opens,
every acknowledged put (and session) is there and bit-exact, and nothing a get
returns is ever wrong.

The child prints "ack <i>" (flushed) after put i returns, so the test knows
exactly which puts were acknowledged when the kill landed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

from conftest import assert_kv_equal, child_argv, kv_for, small_layout

import kvstore

KILLS = 24
B = 8

SEQUENCE = """
B = 8
# Layout arguments: "padded" blocks are 128 KiB, so their format-v2 records
# carry the padding that puts each payload on a 4 KiB boundary.
SHAPES = {"small": {}, "padded": {"H": 4, "D": 512}}
def sequence(i):
    # shared 2-block prefix (one of 4), 2 blocks only this put has, a partial block
    pre = [(i % 4) * 100 + j for j in range(2 * B)]
    own = [1_000_000 + i * 16 + j for j in range(2 * B)]
    return pre + own + [7, 7, 7]
"""

CHILD = (
    SEQUENCE
    + """
import sys
import kvstore
from conftest import kv_for, small_layout

path, start, compression, durability, gc_every, shape = sys.argv[1:7]
start, gc_every = int(start), int(gc_every)
layout = small_layout("float16", block_size=B, **SHAPES[shape])
s = kvstore.open(path, layout=layout, model="test/crash@1", durability=durability,
                 compression=None if compression == "none" else compression,
                 segment_bytes=1 << 20, batch_window_ms=5)
print("ready", flush=True)
i = start
kind = "lowent" if compression != "none" else "random"
while True:
    toks = sequence(i)
    if i % 5 == 0:
        s.save_session(f"s{i}", toks, kv_for(layout, toks, kind=kind))
    else:
        s.put(toks, kv_for(layout, toks, kind=kind))
    print(f"ack {i}", flush=True)
    if durability == "batch" and i % 7 == 0:
        s.flush()
        print(f"flushed {i}", flush=True)
    if gc_every and i % gc_every == 0:
        s.gc(max_bytes=400 << 10)
        print(f"gc {i}", flush=True)
    i += 1
"""
)


def _sequence():
    ns: dict = {}
    exec(SEQUENCE, ns)
    return ns["sequence"]


def _shapes() -> dict:
    ns: dict = {}
    exec(SEQUENCE, ns)
    return ns["SHAPES"]


class _Child:
    """A writer process whose stdout lines are collected as they come."""

    def __init__(self, path, start, compression, durability, gc_every, shape):
        self.proc = subprocess.Popen(
            child_argv(CHILD, path, start, compression, durability, gc_every, shape),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            if not line.endswith("\n"):
                break  # torn last line: not an acknowledgement
            self.lines.append(line.strip())
            if line.startswith("ready"):
                self.ready.set()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        stderr = self.proc.stderr.read()
        self.proc.stderr.close()
        return stderr

    def acks(self) -> list[int]:
        return [int(x.split()[1]) for x in self.lines if x.startswith("ack ")]

    def durable_acks(self, durability: str) -> list[int]:
        """The puts the durability mode promises to keep across a process crash:
        every acknowledged one with "sync" and "none" (a process crash leaves the
        page cache intact), those before the last flush() with "batch"."""
        acks = self.acks()
        if durability != "batch":
            return acks
        flushed = [int(x.split()[1]) for x in self.lines if x.startswith("flushed ")]
        return [i for i in acks if flushed and i <= flushed[-1]]


def _check_store(path, layout, acked, suspects, kind, fresh, rnd):
    """Opens the store (this runs recovery) and checks that every put in `acked`
    is there; for the `suspects` (in flight, not durable yet, or evicted by gc),
    whatever is returned must be right. Bytes are compared for everything `fresh`
    (since the last check) and for a sample of the older ones."""
    sequence = _sequence()

    def sample(xs):
        xs = sorted(xs)
        old = [i for i in xs if i not in fresh]
        return [i for i in xs if i in fresh] + rnd.sample(old, min(len(old), 100))

    with kvstore.open(path, layout=layout, model="test/crash@1", durability="none") as s:
        sessions = set(s.sessions())
        for i in sorted(acked):
            n = s.lookup(sequence(i))
            assert n == 4 * B, f"acknowledged put {i} lost: lookup {n}"
            if i % 5 == 0:
                assert f"s{i}" in sessions, f"acknowledged session s{i} lost"
        for i in sample(acked):
            toks = sequence(i)
            assert_kv_equal(s.get(toks), kv_for(layout, toks, kind=kind)[:, :, : 4 * B], f"put {i}")
        for i in sample(suspects - acked):
            toks = sequence(i)
            got = s.get(toks)
            want = kv_for(layout, toks, kind=kind)[:, :, : got.shape[2]]
            assert_kv_equal(got, want, f"unacknowledged put {i}")
        for name in sample({int(n[1:]) for n in sessions}):
            name = f"s{name}"
            i = int(name[1:])
            toks, kv = s.load_session(name)
            assert toks.tolist() == sequence(i)
            assert_kv_equal(kv, kv_for(layout, sequence(i), kind=kind)[:, :, : kv.shape[2]], name)
            if i in acked:
                assert kv.shape[2] == 4 * B
        v = s.verify()
        assert v["damaged"] == [], v


def _kill_loop(
    tmp_path,
    compression: str,
    kills: int,
    seed: int,
    durability="sync",
    gc_every=0,
    shape="small",
):
    print(f"crash loop seed={seed} (set KVSTORE_CRASH_SEED to replay)")
    rnd = random.Random(seed)
    path = tmp_path / "store"
    layout = small_layout("float16", block_size=B, **_shapes()[shape])
    kind = "lowent" if compression != "none" else "random"
    acked: set[int] = set()
    suspects: set[int] = set()
    total_acks = 0
    total_gcs = 0
    for k in range(kills):
        start = k * 100_000
        child = _Child(path, start, compression, durability, gc_every, shape)
        if k % 4 == 3:
            # now and then from the spawn: lands in start-up, open or recovery too
            time.sleep(rnd.uniform(0.05, 0.5))
        else:
            assert child.ready.wait(timeout=60), (
                f"child never got ready: {child.proc.stderr.read()}"
            )
            time.sleep(rnd.uniform(0.05, 0.5))
        alive = child.proc.poll() is None
        stderr = child.kill()
        assert alive, f"writer died by itself (rc {child.proc.returncode}):\n{stderr}"
        acks = child.acks()
        assert acks == list(range(start, start + len(acks))), "acks out of order"
        total_acks += len(acks)
        total_gcs += sum(1 for x in child.lines if x.startswith("gc "))
        # gc evicts old blocks: then nothing is promised, only correctness is checked
        kept = [] if gc_every else child.durable_acks(durability)
        acked.update(kept)
        # the put after the last ack may have been in flight
        suspects.update(acks)
        suspects.add(start + len(acks))
        fresh = set(acks) | {start + len(acks)}
        _check_store(path, layout, acked, suspects, kind, fresh, rnd)
    return total_acks if not gc_every else (total_acks, total_gcs)


def _seed() -> int:
    return int(os.environ.get("KVSTORE_CRASH_SEED") or int.from_bytes(os.urandom(4), "little"))


def test_sigkill_sync_writer(tmp_path):
    total = _kill_loop(tmp_path, "none", KILLS, seed=_seed())
    assert total > 0, "no put was ever acknowledged: the kills all came too early"


def test_sigkill_sync_writer_zstd(tmp_path):
    total = _kill_loop(tmp_path, "zstd", 6, seed=_seed())
    assert total > 0


def test_sigkill_batch_writer(tmp_path):
    """ "batch": what was flushed survives; nothing returned is ever wrong."""
    total = _kill_loop(tmp_path, "none", 6, seed=_seed(), durability="batch")
    assert total > 0


def test_sigkill_none_writer(tmp_path):
    """ "none": no fsync, but a process crash loses nothing acknowledged."""
    total = _kill_loop(tmp_path, "none", 6, seed=_seed(), durability="none")
    assert total > 0


def test_sigkill_during_gc_and_compaction(tmp_path):
    """A writer that keeps evicting and compacting (1 MiB segments, gc to 400 KiB
    every 40 puts) is killed at random: the store opens, every block it still
    lists reads bit-exact, and verify finds no damage."""
    total, gcs = _kill_loop(tmp_path, "none", 8, seed=_seed(), durability="none", gc_every=40)
    assert total > 0 and gcs > 0


def test_sigkill_sync_writer_padded(tmp_path):
    """128 KiB blocks: every record of the v2 segments is padded (its payload
    on a 4 KiB boundary). Kills land in the padding, meta and payload of the
    record being appended, and in segment rolls (1 MiB segments)."""
    total = _kill_loop(tmp_path, "none", 8, seed=_seed(), shape="padded")
    assert total > 0


def test_sigkill_padded_writer_gc_and_compaction(tmp_path):
    """Padded records through gc and compaction (which rewrite them at other
    offsets, so with other padding) killed at random: every block listed reads
    bit-exact and verify finds no damage."""
    total, gcs = _kill_loop(
        tmp_path, "none", 6, seed=_seed(), durability="none", gc_every=4, shape="padded"
    )
    assert total > 0 and gcs > 0
