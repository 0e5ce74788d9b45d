"""kvstore.vllm's pure parts, without vLLM: block-key extras (cache_salt, LoRA
adapter), which requests are keyed by tokens, the fingerprint's binding to vLLM's
settings, and the paged block map learnt from synthetic cache writers (affine and
not), checked against the writers themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvstore.layout import Layout  # noqa: E402
from kvstore.vllm import keys  # noqa: E402
from kvstore.vllm.paged import PagedKV, affine_strides, paged_block_map  # noqa: E402

# -- keys ---------------------------------------------------------------------------------------


def test_plain_request_has_no_extra():
    assert keys.key_extra(None, None) is None
    assert keys.request_extra(SimpleNamespace(cache_salt=None, lora_request=None)) is None


def test_salts_and_adapters_give_distinct_extras():
    cases = [
        (None, "sha256:aa"),
        (None, "sha256:bb"),
        ("t1", None),
        ("t2", None),
        ("t1", "sha256:aa"),
        ("t1", "sha256:bb"),
        ("t2", "sha256:aa"),
        ("sha256:aa", None),  # a salt equal to an adapter's digest is still a salt
        ("", None),
        (None, ""),
    ]
    extras = [keys.key_extra(s, a) for s, a in cases]
    assert len(set(extras)) == len(cases)


def test_crafted_salt_cannot_pose_as_another_key():
    """Whatever a salt contains (another key's bytes, separators, NULs), its key is no
    other (salt, adapter) pair's: the parts are length-prefixed."""
    target = keys.key_extra("a", "sha256:aa")
    assert target is not None
    head = keys.key_extra("a", None)
    assert head is not None
    crafted = [
        "a\0lora=sha256:aa",
        "a\x00\x01sha256:aa",
        target.decode("latin-1"),
        "a" + target[len(head) - 1 :].decode("latin-1"),
        target[len(b"kvstore.vllm/2") :].decode("latin-1"),
    ]
    for salt in crafted:
        for adapter in (None, "sha256:aa", ""):
            if (salt, adapter) != ("a", "sha256:aa"):
                assert keys.key_extra(salt, adapter) != target, (salt, adapter)


def test_adapter_identity_is_its_files(tmp_path):
    one, two, same = tmp_path / "one", tmp_path / "two", tmp_path / "same"
    for d, payload in ((one, b"\1" * 100), (two, b"\2" * 100), (same, b"\1" * 100)):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(payload)
        (d / "adapter_config.json").write_text('{"r": 8}')
    d1, d2, d3 = (keys.adapter_digest(str(d)) for d in (one, two, same))
    assert d1 != d2
    assert d1 == d3  # the same files under another path: the same adapter
    # Rewritten in place (new size or mtime): hashed again, not served from the cache.
    f = one / "adapter_model.safetensors"
    f.write_bytes(b"\3" * 101)
    assert keys.adapter_digest(str(one)) not in (d1, d2)
    # Requests name adapters by name, id and path: only the files count.
    req = [
        SimpleNamespace(
            cache_salt=None, lora_request=SimpleNamespace(lora_name=n, lora_int_id=i, lora_path=p)
        )
        for n, i, p in (("x", 1, str(two)), ("y", 2, str(two)), ("x", 1, str(same)))
    ]
    e = [keys.request_extra(r) for r in req]
    assert e[0] == e[1] != e[2]
    assert e[0] == keys.key_extra(None, d2)
    # A path not on this machine is identified by its string.
    assert keys.adapter_digest("org/adapter") == "path:org/adapter"


def test_multimodal_and_embeds_requests_are_not_keyed_by_tokens():
    plain = SimpleNamespace(mm_features=[], prompt_embeds=None)
    assert keys.keyed_by_tokens(plain)
    assert not keys.keyed_by_tokens(SimpleNamespace(mm_features=[object()], prompt_embeds=None))
    assert not keys.keyed_by_tokens(SimpleNamespace(mm_features=[], prompt_embeds=torch.zeros(3)))


def test_fingerprint_binds_vllm_settings():
    base = keys.vllm_fingerprint("llama@sha256:00", {"rope_scaling": None}, quantization=None)
    others = [
        keys.vllm_fingerprint("llama@sha256:01", {"rope_scaling": None}, quantization=None),
        keys.vllm_fingerprint(
            "llama@sha256:00", {"rope_scaling": {"factor": 2}}, quantization=None
        ),
        keys.vllm_fingerprint("llama@sha256:00", {"rope_scaling": None}, quantization="fp8"),
        keys.vllm_fingerprint(
            "llama@sha256:00", {"rope_scaling": None}, quantization=None, dtype="float16"
        ),
    ]
    assert len({base, *others}) == 5
    assert base == keys.vllm_fingerprint(
        "llama@sha256:00", {"rope_scaling": None}, quantization=None
    )


def test_speculative_decoding_with_a_draft_cache_is_refused():
    from kvstore.errors import InvalidInput

    keys.check_speculative(None)
    for method in ("ngram", "suffix", "medusa", "mlp_speculator"):
        keys.check_speculative(SimpleNamespace(method=method))
    for method in ("eagle", "eagle3", "mtp", "draft_model", "dflash", "custom_class", None):
        with pytest.raises(InvalidInput, match="draft"):
            keys.check_speculative(SimpleNamespace(method=method))


def test_extra_config_is_checked():
    from kvstore.errors import InvalidInput

    assert keys.parse_extra({"path": "/x", "disk_bytes": 1 << 30})["disk_bytes"] == 1 << 30
    with pytest.raises(InvalidInput, match="unknown"):
        keys.parse_extra({"path": "/x", "hot_byte": 1})
    with pytest.raises(InvalidInput, match="path"):
        keys.parse_extra({})


# -- the paged block map ------------------------------------------------------------------------

LAY = Layout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=8)
B, H, D = LAY.block_size, LAY.num_kv_heads, LAY.head_dim


def cpu_like_writer(pad: int):
    """A writer in the CPU backend's manner: cache `[N, 2, H, B*D + pad]` (the layer's
    rows padded: its strides are not the probe's), K `[H][D][B]`, V `[H][B][D]`.
    Returns (writer, its canonical gather for checking)."""

    def write(key, value, cache, slots):
        for t, s in enumerate(slots.tolist()):
            blk, off = divmod(s, B)
            for h in range(H):
                for d in range(D):
                    cache[blk, 0, h, d * B + off] = key[t, h, d]
                    cache[blk, 1, h, off * D + d] = value[t, h, d]

    def shape(n):
        return (n, 2, H, B * D + pad)

    return write, shape


def permuted_writer(seed: int):
    """A layout no strides describe: each block's tokens at a fixed random permutation
    of places, K and V interleaved per token."""
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).tolist()

    def write(key, value, cache, slots):
        for t, s in enumerate(slots.tolist()):
            blk, off = divmod(s, B)
            cache[blk, perm[off], 0] = key[t]
            cache[blk, perm[off], 1] = value[t]

    def shape(n):
        return (n, B, 2, H, D)

    return write, shape


def layer_caches(shape_of, blocks: int, pad_cols: bool) -> list[torch.Tensor]:
    """One cache per layer; with `pad_cols`, a view of a wider allocation (strides
    that a contiguous probe of one block does not have)."""
    out = []
    for _ in range(LAY.num_layers):
        shape = shape_of(blocks)
        if pad_cols:
            wide = torch.zeros(*shape[:-1], shape[-1] + 5, dtype=torch.bfloat16)
            out.append(wide[..., : shape[-1]])
        else:
            out.append(torch.zeros(shape, dtype=torch.bfloat16))
    return out


def write_all(write, caches, kv, block_ids):
    """Writes canonical `kv` ([L, 2, n*B, H, D]) into `block_ids` with the writer."""
    slots = torch.tensor([b * B + o for b in block_ids for o in range(B)])
    for layer, c in zip(kv, caches, strict=True):
        write(layer[0], layer[1], c, slots)


@pytest.mark.parametrize(
    ("make", "pad_cols", "strided"),
    [
        (lambda: cpu_like_writer(pad=0), False, True),
        (lambda: cpu_like_writer(pad=3), True, True),  # the layer's strides differ
        (lambda: permuted_writer(seed=1), False, False),
        (lambda: permuted_writer(seed=2), True, False),
    ],
)
def test_paged_moves_match_the_writer(make, pad_cols, strided):
    write, shape_of = make()
    blocks = 6
    caches = layer_caches(shape_of, blocks, pad_cols)
    block_map = paged_block_map(write, caches[0], LAY)
    assert bool(affine_strides(block_map, LAY)) == strided
    paged = PagedKV(caches, block_map, LAY)
    assert paged.strided == strided
    g = torch.Generator().manual_seed(0)
    ids = [4, 1, 3]
    n = len(ids) * B
    kv = (torch.randn(LAY.kv_shape(n), generator=g) * 8).round().to(torch.bfloat16)
    # A save reads back what the backend's writer put in the blocks.
    write_all(write, caches, kv, ids)
    out = torch.empty_like(kv)
    paged.move(ids, out, False)
    assert torch.equal(out, kv)
    # A load puts values where the writer would: the caches equal a writer's copy.
    other = [c.clone() for c in layer_caches(shape_of, blocks, False)]
    write_all(write, other, kv, ids)
    fresh = layer_caches(shape_of, blocks, pad_cols)
    PagedKV(fresh, block_map, LAY).move(ids, kv, True)
    for a, b in zip(fresh, other, strict=True):
        assert torch.equal(a, b)


def test_a_lossy_writer_is_refused():
    from kvstore.errors import KVStoreError

    write, shape_of = cpu_like_writer(pad=0)

    def halves(key, value, cache, slots):  # drops V
        write(key, torch.full_like(value, -1.0), cache, slots)

    with pytest.raises(KVStoreError):
        paged_block_map(halves, torch.zeros(shape_of(2), dtype=torch.bfloat16), LAY)


@pytest.mark.parametrize("pad_cols", [False, True])
def test_engine_moves_match_the_writer(tmp_path, pad_cols):
    """The engine's paged get and put (`PagedKV.load`/`save`, the strided path) against
    the backend's writer and the store's canonical get: what a save stores is what the
    writer put in the blocks, a load leaves the caches as the writer would."""
    import kvstore

    write, shape_of = cpu_like_writer(pad=3 if pad_cols else 0)
    blocks = 6
    caches = layer_caches(shape_of, blocks, pad_cols)
    block_map = paged_block_map(write, caches[0], LAY)
    paged = PagedKV(caches, block_map, LAY)
    assert paged.strided
    g = torch.Generator().manual_seed(1)
    ids = [4, 1, 5, 0]
    tokens = list(range(100, 100 + len(ids) * B + 3))  # and a partial block
    kv = (torch.randn(LAY.kv_shape(len(ids) * B), generator=g) * 8).round().to(torch.bfloat16)
    write_all(write, caches, kv, ids)
    with kvstore.open(tmp_path / "s", LAY, "units@1", durability="none") as store:
        # A chunked save: the first block, then the rest.
        assert paged.save(store, tokens[:B], 0, b"x", ids[:1]) == B
        assert paged.save(store, tokens, B, b"x", ids[1:]) == len(ids) * B
        assert torch.equal(store.get(tokens, extra=b"x", like=kv), kv)
        assert store.lookup(tokens) == 0  # another extra, other blocks
        # A load from block 1 on into other cache blocks: as the writer puts them.
        to = [2, 3, 5]
        fresh = layer_caches(shape_of, blocks, pad_cols)
        landed = PagedKV(fresh, block_map, LAY).load(store, tokens, B, b"x", to)
        assert landed == len(ids) * B
        other = layer_caches(shape_of, blocks, False)
        write_all(write, other, kv[:, :, B:], to)
        for a, b in zip(fresh, other, strict=True):
            assert torch.equal(a, b)
