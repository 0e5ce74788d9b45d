"""Corruption (README, Disk format: a damaged record is a miss): flipped bytes
in a payload or a record header, a segment truncated mid-record, a zeroed range,
a misplaced index entry. The damaged blocks become misses (get returns the
prefix before them, never wrong bytes), `verify` names them, everything else
still reads bit-exact, and a new put of the damaged block stores it again.

Records are found through the index with the Python `lmdb` package, and told
apart by their token ids (every block of the test data has its own)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import (
    HAVE_CLI,
    RECORD_HEADER_LEN,
    assert_kv_equal,
    block_record,
    index_blocks,
    kv_for,
    meta_offset,
    needs_cli,
    open_index,
    payload_offset,
    run_cli,
    segment_file,
    seq,
    small_layout,
)

import kvstore

B = 8
LAYOUT = small_layout("float16", block_size=B)
MODEL = "test/corruption@1"
# 4 sequences of 4 blocks (+ a partial block), all token ids distinct
SEQS = [seq(1000 * (k + 1), 4 * B + 3) for k in range(4)]


def _kind(compression):
    return {None: "random", "exponent": "kvlike"}.get(compression, "lowent")


def _open(path, compression=None):
    return kvstore.open(
        path, layout=LAYOUT, model=MODEL, durability="none", compression=compression
    )


def _build(path: Path, compression) -> None:
    with _open(path, compression) as s:
        for toks in SEQS:
            assert s.put(toks, kv_for(LAYOUT, toks, kind=_kind(compression))) == 4 * B
        assert s.stats()["blocks"] == 16
        if compression:
            assert s.stats()["compression_ratio"] > 1
    # closed: everything committed, the segment sealed


def _flip(path: Path, segment: int, at: int, mask: int = 0x40) -> None:
    f = segment_file(path, segment)
    data = bytearray(f.read_bytes())
    data[at] ^= mask
    f.write_bytes(bytes(data))


def _zero(path: Path, segment: int, start: int, end: int) -> None:
    with open(segment_file(path, segment), "r+b") as f:
        f.seek(start)
        f.write(b"\0" * (end - start))


def _check_reads(path: Path, compression, damaged: dict[int, int]) -> None:
    """`damaged`: sequence index -> first damaged block. Every sequence reads the
    prefix before its first damaged block, bit-exact; undamaged ones read whole."""
    with _open(path, compression) as s:
        for k, toks in enumerate(SEQS):
            want_blocks = damaged.get(k, 4)
            want = kv_for(LAYOUT, toks, kind=_kind(compression))
            got = s.get(toks)
            assert got.shape[2] == want_blocks * B, (
                f"seq {k}: got {got.shape[2]} tokens, want {want_blocks * B}"
            )
            assert_kv_equal(got, want[:, :, : want_blocks * B], f"seq {k}")
            # the miss sticks: asking again gives the same, and lookup agrees now
            assert s.get(toks).shape[2] == want_blocks * B
            assert s.lookup(toks) == want_blocks * B
            # with out=: same prefix, same bytes
            import numpy as np

            out = np.zeros(LAYOUT.kv_shape(len(toks)), np.float16)
            assert s.get(toks, out=out) == want_blocks * B
            assert_kv_equal(out[:, :, : want_blocks * B], want[:, :, : want_blocks * B])


def _verify_ids(path: Path, compression) -> tuple[set[str], dict]:
    with _open(path, compression) as s:
        v = s.verify()
    assert set(v) >= {"records_checked", "damaged", "problems"}
    return {d["block_id"] for d in v["damaged"]}, v


def _cli_verify(path: Path, bad_ids: set[str], extra_problem: bool = False) -> None:
    """`kvstore verify PATH` exits 1 and names every damaged block; --json agrees."""
    if not HAVE_CLI:
        return
    p = run_cli("verify", path)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    for bid in bad_ids:
        assert bid in p.stdout + p.stderr, (
            f"{bid} not named by `kvstore verify`:\n{p.stdout}\n{p.stderr}"
        )
    p = run_cli("verify", path, "--json")
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    doc = json.loads(p.stdout)
    assert doc["ok"] is False
    assert bad_ids <= {d["block_id"] for d in doc["damaged"]}
    for d in doc["damaged"]:
        assert set(d) >= {"block_id", "segment", "offset", "reason"}
    if extra_problem:
        assert doc["problems"], doc


def _repair(path: Path, compression, k: int, damaged_blocks: int = 1) -> None:
    """A put of a damaged sequence stores its damaged blocks again.

    A put skips blocks the index still lists; a damaged block that no read has
    reached yet (behind another damaged one) is only found, and moved aside, by
    the get that reaches it. So with several damaged blocks in one sequence it
    takes one get + put round per damaged block."""
    toks = SEQS[k]
    want = kv_for(LAYOUT, toks, kind=_kind(compression))
    with _open(path, compression) as s:
        for _ in range(damaged_blocks):
            got = s.get(toks)  # finds (and moves aside) the first damaged block
            assert_kv_equal(got, want[:, :, : got.shape[2]])
            assert s.put(toks, want) == 4 * B
        assert s.lookup(toks) == 4 * B
        assert_kv_equal(s.get(toks), want[:, :, : 4 * B])
    with _open(path, compression) as s:
        assert_kv_equal(s.get(toks), want[:, :, : 4 * B])


COMPRESSIONS = pytest.mark.parametrize("compression", [None, "zstd", "exponent"])


@COMPRESSIONS
def test_clean_store_verifies(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    ids, v = _verify_ids(path, compression)
    assert ids == set() and v["problems"] == [] and v["records_checked"] == 16
    if HAVE_CLI:
        p = run_cli("verify", path)
        assert p.returncode == 0, (p.stdout, p.stderr)
        p = run_cli("verify", path, "--json")
        assert p.returncode == 0, (p.stdout, p.stderr)
        doc = json.loads(p.stdout)
        assert doc["ok"] is True and doc["damaged"] == [] and doc["records_checked"] == 16


@COMPRESSIONS
def test_flipped_payload_byte(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    bid, loc = block_record(path, LAYOUT, SEQS[1], 2)
    _flip(path, loc.segment, payload_offset(loc) + loc.stored_len // 2)
    _cli_verify(path, {bid.hex()})
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid.hex()}
    _check_reads(path, compression, {1: 2})
    ids, _ = _verify_ids(path, compression)  # still reported after the read moved it aside
    assert ids == {bid.hex()}
    _repair(path, compression, 1)


@COMPRESSIONS
@pytest.mark.parametrize(
    "at", [0, 3, 4, 6, 8, 11, 16, 23, 24, 31, 33, 63, 64, 68, 72, 75, 80, 80 + 4 * B - 1]
)
def test_flipped_header_byte(tmp_path, compression, at):
    """Any byte of the 80-byte header or of the token ids: magic, version, flags,
    n_tokens, lengths, block id, checksums, tokens."""
    path = tmp_path / "s"
    _build(path, compression)
    bid, loc = block_record(path, LAYOUT, SEQS[2], 1)
    _flip(path, loc.segment, meta_offset(loc, B) + at, mask=0x01)
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid.hex()}, f"flip at header byte {at}"
    _check_reads(path, compression, {2: 1})


@COMPRESSIONS
def test_flipped_header_byte_cli(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    bid, loc = block_record(path, LAYOUT, SEQS[2], 0)
    _flip(path, loc.segment, meta_offset(loc, B) + 40)  # inside the block id
    _cli_verify(path, {bid.hex()})
    _check_reads(path, compression, {2: 0})
    _repair(path, compression, 2)


@COMPRESSIONS
def test_truncated_segment(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    # the last record of the file: block 3 of the last sequence
    bid, loc = block_record(path, LAYOUT, SEQS[3], 3)
    assert loc.offset + loc.record_len == segment_file(path, loc.segment).stat().st_size
    os.truncate(segment_file(path, loc.segment), loc.offset + loc.record_len // 2)
    _cli_verify(path, {bid.hex()}, extra_problem=True)
    ids, v = _verify_ids(path, compression)
    assert ids == {bid.hex()}
    assert any("shorter" in p for p in v["problems"]), v["problems"]
    _check_reads(path, compression, {3: 3})
    _repair(path, compression, 3)


@COMPRESSIONS
def test_truncated_segment_mid_header(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    bid_a, loc_a = block_record(path, LAYOUT, SEQS[3], 2)
    bid_b, _ = block_record(path, LAYOUT, SEQS[3], 3)
    # cut inside block 2's header: blocks 2 and 3 of the last sequence are gone
    os.truncate(segment_file(path, loc_a.segment), meta_offset(loc_a, B) + 20)
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid_a.hex(), bid_b.hex()}
    _check_reads(path, compression, {3: 2})


@COMPRESSIONS
def test_zeroed_range(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    # from the middle of block 1's payload to the middle of block 2's header (sequence 0)
    bid1, loc1 = block_record(path, LAYOUT, SEQS[0], 1)
    bid2, loc2 = block_record(path, LAYOUT, SEQS[0], 2)
    assert loc2.offset == loc1.offset + loc1.record_len  # back to back
    start = payload_offset(loc1) + loc1.stored_len // 2
    _zero(path, loc1.segment, start, meta_offset(loc2, B) + 40)
    _cli_verify(path, {bid1.hex(), bid2.hex()})
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid1.hex(), bid2.hex()}
    _check_reads(path, compression, {0: 1})
    _repair(path, compression, 0, damaged_blocks=2)


@COMPRESSIONS
def test_zeroed_whole_record(tmp_path, compression):
    path = tmp_path / "s"
    _build(path, compression)
    bid, loc = block_record(path, LAYOUT, SEQS[1], 0)
    _zero(path, loc.segment, loc.offset, loc.offset + loc.record_len)
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid.hex()}
    _check_reads(path, compression, {1: 0})


def test_zeroed_segment_header(tmp_path):
    """The segment's own header: verify reports it; the records still read."""
    path = tmp_path / "s"
    _build(path, None)
    (seg,) = {loc.segment for loc in index_blocks(path).values()}
    _zero(path, seg, 0, 32)
    ids, v = _verify_ids(path, None)
    assert v["problems"], v
    if HAVE_CLI:
        p = run_cli("verify", path)
        assert p.returncode == 1, (p.stdout, p.stderr)
    _check_reads(path, None, {})


@COMPRESSIONS
def test_misplaced_index_entry(tmp_path, compression):
    """An index entry pointing at another block's record (a misplaced record, as
    a collision would look): the record's block id and token ids do not match
    the request, so it is a miss, never the other block's KV."""
    path = tmp_path / "s"
    _build(path, compression)
    bid_a, _ = block_record(path, LAYOUT, SEQS[0], 1)
    _, loc_b = block_record(path, LAYOUT, SEQS[1], 1)
    env = open_index(path, readonly=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db, write=True) as txn:
            assert txn.put(bid_a, loc_b.encode())
    finally:
        env.close()
    ids, _ = _verify_ids(path, compression)
    assert ids == {bid_a.hex()}
    _check_reads(path, compression, {0: 1})
    _repair(path, compression, 0)


def test_misplaced_record_same_block_id(tmp_path):
    """A record whose header says the right block id but whose token ids differ
    (what a BLAKE3 collision would look like) is a miss: every hit re-checks the
    stored token ids against the request."""
    import struct

    from conftest import crc32c, read_record

    path = tmp_path / "s"
    _build(path, None)
    bid_a, loc_a = block_record(path, LAYOUT, SEQS[0], 1)
    _, loc_b = block_record(path, LAYOUT, SEQS[1], 1)
    # rewrite record b's header so it claims block a, with a valid header checksum
    rec = read_record(path, loc_b)
    meta = bytearray(rec.meta)
    meta[32:64] = bid_a
    crc = crc32c(bytes(meta[RECORD_HEADER_LEN:]), crc32c(bytes(meta[:72])))
    struct.pack_into("<I", meta, 72, crc)
    with open(segment_file(path, loc_b.segment), "r+b") as f:
        f.seek(meta_offset(loc_b, B))
        f.write(bytes(meta))
    env = open_index(path, readonly=False)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db, write=True) as txn:
            txn.put(bid_a, loc_b.encode())
    finally:
        env.close()
    with _open(path) as s:
        got = s.get(SEQS[0])
        assert got.shape[2] == B
        assert_kv_equal(got, kv_for(LAYOUT, SEQS[0])[:, :, :B])


def test_damaged_manifest_refuses_to_open(tmp_path):
    path = tmp_path / "s"
    _build(path, None)
    m = path / "MANIFEST"
    data = bytearray(m.read_bytes())
    data[len(data) // 3] ^= 0x04
    m.write_bytes(bytes(data))
    with pytest.raises(kvstore.CorruptStore) as e:
        _open(path)
    assert "MANIFEST" in str(e.value)
    m.write_bytes(b"")
    with pytest.raises(kvstore.CorruptStore):
        _open(path)


@needs_cli
def test_cli_verify_lists_segment_and_offset(tmp_path):
    path = tmp_path / "s"
    _build(path, None)
    bid, loc = block_record(path, LAYOUT, SEQS[1], 3)
    _flip(path, loc.segment, payload_offset(loc) + 5)
    p = run_cli("verify", path, "--json")
    assert p.returncode == 1
    doc = json.loads(p.stdout)
    (d,) = [d for d in doc["damaged"] if d["block_id"] == bid.hex()]
    assert d["segment"] == loc.segment and d["offset"] == loc.offset
    assert isinstance(d["reason"], str) and d["reason"]
    assert doc["records_checked"] == 16
