"""Interop (README, Disk format): the store's files read with standard tools
only: the index with the Python `lmdb` package, payloads straight from the
segment file with `zstandard`, checksums with a from-scratch CRC-32C, the
MANIFEST as JSON."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from conftest import (
    RECORD_HEADER_LEN,
    crc32c,
    index_blocks,
    kv_for,
    open_index,
    raw_bytes,
    read_record,
    records_by_tokens,
    segment_file,
    seq,
    small_layout,
    unshuffle,
)

import kvstore

MODEL = "test/interop@1"


def _fill(path, layout, compression, kind, sessions=()):
    B = layout.block_size
    seqs = [seq(1000 * (k + 1), 3 * B + 2) for k in range(3)]
    with kvstore.open(
        path, layout=layout, model=MODEL, durability="none", compression=compression
    ) as s:
        for toks in seqs:
            s.put(toks, kv_for(layout, toks, kind=kind))
        for name in sessions:
            s.save_session(name, seqs[0], kv_for(layout, seqs[0], kind=kind))
        st = s.stats()
    return seqs, st


def test_index_opens_with_python_lmdb(tmp_path, layout):
    path = tmp_path / "s"
    seqs, st = _fill(path, layout, None, "random", sessions=("alpha", "beta"))
    env = open_index(path)
    try:
        with env.begin() as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
        assert {b"blocks", b"segments", b"sessions", b"meta"} <= names
        blocks = env.open_db(b"blocks", create=False)
        segments = env.open_db(b"segments", create=False)
        sessions = env.open_db(b"sessions", create=False)
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            assert txn.stat(blocks)["entries"] == st["blocks"] == 9
            for k, v in txn.cursor(db=blocks):
                assert len(k) == 32 and len(v) == 40
                seg, off, rec_len, stored_len, created_ms = struct.unpack("<5Q", v)
                assert seg >= 1 and off >= 32
                # Version 2: zeros before the header put a payload of 64 KiB
                # or more on a 4 KiB boundary of the file; smaller ones have none.
                pad = rec_len - (RECORD_HEADER_LEN + 4 * layout.block_size + stored_len)
                if stored_len >= 64 << 10:
                    assert 0 <= pad < 4096 and (off + rec_len - stored_len) % 4096 == 0
                else:
                    assert pad == 0
                assert stored_len == layout.block_bytes  # uncompressed
                assert created_ms > 1_600_000_000_000
            segs = [
                (struct.unpack(">Q", bytes(k))[0], bytes(v)) for k, v in txn.cursor(db=segments)
            ]
            assert len(segs) == st["segments"] >= 1
            for n, v in segs:
                assert segment_file(path, n).exists()
                assert len(v) == 32
                committed_len = struct.unpack_from("<Q", v, 8)[0]
                assert committed_len == segment_file(path, n).stat().st_size
            sess = {bytes(k): bytes(v) for k, v in txn.cursor(db=sessions)}
            assert len(sess) == 2
            for k, v in sess.items():
                assert k[16:] in (b"alpha", b"beta")  # 16-byte tenant tag, then the name
                assert list(struct.unpack(f"<{len(v) // 4}I", v)) == seqs[0]
            meta_keys = {bytes(k) for k, _ in txn.cursor(db=meta)}
            assert b"next_segment" in meta_keys
    finally:
        env.close()


def test_manifest_is_json_with_checksum(tmp_path, layout):
    path = tmp_path / "s"
    _fill(path, layout, None, "random")
    text = (path / "MANIFEST").read_text()
    body, crc_line = text.rstrip("\n").rsplit("\n", 1)
    assert crc_line.startswith("crc32c ")
    assert int(crc_line.split()[1], 16) == crc32c(body.encode())
    m = json.loads(body)
    assert m["fingerprint"] == MODEL
    assert (m["num_layers"], m["num_kv_heads"], m["head_dim"], m["dtype"], m["block_size"]) == (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.block_size,
    )
    assert m["format_version"] == kvstore.FORMAT_VERSION


def _block_raw(layout, toks, kind, i):
    """Raw bytes of block i in [L, 2, B, H, D] order, from the input array."""
    B = layout.block_size
    kv = kv_for(layout, toks, kind=kind)
    return raw_bytes(kv[:, :, i * B : (i + 1) * B])


def _check_records(path, layout, seqs, kind, expect_compressed):
    import zstandard

    B = layout.block_size
    recs = records_by_tokens(path)
    seen = 0
    for toks in seqs:
        for i in range(len(toks) // B):
            bid, loc = recs[tuple(toks[i * B : (i + 1) * B])]
            rec = read_record(path, loc)
            assert rec.magic == b"KVRC" and rec.version == 1
            assert rec.n_tokens == B
            assert rec.block_id == bid
            assert rec.raw_len == layout.block_bytes
            assert rec.stored_len == loc.stored_len == len(rec.payload)
            assert rec.header_crc == crc32c(rec.meta[RECORD_HEADER_LEN:], crc32c(rec.meta[:72]))
            assert rec.stored_crc == crc32c(rec.payload)
            want = _block_raw(layout, toks, kind, i)
            if expect_compressed:
                assert rec.flags & 1, "expected a zstd payload"
                assert rec.stored_len < rec.raw_len
                decoded = zstandard.ZstdDecompressor().decompressobj().decompress(rec.payload)
                assert len(decoded) == rec.raw_len
                if layout.itemsize > 1:
                    assert rec.flags & 2, "16/32-bit dtypes are byte-plane shuffled"
                    plain = unshuffle(decoded, layout.itemsize)
                else:
                    plain = decoded
                assert plain == want, (
                    f"block {i}: decoded payload differs from the block's raw bytes"
                )
            else:
                assert rec.flags == 0
                assert rec.payload == want, f"block {i}: raw payload differs"
            assert rec.raw_crc == crc32c(want)
            seen += 1
    assert seen == len(recs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_uncompressed_payload_is_the_raw_block(tmp_path, dtype):
    layout = small_layout(dtype, block_size=4, L=2, H=2, D=8)
    path = tmp_path / "s"
    seqs, _ = _fill(path, layout, None, "random")
    _check_records(path, layout, seqs, "random", expect_compressed=False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_zstd_payload_decodes_with_python_zstandard(tmp_path, dtype):
    layout = small_layout(dtype, block_size=16, L=2, H=4, D=32)
    path = tmp_path / "s"
    seqs, st = _fill(path, layout, "zstd", "lowent")
    assert st["compression_ratio"] > 1
    _check_records(path, layout, seqs, "lowent", expect_compressed=True)


def test_zstd_frame_is_standard(tmp_path):
    """The frame alone (no store-specific framing) decodes with the one-shot API
    as well, which needs the content size in the frame header."""
    import zstandard

    layout = small_layout("float16", block_size=16, L=2, H=4, D=32)
    path = tmp_path / "s"
    _fill(path, layout, "zstd", "lowent")
    for _bid, loc in index_blocks(path).items():
        rec = read_record(path, loc)
        assert rec.payload[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic
        params = zstandard.get_frame_parameters(rec.payload)
        assert params.content_size in (rec.raw_len, zstandard.CONTENTSIZE_UNKNOWN)
        out = zstandard.ZstdDecompressor().decompress(rec.payload, max_output_size=rec.raw_len)
        assert len(out) == rec.raw_len


def test_segment_header(tmp_path, layout):
    path = tmp_path / "s"
    _fill(path, layout, None, "random")
    segs = {loc.segment for loc in index_blocks(path).values()}
    for n in segs:
        head = segment_file(path, n).read_bytes()[:32]
        magic, version, hdr_len, seg_no, crc = struct.unpack_from("<8sIIQI", head)
        assert magic == b"KVSTSEG\0" and version == 2 and hdr_len == 32 and seg_no == n
        assert crc == crc32c(head[:24])


def test_files_are_private(tmp_path, layout):
    import os
    import stat

    path = tmp_path / "s"
    _fill(path, layout, None, "random")
    for p in [path / "MANIFEST", *(path / "segments").iterdir()]:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode & 0o077 == 0, f"{p} is {oct(mode)}"


def test_unshuffle_helper():
    a = np.arange(8, dtype=np.uint16) * 0x0101 + 0x0100
    planes = a.view(np.uint8).reshape(-1, 2).T.copy().tobytes()
    assert unshuffle(planes, 2) == a.tobytes()
