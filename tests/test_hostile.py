"""Hostile paths (README, Memory and disk; Errors: CorruptStore): a store
directory someone else has tampered with. Symlinks in place of a segment, the
index, its data file, the MANIFEST or the segments directory; an arena file
planted by another user, with loose permissions, or as a symlink; a
world-writable store directory; records whose lengths point past the end of the
file or are absurd.

Pass: a clear refusal (a typed error naming the problem) or a miss, never a
crash, a giant allocation, wrong bytes, or a byte written (or read and trusted)
outside the store directory and its arena."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
from pathlib import Path

import pytest
from conftest import (
    RECORD_HEADER_LEN,
    assert_kv_equal,
    block_record,
    crc32c,
    kv_for,
    meta_offset,
    open_index,
    read_record,
    run_child,
    segment_file,
    seq,
    small_layout,
)

import kvstore

B = 8
LAYOUT = small_layout("float16", block_size=B)
MODEL = "test/hostile@1"
TOKENS = seq(100, 3 * B)  # three blocks
NEW = seq(90_000, 2 * B)
NOBODY = 65534


def _open(path: Path, **kw) -> kvstore.Store:
    return kvstore.open(path, layout=LAYOUT, model=MODEL, durability="sync", **kw)


def _build(path: Path, **kw) -> None:
    with _open(path, **kw) as s:
        assert s.put(TOKENS, kv_for(LAYOUT, TOKENS)) == 3 * B


class Untouched:
    """Bytes, mode and mtime of every file under `root` (or of one file): what
    must not change when the store is used."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.before = self._snap()

    def _snap(self) -> dict[str, tuple]:
        paths = [self.root] if self.root.is_file() else sorted(self.root.rglob("*"))
        out = {}
        for p in paths:
            st = p.lstat()
            body = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p)] = (st.st_mode, st.st_mtime_ns, st.st_size, body)
        return out

    def check(self) -> None:
        after = self._snap()
        assert after.keys() == self.before.keys(), (
            f"files outside the store appeared or vanished: "
            f"{sorted(after.keys() ^ self.before.keys())}"
        )
        for p, was in self.before.items():
            assert after[p] == was, f"{p} outside the store was modified"


def _use(path: Path, **kw) -> None:
    """Everything a user does: open, read, put, verify, compact, gc, reopen."""
    with _open(path, **kw) as s:
        got = s.get(TOKENS)
        want = kv_for(LAYOUT, TOKENS)
        assert_kv_equal(got, want[:, :, : got.shape[2]])
        assert s.put(NEW, kv_for(LAYOUT, NEW)) == 2 * B
        assert_kv_equal(s.get(NEW), kv_for(LAYOUT, NEW))
        s.verify()
        s.compact()
        s.gc(max_bytes=1 << 30)
    with _open(path, **kw) as s:
        assert_kv_equal(s.get(NEW), kv_for(LAYOUT, NEW))


SYMLINK = r"symlink|symbolic link"


def refused(exc: pytest.ExceptionInfo, root: Path, pattern: str) -> None:
    """The error says why (`pattern`), in its own words: paths (which hold the test's
    name) are cut out of the message first."""
    msg = str(exc.value).replace(str(root), "<tmp>")
    assert re.search(pattern, msg), f"{type(exc.value).__name__}: {msg}"


def _move_out(inside: Path, outside: Path) -> None:
    """Moves `inside` to `outside` and leaves a symlink to it in its place."""
    shutil.move(inside, outside)
    inside.symlink_to(outside)


# ------------------------------------------------------------------------- symlinks


def test_segment_replaced_by_a_symlink(tmp_path):
    """A segment file swapped for a symlink to a (valid!) copy outside the store:
    not followed. Its blocks are misses, verify says so, the store stays
    usable, and compaction or gc never write or delete the target."""
    path, outside = tmp_path / "s", tmp_path / "outside.kvseg"
    _build(path)
    (seg,) = sorted((path / "segments").iterdir())
    _move_out(seg, outside)
    guard = Untouched(outside)
    with _open(path) as s:
        v = s.verify()
        assert any("symlink" in p for p in v["problems"]), v["problems"]
        assert len(v["damaged"]) == 3, v["damaged"]
        assert s.get(TOKENS).shape[2] == 0, "a block was read through the symlink"
        assert s.lookup(TOKENS) == 0
    guard.check()
    _use(path)
    guard.check()
    # the damaged blocks can be stored again
    with _open(path) as s:
        assert s.put(TOKENS, kv_for(LAYOUT, TOKENS)) == 3 * B
        assert_kv_equal(s.get(TOKENS), kv_for(LAYOUT, TOKENS))
    guard.check()


def test_active_segment_replaced_by_a_symlink(tmp_path):
    """The same for a segment the index still calls active (its writer died):
    recovery, which truncates an active segment's torn tail, must not follow it."""
    path, outside = tmp_path / "s", tmp_path / "outside.kvseg"
    _build(path)
    (seg,) = sorted((path / "segments").iterdir())
    env = open_index(path, readonly=False)
    try:
        db = env.open_db(b"segments", create=False)
        with env.begin(db=db, write=True) as txn:
            key = struct.pack(">Q", int(seg.stem, 16))
            info = bytearray(txn.get(key))
            info[0] = 0  # Active
            info[8:16] = struct.pack("<Q", 100)  # committed length: a torn tail past it
            txn.put(key, bytes(info))
    finally:
        env.close()
    _move_out(seg, outside)
    guard = Untouched(outside)
    try:
        s = _open(path)
    except kvstore.KVStoreError as e:  # refused: acceptable, if it says why
        assert "symbolic link" in str(e) or "symlink" in str(e), str(e)
    else:
        with s:
            assert s.get(TOKENS).shape[2] == 0
    guard.check()


@pytest.mark.parametrize("sub", ["index", "segments"])
def test_store_subdirectory_is_a_symlink(tmp_path, sub):
    path, outside = tmp_path / "s", tmp_path / f"outside-{sub}"
    _build(path)
    _move_out(path / sub, outside)
    guard = Untouched(outside)
    with pytest.raises(kvstore.KVStoreError) as e:
        _open(path)
    refused(e, tmp_path, SYMLINK)
    guard.check()


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_index_file_is_a_symlink(tmp_path, name):
    """LMDB would open (and write) the target: refused, CorruptStore."""
    path, outside = tmp_path / "s", tmp_path / f"outside-{name}"
    _build(path)
    _move_out(path / "index" / name, outside)
    guard = Untouched(outside)
    with pytest.raises(kvstore.CorruptStore) as e:
        _use(path)
    refused(e, tmp_path, SYMLINK)
    guard.check()


def test_manifest_is_a_symlink(tmp_path):
    """Not followed (read from outside the store and trusted): CorruptStore."""
    path, outside = tmp_path / "s", tmp_path / "outside-MANIFEST"
    _build(path)
    _move_out(path / "MANIFEST", outside)
    guard = Untouched(outside)
    with pytest.raises(kvstore.CorruptStore) as e:
        _open(path)
    refused(e, tmp_path, SYMLINK)
    with pytest.raises(kvstore.CorruptStore):
        kvstore.open(path, create=False)
    guard.check()


def test_lock_file_is_a_symlink(tmp_path):
    path, outside = tmp_path / "s", tmp_path / "outside-LOCK"
    _build(path)
    _move_out(path / "LOCK", outside)
    guard = Untouched(outside)
    with pytest.raises(kvstore.KVStoreError) as e:
        _open(path)
    refused(e, tmp_path, SYMLINK)
    guard.check()


@pytest.mark.parametrize("sub", [".", "segments", "index"])
def test_world_writable_directory_is_refused(tmp_path, sub):
    """Anyone could swap the files of a store directory (or of its segments or
    index directory) that every user may write: refused, naming the problem."""
    path = tmp_path / "s"
    _build(path)
    os.chmod(path / sub, 0o777)
    with pytest.raises((kvstore.CorruptStore, kvstore.InvalidInput)) as e:
        _open(path)
    refused(e, tmp_path, "writable")
    os.chmod(path / sub, 0o700)
    with _open(path) as s:
        assert_kv_equal(s.get(TOKENS), kv_for(LAYOUT, TOKENS))


# ---------------------------------------------------------------------------- arena


def _arena_path(path: Path, hot: Path) -> Path:
    with _open(path) as s:
        store_id = s.manifest()["store_id"]
    return hot / f"kvstore-{store_id}.arena"


def _arena_refused(path: Path, hot: Path, needle: str) -> None:
    with pytest.raises(kvstore.CorruptStore) as e:
        _open(path, hot_bytes=4 << 20, hot_dir=hot)
    refused(e, path.parent, needle)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown the arena to nobody")
def test_arena_planted_by_another_user(tmp_path):
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    _build(path)
    arena = _arena_path(path, hot)
    arena.write_bytes(b"\0" * 8192)
    os.chown(arena, NOBODY, NOBODY)
    os.chmod(arena, 0o600)
    guard = Untouched(arena)
    _arena_refused(path, hot, r"owned by uid 65534")
    guard.check()
    # the store itself still works without the hot tier
    _use(path)


def test_arena_with_loose_permissions(tmp_path):
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    _build(path, hot_bytes=4 << 20, hot_dir=hot)
    arena = _arena_path(path, hot)
    assert stat.S_IMODE(arena.stat().st_mode) == 0o600, "created 0600"
    os.chmod(arena, 0o666)
    guard = Untouched(arena)
    _arena_refused(path, hot, "mode")
    guard.check()


@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_arena_path_is_a_symlink(tmp_path, target):
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    _build(path)
    arena = _arena_path(path, hot)
    victim = tmp_path / "victim"
    if target == "existing":
        victim.write_bytes(b"do not touch" * 1000)
    arena.symlink_to(victim)
    guard = Untouched(tmp_path / "victim") if target == "existing" else None
    _arena_refused(path, hot, SYMLINK)
    if guard:
        guard.check()
    else:
        assert not victim.exists(), "the arena was created through a dangling symlink"


def test_arena_path_is_a_fifo_or_a_directory(tmp_path):
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    _build(path)
    arena = _arena_path(path, hot)
    os.mkfifo(arena, 0o600)
    _arena_refused(path, hot, "regular file")
    arena.unlink()
    arena.mkdir(mode=0o700)
    with pytest.raises(kvstore.KVStoreError):
        _open(path, hot_bytes=4 << 20, hot_dir=hot)


# ---------------------------------------------------------- forged record lengths

FORGE_CHILD = """
import json, resource, sys
import numpy as np
import kvstore
from conftest import kv_for, small_layout

path, tokens = sys.argv[1], json.loads(sys.argv[2])
layout = small_layout("float16", block_size=8)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
with kvstore.open(path, layout=layout, model="test/hostile@1", durability="sync") as s:
    v = s.verify()
    out["damaged"] = sorted(d["block_id"] for d in v["damaged"])
    out["got"] = int(s.get(tokens).shape[2])
    buf = np.zeros(layout.kv_shape(len(tokens)), np.float16)
    out["got_out"] = int(s.get(tokens, out=buf))
    s.compact()
    s.gc(max_bytes=1 << 30)
    new = list(range(90_000, 90_016))
    s.put(new, kv_for(layout, new))
    out["new"] = int(s.get(new).shape[2])
    s.put(tokens, kv_for(layout, tokens))
    out["again"] = int(s.get(tokens).shape[2])
out["rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
print(json.dumps(out))
"""


def _forge_header(path: Path, loc, **fields) -> None:
    """Rewrites a record header's fields, with a valid header checksum."""
    rec = read_record(path, loc)
    meta = bytearray(rec.meta)
    offsets = {"n_tokens": (8, "<I"), "stored_len": (16, "<Q"), "raw_len": (24, "<Q")}
    for name, value in fields.items():
        at, fmt = offsets[name]
        struct.pack_into(fmt, meta, at, value)
    crc = crc32c(bytes(meta[RECORD_HEADER_LEN:]), crc32c(bytes(meta[:72])))
    struct.pack_into("<I", meta, 72, crc)
    with open(segment_file(path, loc.segment), "r+b") as f:
        f.seek(meta_offset(loc, len(rec.tokens)))
        f.write(bytes(meta))


def _forge_index(path: Path, bid: bytes, loc) -> None:
    env = open_index(path, readonly=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db, write=True) as txn:
            assert txn.put(bid, loc.encode())
    finally:
        env.close()


FORGERIES = {
    "header stored_len 2**40": lambda p, bid, loc: _forge_header(p, loc, stored_len=1 << 40),
    "header stored_len raw+1": lambda p, bid, loc: _forge_header(p, loc, stored_len=2049),
    "header raw_len 2**62": lambda p, bid, loc: _forge_header(p, loc, raw_len=1 << 62),
    "header n_tokens 2**31": lambda p, bid, loc: _forge_header(p, loc, n_tokens=1 << 31),
    "index lengths 2**40": lambda p, bid, loc: _forge_index(
        p, bid, type(loc)(loc.segment, loc.offset, (1 << 40) + 112, 1 << 40, loc.created_ms)
    ),
    "index offset past EOF": lambda p, bid, loc: _forge_index(
        p,
        bid,
        type(loc)(
            loc.segment,
            segment_file(p, loc.segment).stat().st_size - 100,
            loc.record_len,
            loc.stored_len,
            loc.created_ms,
        ),
    ),
    "index offset 2**62": lambda p, bid, loc: _forge_index(
        p, bid, type(loc)(loc.segment, 1 << 62, loc.record_len, loc.stored_len, loc.created_ms)
    ),
    "index segment 2**64-1": lambda p, bid, loc: _forge_index(
        p, bid, type(loc)((1 << 64) - 1, loc.offset, loc.record_len, loc.stored_len, 0)
    ),
}


@pytest.mark.parametrize(
    "forgery",
    FORGERIES,
)
def test_forged_record_lengths(tmp_path, forgery):
    """Lengths in a record header (with a valid checksum) or in its index entry
    that point past the end of the file or are absurd: the block is a miss, verify
    names it, compaction drops it, nothing allocates by the forged length (the
    child's peak RSS grows by less than 64 MiB), and the block can be put again."""
    path = tmp_path / "s"
    _build(path)
    bid, loc = block_record(path, LAYOUT, TOKENS, 1)
    FORGERIES[forgery](path, bid, loc)
    p = run_child(FORGE_CHILD, path, json.dumps(TOKENS), timeout=60)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["got"] == B and out["got_out"] == B, out  # block 0 only
    assert out["damaged"] == [bid.hex()], out
    assert out["new"] == 2 * B and out["again"] == 3 * B, out
    assert out["rss_growth_kib"] < 64 << 10, out
    with _open(path) as s:
        assert_kv_equal(s.get(TOKENS), kv_for(LAYOUT, TOKENS))
        assert s.verify()["damaged"] == []


def _zstd_rle_frame(declared: int, blocks: int) -> bytes:
    """A zstd frame that declares `declared` bytes of content and holds `blocks`
    RLE blocks of 128 KiB zeros (not the last): decodes to far more than a block."""
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", declared)
    header = (128 << 10) << 3 | 1 << 1  # size, type RLE, not last
    return frame + (header.to_bytes(3, "little") + b"\0") * blocks


@pytest.mark.parametrize("bomb", ["8 MiB of zeros", "declares 2**40 bytes"])
def test_zstd_bomb_record(tmp_path, bomb):
    """A compressed record (valid checksums) whose zstd frame decodes to far more
    than a block, or declares a huge size: a miss, no giant allocation."""
    path = tmp_path / "s"
    with kvstore.open(path, layout=LAYOUT, model=MODEL, durability="sync", compression="zstd") as s:
        assert s.put(TOKENS, kv_for(LAYOUT, TOKENS, kind="lowent")) == 3 * B
    bid, loc = block_record(path, LAYOUT, TOKENS, 1)
    rec = read_record(path, loc)
    assert rec.flags & 1, "the record is compressed"
    if bomb == "8 MiB of zeros":
        zstandard = pytest.importorskip("zstandard")
        frame = zstandard.ZstdCompressor(level=19).compress(b"\0" * (8 << 20))
    else:
        frame = _zstd_rle_frame(1 << 40, 40)
    assert len(frame) <= loc.stored_len, (len(frame), loc.stored_len)
    payload = frame + b"\0" * (loc.stored_len - len(frame))  # same length: index agrees
    meta = bytearray(rec.meta)
    struct.pack_into("<I", meta, 64, crc32c(payload))
    crc = crc32c(bytes(meta[RECORD_HEADER_LEN:]), crc32c(bytes(meta[:72])))
    struct.pack_into("<I", meta, 72, crc)
    with open(segment_file(path, loc.segment), "r+b") as f:
        f.seek(meta_offset(loc, len(rec.tokens)))
        f.write(bytes(meta) + payload)
    code = FORGE_CHILD.replace('durability="sync")', 'durability="sync", compression="zstd")')
    code = code.replace("kv_for(layout, tokens)", 'kv_for(layout, tokens, kind="lowent")')
    assert code.count("zstd") == 1 and code.count("lowent") == 1
    p = run_child(code, path, json.dumps(TOKENS), timeout=60)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["got"] == B and out["damaged"] == [bid.hex()], out
    assert out["again"] == 3 * B, out
    assert out["rss_growth_kib"] < 64 << 10, out
