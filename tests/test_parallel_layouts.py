"""Blocks for tensor-parallel workers (kvstore.heads, kvstore.vllm.shard) and latent
(MLA) layouts, against independent references: the whole `[L, 2, T, H, D]` KV a
test made, sliced or permuted by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore.heads import HeadParts, head_extra
from kvstore.torch import BlockPool
from kvstore.vllm.shard import shard

L, H, D, B = 2, 4, 8, 4
LAYOUT = kvstore.Layout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16", block_size=B)
TOKENS = list(range(100, 130))  # 7 full blocks and 2 tokens


def kv_of(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, tokens, H, D, generator=g).to(torch.bfloat16)


def put_heads(s: kvstore.Store, tokens: list[int], kv: torch.Tensor, heads=range(H), extra=b""):
    """What tensor-parallel ranks holding `heads` store: one record per (block, head)."""
    parts = s.heads(create=True)
    assert parts is not None
    for h in heads:
        parts.store.put(tokens, kv[:, :, :, h : h + 1].contiguous(), extra=head_extra(extra, h))


def test_a_prefix_stored_by_heads_reads_back_whole(tmp_path):
    kv = kv_of(28)
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", array="torch") as s:
        put_heads(s, TOKENS, kv)
        assert s.lookup(TOKENS) == 28
        assert torch.equal(s.get(TOKENS), kv)
        out = torch.zeros(L, 2, 30, H, D, dtype=torch.bfloat16)
        assert s.get(TOKENS, out=out, start=8) == 28
        assert torch.equal(out[:, :, :20], kv[:, :, 8:])
    # Another handle, another process's view: the heads store is found on disk.
    with kvstore.open(tmp_path / "s", array="torch") as s:
        assert s.stats()["blocks"] == 0
        assert torch.equal(s.get(TOKENS), kv)


def test_a_block_counts_only_once_every_head_holds_it(tmp_path):
    kv = kv_of(28)
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", array="torch") as s:
        put_heads(s, TOKENS, kv, heads=range(2))  # rank 0 of TP=2 only
        assert s.lookup(TOKENS) == 0
        assert s.get(TOKENS).shape[2] == 0
        put_heads(s, TOKENS[:12], kv, heads=range(2, 4))  # rank 1, a shorter prefix
        assert s.lookup(TOKENS) == 12
        assert torch.equal(s.get(TOKENS), kv[:, :, :12])


def test_whole_blocks_and_heads_serve_the_longer_prefix(tmp_path):
    kv = kv_of(28)
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", array="torch") as s:
        assert s.put(TOKENS[:8], kv) == 8  # a TP=1 writer, whole blocks
        put_heads(s, TOKENS, kv)  # TP=2 writers, the whole prefix
        assert s.lookup(TOKENS) == 28
        assert torch.equal(s.get(TOKENS), kv)
        assert s.put(TOKENS, kv) == 28
        assert s.lookup(TOKENS) == 28  # now the main store alone would do


def test_heads_keep_tenants_and_extras_apart(tmp_path):
    kv = kv_of(28)
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", salt="a", array="torch") as s:
        put_heads(s, TOKENS, kv, extra=b"lora-1")
        assert s.lookup(TOKENS, extra=b"lora-1") == 28
        assert s.lookup(TOKENS) == 0
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", salt="b", array="torch") as s:
        assert s.lookup(TOKENS, extra=b"lora-1") == 0
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", salt="a", array="torch") as s:
        assert torch.equal(s.get(TOKENS, extra=b"lora-1"), kv)


def test_a_damaged_head_record_is_a_miss_from_there(tmp_path):
    kv = kv_of(28)
    path = tmp_path / "s"
    with kvstore.open(path, layout=LAYOUT, model="m", array="torch") as s:
        put_heads(s, TOKENS, kv)
        heads = s.heads(create=False)
        assert heads is not None
        # head 3's fourth block: damaged in its segment (found by its id in the file)
        victim = heads.store.block_ids(TOKENS, head_extra(b"", 3))[3]
    seg = next((path / "heads" / "segments").glob("*.kvseg"))
    data = bytearray(seg.read_bytes())
    at = data.find(victim)
    assert at > 0
    data[at + 200] ^= 0x40
    seg.write_bytes(bytes(data))
    with kvstore.open(path, array="torch") as s:
        got = s.get(TOKENS)
    assert got.shape[2] == 12
    assert torch.equal(got, kv[:, :, :12])


def test_head_ids_are_golden(tmp_path):
    """Per-head ids are an on-disk contract (the format document's "Heads store"):
    the heads store's layout `[L, 2, B, 1, D]`, its model "<model>#kv-head-of-<H>",
    the head's index ahead of the request's extra."""
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="golden") as s:
        parts = s.heads(create=True)
        assert parts is not None
        assert parts.store.model == "golden#kv-head-of-4"
        assert parts.store.layout == kvstore.Layout(L, 1, D, "bfloat16", B)
        ids = [parts.store.block_ids([0, 1, 2, 3], head_extra(b"", h))[0].hex() for h in (0, 3)]
    assert head_extra(b"x", 3) == b"kvstore.head/1\x00\x03\x00\x00\x00x"
    assert ids == GOLDEN_HEAD_IDS


GOLDEN_HEAD_IDS = [
    "a548a6bd43fdda530a871527bda8d15266bbab2c19529251a381d22f3cf1858e",
    "ea7a2d92d0526b5bc62644b8e410ca9844eb9b35609954625294a69b9a832cee",
]


@pytest.mark.parametrize(
    ("heads", "size", "expect"),
    [
        # (KV heads, TP size, [(heads held, writes) per rank])
        (8, 1, [(range(8), True)]),
        (8, 2, [(range(0, 4), True), (range(4, 8), True)]),
        (8, 8, [(range(r, r + 1), True) for r in range(8)]),
        # fewer heads than ranks: vLLM replicates each head on size/heads ranks
        (
            2,
            4,
            [(range(0, 1), True), (range(0, 1), False), (range(1, 2), True), (range(1, 2), False)],
        ),
        # one KV head (MQA): whole on every rank, stored whole by rank 0
        (1, 2, [(range(0, 1), True), (range(0, 1), False)]),
    ],
)
def test_shards_split_heads_as_vllm_does(heads, size, expect):
    layout = kvstore.Layout(2, heads, 8, "bfloat16", 16)
    got = [shard(layout, r, size) for r in range(size)]
    assert [(s.heads, s.writes) for s in got] == expect
    assert all(s.per_head == (size > 1 and heads > 1) for s in got)
    # Every head is written by exactly one rank.
    written = [h for s in got if s.writes for h in s.heads]
    assert sorted(written) == list(range(heads))


def test_a_latent_is_whole_on_every_rank_and_stored_by_rank_0():
    layout = kvstore.Layout(2, 1, 576, "bfloat16", 16, kind="latent")
    got = [shard(layout, r, 4) for r in range(4)]
    assert [s.writes for s in got] == [True, False, False, False]
    assert all(s.heads == range(1) and not s.per_head for s in got)


def test_bad_shards_are_refused():
    with pytest.raises(kvstore.InvalidInput, match="do not split"):
        shard(kvstore.Layout(2, 6, 8, "bfloat16", 16), 0, 4)
    with pytest.raises(kvstore.InvalidInput, match="rank"):
        shard(LAYOUT, 2, 2)


# -- latent (MLA) layouts ---------------------------------------------------------------

LATENT = kvstore.Layout(num_layers=3, num_kv_heads=1, head_dim=576, block_size=4, kind="latent")


@pytest.mark.parametrize("family", ["torch", "numpy"])
def test_latent_round_trip(tmp_path, family):
    lay = LATENT if family == "torch" else kvstore.Layout(3, 1, 576, "float32", 4, kind="latent")
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 14, 576, generator=g).to(getattr(torch, lay.dtype))
    if family == "numpy":
        kv = kv.numpy()
    toks = list(range(14))
    with kvstore.open(tmp_path / "s", layout=lay, model="m", array=family) as s:
        assert s.put(toks, kv) == 12
        got = s.get(toks)
        assert tuple(got.shape) == (3, 12, 576)
        assert (got == kv[:, :12]).all()
        assert s.get(toks, start=8).shape[1] == 4
        assert (s.get(toks, start=8) == kv[:, 8:12]).all()
        out = torch.zeros(3, 14, 576, dtype=kv.dtype) if family == "torch" else np.zeros_like(kv)
        assert s.get(toks, out=out) == 12
        assert (out[:, :12] == kv[:, :12]).all() and not out[:, 12:].any()
        # One block of latent: L x B x W elements, no K/V split.
        assert lay.block_bytes == 3 * 4 * 576 * lay.itemsize
        s.flush()
        assert s.stats()["raw_live_bytes"] == 3 * (3 * 4 * 576 * lay.itemsize)
        assert s.save_session("agent", toks, kv) == 12
        t, back = s.load_session("agent")
        assert list(t) == toks and (back == kv[:, :12]).all()


def test_latent_and_kv_layouts_never_share_a_store_or_ids(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LATENT, model="m") as s:
        latent_ids = s.block_ids(list(range(8)))
    with pytest.raises(kvstore.LayoutMismatch, match="kind=latent"):
        kvstore.open(tmp_path / "s", layout=kvstore.Layout(3, 1, 288, "bfloat16", 4), model="m")
    with kvstore.open(
        tmp_path / "t", layout=kvstore.Layout(3, 1, 288, "bfloat16", 4), model="m"
    ) as s:
        assert s.block_ids(list(range(8))) != latent_ids
    with kvstore.open(tmp_path / "s") as s:
        assert s.layout == LATENT
        assert s.manifest()["kind"] == "latent"


def test_bad_latent_input_is_refused_naming_the_shapes(tmp_path):
    with pytest.raises(kvstore.InvalidInput, match="even head_dim"):
        kvstore.Layout(3, 1, 575, kind="latent")
    with pytest.raises(kvstore.InvalidInput, match="num_kv_heads 1"):
        kvstore.Layout(3, 2, 576, kind="latent")
    with pytest.raises(kvstore.InvalidInput, match="kind"):
        kvstore.Layout(3, 1, 576, kind="mla")
    with kvstore.open(tmp_path / "s", layout=LATENT, model="m") as s:
        with pytest.raises(kvstore.InvalidInput, match=r"\[3, T, 576\]"):
            s.put(list(range(8)), torch.zeros(3, 2, 8, 1, 288, dtype=torch.bfloat16))
        assert s.stats()["blocks"] == 0
    with pytest.raises(kvstore.InvalidInput, match="latent"):
        BlockPool(LATENT, 4, device="cpu")


def test_hf_refuses_mla_models():
    from transformers import DeepseekV3Config

    from kvstore import hf

    config = DeepseekV3Config(num_hidden_layers=1, kv_lora_rank=64, qk_rope_head_dim=16)
    with pytest.raises(kvstore.InvalidInput, match="MLA"):
        hf.layout_of(config)


def test_heads_store_path_is_beside_the_main_store(tmp_path):
    assert HeadParts.path_of(tmp_path / "s") == tmp_path / "s" / "heads"
    assert not HeadParts.exists(tmp_path / "s")
