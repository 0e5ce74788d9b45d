"""Bit-exact round trips (README, Quick start): dtypes, layouts, partial blocks,
dedupe, compression, `out=`, `like=`, `extra=`, empty and unknown prefixes,
sessions.

The reference is always independent of the store: the input array sliced to
its full-block tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_kv_equal, full_tokens, kv_for, seq, small_layout

import kvstore

LAYOUTS = [
    # (L, H, D, dtype, B)
    (2, 2, 16, "float16", 8),
    (3, 1, 8, "bfloat16", 16),
    (1, 4, 4, "float32", 4),
    (2, 3, 5, "float16", 7),  # odd sizes everywhere
    (4, 2, 8, "bfloat16", 1),  # one token per block
    (1, 1, 64, "float32", 32),
]


def _layout(spec):
    L, H, D, dtype, B = spec
    return kvstore.Layout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, block_size=B)


def _open(path, layout, **kw):
    kw.setdefault("durability", "none")
    return kvstore.open(path, layout=layout, model="test/roundtrip@1", **kw)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: "L{}H{}D{}-{}-B{}".format(*s))
def test_round_trip_bit_exact(tmp_path, spec, compression):
    layout = _layout(spec)
    B = layout.block_size
    n = 5 * B + (B // 2 if B > 1 else 0)  # a trailing partial block when B > 1
    tokens = seq(100, n)
    kv = kv_for(layout, tokens)  # every bit pattern, NaNs included
    with _open(tmp_path / "s", layout, compression=compression) as s:
        full = full_tokens(layout, n)
        assert s.put(tokens, kv) == full
        assert s.lookup(tokens) == full
        got = s.get(tokens)
        assert_kv_equal(got, kv[:, :, :full])
        st = s.stats()
        assert st["blocks"] == full // B
        assert st["blocks_written"] == full // B
    # and again from a fresh handle, i.e. from the segment files
    with _open(tmp_path / "s", layout, compression=compression) as s:
        assert s.lookup(tokens) == full
        assert_kv_equal(s.get(tokens), kv[:, :, :full])
        # a longer request with the same prefix gets the stored prefix only
        longer = tokens + seq(90_000, 3 * B)
        assert s.lookup(longer) == full
        assert_kv_equal(s.get(longer), kv[:, :, :full])
        # a shorter request gets its own full blocks
        short = tokens[: 2 * B + 1]
        sfull = full_tokens(layout, len(short))
        assert s.lookup(short) == sfull
        assert_kv_equal(s.get(short), kv[:, :, :sfull])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kv_longer_than_tokens_and_token_types(tmp_path, dtype):
    """kv may carry more tokens than the full blocks (T >= full); token ids may be
    a list, numpy int32/int64/uint32, or a 1-D torch tensor."""
    import torch

    layout = small_layout(dtype, block_size=4)
    tokens = seq(7, 13)  # 3 full blocks + 1
    kv = kv_for(layout, tokens, total=20)  # T = 20 > 12
    want = kv[:, :, :12]
    with _open(tmp_path / "s", layout) as s:
        assert s.put(np.array(tokens, dtype=np.int32), kv) == 12
        for toks in (
            tokens,
            np.array(tokens, np.int64),
            np.array(tokens, np.uint32),
            torch.tensor(tokens),
            torch.tensor(tokens, dtype=torch.int32),
        ):
            assert s.lookup(toks) == 12
            assert_kv_equal(s.get(toks), want)


def test_non_contiguous_input(tmp_path):
    """A non-contiguous view of the right shape stores its logical values."""
    layout = small_layout("float16", block_size=4)
    tokens = seq(0, 8)
    base = kv_for(layout, tokens)  # [L, 2, 8, H, D]
    # same logical content, strided memory: [L, 2, H, 8, D] then swap back
    strided = np.ascontiguousarray(base.transpose(0, 1, 3, 2, 4)).transpose(0, 1, 3, 2, 4)
    assert not strided.flags.c_contiguous
    with _open(tmp_path / "s", layout) as s:
        assert s.put(tokens, strided) == 8
        assert_kv_equal(s.get(tokens), base)


def test_torch_input_for_float16(tmp_path):
    import torch

    layout = small_layout("float16", block_size=4)
    tokens = seq(0, 9)
    kv = kv_for(layout, tokens, family="torch")
    assert isinstance(kv, torch.Tensor)
    with _open(tmp_path / "s", layout) as s:
        assert s.put(torch.tensor(tokens), kv) == 8
        got = s.get(tokens)  # float16 store: numpy by default
        assert isinstance(got, np.ndarray)
        assert_kv_equal(torch.from_numpy(got), kv[:, :, :8])


def test_shared_prefixes_stored_once(tmp_path, layout):
    B = layout.block_size
    a = seq(0, 4 * B)
    b = a[: 2 * B] + seq(10_000, 2 * B + 3)  # shares 2 blocks with a
    c = a + seq(20_000, B)  # extends a by one block
    with _open(tmp_path / "s", layout) as s:
        assert s.put(a, kv_for(layout, a)) == 4 * B
        st = s.stats()
        assert (st["blocks"], st["blocks_written"], st["blocks_deduped"]) == (4, 4, 0)

        assert s.put(b, kv_for(layout, b)) == 4 * B
        st = s.stats()
        assert (st["blocks"], st["blocks_written"], st["blocks_deduped"]) == (6, 6, 2)

        assert s.put(a, kv_for(layout, a)) == 4 * B  # all already there
        st = s.stats()
        assert (st["blocks"], st["blocks_written"], st["blocks_deduped"]) == (6, 6, 6)

        assert s.put(c, kv_for(layout, c)) == 5 * B
        st = s.stats()
        assert (st["blocks"], st["blocks_written"], st["blocks_deduped"]) == (7, 7, 10)
        assert st["raw_live_bytes"] == 7 * layout.block_bytes

        for toks in (a, b, c):
            full = full_tokens(layout, len(toks))
            assert_kv_equal(s.get(toks), kv_for(layout, toks)[:, :, :full])


def test_same_put_twice_in_batch_mode_dedupes_pending(tmp_path, layout):
    """With durability="batch" a block not yet committed is still deduped, and the
    handle sees its own pending blocks."""
    B = layout.block_size
    a = seq(0, 3 * B)
    with _open(tmp_path / "s", layout, durability="batch", batch_window_ms=60_000) as s:
        s.put(a, kv_for(layout, a))
        s.put(a, kv_for(layout, a))
        st = s.stats()
        assert st["blocks_written"] == 3
        assert st["blocks_deduped"] == 3
        assert s.lookup(a) == 3 * B
        assert_kv_equal(s.get(a), kv_for(layout, a))
        s.flush()
        assert s.stats()["blocks"] == 3
        assert s.stats()["pending_blocks"] == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_zstd_compresses_low_entropy(tmp_path, dtype):
    layout = small_layout(dtype, block_size=16, L=2, H=4, D=32)
    tokens = seq(0, 6 * 16 + 5)
    kv = kv_for(layout, tokens, kind="lowent")
    with _open(tmp_path / "z", layout, compression="zstd") as s:
        assert s.put(tokens, kv) == 96
        st = s.stats()
        assert st["compression_ratio"] > 1.5, st
        assert st["live_bytes"] < st["raw_live_bytes"]
        assert_kv_equal(s.get(tokens), kv[:, :, :96])
    with _open(tmp_path / "z", layout, compression="zstd") as s:
        assert_kv_equal(s.get(tokens), kv[:, :, :96])
    # a handle without compression reads compressed records too
    with _open(tmp_path / "z", layout) as s:
        assert_kv_equal(s.get(tokens), kv[:, :, :96])
        # and writes raw ones next to them
        more = tokens[:96] + seq(5000, 32)
        kv2 = kv_for(layout, more, kind="lowent")
        assert s.put(more, kv2) == 128
        assert_kv_equal(s.get(more), kv2)
    with _open(tmp_path / "z", layout, compression="zstd") as s:
        assert_kv_equal(s.get(more), kv2)


def test_zstd_incompressible_data_still_exact(tmp_path, layout):
    tokens = seq(0, 40)
    kv = kv_for(layout, tokens)  # random bits: zstd does not pay
    with _open(tmp_path / "z", layout, compression="zstd", compression_level=19) as s:
        assert s.put(tokens, kv) == 40
        assert_kv_equal(s.get(tokens), kv)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_exponent_codec_round_trip(tmp_path, dtype):
    """compression="exponent": bit-exact, smaller on KV-like 16-bit data, raw where
    it does not pay (random bits, 32-bit dtypes), readable by a handle without it."""
    layout = small_layout(dtype)
    kind = "kvlike" if layout.itemsize == 2 else "lowent"
    tokens, other = seq(0, 40), seq(900, 24)
    kv, noise = kv_for(layout, tokens, kind=kind), kv_for(layout, other)
    with _open(tmp_path / "x", layout, compression="exponent", durability="batch") as s:
        assert s.put(tokens, kv) == 40
        assert s.put(other, noise) == 24
        s.flush()
        st = s.stats()
        assert_kv_equal(s.get(tokens), kv[:, :, :40])
        assert_kv_equal(s.get(other), noise[:, :, :24])
    if layout.itemsize == 2:
        # 5 KV-like blocks at 1.2x or better, 3 random ones raw.
        assert st["live_bytes"] < st["raw_live_bytes"] - 5 * layout.block_bytes // 6
    else:  # every record raw: payload plus header and token ids
        assert st["live_bytes"] == st["raw_live_bytes"] + 8 * (80 + 4 * layout.block_size)
    with _open(tmp_path / "x", layout) as s:
        assert_kv_equal(s.get(tokens), kv[:, :, :40])


def test_get_out_numpy(tmp_path, layout):
    B = layout.block_size
    tokens = seq(0, 5 * B + 2)
    kv = kv_for(layout, tokens)
    with _open(tmp_path / "s", layout) as s:
        s.put(tokens, kv)
        # room for more than what is stored
        out = np.zeros(layout.kv_shape(8 * B), dtype=np.float16)
        m = s.get(tokens, out=out)
        assert m == 5 * B
        assert_kv_equal(out[:, :, :m], kv[:, :, :m])
        # room for fewer tokens than stored: fills its full blocks
        small = np.zeros(layout.kv_shape(2 * B + 3), dtype=np.float16)
        assert s.get(tokens, out=small) == 2 * B
        assert_kv_equal(small[:, :, : 2 * B], kv[:, :, : 2 * B])
        # unknown prefix: 0, nothing to compare
        assert s.get(seq(77_777, 3 * B), out=out) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_get_out_torch(tmp_path, dtype):
    import torch

    layout = small_layout(dtype, block_size=4)
    tokens = seq(3, 17)
    kv = kv_for(layout, tokens, family="torch")
    with _open(tmp_path / "s", layout) as s:
        s.put(tokens, kv)
        out = torch.zeros(layout.kv_shape(20), dtype=getattr(torch, dtype))
        m = s.get(torch.tensor(tokens), out=out)
        assert m == 16
        assert_kv_equal(out[:, :, :m], kv[:, :, :16])


def test_like_chooses_the_family(tmp_path):
    import torch

    layout = small_layout("float16", block_size=4)
    tokens = seq(0, 12)
    kv = kv_for(layout, tokens)
    with _open(tmp_path / "s", layout) as s:
        s.put(tokens, kv)
        t = s.get(tokens, like=torch.empty(0))
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float16
        assert_kv_equal(t, torch.from_numpy(kv))
        a = s.get(tokens, like=np.empty(0))
        assert isinstance(a, np.ndarray) and a.dtype == np.float16
        assert_kv_equal(a, kv)
        assert isinstance(s.get(tokens), np.ndarray)
    with _open(tmp_path / "s", layout, array="torch") as s:
        assert isinstance(s.get(tokens), torch.Tensor)
        assert isinstance(s.get(tokens, like=np.empty(0)), np.ndarray)

    bf = small_layout("bfloat16", block_size=4)
    with _open(tmp_path / "b", bf) as s:
        kvb = kv_for(bf, tokens)
        s.put(tokens, kvb)
        got = s.get(tokens)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        assert_kv_equal(got, kvb)
        # numpy has no bfloat16: asking for it is a clear InvalidInput
        with pytest.raises(kvstore.InvalidInput, match="bfloat16"):
            s.get(tokens, like=np.empty(0))


def test_extra_is_part_of_the_key(tmp_path, layout):
    B = layout.block_size
    tokens = seq(0, 3 * B)
    kv_a = kv_for(layout, tokens, seed=1)
    kv_b = kv_for(layout, tokens, seed=2)
    with _open(tmp_path / "s", layout) as s:
        assert s.put(tokens, kv_a, extra="adapter-a") == 3 * B
        assert s.lookup(tokens, extra="adapter-a") == 3 * B
        assert s.lookup(tokens, extra=b"adapter-a") == 3 * B  # str and bytes agree
        assert s.lookup(tokens, extra="adapter-b") == 0
        assert s.lookup(tokens) == 0
        assert s.get(tokens, extra="adapter-b").shape[2] == 0
        assert s.get(tokens).shape[2] == 0
        # same tokens, other extra: stored separately, each reads its own KV
        assert s.put(tokens, kv_b, extra="adapter-b") == 3 * B
        assert s.stats()["blocks"] == 6
        assert_kv_equal(s.get(tokens, extra="adapter-a"), kv_a)
        assert_kv_equal(s.get(tokens, extra="adapter-b"), kv_b)
        assert s.lookup(tokens) == 0


def test_empty_and_unknown(tmp_path, layout):
    L, H, D, B = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    with _open(tmp_path / "s", layout) as s:
        empty_kv = np.zeros((L, 2, 0, H, D), np.float16)
        assert s.put([], empty_kv) == 0
        assert s.lookup([]) == 0
        got = s.get([])
        assert got.shape == (L, 2, 0, H, D) and got.dtype == np.float16
        # fewer tokens than one block: nothing stored, nothing found
        few = seq(1, B - 1)
        assert s.put(few, kv_for(layout, few)) == 0
        assert s.lookup(few) == 0
        assert s.get(few).shape == (L, 2, 0, H, D)
        assert s.stats()["blocks"] == 0
        assert s.stats()["blocks_written"] == 0
        # unknown prefix
        unknown = seq(123_456, 4 * B)
        assert s.lookup(unknown) == 0
        got = s.get(unknown)
        assert got.shape == (L, 2, 0, H, D)
        tokens = seq(0, 2 * B)
        s.put(tokens, kv_for(layout, tokens))
        # first block differs -> nothing, even though block 2 tokens match
        other = [99_999] + tokens[1:]
        assert s.lookup(other) == 0
        assert s.get(other).shape == (L, 2, 0, H, D)


def test_prefix_diverging_midway(tmp_path, layout):
    B = layout.block_size
    a = seq(0, 4 * B)
    with _open(tmp_path / "s", layout) as s:
        s.put(a, kv_for(layout, a))
        diverge = a[: 2 * B + 3] + seq(50_000, 3 * B)  # block 2 differs in its 4th token
        assert s.lookup(diverge) == 2 * B
        assert_kv_equal(s.get(diverge), kv_for(layout, a)[:, :, : 2 * B])


def test_block_position_matters(tmp_path, layout):
    """Ids chain over the prefix: a block's tokens at another position (another
    parent) are a different block."""
    B = layout.block_size
    x, y = seq(0, B), seq(1000, B)
    with _open(tmp_path / "s", layout) as s:
        s.put(x + y, kv_for(layout, x + y))
        assert s.lookup(y + x) == 0
        assert s.lookup(y) == 0
        assert s.lookup(x) == B


def test_many_blocks_one_put(tmp_path):
    layout = small_layout("float16", block_size=4, L=1, H=1, D=8)
    tokens = seq(0, 4 * 1500 + 1)
    kv = kv_for(layout, tokens)
    with _open(tmp_path / "s", layout) as s:
        assert s.put(tokens, kv) == 6000
        assert s.stats()["blocks"] == 1500
        assert_kv_equal(s.get(tokens), kv[:, :, :6000])


def test_sessions_round_trip(tmp_path):
    import torch

    layout = small_layout("bfloat16", block_size=4)
    t1 = seq(0, 4 * 4 + 3)
    t2 = t1[:8] + seq(500, 9)  # shares two blocks with t1
    with _open(tmp_path / "s", layout) as s:
        assert s.save_session("agent-1", t1, kv_for(layout, t1)) == 16
        assert s.save_session("agent-2", torch.tensor(t2), kv_for(layout, t2)) == 16
        assert sorted(s.sessions()) == ["agent-1", "agent-2"]
        assert s.stats()["blocks"] == 4 + 2
        assert s.stats()["sessions"] == 2
        toks, kv = s.load_session("agent-1")
        assert [int(t) for t in toks] == t1  # all tokens, as saved
        assert_kv_equal(kv, kv_for(layout, t1)[:, :, :16])
        toks, kv = s.load_session("agent-2")
        assert [int(t) for t in toks] == t2
        assert_kv_equal(kv, kv_for(layout, t2)[:, :, :16])
        # a session's blocks are ordinary blocks
        assert s.lookup(t1) == 16
        # re-saving replaces the binding
        t3 = seq(900, 8)
        s.save_session("agent-1", t3, kv_for(layout, t3))
        toks, kv = s.load_session("agent-1")
        assert [int(t) for t in toks] == t3
        assert_kv_equal(kv, kv_for(layout, t3))
        assert s.delete_session("agent-1") is True
        assert s.delete_session("agent-1") is False
        assert s.sessions() == ["agent-2"]
        with pytest.raises(kvstore.SessionNotFound):
            s.load_session("agent-1")
        # blocks stay after a session is deleted
        assert s.lookup(t3) == 8


def test_session_numpy_family(tmp_path, layout):
    tokens = seq(0, 19)
    kv = kv_for(layout, tokens)
    with _open(tmp_path / "s", layout) as s:
        s.save_session("n", tokens, kv)
        toks, got = s.load_session("n")
        assert isinstance(toks, np.ndarray) and isinstance(got, np.ndarray)
        assert toks.tolist() == tokens
        assert_kv_equal(got, kv[:, :, :16])


def test_two_handles_one_process(tmp_path, layout):
    """Two handles on one store in one process see each other's committed blocks."""
    B = layout.block_size
    a, b = seq(0, 2 * B), seq(1000, 2 * B)
    with (
        _open(tmp_path / "s", layout) as s1,
        _open(tmp_path / "s", layout, durability="batch") as s2,
    ):
        s1.put(a, kv_for(layout, a))
        assert s2.lookup(a) == 2 * B
        assert_kv_equal(s2.get(a), kv_for(layout, a))
        s2.put(b, kv_for(layout, b))
        s2.flush()
        assert_kv_equal(s1.get(b), kv_for(layout, b))


def test_reopen_without_layout_uses_manifest(tmp_path, layout):
    tokens = seq(0, 16)
    with _open(tmp_path / "s", layout) as s:
        s.put(tokens, kv_for(layout, tokens))
    with kvstore.open(tmp_path / "s", durability="none") as s:
        assert s.layout == layout
        assert s.model == "test/roundtrip@1"
        assert_kv_equal(s.get(tokens), kv_for(layout, tokens))
