"""fp8 storage (`Layout(storage="fp8")`): put quantizes, get dequantizes within the
stated bound of a float64 reference, an exact request never gets fp8 KV, and an fp8
pool loads the stored bytes and scales as `ops.write_kv` would have written them."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore

torch = pytest.importorskip("torch")
from kvstore import fp8  # noqa: E402
from kvstore.torch import BlockPool  # noqa: E402

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
        # kvstore.ops' bound: |x - q| <= 2**-4 |x| + 2**-9 s, in float64.
        x = kv[:, :, :n].double()
        s_tok = ref_s.repeat_interleave(B, dim=2)[:, :, :, :, None]
        err = (got.double() - x).abs()
        bound = 2.0**-4 * x.abs() + 2.0**-9 * s_tok
        # The result is rounded to the request dtype too: half an ulp of it.
        ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}[dtype]
        assert bool((err <= bound + ulp * x.abs()).all()), float((err - bound).max())
        assert bool((got[0, 1, :, 0] == 0).all())
        # It is lossy (a test that could not fail otherwise): some values moved.
        assert bool((err > 0).any())
        # get(out=) agrees, with a partial block's room left alone.
        out = torch.full((L, 2, n + 3, H, D), 7.0, dtype=kv.dtype)
        assert s.get(list(range(n + 3)), out=out) == n
        assert torch.equal(out[:, :, :n], got)
        assert bool((out[:, :, n:] == 7).all())
        # From a block on.
        part = s.get(list(range(n)), start=2 * B)
        assert torch.equal(part, got[:, :, 2 * B :])


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
        mine = BlockPool(pool_layout, 8, device="cpu")
        own = mine.new_sequence()
        own.reserve(n)
        slots = own.slot_mapping(0, n)
        for layer in range(L):
            kvstore.ops.write_kv(
                kv[layer, 0],
                kv[layer, 1],
                mine.key_cache(layer),
                mine.value_cache(layer),
                slots,
                mine.key_scales(layer),
                mine.value_scales(layer),
            )
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
