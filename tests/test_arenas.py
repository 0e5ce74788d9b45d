"""Arenas that clean up after themselves (issue 15): every arena names its store,
`kvstore arenas [--prune]` lists and removes orphans, opening a store prunes the
orphans beside its arena, and pruning never removes an arena that a process maps or
whose store exists. The expected state is modelled independently: which stores
exist (on disk, by our own bookkeeping) and which processes hold which store open."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_argv, run_child, small_layout
from support.hugetlbfs import hugetlbfs_mount

import kvstore
from kvstore.cli import main as cli

LAYOUT = small_layout()
MODEL = "test/arenas@1"
HOT = 4 << 20


def open_store(path: Path, hot: Path, **kw: object) -> kvstore.Store:
    return kvstore.open(path, layout=LAYOUT, model=MODEL, hot_bytes=HOT, hot_dir=hot, **kw)  # type: ignore[arg-type]


def seq(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(n * LAYOUT.block_size)]


def kv_of(tokens: list[int]) -> np.ndarray:
    rng = np.random.default_rng(sum(tokens) + len(tokens))
    return rng.standard_normal(LAYOUT.kv_shape(len(tokens))).astype(np.float16)


def arena_of(path: Path, hot: Path) -> Path:
    with kvstore.open(path, durability="none", create=False) as s:
        return hot / f"kvstore-{s.manifest()['store_id']}.arena"


def listed(hot: Path, prune: bool = False) -> dict[str, dict]:
    """`kvstore arenas` for the arenas in `hot` only, by file name."""
    return {
        Path(a["path"]).name: a
        # Only `hot`: pruning must not touch the machine's other arenas.
        for a in kvstore.arenas(prune=prune, dirs=[hot])
    }


def make(path: Path, hot: Path, blocks: int = 2) -> Path:
    """A store with a hot tier holding `blocks` blocks; returns its arena."""
    with open_store(path, hot) as s:
        t = seq(blocks)
        s.put(t, kv_of(t))
    return arena_of(path, hot)


@pytest.fixture
def hot(tmp_path: Path) -> Path:
    d = tmp_path / "hot"
    d.mkdir()
    return d


def test_deleted_store_is_listed_as_orphan_and_pruned_by_the_cli(
    tmp_path: Path, hot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made_ms = int(time.time() * 1000)  # the wall clock, as the arena's header keeps it
    a, b = make(tmp_path / "a", hot), make(tmp_path / "b", hot)
    got = listed(hot)
    listed_ms = int(time.time() * 1000)
    assert set(got) == {a.name, b.name}
    for name, store in [(a.name, tmp_path / "a"), (b.name, tmp_path / "b")]:
        assert got[name]["store_path"] == str(store.resolve())
        assert (got[name]["owned"], got[name]["orphan"], got[name]["header"]) == (True, False, "ok")
        assert got[name]["bytes"] == a.stat().st_size > 0
        assert got[name]["mapped_by"] == 0
        assert made_ms <= got[name]["last_used_ms"] <= listed_ms, (made_ms, got[name], listed_ms)
    shutil.rmtree(tmp_path / "a")
    assert cli(["arenas", "--hot-dir", str(hot), "--json"]) == 0
    out = {Path(x["path"]).name: x for x in json.loads(capsys.readouterr().out)}
    assert (out[a.name]["orphan"], out[a.name]["store_exists"], out[a.name]["pruned"]) == (
        True,
        False,
        False,
    )
    assert out[b.name]["orphan"] is False
    assert a.exists(), "listing alone never removes anything"
    assert cli(["arenas", "--dir", str(hot), "--prune", "--json"]) == 0
    out = {Path(x["path"]).name: x for x in json.loads(capsys.readouterr().out)}
    assert out[a.name]["pruned"] is True and out[b.name]["pruned"] is False
    assert sorted(p.name for p in hot.iterdir()) == [b.name]
    kvstore.remove_arena(tmp_path / "b", hot_dir=hot)


def test_store_replaced_at_the_same_path_is_an_orphan(tmp_path: Path, hot: Path) -> None:
    old = make(tmp_path / "a", hot)
    shutil.rmtree(tmp_path / "a")
    new = make(tmp_path / "a", hot)  # another store id at the same path; prunes `old`
    assert sorted(p.name for p in hot.iterdir()) == [new.name]
    assert not old.exists()
    kvstore.remove_arena(tmp_path / "a", hot_dir=hot)


def test_opening_another_store_prunes_orphans_in_its_directory(tmp_path: Path, hot: Path) -> None:
    arenas = {name: make(tmp_path / name, hot) for name in "abc"}
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    with open_store(tmp_path / "c", hot) as s:
        assert s.stats()["hot_slots_used"] == 2  # its own arena kept, blocks and all
    assert sorted(p.name for p in hot.iterdir()) == [arenas["c"].name]
    # A store in another directory is not touched by an open elsewhere.
    other = tmp_path / "hot2"
    other.mkdir()
    lone = make(tmp_path / "d", other)
    shutil.rmtree(tmp_path / "d")
    with open_store(tmp_path / "c", hot):
        pass
    assert lone.exists()
    assert listed(other, prune=True)[lone.name]["pruned"] is True
    kvstore.remove_arena(tmp_path / "c", hot_dir=hot)


HOLD = """
import sys, kvstore
from conftest import small_layout
s = kvstore.open(sys.argv[1], layout=small_layout(), model="test/arenas@1",
                 hot_bytes=4 << 20, hot_dir=sys.argv[2])
t = [i % 50000 for i in range(2 * s.layout.block_size)]
print(s.lookup(t), flush=True)
sys.stdin.readline()      # hold the arena mapped until told
s.close()
"""


def hold(store: Path, hot: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        child_argv(HOLD, str(store), str(hot)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    p.stdout.readline()  # the store is open, its arena mapped
    return p


def release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_an_arena_a_live_process_maps_is_never_pruned(tmp_path: Path, hot: Path) -> None:
    arena = make(tmp_path / "a", hot)
    make(tmp_path / "b", hot)
    child = hold(tmp_path / "a", hot)
    try:
        shutil.rmtree(tmp_path / "a")
        got = listed(hot, prune=True)[arena.name]
        assert (got["orphan"], got["mapped_by"], got["pruned"]) == (True, 1, False)
        with open_store(tmp_path / "b", hot):
            pass
        assert arena.exists()
    finally:
        release(child)
    assert listed(hot, prune=True)[arena.name]["pruned"] is True
    assert not arena.exists()
    kvstore.remove_arena(tmp_path / "b", hot_dir=hot)


# A child that holds the arena's lifetime lock (a shared open-file-description lock,
# as every kvstore process that has the arena open does) without mapping it, so the
# /proc scan cannot see it: only the lock keeps the arena.
LOCK_ONLY = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
# struct flock on x86-64/aarch64 Linux: l_type, l_whence, l_start, l_len, l_pid.
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_RDLCK, 0, 0, 0, 0))
print("locked", flush=True)
sys.stdin.readline()
"""


def test_the_lifetime_lock_alone_keeps_an_arena(tmp_path: Path, hot: Path) -> None:
    arena = make(tmp_path / "a", hot)
    child = subprocess.Popen(
        child_argv(LOCK_ONLY, arena), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        shutil.rmtree(tmp_path / "a")
        got = listed(hot, prune=True)[arena.name]
        assert (got["orphan"], got["mapped_by"], got["pruned"]) == (True, 0, False)
        assert arena.exists()
    finally:
        release(child)
    assert listed(hot, prune=True)[arena.name]["pruned"] is True
    assert not arena.exists()


def _ofd_read_locks(path: Path) -> int:
    """Shared open-file-description locks on `path`'s inode, from /proc/locks."""
    ino = os.stat(path).st_ino
    return sum(
        1
        for line in Path("/proc/locks").read_text().splitlines()
        if " OFDLCK " in f" {line} " and " READ " in line and line.split()[5].endswith(f":{ino}")
    )


def test_an_arena_view_holds_the_lifetime_lock_after_its_store_closes(
    tmp_path: Path, hot: Path
) -> None:
    torch = pytest.importorskip("torch")
    from kvstore.torch import arena_view

    arena = make(tmp_path / "a", hot)
    s = open_store(tmp_path / "a", hot)
    assert _ofd_read_locks(arena) == 1  # the store's own handle
    view = arena_view(s)
    assert isinstance(view, torch.Tensor)
    assert _ofd_read_locks(arena) == 2
    s.close()
    assert _ofd_read_locks(arena) == 1, "the view outlives the store: its lock must too"
    del view, s  # the store's entry in the view cache goes with it
    import gc

    gc.collect()
    assert _ofd_read_locks(arena) == 0
    kvstore.remove_arena(tmp_path / "a", hot_dir=hot)


def test_renamed_store_keeps_its_arena_and_takes_it_back(tmp_path: Path, hot: Path) -> None:
    arena = make(tmp_path / "a", hot, blocks=3)
    child = hold(tmp_path / "a", hot)
    try:
        (tmp_path / "a").rename(tmp_path / "renamed")
        got = listed(hot, prune=True)[arena.name]
        assert (got["orphan"], got["pruned"]) == (True, False)
        assert got["store_path"] == str((tmp_path / "a").resolve())
    finally:
        release(child)
    # Opened from its new path, the store adopts its arena (and every hot block) and
    # the header names the new path: no longer an orphan.
    with open_store(tmp_path / "renamed", hot) as s:
        t = seq(3)
        assert s.get(t).shape[2] == len(t)
        st = s.stats()
        assert (st["hot_hit_blocks"], st["disk_hit_blocks"]) == (3, 0)
    got = listed(hot, prune=True)[arena.name]
    assert (got["owned"], got["orphan"], got["pruned"]) == (True, False, False)
    assert got["store_path"] == str((tmp_path / "renamed").resolve())
    kvstore.remove_arena(tmp_path / "renamed", hot_dir=hot)


def test_damaged_header_is_listed_and_pruned_only_with_its_store_gone(
    tmp_path: Path, hot: Path
) -> None:
    arena = make(tmp_path / "a", hot)
    with open(arena, "r+b") as f:  # the slot count (header word at byte 16)
        f.seek(16)
        f.write((12345).to_bytes(8, "little"))
    got = listed(hot, prune=True)[arena.name]
    assert (got["header"], got["owned"], got["orphan"], got["pruned"]) == (
        "damaged",
        True,
        False,
        False,
    )
    assert "geometry" in got["reason"]
    with pytest.raises(kvstore.CorruptStore, match="header word"):
        open_store(tmp_path / "a", hot)
    shutil.rmtree(tmp_path / "a")
    got = listed(hot, prune=True)[arena.name]
    assert (got["header"], got["orphan"], got["pruned"]) == ("damaged", True, True)
    assert not arena.exists()


def test_foreign_and_old_format_arenas_are_listed_and_never_pruned(
    tmp_path: Path, hot: Path
) -> None:
    arena = make(tmp_path / "a", hot)
    with open(arena, "r+b") as f:  # arena format 2: before the header named its store
        f.seek(8)
        f.write((2).to_bytes(8, "little"))
    junk = hot / f"kvstore-{'ab' * 16}.arena"
    junk.write_bytes(os.urandom(8192))
    junk.chmod(0o600)
    with pytest.raises(kvstore.CorruptStore, match="arena format 2"):
        open_store(tmp_path / "a", hot)
    shutil.rmtree(tmp_path / "a")
    got = listed(hot, prune=True)
    assert (got[arena.name]["header"], got[arena.name]["pruned"]) == ("foreign", False)
    assert "arena format 2" in got[arena.name]["reason"]
    assert (got[junk.name]["header"], got[junk.name]["pruned"]) == ("foreign", False)
    assert got[junk.name]["store_path"] is None
    with open_store(tmp_path / "b", hot):  # pruning at open keeps them too
        pass
    assert arena.exists() and junk.exists()
    assert cli(["remove-arena", str(arena)]) == 0
    assert kvstore.remove_arena(junk) == 1
    assert not arena.exists() and not junk.exists()
    kvstore.remove_arena(tmp_path / "b", hot_dir=hot)


def test_info_shows_an_existing_arena_without_creating_one(
    tmp_path: Path, hot: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_HOT_DIR", str(hot))
    with open_store(tmp_path / "a", hot) as s:
        t = seq(3)
        s.put(t, kv_of(t))
        s.pin(t[: LAYOUT.block_size], priority=5)
    arena = arena_of(tmp_path / "a", hot)
    before = (sorted(hot.iterdir()), arena.stat().st_mtime_ns, arena.read_bytes()[:4096])
    assert cli(["info", str(tmp_path / "a"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hot_path"] == str(arena)
    assert info["hot_bytes"] == arena.stat().st_size
    assert (info["hot_slots_used"], info["hot_slots_pinned"]) == (3, 1)
    assert info["page_kind"] in {"normal", "thp", "hugetlb"}
    assert cli(["stats", str(tmp_path / "a")]) == 0
    assert "3 of" in capsys.readouterr().out
    assert (sorted(hot.iterdir()), arena.stat().st_mtime_ns, arena.read_bytes()[:4096]) == before
    # A store without an arena: none reported, none created.
    with kvstore.open(tmp_path / "b", layout=LAYOUT, model=MODEL):
        pass
    assert cli(["info", str(tmp_path / "b"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["hot_path"], info["hot_bytes"], info["page_kind"]) == (None, 0, "none")
    assert sorted(hot.iterdir()) == before[0]
    kvstore.remove_arena(tmp_path / "a", hot_dir=hot)


def test_gc_prunes_orphans(
    tmp_path: Path, hot: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSTORE_HOT_DIR", str(hot))
    gone = make(tmp_path / "gone", hot)
    make(tmp_path / "a", hot)
    shutil.rmtree(tmp_path / "gone")
    assert cli(["gc", str(tmp_path / "a"), "--older-than", "30d", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arenas_pruned"] == [str(gone)]
    assert not gone.exists()
    kvstore.remove_arena(tmp_path / "a", hot_dir=hot)


def test_hugetlbfs_arena_is_listed_and_pruned(tmp_path: Path) -> None:
    with hugetlbfs_mount(tmp_path) as mnt:
        arena = make(tmp_path / "a", mnt)
        other = make(tmp_path / "b", mnt)
        got = listed(mnt)[arena.name]
        assert (got["page_kind"], got["owned"], got["header"]) == ("hugetlb", True, "ok")
        child = hold(tmp_path / "a", mnt)
        try:
            shutil.rmtree(tmp_path / "a")
            got = listed(mnt, prune=True)[arena.name]
            assert (got["orphan"], got["mapped_by"], got["pruned"]) == (True, 1, False)
        finally:
            release(child)
        with open_store(tmp_path / "b", mnt):
            pass
        assert not arena.exists() and other.exists()
        kvstore.remove_arena(tmp_path / "b", hot_dir=mnt)


# Each worker round waits until a whole prune pass (counted in a file by the test)
# has run since the round before: the pruner meets every state the workers' arenas
# go through, by construction rather than by sharing a time window.
WORKER = """
import sys, time, numpy as np, kvstore
from pathlib import Path
from conftest import small_layout
root, hot, me, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
passes = Path(sys.argv[5])
def passes_done():
    try:
        return int(passes.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0
def wait_for_a_pass():
    seen = passes_done()
    deadline = time.monotonic() + 120  # only ends a wait on a dead pruner
    while passes_done() < seen + 2:
        assert time.monotonic() < deadline, "the pruner stopped"
        time.sleep(0.002)
L = small_layout()
def kv_of(t):
    rng = np.random.default_rng(sum(t) + len(t))
    return rng.standard_normal(L.kv_shape(len(t))).astype(np.float16)
def opened(name):
    return kvstore.open(f"{root}/{name}", layout=L, model="test/arenas@1",
                        hot_bytes=4 << 20, hot_dir=hot, durability="none")
t = [(me * 1000 + i) % 50000 for i in range(4 * L.block_size)]
live = opened(f"live-{me}")      # open for the whole run: its hot blocks must stay
live.put(t, kv_of(t))
for r in range(rounds):
    wait_for_a_pass()
    with opened(f"churn-{me}-{r % 3}") as s:   # open, use, close other stores
        s.put(t, kv_of(t))
        assert np.array_equal(s.get(t), kv_of(t))
    before = live.stats()["hot_hit_blocks"]
    assert np.array_equal(live.get(t), kv_of(t))
    st = live.stats()
    assert st["hot_hit_blocks"] - before == 4 and st["disk_hit_blocks"] == 0, st
live.close()
print(rounds)
"""

WORKER_ROUNDS = 30


def test_pruning_races_safely_with_stores_opening_and_closing(tmp_path: Path, hot: Path) -> None:
    passes = tmp_path / "passes"
    workers = [
        subprocess.Popen(
            child_argv(WORKER, str(tmp_path), str(hot), str(i), str(WORKER_ROUNDS), str(passes)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    orphans_made = pruned = 0
    try:
        while any(w.poll() is None for w in workers):
            # An orphan every pass, next to the workers' arenas, then the prune.
            make(tmp_path / "doomed", hot, blocks=1)
            shutil.rmtree(tmp_path / "doomed")
            orphans_made += 1
            pruned += sum(a["pruned"] for a in listed(hot, prune=True).values())
            (tmp_path / "passes.tmp").write_text(str(orphans_made))
            os.replace(tmp_path / "passes.tmp", passes)
        outs = [w.communicate(timeout=120) for w in workers]  # only ends a hung worker
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, (out, err) in zip(workers, outs, strict=True):
        assert w.returncode == 0, (
            f"worker exited {w.returncode} (SIGBUS is {-signal.SIGBUS})\n{err}"
        )
        assert int(out) == WORKER_ROUNDS
    # Every orphan went (by our prunes or by the workers' opens); no live store's did.
    left = listed(hot, prune=True)
    assert all(a["owned"] for a in left.values()), left
    live_and_churn = {f"live-{i}" for i in range(3)} | {
        f"churn-{i}-{r}" for i in range(3) for r in range(3)
    }
    existing = {p.name for p in tmp_path.iterdir()} & live_and_churn
    assert len(left) == len(existing)
    # A prune pass ran between every two rounds of every worker.
    assert orphans_made >= 2 * WORKER_ROUNDS and pruned <= orphans_made
    for name in existing:
        kvstore.remove_arena(tmp_path / name, hot_dir=hot)
    assert list(hot.iterdir()) == []


def test_a_child_process_lists_the_same(tmp_path: Path, hot: Path) -> None:
    arena = make(tmp_path / "a", hot)
    out = run_child(
        "import sys, json, kvstore; print(json.dumps(kvstore.arenas(sys.argv[1])))", str(hot)
    ).stdout
    mine = [a for a in json.loads(out) if a["path"] == str(arena)]
    assert len(mine) == 1 and mine[0]["owned"]
    assert sys.executable  # the child ran with this interpreter
    kvstore.remove_arena(tmp_path / "a", hot_dir=hot)


def test_opens_reach_orphans_past_the_first_arenas_listed(tmp_path: Path, hot: Path) -> None:
    """An open inspects at most 64 arena files of its directory. It took the first
    64 of the listing, whose order is stable: with 80 arenas there, orphans past
    them stayed in memory however many stores opened. Each open now looks at
    another window of them."""
    stores = [tmp_path / f"s{i}" for i in range(80)]
    for p in stores:
        open_store(p, hot, durability="none").close()
    by_arena = {arena_of(p, hot).name: p for p in stores}
    # Orphans last in the directory's own order, where the first 64 never reached.
    order = [e.name for e in os.scandir(hot)]
    gone = [by_arena[name] for name in order[-10:]]
    for p in gone:
        shutil.rmtree(p)
    live = [p for p in stores if p not in gone]
    for i in range(20):
        open_store(live[i % 5], hot).close()
    left = [a["path"] for a in listed(hot).values() if a["orphan"]]
    assert left == []
    for p in live:
        kvstore.remove_arena(p, hot_dir=hot)
