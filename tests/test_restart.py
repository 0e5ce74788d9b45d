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
