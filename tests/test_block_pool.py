"""kvstore.torch.BlockPool: store -> pool blocks, content addressing, refcounts.

KV comes from conftest.kv_for (every bit pattern, NaNs included), so a load
that changes a single bit fails the bitwise comparisons.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import assert_kv_equal, kv_for, seq, small_layout  # noqa: E402

import kvstore  # noqa: E402
from kvstore import ops  # noqa: E402
from kvstore.torch import BlockPool, BlockTable, PoolFull  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()


class CountingStore:
    """A Store proxy that counts the reads (`get`) the pool makes."""

    def __init__(self, store: kvstore.Store) -> None:
        self._store = store
        self.gets = 0

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.gets += 1
        return self._store.get(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture
def opened(tmp_path):
    layout = small_layout("bfloat16", block_size=8)
    with kvstore.open(tmp_path / "s", layout=layout, model="m@1", durability="none") as s:
        yield CountingStore(s)


def put(store, tokens: list[int]) -> Any:
    kv = kv_for(store.layout, tokens, family="torch")
    store.put(tokens, kv)
    return kv


def test_load_copies_the_stored_prefix_bit_exact(opened):
    tokens = seq(100, 45)  # 5 full blocks of 8 and a partial one
    kv = put(opened, tokens)
    pool = BlockPool(opened.layout, 16, device="cpu")
    with pool.load(opened, tokens) as s:
        table, n = s
        assert n == 40 and table.dtype == torch.int32 and table.shape == (5,)
        assert_kv_equal(pool.gather(s), kv[:, :, :40])
        # Per block: pool.key_cache(l)[table[i]] is the K of tokens 8i .. 8i + 7.
        k0 = pool.key_cache(1)[table[2]]
        assert_kv_equal(k0, kv[1, 0, 16:24])
    assert pool.num_free == 16


def test_unknown_tokens_give_an_empty_table(opened):
    pool = BlockPool(opened.layout, 4, device="cpu")
    s = pool.load(opened, seq(7, 30))
    assert s.length == 0 and s.table.numel() == 0 and opened.gets == 0
    s.release()


def test_resident_blocks_are_shared_and_refcounted(opened):
    a = seq(0, 24)
    b = a[:16] + seq(500, 8)  # shares two blocks with a
    put(opened, a)
    put(opened, b)
    pool = BlockPool(opened.layout, 8, device="cpu")
    sa = pool.load(opened, a)
    assert opened.gets == 1
    sa2 = pool.load(opened, a)  # everything resident: no read at all
    assert opened.gets == 1 and sa2.blocks == sa.blocks
    sb = pool.load(opened, b)
    assert sb.blocks[:2] == sa.blocks[:2] and sb.blocks[2] not in sa.blocks
    assert [pool.refcount(x) for x in sa.blocks] == [3, 3, 2]
    assert pool.num_free == 8 - 4
    for s in (sa, sa2, sb):
        s.release()
    assert pool.num_free == 8 and pool.num_cached == 4
    # Released blocks keep their content: a later load reuses them without a read.
    gets = opened.gets
    with pool.load(opened, b) as again:
        assert again.blocks == sb.blocks and opened.gets == gets


def test_release_is_idempotent_and_a_released_table_is_dead(opened):
    put(opened, seq(0, 16))
    pool = BlockPool(opened.layout, 4, device="cpu")
    s = pool.load(opened, seq(0, 16))
    pool.release(s)
    s.release()
    assert pool.num_free == 4 and s.released
    with pytest.raises(kvstore.InvalidInput, match="released"):
        s.reserve(20)


def test_a_released_or_foreign_table_is_neither_saved_nor_gathered(opened):
    """A released table's blocks may hold another sequence's KV by now, and another
    pool's table names blocks of that pool: saving either would store wrong KV."""
    pool = BlockPool(opened.layout, 2, device="cpu")
    a = pool.new_sequence()
    a.reserve(16)
    a.length = 16
    a.release()
    b = pool.new_sequence()
    b.reserve(16)  # a's blocks, now b's
    foreign = BlockPool(opened.layout, 2, device="cpu").new_sequence()
    foreign.reserve(16)
    foreign.length = 16
    for table, match in ((a, "released"), (foreign, "of this pool")):
        with pytest.raises(kvstore.InvalidInput, match=match):
            pool.save(opened, table, list(range(16)))
        with pytest.raises(kvstore.InvalidInput, match=match):
            pool.gather(table)
    b.length = 40  # past its 2 blocks
    with pytest.raises(kvstore.InvalidInput, match="within its blocks"):
        pool.save(opened, b, list(range(40)))
    assert opened.lookup(list(range(40))) == 0


def test_a_loaded_block_is_read_only(opened):
    """Loaded blocks are shared by every sequence of that prefix (and kept for later
    loads): a write into one would change their KV. Positions past the loaded
    prefix, in the sequence's own blocks, are writable."""
    tokens = seq(300, 16)
    kv = put(opened, tokens)
    pool = BlockPool(opened.layout, 8, device="cpu")
    a, b = pool.load(opened, tokens), pool.load(opened, tokens)
    assert a.blocks == b.blocks
    for start, count in ((3, 1), (0, 16), (15, 2)):
        a.reserve(start + count)
        with pytest.raises(kvstore.InvalidInput, match="read-only"):
            a.slot_mapping(start, count)
    slots = a.slot_mapping(16, 1)  # its own block
    assert int(slots[0]) // 8 not in b.blocks
    assert_kv_equal(pool.gather(b), kv)
    a.release()
    b.release()
    with pool.load(opened, tokens) as c:
        assert_kv_equal(pool.gather(c), kv)


def test_an_fp8_pool_loads_raw_e4m3_without_a_hot_tier(tmp_path):
    """From the segments, on the CPU (index_copy_ has no float8 kernel there): the
    stored bytes, unit scales; a load that fails gives its blocks back."""
    layout = small_layout("float8_e4m3fn", block_size=8)
    tokens = seq(700, 32)
    kv = torch.randn(layout.kv_shape(32)).to(torch.float8_e4m3fn)
    with kvstore.open(tmp_path / "s", layout=layout, model="m@1", durability="none") as s:
        s.put(tokens, kv)
        pool = BlockPool(layout, 8, device="cpu")
        with pool.load(s, tokens) as t:
            assert t.length == 32 and pool.hot_loads == 0
            assert torch.equal(pool.gather(t).view(torch.uint8), kv.view(torch.uint8))
            assert pool.scales is not None
            assert bool((pool.scales[:, :, t.blocks] == 1).all())
        pool2 = BlockPool(layout, 8, device="cpu")

        def broken(*a: Any, **k: Any) -> None:
            raise RuntimeError("copy failed")

        pool2._copy_in = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="copy failed"):
            pool2.load(s, tokens)
        assert pool2.num_free == 8


def test_eviction_takes_least_recently_released_and_full_pool_raises(opened):
    first, second, third = seq(0, 16), seq(1000, 16), seq(2000, 16)
    for t in (first, second, third):
        put(opened, t)
    pool = BlockPool(opened.layout, 4, device="cpu")
    pool.load(opened, first).release()
    pool.load(opened, second).release()
    assert pool.num_cached == 4
    # Two blocks needed: the two of `first` (released earliest) are evicted.
    s3 = pool.load(opened, third)
    gets = opened.gets
    pool.load(opened, second).release()
    assert opened.gets == gets, "second's blocks should still be resident"
    pool.load(opened, first).release()
    assert opened.gets == gets + 1, "first's blocks should have been evicted"
    # Everything referenced: a load that needs blocks raises, and holds nothing.
    held = [s3, pool.load(opened, second)]
    free = pool.num_free
    with pytest.raises(PoolFull, match="expected 2 free blocks, got 0"):
        pool.load(opened, first)
    assert pool.num_free == free == 0
    for s in held:
        s.release()
    assert pool.num_free == 4


def test_reserve_write_and_gather_a_decoded_sequence(opened):
    layout = opened.layout
    tokens = seq(0, 16)
    kv = put(opened, tokens)
    pool = BlockPool(layout, 8, device="cpu")
    s = pool.load(opened, tokens)
    # Three decoded tokens go into a new private block.
    s.reserve(19)
    assert len(s.blocks) == 3 and s.capacity == 24
    slots = s.slot_mapping(16, 3)
    new = kv_for(layout, seq(0, 19), family="torch")[:, :, 16:]
    for layer in range(layout.num_layers):
        k = new[layer, 0].contiguous()
        v = new[layer, 1].contiguous()
        ops.write_kv(k, v, pool.key_cache(layer), pool.value_cache(layer), slots)
    s.length = 19
    assert_kv_equal(pool.gather(s), torch.cat([kv, new], dim=2))
    with pytest.raises(kvstore.InvalidInput, match="reserved capacity 24"):
        s.slot_mapping(20, 5)
    # save() puts the full blocks: 16 stored already, 19 -> still 16 (block 3 is partial).
    assert pool.save(opened, s, seq(0, 19)) == 16
    s.release()
    assert pool.num_free == 8 and pool.num_cached == 2  # the private block is simply free


def test_save_then_load_round_trip_of_decoded_blocks(opened):
    layout = opened.layout
    pool = BlockPool(layout, 8, device="cpu")
    s = pool.new_sequence()
    tokens = seq(300, 24)
    kv = kv_for(layout, tokens, family="torch")
    s.reserve(24)
    slots = s.slot_mapping(0, 24)
    for layer in range(layout.num_layers):
        ops.write_kv(
            kv[layer, 0].contiguous(),
            kv[layer, 1].contiguous(),
            pool.key_cache(layer),
            pool.value_cache(layer),
            slots,
        )
    s.length = 24
    assert pool.save(opened, s, tokens) == 24
    s.release()
    assert opened.lookup(tokens) == 24
    with BlockPool(layout, 4, device="cpu").load(opened, tokens) as loaded:
        assert_kv_equal(loaded.pool.gather(loaded), kv)


def test_namespaces_and_extra_do_not_share_blocks(opened):
    tokens = seq(0, 16)
    put(opened, tokens)
    pool = BlockPool(opened.layout, 8, device="cpu")
    a = pool.load(opened, tokens)
    b = pool.load(opened, tokens, namespace="tenant-b")
    assert set(a.blocks).isdisjoint(b.blocks)
    c = pool.load(opened, tokens, extra="adapter")  # nothing stored under that extra
    assert c.length == 0


def test_layout_mismatch_and_bad_arguments(opened):
    other = small_layout("bfloat16", block_size=16)
    with pytest.raises(kvstore.InvalidInput, match="store: expected layout"):
        BlockPool(other, 4, device="cpu").load(opened, seq(0, 16))
    with pytest.raises(kvstore.InvalidInput, match="num_blocks: expected a positive int"):
        BlockPool(opened.layout, 0, device="cpu")
    with pytest.raises(kvstore.InvalidInput, match="layout: expected kvstore.Layout"):
        BlockPool("layout", 4, device="cpu")  # type: ignore[arg-type]


def test_paged_attention_over_a_loaded_pool_equals_attention_over_store_get(tmp_path):
    layout = small_layout("float32", block_size=8, L=2, H=2, D=64)
    g = torch.Generator().manual_seed(0)
    tokens = seq(0, 100)
    with kvstore.open(tmp_path / "f", layout=layout, model="m@1", durability="none") as st:
        st.put(tokens, torch.randn(layout.kv_shape(100), generator=g))
        contiguous = st.get(tokens, like=torch.empty(0))
        pool = BlockPool(layout, 32, device="cpu")
        pool.load(st, seq(0, 40)).release()  # make the first blocks resident, then cached
        with pool.load(st, tokens) as s:
            table, n = s
            assert n == 96
            q = torch.randn(1, 8, 64, generator=g)
            for layer in range(2):
                out = ops.paged_attention(
                    q,
                    pool.key_cache(layer),
                    pool.value_cache(layer),
                    table[None],
                    torch.tensor([n], dtype=torch.int32),
                    1 / math.sqrt(64),
                )
                k = contiguous[layer, 0].transpose(0, 1)[None]  # [1, H, T, D]
                v = contiguous[layer, 1].transpose(0, 1)[None]
                want = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, None], k, v, enable_gqa=True
                )[:, :, 0]
                torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_block_table_unpacks_and_reprs(opened):
    pool = BlockPool(opened.layout, 2, device="cpu")
    s = pool.new_sequence()
    assert isinstance(s, BlockTable) and "length=0" in repr(s) and "BlockPool" in repr(pool)
    table, n = s
    assert n == 0 and table.numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device (none available)")
def test_cuda_pool_loads_through_pinned_memory(opened):
    tokens = seq(0, 40)
    kv = put(opened, tokens)
    pool = BlockPool(opened.layout, 16, device="cuda")
    pool.load(opened, tokens[:16]).release()  # partly resident: per-plane copies
    with pool.load(opened, tokens) as s:
        assert s.table.device.type == "cuda" and s.length == 40
        assert_kv_equal(pool.gather(s).cpu(), kv)
    assert pool._staging is not None and pool._staging.is_pinned()


# ----------------------------------------------------------------------------- huge pages


def _pool_round_trip(pool: BlockPool) -> None:
    """Writes distinct KV into every block of layer 0 and reads it back through the
    pool's views: the memory under the pool is real, writable and not shared."""
    kc = pool.key_cache(0)
    values = torch.arange(kc.numel(), dtype=torch.float32).remainder(251).to(pool.dtype)
    kc.copy_(values.view(kc.shape))
    pool.value_cache(0).copy_(-values.view(kc.shape))
    assert torch.equal(pool.key_cache(0).flatten(), values)
    assert torch.equal(pool.value_cache(0).flatten(), -values)
    assert pool.kv.is_contiguous() and pool.kv.device.type == "cpu"


def _huge_backed(addr: int) -> bool:
    """Whether the kernel backs the mapping holding `addr` with transparent huge
    pages, read from /proc/self/smaps (the test's own reading, not the pool's)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        first = line.split()[0] if line.split() else ""
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            if lo <= addr < hi:
                for field in lines[i + 1 :]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1]) > 0
                    if "-" in field.split()[0] and not field.split()[0].endswith(":"):
                        break
                return False
    return False


def test_cpu_pool_reports_its_page_kind_and_works():
    layout = small_layout()
    pool = BlockPool(layout, 4096, device="cpu")
    if pool.page_kind != "hugetlb":
        # "thp" exactly when the kernel gave a huge page (asked is not given).
        want = "thp" if _huge_backed(pool.kv.data_ptr()) else "normal"
        assert pool.page_kind == want
    if pool.page_kind in ("thp", "hugetlb"):
        assert pool.kv.data_ptr() % (2 << 20) == 0, "huge pages need a 2 MiB-aligned start"
    assert not pool.kv.any(), "a new pool is zero-filled"
    _pool_round_trip(pool)
    small = BlockPool(layout, 4096, device="cpu", huge_pages=False)
    assert small.page_kind == "normal"
    _pool_round_trip(small)


def test_huge_page_pool_falls_back_cleanly_without_huge_pages(monkeypatch):
    """No hugetlb pages (MAP_HUGETLB fails) and THP off: a pool on 4 KiB pages."""
    import mmap as mmap_module

    import kvstore.torch as kt

    real_mmap = mmap_module.mmap

    def no_hugetlb(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("flags", 0) & kt._MAP_HUGETLB:
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(kt.mmap, "mmap", no_hugetlb)
    monkeypatch.setattr(kt, "_THP_ENABLED", "/nonexistent/transparent_hugepage/enabled")
    pool = BlockPool(small_layout(), 4096, device="cpu")
    assert pool.page_kind == "normal"
    _pool_round_trip(pool)
    # THP asked for but no hugetlb: transparent huge pages where the kernel gives
    # them, on a 2 MiB-aligned start either way.
    monkeypatch.setattr(kt, "_thp_mode", lambda: "madvise")
    pool = BlockPool(small_layout(), 4096, device="cpu")
    assert pool.kv.data_ptr() % (2 << 20) == 0
    assert pool.page_kind == ("thp" if _huge_backed(pool.kv.data_ptr()) else "normal")
    _pool_round_trip(pool)


class RangeCountingStore(CountingStore):
    """Also sums the tokens each read asks the store for (from `start` on)."""

    def __init__(self, store: kvstore.Store) -> None:
        super().__init__(store)
        self.tokens_read = 0

    def get(self, tokens: Any, **kwargs: Any) -> Any:
        self.tokens_read += len(tokens) - kwargs.get("start", 0)
        return super().get(tokens, **kwargs)


def test_load_reads_only_the_blocks_it_lacks_and_allocates_before_reading(tmp_path):
    layout = small_layout("bfloat16", block_size=8)
    with kvstore.open(tmp_path / "s", layout=layout, model="m@1", durability="none") as raw:
        s = RangeCountingStore(raw)
        tokens = seq(7, 8 * 40)
        kv = put(s, tokens)
        pool = BlockPool(layout, 48, device="cpu")
        first = pool.load(s, tokens[: 8 * 30])
        assert s.tokens_read == 8 * 30
        # 30 of 40 blocks resident: only the other 10 are read, bit-exact.
        s.tokens_read = 0
        whole = pool.load(s, tokens)
        assert whole.length == 8 * 40 and s.tokens_read == 8 * 10
        assert whole.blocks[:30] == first.blocks
        assert_kv_equal(pool.gather(whole), kv)
        # A pool without room raises before reading anything.
        small = BlockPool(layout, 4, device="cpu")
        s.gets = s.tokens_read = 0
        with pytest.raises(PoolFull):
            small.load(s, tokens)
        assert s.gets == 0 and small.num_free == 4


def test_load_falls_back_to_the_store_when_the_arena_file_is_gone(tmp_path):
    layout = small_layout("float32", block_size=8)
    hot = tmp_path / "hot"
    hot.mkdir()
    opts = {"hot_bytes": 4 << 20, "hot_dir": hot, "durability": "none"}
    with kvstore.open(tmp_path / "s", layout=layout, model="m@1", **opts) as s:
        tokens = seq(3, 32)
        kv = put(s, tokens)
        path = Path(s.arena_file()[0])
        path.unlink()  # a tmp cleaner, systemd's RemoveIPC
        pool = BlockPool(layout, 8, device="cpu")
        assert_kv_equal(pool.gather(pool.load(s, tokens)), kv)
        path.write_bytes(b"\0" * 4096)  # and another file put in its place
        pool = BlockPool(layout, 8, device="cpu")
        assert_kv_equal(pool.gather(pool.load(s, tokens)), kv)
        assert pool.hot_loads == 0


def test_save_refuses_loaded_blocks_under_other_tokens_or_extra(opened):
    tokens = seq(11, 32)
    put(opened, tokens)
    pool = BlockPool(opened.layout, 16, device="cpu")
    table = pool.load(opened, tokens)
    other = seq(500, 32)
    with pytest.raises(kvstore.InvalidInput, match="other token ids"):
        pool.save(opened, table, other)
    with pytest.raises(kvstore.InvalidInput, match="extra"):
        pool.save(opened, table, tokens, extra="adapter-a")
    assert opened.lookup(other) == 0 and opened.lookup(tokens, extra="adapter-a") == 0
    # The tokens it was loaded for, extended by decoded ones, save as before.
    table.reserve(40)
    assert pool.save(opened, table, tokens + seq(900, 8)) == 32


def test_gather_of_a_partial_block_is_contiguous(opened):
    tokens = seq(5, 24)
    kv = put(opened, tokens)
    pool = BlockPool(opened.layout, 8, device="cpu")
    table = pool.load(opened, tokens)
    got = pool.gather(table, 19)
    assert got.is_contiguous() and got.view(-1).numel() == got.numel()
    assert_kv_equal(got, kv[:, :, :19])


def test_cuda_staging_of_a_pool_with_an_fp8_stores_layout_is_sized_by_its_dtype(
    tmp_path, monkeypatch
):
    """The pinned buffer holds the pool's dtype, not the fp8 store's stored bytes (CUDA
    path, run here with its allocations on the CPU)."""
    layout = kvstore.Layout(2, 2, 16, "bfloat16", 8, storage="fp8")
    pool = BlockPool(layout, 16, device="cpu")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: real_empty(*a, **kw))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: None)
    pool.device = torch.device("cuda")
    host = pool._host_buffer(40)
    assert host.shape == tuple(layout.kv_shape(40)) and host.dtype == torch.bfloat16


def test_a_registered_arena_is_unregistered_when_its_view_goes(tmp_path, monkeypatch):
    import gc

    import kvstore.torch as kt

    calls: list[tuple[str, int]] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
            calls.append(("register", ptr))
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    layout = small_layout("float32", block_size=8)
    hot = tmp_path / "hot"
    hot.mkdir()
    s = kvstore.open(
        tmp_path / "s", layout=layout, model="m@1", hot_bytes=4 << 20, hot_dir=hot,
        durability="none",
    )  # fmt: skip
    assert kt.register_arena(s)
    ptr = calls[0][1]
    s.close()
    del s
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]
