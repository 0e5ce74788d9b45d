"""The shared-memory hot tier across processes: sharing, eviction under load,
pins, SIGKILL at any moment, page kinds, hostile arena files, restart.

Every test keeps its arena in its own temporary directory (`hot_dir`)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from support.hot_common import LAYOUT, MODEL, check, kv_of, seq
from support.hugetlbfs import hugetlbfs_mount

import kvstore

# Child processes import the same helpers.
HELPERS = (
    "import os, sys, time, random\n"
    f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
    "import kvstore\n"
    "from support.hot_common import LAYOUT, MODEL, check, kv_of, seq\n"
)


def open_store(path: Path, hot: Path, hot_bytes: int = 4 << 20, **kw: object) -> kvstore.Store:
    return kvstore.open(path, layout=LAYOUT, model=MODEL, hot_bytes=hot_bytes, hot_dir=hot, **kw)  # type: ignore[arg-type]


def child_args(code: str, *args: object) -> list[str]:
    return [sys.executable, "-c", HELPERS + textwrap.dedent(code), *map(str, args)]


def run_child(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(child_args(code, *args), capture_output=True, text=True, timeout=timeout)


def test_process_b_reads_what_process_a_put_from_the_arena(tmp_path: Path) -> None:
    store, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    r = run_child(
        """
        with kvstore.open(sys.argv[1], layout=LAYOUT, model=MODEL, hot_bytes=4 << 20,
                          hot_dir=sys.argv[2]) as s:
            for i in range(5):
                s.put(seq(i), kv_of(seq(i)))
        """,
        str(store),
        str(hot),
    )
    assert r.returncode == 0, r.stderr
    r = run_child(
        """
        with kvstore.open(sys.argv[1], layout=LAYOUT, model=MODEL, hot_bytes=4 << 20,
                          hot_dir=sys.argv[2]) as s:
            n = sum(check(s, seq(i)) for i in range(5))
            st = s.stats()
            print(n, st["hot_hit_blocks"], st["disk_hit_blocks"], st["bytes_read"])
        """,
        str(store),
        str(hot),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["320", "20", "0", "0"], "every block from memory, none from disk"


STRESS = """
    path, hot, ops, me = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(me)
    gets = misses = full = 0
    with kvstore.open(path, layout=LAYOUT, model=MODEL, hot_bytes=4 << 20, hot_dir=hot,
                      durability="none") as s:
        for _ in range(ops):
            op = rng.random()
            i = rng.randrange(400)
            if op < 0.4:
                s.put(seq(i), kv_of(seq(i)))
            elif op < 0.98:
                m = check(s, seq(i))
                gets += 1
                misses += m == 0
            elif op < 0.99:
                try:
                    s.pin(seq(i), priority=rng.randrange(1, 5), ttl=0.2)
                except kvstore.StoreFull:
                    full += 1  # both sets of a block hold live pins of higher priority
        st = s.stats()
        print("OK", gets, misses, st["hot_hit_blocks"], st["disk_hit_blocks"], full, flush=True)
"""


# Operations per process: puts and gets of 400 sequences of 4 blocks (1600 blocks of
# 8 KiB) through a 4 MiB arena (about 250 slots), so it evicts all along.
STRESS_OPS = 3000


@pytest.mark.slow
def test_four_processes_under_constant_eviction(tmp_path: Path) -> None:
    store, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    # The pinned prefix, put and pinned for good before the storm.
    with open_store(store, hot, hot_bytes=4 << 20) as s:
        keep = seq(10_000, 64)
        s.put(keep, kv_of(keep))
        assert s.pin(keep, priority=1000) == 64
        slots = s.stats()["hot_slots"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                HELPERS + textwrap.dedent(STRESS),
                str(store),
                str(hot),
                str(STRESS_OPS),
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.startswith("OK"), f"{out}\n{err}"
    hot_hits = sum(int(out.split()[3]) for out, _ in outs)
    disk_hits = sum(int(out.split()[4]) for out, _ in outs)
    assert hot_hits > 0 and disk_hits > 0, "the arena both served and evicted"
    with open_store(store, hot, hot_bytes=4 << 20) as s:
        st = s.stats()
        assert st["hot_evictions"] > 0
        assert st["hot_slots_used"] <= slots
        assert st["hot_bytes"] <= 4 << 20
        before = st["disk_hit_blocks"]
        assert check(s, keep) == 64
        assert s.stats()["disk_hit_blocks"] == before, "the pinned blocks survived the churn"
    assert (hot / os.listdir(hot)[0]).stat().st_size <= 4 << 20


KILLED = """
    path, hot, me = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(me)
    with kvstore.open(path, layout=LAYOUT, model=MODEL, hot_bytes=4 << 20, hot_dir=hot,
                      durability="none") as s:
        print("READY", flush=True)
        while True:
            i = rng.randrange(300)
            if rng.random() < 0.5:
                s.put(seq(i), kv_of(seq(i)))
            else:
                check(s, seq(i))
"""

SURVIVOR = """
    path, hot = sys.argv[1], sys.argv[2]
    reads = 0
    with kvstore.open(path, layout=LAYOUT, model=MODEL, hot_bytes=4 << 20, hot_dir=hot,
                      durability="none") as s:
        while not os.path.exists(os.path.join(hot, "..", "stop")):
            for i in range(0, 300, 7):
                check(s, seq(i))
                reads += 1
            s.put(seq(300 + reads % 50), kv_of(seq(300 + reads % 50)))
    print("OK", reads, flush=True)
"""


@pytest.mark.slow
def test_sigkill_mid_put_and_get_leaves_no_lock_or_leaked_slot(tmp_path: Path) -> None:
    store, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    with open_store(store, hot, hot_bytes=4 << 20, durability="none") as s:
        for i in range(0, 300, 3):
            s.put(seq(i), kv_of(seq(i)))
    survivor = subprocess.Popen(
        child_args(SURVIVOR, store, hot),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rng = random.Random(1)
    kills = 0
    for cycle in range(24):
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HELPERS + textwrap.dedent(KILLED),
                str(store),
                str(hot),
                str(cycle),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "READY", p.stderr.read() if p.stderr else ""
        time.sleep(rng.uniform(0.01, 0.25))
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, f"child ended on its own: {out}\n{err}"
        assert "WRONG" not in out
        kills += 1
    (tmp_path / "stop").touch()
    out, err = survivor.communicate(timeout=60)
    assert survivor.returncode == 0 and out.startswith("OK"), f"survivor: {out}\n{err}"
    assert kills >= 20
    # Opening reclaims any slot a killed writer left half-written; nothing is
    # locked (this open would hang otherwise) and every used slot holds a block.
    with open_store(store, hot, hot_bytes=4 << 20, durability="none") as s:
        st = s.stats()
        assert st["hot_slots_torn"] == 0
        assert st["hot_slots_used"] <= min(st["hot_slots"], 350 * 4)
        for i in range(0, 350):
            check(s, seq(i))
        assert s.verify()["damaged"] == []


HOLD_AND_STOP = """
import fcntl, os, signal, sys
f = open(sys.argv[1], "rb")
fcntl.flock(f, fcntl.LOCK_EX)
print("HELD", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_holder_of_the_writers_lock_delays_puts_once_and_fails_pins(
    tmp_path: Path,
) -> None:
    # A process stopped while it holds the arena's writers' lock (SIGSTOP, a
    # debugger): puts and gets still work, from the segments, late by one wait
    # (2 s) in all, not one per block (the handle's count of waits that ran out);
    # a pin fails with StoreLocked naming it.
    store, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    with open_store(store, hot) as s:
        (arena,) = hot.iterdir()
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_AND_STOP, str(arena)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
            for i in range(8):  # 32 blocks
                s.put(seq(i), kv_of(seq(i)))
            st = s.stats()
            assert st["hot_lock_timeouts"] == 1, "one wait for the whole run of puts"
            assert st["hot_fills_skipped"] == 32, "each block stays in the segments"
            for i in range(8):
                assert check(s, seq(i)) == 64  # their copies into the arena: no wait
            st = s.stats()
            assert st["hot_lock_timeouts"] == 1 and st["hot_fills_skipped"] > 32, st
            assert st["hot_slots_used"] == 0
            with pytest.raises(
                kvstore.StoreLocked,
                match=rf"writers' lock was not free within 2s; held now \(pid {holder.pid}: ",
            ):
                s.pin(seq(0), priority=1)
            assert s.stats()["hot_lock_timeouts"] == 2, "a pin waits, and gives up"
        finally:
            holder.kill()
            holder.wait()
        # The lock is free again: fills and pins go through the hot tier.
        s.put(seq(9), kv_of(seq(9)))
        assert s.pin(seq(0), priority=1) == 64
        assert s.stats()["hot_slots_used"] >= 8
        assert check(s, seq(9)) == 64


def test_page_kind_without_a_huge_page_pool_is_reported(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", tmp_path) as s:
        kind = s.stats()["page_kind"]
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    expected = {"normal", "thp"} if "[never]" not in thp and "[deny]" not in thp else {"normal"}
    assert kind in expected, f"{kind} with shmem_enabled {thp.strip()}"


def test_huge_pages_when_a_pool_can_be_set_up(tmp_path: Path) -> None:
    with hugetlbfs_mount(tmp_path) as mnt:
        with open_store(tmp_path / "s", mnt, hot_bytes=4 << 20) as s:
            st = s.stats()
            assert st["page_kind"] == "hugetlb"
            t = seq(1)
            s.put(t, kv_of(t))
            assert check(s, t) == 64
            assert s.stats()["hot_hit_blocks"] == 4
        # Adopting the existing arena, then closing, leaves nothing mapped
        # (a mapping shorter than a huge page would be impossible to unmap).
        with open_store(tmp_path / "s", mnt, hot_bytes=4 << 20) as s:
            assert check(s, t) == 64
        maps = Path("/proc/self/maps").read_text()
        assert str(mnt) not in maps, "arena still mapped after close"
        kvstore.remove_arena(tmp_path / "s", hot_dir=mnt)


def test_hostile_arena_symlink_is_refused(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    with open_store(tmp_path / "s", hot):
        pass
    (arena,) = hot.iterdir()
    arena.unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch")
    arena.symlink_to(victim)
    with pytest.raises(kvstore.CorruptStore, match="symlink"):
        open_store(tmp_path / "s", hot)
    assert victim.read_bytes() == b"do not touch"


def test_restart_with_the_arena_gone_refills_from_segments(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    t = seq(2)
    with open_store(tmp_path / "s", hot) as s:
        s.put(t, kv_of(t))
    assert kvstore.remove_arena(tmp_path / "s", hot_dir=hot) == 1
    with open_store(tmp_path / "s", hot) as s:
        assert check(s, t) == 64
        assert check(s, t) == 64
        st = s.stats()
        assert (st["disk_hit_blocks"], st["hot_hit_blocks"]) == (4, 4)


def test_pin_validation_and_full_of_pins(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", tmp_path) as s:
        with pytest.raises(kvstore.InvalidInput, match="priority"):
            s.pin(seq(1), priority=0)
        with pytest.raises(kvstore.InvalidInput, match="ttl"):
            s.pin(seq(1), ttl=-1)
        everything = np.concatenate([seq(i) for i in range(80)])
        s.put(everything, kv_of(everything))
        with pytest.raises(kvstore.StoreFull):
            s.pin(everything, priority=3)
        assert s.stats()["hot_slots_pinned"] > 0
        assert check(s, everything) == len(everything)
