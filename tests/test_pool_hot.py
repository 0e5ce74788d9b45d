"""BlockPool.load straight from the hot tier (one copy per block, a DMA on CUDA), and
its fallback when a slot changes during the copy."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvstore
import kvstore.torch as kt

LAYOUT = kvstore.Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=4)
TOKENS = np.arange(40)


@pytest.fixture()
def store(tmp_path):
    hot = tmp_path / "hot"
    hot.mkdir()
    with kvstore.open(
        tmp_path / "s", layout=LAYOUT, model="m", hot_bytes=4 << 20, hot_dir=hot, array="torch"
    ) as s:
        yield s


def kv() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYOUT.kv_shape(len(TOKENS)), generator=g)


def test_pool_loads_hot_blocks_straight_from_the_arena(store):
    store.put(TOKENS, kv())
    pool = kt.BlockPool(LAYOUT, 32, device="cpu")
    table = pool.load(store, TOKENS)
    assert table.length == 40
    assert pool.hot_loads == 10, "every block copied from the arena, none through get()"
    assert torch.equal(pool.gather(table), kv())
    assert store.stats()["disk_hit_blocks"] == 0


def test_a_slot_changed_during_the_copy_falls_back_to_the_store(store, monkeypatch):
    store.put(TOKENS, kv())
    pool = kt.BlockPool(LAYOUT, 32, device="cpu")
    monkeypatch.setattr(store, "hot_unchanged", lambda slots: [False] * len(slots))
    table = pool.load(store, TOKENS)
    assert pool.hot_loads == 0
    assert table.length == 40
    assert torch.equal(pool.gather(table), kv())
    assert pool.num_free == 32 - 10, "the blocks of the abandoned copy were given back"


def test_blocks_not_hot_are_read_from_the_store(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", array="torch") as s:
        s.put(TOKENS, kv())
    # Reopen with a hot tier: nothing is hot yet.
    hot = tmp_path / "hot"
    hot.mkdir()
    with kvstore.open(
        tmp_path / "s", layout=LAYOUT, model="m", hot_bytes=4 << 20, hot_dir=hot
    ) as s:
        pool = kt.BlockPool(LAYOUT, 32, device="cpu")
        table = pool.load(s, TOKENS)
        assert (table.length, pool.hot_loads) == (40, 0)
        assert torch.equal(pool.gather(table), kv())


def test_a_replaced_arena_file_is_refused(store):
    store.put(TOKENS, kv())
    path = store.arena_file()[0]
    os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.ftruncate(fd, 4 << 20)
    os.close(fd)
    with pytest.raises(kvstore.KVStoreError, match="replaced"):
        kt.arena_view(store)


def test_hot_blocks_without_a_hot_tier_is_invalid_input(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m") as s:
        assert kt.arena_view(s) is None
        assert kt.register_arena(s) is False
        with pytest.raises(kvstore.InvalidInput, match="hot tier"):
            s.hot_blocks(TOKENS)


def test_register_arena_is_a_no_op_without_cuda(store):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the GPU test")
    assert kt.register_arena(store) is False


@pytest.mark.gpu
def test_pool_on_cuda_dmas_from_the_registered_arena(store):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none available)")
    store.put(TOKENS, kv())
    assert kt.register_arena(store) is True
    pool = kt.BlockPool(LAYOUT, 32, device="cuda")
    table = pool.load(store, TOKENS)
    assert pool.hot_loads == 10
    assert torch.equal(pool.gather(table).cpu(), kv())
