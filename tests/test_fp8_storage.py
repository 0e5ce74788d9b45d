"""fp8 storage (`Layout(storage="fp8")`): put quantizes, get dequantizes within the
stated bound of a float64 reference, an exact request never gets fp8 KV, and an fp8
pool loads the stored bytes and scales as `ops.write_kv` would have written them."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore

torch = pytest.importorskip("torch")
from kvstore import fp8, ops  # noqa: E402
from kvstore.torch import BlockPool, BlockTable  # noqa: E402

B, L, H, D = 8, 2, 2, 16
MODEL = "fp8-test@1"


def layout(dtype: str = "bfloat16", storage: str = "fp8") -> kvstore.Layout:
    return kvstore.Layout(L, H, D, dtype, B, storage)


def kv_of(tokens: int, dtype: str = "bfloat16", seed: int = 0) -> torch.Tensor:
    """KV-like values: randn * 0.05, one (layer, K/V, head) much larger, one all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((L, 2, tokens, H, D), generator=g, dtype=torch.float64) * 0.05
    x[1, 0, :, 1] *= 300.0
    x[0, 1, :, 0] = 0.0
    return x.to(getattr(torch, dtype))


def reference_scales(kv: torch.Tensor, tokens: int) -> torch.Tensor:
    """float64: per (layer, K/V, block, head) the smallest power of two s with
    max|x| <= 448 s (0 for an all-zero block: it has no scale)."""
    x = kv[:, :, :tokens].double().reshape(L, 2, tokens // B, B, H, D)
    amax = x.abs().amax(dim=(3, 5))
    s = torch.zeros_like(amax)
    nz = amax > 0
    s[nz] = torch.exp2(torch.ceil(torch.log2(amax[nz] / 448.0)))
    return s


def assert_within_fp8_error(got: torch.Tensor, kv: torch.Tensor, n: int, dtype: str) -> None:
    """`got` (the first n tokens) is `kv` within kvstore.ops' stated bound
    |x - q| <= 2**-4 |x| + 2**-9 s, in float64, plus half an ulp of `dtype` (the
    result is rounded to it); and it is lossy (some value moved)."""
    x = kv[:, :, :n].double()
    s_tok = reference_scales(kv, n).repeat_interleave(B, dim=2)[:, :, :, :, None]
    err = (got.double() - x).abs()
    bound = 2.0**-4 * x.abs() + 2.0**-9 * s_tok
    ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}[dtype]
    assert bool((err <= bound + ulp * x.abs()).all()), float((err - bound).max())
    # A test that could not fail otherwise: fp8 moved some values.
    assert bool((err > 0).any())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_round_trip_within_stated_error(tmp_path, dtype):
    n = 5 * B
    kv = kv_of(n + 3, dtype)
    with kvstore.open(tmp_path / "s", layout=layout(dtype), model=MODEL, array="torch") as s:
        assert s.put(list(range(n + 3)), kv) == n
        got = s.get(list(range(n + 3)))
        assert got.dtype == kv.dtype and tuple(got.shape) == (L, 2, n, H, D)
        values, scales = s.get_fp8(list(range(n)))
        ref_s = reference_scales(kv, n)
        torch.testing.assert_close(scales.double(), ref_s, rtol=0, atol=0)
        assert_within_fp8_error(got, kv, n, dtype)
        assert bool((got[0, 1, :, 0] == 0).all())
        # get(out=) agrees, with a partial block's room left alone.
        out = torch.full((L, 2, n + 3, H, D), 7.0, dtype=kv.dtype)
        assert s.get(list(range(n + 3)), out=out) == n
        assert torch.equal(out[:, :, :n], got)
        assert bool((out[:, :, n:] == 7).all())
        # From a block on.
        part = s.get(list(range(n)), start=2 * B)
        assert torch.equal(part, got[:, :, 2 * B :])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_values_near_the_largest_finite_come_back_finite(tmp_path, dtype):
    """e4m3 rounds up too: float16's 64000 and 65504 came back as 65536, which float16
    holds as inf. Clamped to the dtype's range, they stay within the stated error."""
    big = torch.finfo(getattr(torch, dtype)).max
    kv = kv_of(B, dtype)
    kv[0, 0, 0, 0, :4] = torch.tensor([big, -big, 0.977 * big, -0.977 * big]).to(kv.dtype)
    with kvstore.open(tmp_path / "s", layout=layout(dtype), model=MODEL, array="torch") as s:
        s.put(list(range(B)), kv)
        got = s.get(list(range(B)))
    assert bool(torch.isfinite(got).all())
    assert_within_fp8_error(got, kv, B, dtype)


def test_stored_bytes_are_half_of_bf16(tmp_path):
    n = 4 * B
    with kvstore.open(tmp_path / "s", layout=layout(), model=MODEL) as s:
        s.put(list(range(n)), kv_of(n))
        s.flush()
        st = s.stats()
    exact = layout(storage="exact").block_bytes
    assert st["raw_live_bytes"] == 4 * layout().block_bytes
    assert layout().block_bytes == exact // 2 + L * 2 * 4 * H


def test_never_served_to_an_exact_request(tmp_path):
    toks = list(range(3 * B))
    kv = kv_of(3 * B)
    with kvstore.open(tmp_path / "f", layout=layout(), model=MODEL) as lossy:
        lossy.put(toks, kv)
        lossy_ids = lossy.block_ids(toks)
    with kvstore.open(tmp_path / "e", layout=layout(storage="exact"), model=MODEL) as exact:
        assert exact.lookup(toks) == 0
        exact_ids = exact.block_ids(toks)
    # Same model, tokens and shape: other ids, so no tier (local, hot, remote) can
    # hand one mode's block to the other.
    assert not set(lossy_ids) & set(exact_ids)
    with pytest.raises(kvstore.LayoutMismatch, match="storage=fp8"):
        kvstore.open(tmp_path / "f", layout=layout(storage="exact"), model=MODEL)
    # Opened as its MANIFEST says, it is the fp8 store.
    with kvstore.open(tmp_path / "f") as again:
        assert again.layout == layout()
        assert again.lookup(toks) == 3 * B


def test_fp8_pool_loads_without_quantizing_again(tmp_path):
    n = 4 * B
    kv = kv_of(n)
    toks = list(range(n))
    pool_layout = kvstore.Layout(L, H, D, "float8_e4m3fn", B)
    with kvstore.open(tmp_path / "s", layout=layout(), model=MODEL) as s:
        s.put(toks, kv)
        loaded = BlockPool(pool_layout, 8, device="cpu")
        seq = loaded.load(s, toks)
        assert seq.length == n
        # The pool's own quantizer over the same KV, token by token from offset 0.
        mine, own = fp8_pool_of(kv, n)
        a = torch.tensor(seq.blocks, dtype=torch.int64)
        b = torch.tensor(own.blocks, dtype=torch.int64)
        assert torch.equal(
            loaded.kv.index_select(2, a).view(torch.uint8),
            mine.kv.index_select(2, b).view(torch.uint8),
        )
        assert torch.equal(loaded.scales.index_select(2, a), mine.scales.index_select(2, b))
        # And the store's own dequantized get is those bytes times those scales.
        deq = (
            loaded.kv.index_select(2, a).float()
            * loaded.scales.index_select(2, a)[:, :, :, None, :, None]
        )
        assert torch.equal(deq.reshape(L, 2, n, H, D).to(torch.bfloat16), s.get(toks, like=kv))
    exact = kvstore.open(tmp_path / "x", layout=layout(storage="exact"), model=MODEL)
    with exact, pytest.raises(kvstore.InvalidInput):
        BlockPool(pool_layout, 8, device="cpu").load(exact, toks)


def fp8_pool_of(kv: torch.Tensor, n: int) -> tuple[BlockPool, BlockTable]:
    """A CPU fp8 pool holding the first n tokens of `kv`, written by `ops.write_kv`
    token by token from offset 0 (the pool's own quantizer and scales)."""
    pool = BlockPool(kvstore.Layout(L, H, D, "float8_e4m3fn", B), 8, device="cpu")
    seq = pool.new_sequence()
    seq.reserve(n)
    slots = seq.slot_mapping(0, n)
    for layer in range(L):
        ops.write_kv(
            kv[layer, 0, :n],
            kv[layer, 1, :n],
            pool.key_cache(layer),
            pool.value_cache(layer),
            slots,
            pool.key_scales(layer),
            pool.value_scales(layer),
        )
    seq.length = n
    return pool, seq


def pool_blocks(pool: BlockPool, seq: BlockTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes `[L, 2, nb, B, H, D]` and scales `[L, 2, nb, H]` of `seq`'s blocks."""
    idx = torch.tensor(seq.blocks, dtype=torch.int64)
    return pool.kv.view(torch.uint8).index_select(2, idx), pool.scales.index_select(2, idx)


def test_fp8_pool_saves_bytes_and_scales_as_they_are(tmp_path):
    n = 4 * B
    kv = kv_of(n + 3)
    toks = list(range(n + 3))
    pool, seq = fp8_pool_of(kv, n + 3)
    assert bool((pool.scales != 1).any()), "write_kv chose scales: the case save refused"
    want_bytes, want_scales = pool_blocks(pool, seq)
    with kvstore.open(tmp_path / "s", layout=layout(), model=MODEL, array="torch") as s:
        # The partial last block is not stored.
        assert pool.save(s, seq, toks) == n
        assert s.lookup(toks) == n
        values, scales = s.get_fp8(toks)
        assert torch.equal(values.view(torch.uint8), want_bytes[:, :, : n // B])
        assert torch.equal(scales, want_scales[:, :, : n // B])
        # A put of the unquantized KV into another fp8 store stores the same bytes
        # (the store's quantizer is write_kv's): one id, one content, either way.
        with kvstore.open(tmp_path / "q", layout=layout(), model=MODEL) as q:
            q.put(toks, kv)
            qv, qs = q.get_fp8(toks)
            assert q.block_ids(toks) == s.block_ids(toks)
        assert torch.equal(qv.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(qs, scales)
        # The store's dequantized get is those bytes times those scales.
        deq = values.float() * scales[:, :, :, None, :, None]
        assert torch.equal(s.get(toks), deq.reshape(L, 2, n, H, D).to(torch.bfloat16))
        # And an fp8 pool loads them back bit for bit.
        back = BlockPool(pool.layout, 8, device="cpu")
        table = back.load(s, toks)
        assert table.length == n
        got_bytes, got_scales = pool_blocks(back, table)
        assert torch.equal(got_bytes, want_bytes[:, :, : n // B])
        assert torch.equal(got_scales, want_scales[:, :, : n // B])
    # Another shape's fp8 store is refused, as is a forged scale.
    other = kvstore.Layout(L, H, 2 * D, "bfloat16", B, "fp8")
    with kvstore.open(tmp_path / "o", layout=other, model=MODEL) as o:
        with pytest.raises(kvstore.InvalidInput):
            pool.save(o, seq, toks)
        assert o.lookup(toks) == 0
    with kvstore.open(tmp_path / "s", layout=layout(), model=MODEL) as s:
        bad = want_scales.clone()
        bad[0, 0, 0, 0] = float("nan")
        with pytest.raises(kvstore.InvalidInput, match="scales"):
            s.put_fp8(list(range(100, 100 + n)), want_bytes.view(torch.float8_e4m3fn), bad)
        assert s.lookup(list(range(100, 100 + n))) == 0


@pytest.mark.parametrize("hot", [False, True])
def test_bf16_pool_loads_dequantized_from_an_fp8_store(tmp_path, hot):
    n = 5 * B
    kv = kv_of(n)
    toks = list(range(n))
    opts = {"hot_bytes": 4 << 20, "hot_dir": tmp_path} if hot else {}
    with kvstore.open(tmp_path / "s", layout=layout(), model=MODEL, array="torch", **opts) as s:
        s.put(toks, kv)
        pool = BlockPool(kvstore.Layout(L, H, D, "bfloat16", B), 16, device="cpu")
        table = pool.load(s, toks)
        assert table.length == n
        # Not through the hot tier's raw copy, which holds the stored (fp8) form.
        assert pool.hot_loads == 0
        got = pool.gather(table)
        assert_within_fp8_error(got, kv, n, "bfloat16")
        assert torch.equal(got, s.get(toks))
        # Keyed by the fp8 store's ids: an exact store of the same KV shares nothing.
        with kvstore.open(tmp_path / "e", layout=layout(storage="exact"), model=MODEL) as e:
            e.put(toks, kv)
            exact = pool.load(e, toks)
            assert not set(exact.blocks) & set(table.blocks)
            assert torch.equal(pool.gather(exact), kv)
            # Nor is the dequantized sequence saved into an exact store as exact KV.
            other = list(range(1000, 1000 + n))
            with pytest.raises(kvstore.InvalidInput, match="not exact"):
                pool.save(e, table, other)
            assert e.lookup(other) == 0 and not exact.lossy and table.lossy
        # A pool of another dtype is refused rather than converted.
        with pytest.raises(kvstore.InvalidInput):
            BlockPool(kvstore.Layout(L, H, D, "float16", B), 8, device="cpu").load(s, toks)


def test_sessions_and_numpy(tmp_path):
    n = 2 * B
    kv = kv_of(n + 1, "float16").numpy()
    with kvstore.open(tmp_path / "s", layout=layout("float16"), model=MODEL) as s:
        assert s.save_session("a", list(range(n + 1)), kv) == n
        toks, got = s.load_session("a")
        assert isinstance(got, np.ndarray) and got.dtype == np.float16
        assert list(toks) == list(range(n + 1))
        assert np.allclose(got, kv[:, :, :n], rtol=2.0**-4, atol=2.0**-9)


def test_bad_storage_is_refused():
    with pytest.raises(kvstore.InvalidInput, match="storage"):
        kvstore.Layout(L, H, D, "bfloat16", B, "int4")
    with pytest.raises(kvstore.InvalidInput, match="float8_e4m3fn already"):
        kvstore.Layout(L, H, D, "float8_e4m3fn", B, "fp8")
    assert fp8.buffer_bytes(layout(), 2 * B) == 2 * layout().block_bytes
