"""Restart (README, Durability): a process puts and exits; a new process finds
every block and session flushed before, bit-exact.

The writer leaves with os._exit, so nothing but what it made durable itself
(flush() for "batch", every put for "sync") can be relied on: no close(), no
destructors, no atexit."""

from __future__ import annotations

import json

import pytest
from conftest import assert_kv_equal, kv_for, run_child, seq, small_layout

import kvstore

WRITER = """
import json, os, sys
import kvstore
from conftest import kv_for, small_layout, seq

path, durability, compression = sys.argv[1], sys.argv[2], sys.argv[3]
compression = None if compression == "none" else compression
layout = small_layout("float16", block_size=8)
s = kvstore.open(path, layout=layout, model="test/restart@1", durability=durability,
                 compression=compression, batch_window_ms=60_000)
B = layout.block_size
seqs = {}
base = seq(0, 3 * B)
for k in range(6):
    toks = base[: (k % 3) * B] + seq(10_000 * (k + 1), 2 * B + k)  # shared prefixes, partial tails
    kind = "lowent" if k % 3 == 0 else "random"  # sequences sharing a prefix share its KV
    n = s.put(toks, kv_for(layout, toks, kind=kind))
    seqs[f"p{k}"] = [toks, n, kind]
for k in range(2):
    toks = base + seq(70_000 + 1000 * k, B + 3)
    n = s.save_session(f"sess-{k}", toks, kv_for(layout, toks))
    seqs[f"sess-{k}"] = [toks, n, "random"]
if durability == "batch":
    s.flush()
print(json.dumps(seqs), flush=True)
os._exit(0)  # no close(), no destructors
"""

READER = """
import json, sys
import kvstore
from conftest import kv_for, small_layout, assert_kv_equal

path, expected = sys.argv[1], json.loads(sys.stdin.read())
layout = small_layout("float16", block_size=8)
with kvstore.open(path, layout=layout, model="test/restart@1", durability="none") as s:
    for name, (toks, n, kind) in expected.items():
        assert s.lookup(toks) == n, (name, s.lookup(toks), n)
        assert_kv_equal(s.get(toks), kv_for(layout, toks, kind=kind)[:, :, :n], name)
        if name.startswith("sess-"):
            t, kv = s.load_session(name)
            assert t.tolist() == toks, name
            assert_kv_equal(kv, kv_for(layout, toks)[:, :, :n], name)
    assert sorted(s.sessions()) == ["sess-0", "sess-1"], s.sessions()
    v = s.verify()
    assert v["damaged"] == [] and v["problems"] == [], v
    print("OK", s.stats()["blocks"])
"""


def _run_reader(path, expected):
    import subprocess

    from conftest import child_argv

    p = subprocess.run(
        child_argv(READER, path),
        input=json.dumps(expected),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, f"reader failed\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("durability", ["batch", "sync"])
def test_restart_finds_everything(tmp_path, durability, compression):
    path = tmp_path / "store"
    out = run_child(WRITER, path, durability, compression).stdout
    expected = json.loads(out.strip().splitlines()[-1])
    assert all(n > 0 for _, n, _ in expected.values())
    res = _run_reader(path, expected)
    assert res.startswith("OK")
    # a third process (this one) too, and twice in a row (reopen after reopen)
    layout = small_layout("float16", block_size=8)
    for _ in range(2):
        with kvstore.open(path, layout=layout, model="test/restart@1", durability="none") as s:
            for toks, n, kind in expected.values():
                assert_kv_equal(s.get(toks), kv_for(layout, toks, kind=kind)[:, :, :n])


def test_restart_after_clean_close_batch(tmp_path):
    """With "batch" and no flush, close() commits what is pending."""
    path = tmp_path / "store"
    code = """
import sys, kvstore
from conftest import kv_for, small_layout, seq
layout = small_layout()
s = kvstore.open(sys.argv[1], layout=layout, model="m", durability="batch", batch_window_ms=60_000)
t = seq(0, 40)
s.put(t, kv_for(layout, t))
s.close()
"""
    run_child(code, path)
    layout = small_layout()
    t = seq(0, 40)
    with kvstore.open(path, layout=layout, model="m", durability="none") as s:
        assert s.lookup(t) == 40
        assert_kv_equal(s.get(t), kv_for(layout, t))


def test_restart_batch_window_commits_without_flush(tmp_path):
    """With "batch", the group commit happens by itself within the window: a
    process that waits past it and dies keeps its blocks."""
    path = tmp_path / "store"
    code = """
import os, sys, time, kvstore
from conftest import kv_for, small_layout, seq
layout = small_layout()
s = kvstore.open(sys.argv[1], layout=layout, model="m", durability="batch", batch_window_ms=20)
t = seq(0, 40)
s.put(t, kv_for(layout, t))
deadline = time.time() + 10
while s.stats()["pending_blocks"] and time.time() < deadline:
    time.sleep(0.02)
os._exit(0)
"""
    run_child(code, path)
    layout = small_layout()
    t = seq(0, 40)
    with kvstore.open(path, layout=layout, model="m", durability="none") as s:
        assert s.lookup(t) == 40
        assert_kv_equal(s.get(t), kv_for(layout, t))


def _page_cache_state(path) -> tuple[int, int, int] | None:
    """(cached, dirty, under writeback) pages of a file, by cachestat(2) (Linux 6.5);
    None where the kernel lacks it."""
    import ctypes
    import os

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_uint64)
            for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
        ]

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        st, rng = Stat(), Range(0, 0)  # len 0: to the end of the file
        rc = libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(st), 0)
    finally:
        os.close(fd)
    return None if rc != 0 else (st.cache, st.dirty, st.writeback)


def _file_system_of(path) -> str:
    """The type of the mount `path` is on (the longest mount point above it)."""
    import os

    real, best = os.path.realpath(path), ("", "")
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, fstype)
    return best[1]


@pytest.mark.parametrize("compression", [None, "exponent"])
def test_a_put_has_the_disk_write_as_it_goes(tmp_path, compression):
    """A durable put starts the disk writing its records as it appends them
    (sync_file_range), so the commit's fdatasync waits for the last pages only.
    Observable before any commit (a batch window of a minute): the segment's
    pages are no longer dirty, but written back or under writeback; without it
    every page of the put would still be dirty (the kernel's own flusher waits
    30 s or for far more dirty memory). And nothing changes what is durable:
    flush, then a fresh process reads every block bit-exact."""
    if _file_system_of(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on a file system without a disk to write back to")
    layout = kvstore.Layout(
        num_layers=2, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_size=16
    )  # 32 KiB blocks
    toks = seq(0, 16 * 256)  # 256 blocks, 8 MiB
    kv = kv_for(layout, toks, kind="lowent")
    path = tmp_path / "s"
    with kvstore.open(
        path,
        layout=layout,
        model="test/writeback@1",
        durability="batch",
        compression=compression,
        batch_window_ms=60_000,
    ) as s:
        assert s.put(toks, kv) == len(toks)
        segments = sorted((path / "segments").iterdir())
        state = [_page_cache_state(p) for p in segments]
        if any(st is None for st in state):
            pytest.skip("the kernel has no cachestat(2) to look at dirty pages with")
        pages = sum(st[0] for st in state)
        dirty = sum(st[1] for st in state)
        assert pages > 0, state
        # At most the page each segment's last record ends in.
        assert dirty <= len(segments), f"{dirty} of {pages} pages still dirty: {state}"
        s.flush()
    done = run_child(
        "import sys, kvstore\n"
        "from conftest import seq, kv_for, assert_kv_equal\n"
        "layout = kvstore.Layout(num_layers=2, num_kv_heads=4, head_dim=128,"
        " dtype='bfloat16', block_size=16)\n"
        "toks = seq(0, 16 * 256)\n"
        "with kvstore.open(sys.argv[1], layout=layout, model='test/writeback@1') as s:\n"
        "    assert_kv_equal(s.get(toks), kv_for(layout, toks, kind='lowent'), 'writeback')\n"
        "print('ok')\n",
        str(path),
    )
    assert done.stdout.strip().endswith("ok"), done.stdout
