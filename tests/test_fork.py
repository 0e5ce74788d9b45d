"""fork() (README, Concurrency): a child that touches a handle opened before the
fork gets StoreClosed telling it to reopen, never corruption; the parent keeps
working. Reopening in the child works when the parent had closed its handles
before forking; while the parent has the store open it is refused (StoreClosed):
the LMDB environment cannot cross fork() (another parent thread may have been in
the middle of a write transaction).
The fork happens in a helper process, not in pytest; the child reports through
its exit code."""

from __future__ import annotations

import os

import pytest
from conftest import assert_kv_equal, kv_for, run_child, seq, small_layout

import kvstore

FORK = """
import os, sys
import kvstore
from conftest import kv_for, small_layout, seq, assert_kv_equal

path, durability, what = sys.argv[1], sys.argv[2], sys.argv[3]
layout = small_layout()
s = kvstore.open(path, layout=layout, model="m", durability=durability)
a = seq(0, 32)
s.put(a, kv_for(layout, a))
s.flush()
if what == "reopen-closed":
    s.close()

pid = os.fork()
if pid == 0:
    code = 0
    try:
        if what == "get":
            s.get(a)
        elif what == "put":
            s.put(seq(5000, 16), kv_for(layout, seq(5000, 16)))
        elif what == "lookup":
            s.lookup(a)
        elif what == "flush":
            s.flush()
        elif what == "stats":
            s.stats()
        elif what == "close":
            s.close()  # closing the parent's handle in the child must not hurt it
            code = 10
        code = code or 5  # no exception
    except kvstore.StoreClosed as e:
        msg = str(e).lower()
        code = 3 if ("fork" in msg and "open" in msg) else 4
    except BaseException:
        code = 6
    if what in ("reopen", "reopen-closed") or code == 3:
        # a new handle in the child: works, and sees the parent's blocks, if the
        # parent closed its handle before forking; else refused, saying why
        try:
            with kvstore.open(path, layout=layout, model="m", durability="none") as c:
                assert_kv_equal(c.get(a), kv_for(layout, a))
                b = seq(9000, 16)
                c.put(b, kv_for(layout, b))
                assert_kv_equal(c.get(b), kv_for(layout, b))
            code = 7 if what == "reopen-closed" else 8
        except kvstore.StoreClosed as e:
            refused = "fork" in str(e) and what != "reopen-closed"
            code = (9 if what == "reopen" else 3) if refused else 8
        except BaseException as e:
            print("child reopen failed:", repr(e), flush=True)
            code = 8
    os._exit(code)

_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
if what == "reopen-closed":
    s = kvstore.open(path, layout=layout, model="m", durability=durability)
# the parent's handle still works, reads and writes
assert_kv_equal(s.get(a), kv_for(layout, a))
c = seq(7000, 24)
s.put(c, kv_for(layout, c))
s.flush()
assert_kv_equal(s.get(c), kv_for(layout, c))
if code == 7:
    b = seq(9000, 16)
    assert s.lookup(b) == 16, "parent does not see the child's blocks"
    assert_kv_equal(s.get(b), kv_for(layout, b))
s.close()
print("child-exit", code, flush=True)
"""


@pytest.mark.parametrize("durability", ["batch", "none"])
@pytest.mark.parametrize("what", ["get", "put", "lookup", "flush", "stats"])
def test_handle_from_before_fork_raises_in_child(tmp_path, what, durability):
    out = run_child(FORK, tmp_path / "s", durability, what).stdout
    code = int(out.split("child-exit")[1].split()[0])
    assert code == 3, {
        4: "StoreClosed without telling the child to reopen after fork",
        5: "no exception: the child used the parent's handle",
        6: "another exception than StoreClosed",
        8: "reopening in the child did not refuse with StoreClosed naming fork",
    }.get(code, f"child exit code {code}\n{out}")
    _check_after(tmp_path / "s")


def test_close_in_child_leaves_parent_alone(tmp_path):
    out = run_child(FORK, tmp_path / "s", "batch", "close").stdout
    assert "child-exit" in out
    _check_after(tmp_path / "s")


def test_reopen_in_child_while_the_parent_has_it_open_is_refused(tmp_path):
    out = run_child(FORK, tmp_path / "s", "batch", "reopen").stdout
    code = int(out.split("child-exit")[1].split()[0])
    assert code == 9, out
    _check_after(tmp_path / "s")


def test_reopen_in_child_after_the_parent_closed(tmp_path):
    out = run_child(FORK, tmp_path / "s", "batch", "reopen-closed").stdout
    code = int(out.split("child-exit")[1].split()[0])
    assert code == 7, out
    _check_after(tmp_path / "s")


def _check_after(path):
    layout = small_layout()
    with kvstore.open(path, layout=layout, model="m", durability="none") as s:
        for toks in (seq(0, 32), seq(7000, 24)):
            assert_kv_equal(s.get(toks), kv_for(layout, toks))
        # what the child may have put (5000) must not exist: the child's put raised
        assert s.lookup(seq(5000, 16)) == 0
        v = s.verify()
        assert v["damaged"] == [] and v["problems"] == [], v


WRITER_WITH_AN_IDLE_CHILD = """
import os, sys, time
import numpy as np
import kvstore

layout = kvstore.Layout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
s = kvstore.open(sys.argv[1], layout=layout, model="m", durability="none",
                 hot_bytes=16 << 20, hot_dir=sys.argv[2])
if os.fork() == 0:  # a worker forked early that never touches the store
    time.sleep(120)
    os._exit(0)
kv = np.ones(layout.kv_shape(16), np.float16)
print("writing", flush=True)
i = 0
while True:  # almost all of a put's time is its copy into the arena, under its lock
    s.put(list(range(16 * i, 16 * i + 16)), kv)
    i += 1
"""


def _flock_holders(inode: int) -> list[int]:
    """The pids that hold a flock on the file of `inode` (/proc/locks)."""
    with open("/proc/locks") as f:
        return [
            int(parts[4])
            for parts in map(str.split, f)
            if "FLOCK" in parts and "->" not in parts and parts[-3].endswith(f":{inode}")
        ]


def _holds_flock(pid: int, inode: int) -> bool:
    """Whether process `pid` holds a flock on the file of `inode`."""
    return pid in _flock_holders(inode)


def test_a_writer_killed_in_the_arena_leaves_no_lock_behind_a_forked_child(tmp_path):
    """The writers' lock was taken through the arena file's description, which a child
    forked earlier shares (its copy of the mapping keeps it open): a writer killed
    inside an insert left the lock held for as long as the idle child lived, and every
    open of the store with a hot tier failed after 20 s with StoreLocked. The writer is
    stopped until it is caught holding the lock, then killed: the arena is free."""
    import signal
    import subprocess
    import time

    from conftest import child_argv

    layout = kvstore.Layout(
        num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16
    )
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    p = subprocess.Popen(
        child_argv(WRITER_WITH_AN_IDLE_CHILD, path, hot),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "writing\n"
        (arena,) = hot.iterdir()
        inode = arena.stat().st_ino
        for _ in range(2000):
            p.send_signal(signal.SIGSTOP)
            time.sleep(0.002)  # stopped for sure
            if _holds_flock(p.pid, inode):
                break
            p.send_signal(signal.SIGCONT)
            time.sleep(0.001)
        else:
            pytest.fail("never caught the writer holding the arena's lock")
        p.kill()  # the writer, inside an insert; not its idle child
        p.wait()
        # Nobody holds a lock on the arena: not the idle child, through its copy of
        # the mapping's description.
        assert not _flock_holders(inode), "a lock on the arena outlived its writer"
        with kvstore.open(
            path, layout=layout, model="m", durability="none", hot_bytes=16 << 20, hot_dir=hot
        ) as s:
            # Takes the writers' lock: StoreLocked if it were still held.
            assert s.pin(list(range(16)), priority=1) == 16
            assert s.stats()["hot_lock_timeouts"] == 0
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the idle child too
