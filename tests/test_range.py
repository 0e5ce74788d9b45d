"""Range puts and gets (README, Quick start: `start=`): a chunked prefill hands over
only its new tokens' KV, and a reader asks for the KV from a block boundary on.

The reference is the KV of the whole sequence, sliced: a range put must store the
same blocks a whole put stores, and a range get must return exactly its slice."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_kv_equal, index_blocks, kv_for, read_record, seq

import kvstore
from kvstore import InvalidInput


def test_chunked_prefill_stores_the_blocks_of_one_put(store, store_path, layout, tmp_path):
    B = layout.block_size
    tokens = seq(500, 5 * B + 3)
    kv = kv_for(layout, tokens)
    for lo, hi in [(0, 2 * B), (2 * B, 2 * B + 5), (2 * B, 4 * B + 1), (4 * B, len(tokens))]:
        # Each step hands over tokens[lo:hi] only; lo is the last block boundary.
        covered = store.put(tokens[:hi], kv[:, :, lo:hi], start=lo)
        assert covered == hi // B * B
    assert store.stats()["blocks_written"] == 5
    assert store.lookup(tokens) == 5 * B
    assert_kv_equal(store.get(tokens), kv[:, :, : 5 * B])
    store.close()
    # The blocks a whole put of the sequence stores in another store: the same ids
    # in the index, each record with the same token ids and the same payload.
    whole_path = tmp_path / "whole"
    with kvstore.open(whole_path, layout=layout, model="test/model@1", durability="none") as w:
        assert w.put(tokens, kv) == 5 * B
    chunked, whole = index_blocks(store_path), index_blocks(whole_path)
    assert len(whole) == 5 and set(chunked) == set(whole)
    for bid in whole:
        a, b = read_record(store_path, chunked[bid]), read_record(whole_path, whole[bid])
        assert (a.tokens, a.payload) == (b.tokens, b.payload), bid.hex()


def test_range_get_returns_the_slice_from_start(store, layout):
    B = layout.block_size
    tokens = seq(600, 4 * B)
    kv = kv_for(layout, tokens)
    store.put(tokens[: 3 * B], kv[:, :, : 3 * B])
    for start in range(0, 4 * B, B):
        got = store.get(tokens, start=start)
        want = kv[:, :, start : 3 * B] if start < 3 * B else kv[:, :, :0]
        assert_kv_equal(got, want, f"start={start}")
        out = np.full_like(kv[:, :, : 4 * B - start], 7)
        assert store.get(tokens, start=start, out=out) == 3 * B
        assert_kv_equal(out[:, :, : max(3 * B - start, 0)], want, f"out, start={start}")


def test_a_hole_before_start_ends_the_prefix_and_leaves_out_alone(store, layout):
    B = layout.block_size
    tokens = seq(700, 3 * B)
    kv = kv_for(layout, tokens)
    store.put(tokens, kv[:, :, B:], start=B)  # blocks 1 and 2, not their parent
    assert store.lookup(tokens) == 0
    out = np.full_like(kv[:, :, B:], 3)
    assert store.get(tokens, start=B, out=out) == 0
    assert (out == 3).all()
    store.put(tokens[:B], kv[:, :, :B])
    assert store.get(tokens, start=B, out=out) == 3 * B
    assert_kv_equal(out, kv[:, :, B:])


@pytest.mark.parametrize("start", [1, -8, 10**6, 2.0, True, "8"])
def test_bad_start_is_invalid_input_and_writes_nothing(store, layout, start):
    B = layout.block_size
    tokens = seq(800, 2 * B)
    kv = kv_for(layout, tokens)
    with pytest.raises(InvalidInput, match="start"):
        store.put(tokens, kv, start=start)
    with pytest.raises(InvalidInput, match="start"):
        store.get(tokens, start=start)
    assert store.stats()["blocks_written"] == 0


def test_range_kv_too_short_is_invalid_input(store, layout):
    B = layout.block_size
    tokens = seq(900, 3 * B)
    kv = kv_for(layout, tokens)
    with pytest.raises(InvalidInput, match="kv"):
        store.put(tokens, kv[:, :, B : 2 * B], start=B)  # blocks 1 and 2 need 2*B tokens
    assert store.stats()["blocks_written"] == 0
