"""Results of `get()` without `out=`, `load_session` and `hf.load` land in buffers
the process reuses (kvstore._pool): a result stays bit-exact while it is held,
whatever gets come after; buffers are reused once results are dropped; the
pool stays within its bound. The reference is the KV recomputed from the token
ids (conftest.kv_for)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_kv_equal, kv_for, seq, small_layout

import kvstore
from kvstore import _pool


def _store(path, dtype="float16"):
    lay = small_layout(dtype=dtype, block_size=8, L=2, H=2, D=64)  # 4 KiB a token
    return kvstore.open(path, layout=lay, model="test/pool@1", durability="none"), lay


def _address(x) -> int:
    return x.data_ptr() if hasattr(x, "data_ptr") else x.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_held_results_stay_valid_while_later_gets_reuse_memory(tmp_path, dtype):
    s, lay = _store(tmp_path / "s", dtype)
    seqs = [seq(1000 * i, 512) for i in range(6)]
    for t in seqs:
        s.put(t, kv_for(lay, t))
    held = s.get(seqs[0])
    part = s.get(seqs[1])[:, :, 8:40]  # a slice alone keeps its buffer too
    # Many gets of other sequences, their results dropped at once: the buffers
    # they used are reused, never the held ones.
    seen = set()
    for _ in range(3):
        for t in seqs[2:]:
            r = s.get(t)
            assert_kv_equal(r, kv_for(lay, t))
            seen.add(_address(r))
            del r
    assert _address(held) not in seen
    assert_kv_equal(held, kv_for(lay, seqs[0]))
    assert_kv_equal(part, kv_for(lay, seqs[1])[:, :, 8:40])
    # Reuse really happened: 12 gets of 2 MiB results came from a few buffers.
    assert len(seen) <= 2, seen
    assert s._pool.pooled_bytes <= kvstore.store.RESULT_POOL_BYTES
    # Once dropped, a held buffer is handed out again.
    addr = _address(held)
    del held
    assert _address(s.get(seqs[0])) == addr
    s.close()


def test_the_pool_stays_within_its_bound(tmp_path):
    s, lay = _store(tmp_path / "s")
    s._pool = _pool.ResultPool(6 << 20)
    t = seq(7, 512)  # 2 MiB of KV
    s.put(t, kv_for(lay, t))
    held = [s.get(t) for _ in range(8)]  # more than the pool may keep
    for r in held:
        assert_kv_equal(r, kv_for(lay, t))
    assert s._pool.pooled_bytes <= 6 << 20
    assert len({_address(r) for r in held}) == len(held)  # all distinct memory
    del held
    for _ in range(5):
        assert_kv_equal(s.get(t), kv_for(lay, t))
    assert s._pool.pooled_bytes <= 6 << 20
    s.close()


def test_free_buffers_are_dropped_for_larger_ones(tmp_path):
    pool = _pool.ResultPool(8 << 20)
    small = pool.take(1 << 20)
    small[:] = 1
    del small
    big = pool.take(7 << 20)  # needs the 2 MiB the free small buffer takes: dropped
    assert pool.pooled_bytes == 8 << 20
    big2 = pool.take(7 << 20)  # the big one is held: fresh memory, not pooled
    assert pool.pooled_bytes == 8 << 20
    assert _address(big) != _address(big2)
    big[:] = 2
    big2[:] = 3
    assert (big == 2).all() and (big2 == 3).all()


def test_load_session_result_survives_more_loads(tmp_path):
    s, lay = _store(tmp_path / "s", "bfloat16")
    a, b = seq(1, 256), seq(50_000, 256)
    s.save_session("a", a, kv_for(lay, a))
    s.save_session("b", b, kv_for(lay, b))
    toks, kv = s.load_session("a")
    for _ in range(4):
        s.load_session("b")
    assert list(np.asarray(toks)) == a
    assert_kv_equal(kv, kv_for(lay, a))
    s.close()


def test_hf_load_cache_survives_more_loads(tmp_path):
    torch = pytest.importorskip("torch")
    from kvstore import hf

    s, lay = _store(tmp_path / "s", "bfloat16")
    a, b = seq(3, 256), seq(60_000, 256)
    for t in (a, b):
        s.put(t, kv_for(lay, t))
    cache, n = hf.load(s, torch.tensor(a))
    assert n == 256
    for _ in range(4):
        hf.load(s, torch.tensor(b))
    want = kv_for(lay, a)
    for i, layer in enumerate(cache.layers):
        assert_kv_equal(layer.keys[0].transpose(0, 1), want[i, 0])
        assert_kv_equal(layer.values[0].transpose(0, 1), want[i, 1])
    s.close()


def test_every_buffer_taken_is_as_long_as_asked():
    """Sizes up and down while earlier results are held: each has exactly the bytes
    asked for (a mix-up of the size asked and a pooled buffer's handed out a buffer
    of the last pooled one's size, and the demo's restore failed to reshape it)."""
    pool = _pool.ResultPool(64 << 20)
    held = []
    for mib in (4, 2, 6, 1, 10, 3, 40, 5):
        n = (mib << 20) + 123
        buf = pool.take(n)
        assert buf.nbytes == n, (mib, buf.nbytes)
        buf[:] = mib  # writable, and not shared with a held one
        held.append((mib, buf))
    assert all(bool((b == mib).all()) for mib, b in held)
    assert pool.take(100 << 20).nbytes == 100 << 20  # past the limit: never pooled
