"""Isolation (README, Quick start: `salt=`) and model identity on open (README,
Errors: LayoutMismatch): same salt hits, different salt (or none vs one) misses,
sessions stay with their tenant; a store opened for another model fingerprint or
layout raises LayoutMismatch naming both."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_kv_equal, kv_for, raw_bytes, run_cli, seq, small_layout

import kvstore

MODEL = "org/model@rev1"


def _open(path, layout, salt=None, **kw):
    kw.setdefault("durability", "none")
    return kvstore.open(path, layout=layout, model=MODEL, salt=salt, **kw)


def test_salts_isolate_blocks(tmp_path, layout):
    B = layout.block_size
    path = tmp_path / "s"
    tokens = seq(0, 3 * B + 1)
    kv = kv_for(layout, tokens, seed=1)
    with _open(path, layout, salt=b"tenant-a") as a:
        assert a.put(tokens, kv) == 3 * B
    # same salt, new handle (bytes and str spell the same salt): hit
    for salt in (b"tenant-a", "tenant-a"):
        with _open(path, layout, salt=salt) as a2:
            assert a2.lookup(tokens) == 3 * B
            assert_kv_equal(a2.get(tokens), kv[:, :, : 3 * B])
    # other salt, no salt: miss
    for salt in (b"tenant-b", None, b"", b"tenant-a\0", b"TENANT-A"):
        with _open(path, layout, salt=salt) as other:
            assert other.lookup(tokens) == 0, salt
            assert other.get(tokens).shape[2] == 0, salt
            assert other.get(tokens[:B]).shape[2] == 0, salt


def test_no_salt_vs_salt(tmp_path, layout):
    B = layout.block_size
    path = tmp_path / "s"
    tokens = seq(0, 2 * B)
    kv_plain, kv_salted = kv_for(layout, tokens, seed=1), kv_for(layout, tokens, seed=2)
    with _open(path, layout) as plain, _open(path, layout, salt="secret") as salted:
        plain.put(tokens, kv_plain)
        assert salted.lookup(tokens) == 0
        salted.put(tokens, kv_salted)
        # identical tokens, separate blocks, each tenant reads its own bytes
        assert plain.stats()["blocks"] == 4
        assert_kv_equal(plain.get(tokens), kv_plain)
        assert_kv_equal(salted.get(tokens), kv_salted)
        assert plain.stats()["blocks_deduped"] == 0
        assert salted.stats()["blocks_deduped"] == 0


def test_empty_salt_differs_from_no_salt(tmp_path, layout):
    tokens = seq(0, 16)
    with _open(tmp_path / "s", layout, salt=b"") as e, _open(tmp_path / "s", layout) as n:
        e.put(tokens, kv_for(layout, tokens))
        assert n.lookup(tokens) == 0


def test_sessions_belong_to_their_tenant(tmp_path, layout):
    path = tmp_path / "s"
    t = seq(0, 20)
    with (
        _open(path, layout, salt=b"a") as a,
        _open(path, layout, salt=b"b") as b,
        _open(path, layout) as n,
    ):
        a.save_session("chat", t, kv_for(layout, t, seed=1))
        a.save_session("only-a", t, kv_for(layout, t, seed=1))
        b.save_session("chat", t, kv_for(layout, t, seed=2))
        assert sorted(a.sessions()) == ["chat", "only-a"]
        assert b.sessions() == ["chat"]
        assert n.sessions() == []
        with pytest.raises(kvstore.SessionNotFound):
            b.load_session("only-a")
        with pytest.raises(kvstore.SessionNotFound):
            n.load_session("chat")
        # same name, two tenants, two bindings with their own KV
        _, kva = a.load_session("chat")
        _, kvb = b.load_session("chat")
        assert_kv_equal(kva, kv_for(layout, t, seed=1)[:, :, :16])
        assert_kv_equal(kvb, kv_for(layout, t, seed=2)[:, :, :16])
        # deleting in one tenant leaves the other's alone
        assert n.delete_session("chat") is False
        assert b.delete_session("chat") is True
        assert a.sessions() == ["chat", "only-a"] or sorted(a.sessions()) == ["chat", "only-a"]
        assert b.sessions() == []
        assert a.stats()["sessions"] == 2
        assert b.stats()["sessions"] == 0


def test_wrong_model_fingerprint(tmp_path, layout):
    path = tmp_path / "s"
    with _open(path, layout):
        pass
    with pytest.raises(kvstore.LayoutMismatch) as e:
        kvstore.open(path, layout=layout, model="org/other-model@rev9", durability="none")
    msg = str(e.value)
    assert MODEL in msg and "org/other-model@rev9" in msg, msg
    assert isinstance(e.value, kvstore.KVStoreError)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 32),
        ("dtype", "bfloat16"),
        ("dtype", "float32"),
        ("block_size", 16),
    ],
)
def test_wrong_layout(tmp_path, layout, field, value):
    path = tmp_path / "s"
    tokens = seq(0, 16)
    with _open(path, layout) as s:
        s.put(tokens, kv_for(layout, tokens))
    wrong = kvstore.Layout(**{**layout.__dict__, field: value})
    with pytest.raises(kvstore.LayoutMismatch) as e:
        _open(path, wrong)
    msg = str(e.value)
    old = getattr(layout, field)
    assert f"{field}={old}" in msg and f"{field}={value}" in msg, msg
    # nothing changed: the store still opens with its own layout, data intact
    with _open(path, layout) as s:
        assert_kv_equal(s.get(tokens), kv_for(layout, tokens))
        assert s.manifest()[field] == old


def test_identity_checked_in_another_process_too(tmp_path, layout):
    from conftest import run_child

    path = tmp_path / "s"
    with _open(path, layout):
        pass
    code = """
import sys, kvstore
from conftest import small_layout
try:
    kvstore.open(sys.argv[1], layout=small_layout(block_size=4), model="org/model@rev1")
except kvstore.LayoutMismatch as e:
    print("LayoutMismatch:", e)
    sys.exit(0)
sys.exit(1)
"""
    out = run_child(code, path).stdout
    assert "block_size=8" in out and "block_size=4" in out, out


def test_salt_does_not_change_the_store_binding(tmp_path):
    """A salted handle is still bound to the model: wrong model + right salt fails."""
    layout = small_layout()
    path = tmp_path / "s"
    with _open(path, layout, salt=b"x"):
        pass
    with pytest.raises(kvstore.LayoutMismatch):
        kvstore.open(path, layout=layout, model="other", salt=b"x")


# ------------------------------------------------------------ nothing of tenant A leaks

SALT_A = "tenant-a-secret-7f3c"
SECRET_SESSIONS = ["secret-session-a", "a-private-chat"]


def _fill_tenant_a(path, layout, hot):
    """Tenant A: blocks (some pinned), two sessions, all also in the hot tier."""
    B = layout.block_size
    tokens = seq(900_000, 4 * B + 3)
    with _open(path, layout, salt=SALT_A, hot_bytes=4 << 20, hot_dir=hot) as a:
        assert a.put(tokens, kv_for(layout, tokens, seed=7)) == 4 * B
        assert a.put(tokens, kv_for(layout, tokens, seed=7), extra="lora-1") == 4 * B
        for name in SECRET_SESSIONS:
            a.save_session(name, tokens, kv_for(layout, tokens, seed=7))
        assert a.pin(tokens[: 2 * B]) == 2 * B
        assert all(h is not None for h in a.hot_blocks(tokens))
    return tokens


@pytest.mark.parametrize("other_salt", [b"tenant-b", None, b""], ids=["salt-b", "none", "empty"])
def test_other_tenant_sees_nothing_of_a(tmp_path, layout, other_salt):
    """Every read path of a handle with another salt (or none): no block, no session,
    no hot-tier slot, no hit in its own figures; its writes do not touch A's state."""
    B = layout.block_size
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    tokens = _fill_tenant_a(path, layout, hot)
    n_blocks = len(tokens) // B
    with _open(path, layout, salt=other_salt, hot_bytes=4 << 20, hot_dir=hot) as o:
        for extra in (None, "lora-1"):
            assert o.lookup(tokens, extra=extra) == 0
            assert o.get(tokens, extra=extra).shape[2] == 0
            out = np.zeros(layout.kv_shape(len(tokens)), np.float16)
            assert o.get(tokens, out=out, extra=extra) == 0
            assert o.hot_blocks(tokens, extra=extra) == [None] * n_blocks
            assert o.pin(tokens, extra=extra) == 0
        assert o.sessions() == [] and o.session_sizes() == {}
        for name in SECRET_SESSIONS:
            with pytest.raises(kvstore.SessionNotFound):
                o.session_tokens(name)
            with pytest.raises(kvstore.SessionNotFound):
                o.load_session(name)
            assert o.delete_session(name) is False
        st = o.stats()
        assert st["sessions"] == 0
        assert st["hit_blocks"] == 0 and st["hot_hit_blocks"] == 0 and st["disk_hit_blocks"] == 0
        assert st["miss_blocks"] == 2 * 3 * n_blocks  # lookup, get, get(out=), per extra
        assert st["bytes_read"] == 0
        # unpinning A's tokens from here does not unpin A's blocks: a gc that evicts
        # every unpinned block leaves A's pinned prefix
        o.unpin(tokens)
        o.gc(max_bytes=0)
        # the same tokens put here are new blocks with this tenant's bytes
        assert o.put(tokens, kv_for(layout, tokens, seed=8)) == 4 * B
        st = o.stats()
        assert st["blocks_written"] == n_blocks and st["blocks_deduped"] == 0
        assert_kv_equal(o.get(tokens), kv_for(layout, tokens, seed=8)[:, :, : 4 * B])
    kvstore.remove_arena(path, hot_dir=hot)
    with _open(path, layout, salt=SALT_A) as a:  # no hot tier: what is on disk
        assert sorted(a.sessions()) == sorted(SECRET_SESSIONS)
        # exactly A's pinned prefix survived the other's unpin + gc
        assert a.lookup(tokens) == 2 * B
        assert_kv_equal(a.get(tokens), kv_for(layout, tokens, seed=7)[:, :, : 2 * B])


def test_cli_without_the_salt_lists_nothing_of_a(tmp_path, layout):
    """`kvstore ls --sessions` lists the sessions of the tenant it is given (none:
    the unsalted one); no command shows a salted tenant's session names or its salt.
    Store-wide figures (blocks, bytes, segments) are all the CLI knows of them."""
    B = layout.block_size
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    tokens = _fill_tenant_a(path, layout, hot)
    public = seq(5, 2 * B)
    with _open(path, layout) as n:
        n.save_session("public", public, kv_for(layout, public))
        total = n.stats()["blocks"]

    def ls_sessions(*salt):
        r = run_cli("ls", path, "--sessions", "--json", *salt)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    assert ls_sessions() == [{"name": "public", "tokens": 2 * B}]
    assert ls_sessions("--salt", "tenant-b") == []
    mine = ls_sessions("--salt", SALT_A)
    assert sorted(x["name"] for x in mine) == sorted(SECRET_SESSIONS)
    assert all(x["tokens"] == len(tokens) for x in mine)

    outputs = []
    for args in (
        ("info", path, "--json"),
        ("info", path),
        ("ls", path, "--json"),
        ("ls", path),
        ("ls", path, "--sessions"),
        ("ls", path, "--sessions", "--json"),
        ("stats", path, "--json"),
        ("stats", path),
        ("verify", path, "--json"),
    ):
        r = run_cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        outputs.append(r.stdout + r.stderr)
    text = "\n".join(outputs)
    for secret in [*SECRET_SESSIONS, SALT_A]:
        assert secret not in text, secret
    info = json.loads(outputs[0])
    assert info["blocks"] == total  # A's blocks are counted, not shown


def test_salt_is_never_written(tmp_path, layout):
    """Neither the store's files nor the hot-tier arena hold the salt (ids and the
    tenant tag are keyed hashes of it)."""
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    _fill_tenant_a(path, layout, hot)
    files = [p for p in path.rglob("*") if p.is_file()] + list(hot.iterdir())
    assert any(p.suffix == ".arena" for p in files)
    needles = [SALT_A.encode(), SALT_A.encode("utf-16-le")]
    for p in files:
        data = p.read_bytes()
        for needle in needles:
            assert needle not in data, p
    kvstore.remove_arena(path, hot_dir=hot)


def test_block_pool_keeps_tenants_apart(tmp_path, layout):
    """A BlockPool shared by two tenants of one store: B never gets A's resident
    blocks (it used to: pool keys ignored the salt), and A's second handle does."""
    pytest.importorskip("torch")
    from kvstore.torch import BlockPool

    B = layout.block_size
    path = tmp_path / "s"
    tokens = seq(0, 2 * B)
    kv_a, kv_b = kv_for(layout, tokens, seed=1), kv_for(layout, tokens, seed=2)
    pool = BlockPool(layout, 8, device="cpu")
    with (
        _open(path, layout, salt=b"A") as a,
        _open(path, layout, salt=b"A") as a2,
        _open(path, layout, salt=b"B") as b,
        _open(path, layout) as n,
    ):
        a.put(tokens, kv_a)
        seq_a = pool.load(a, tokens)
        assert seq_a.length == 2 * B and raw_bytes(pool.gather(seq_a)) == raw_bytes(kv_a)
        for other in (b, n):
            with pool.load(other, tokens) as s:
                assert s.length == 0
        b.put(tokens, kv_b)
        with pool.load(b, tokens) as s:
            assert s.length == 2 * B
            assert raw_bytes(pool.gather(s)) == raw_bytes(kv_b)
            assert not set(s.blocks) & set(seq_a.blocks)
        with pool.load(a2, tokens) as s:  # same tenant: the resident blocks are shared
            assert s.blocks == seq_a.blocks
        seq_a.release()


def test_block_pool_keeps_models_apart(tmp_path, layout):
    """Two stores of different model fingerprints, same tokens, one pool: no sharing."""
    pytest.importorskip("torch")
    from kvstore.torch import BlockPool

    tokens = seq(0, 16)
    kv1, kv2 = kv_for(layout, tokens, seed=1), kv_for(layout, tokens, seed=2)
    pool = BlockPool(layout, 8, device="cpu")
    with (
        kvstore.open(tmp_path / "m1", layout=layout, model="org/m@1", durability="none") as s1,
        kvstore.open(tmp_path / "m2", layout=layout, model="org/m@2", durability="none") as s2,
    ):
        s1.put(tokens, kv1)
        s2.put(tokens, kv2)
        with pool.load(s1, tokens) as t1, pool.load(s2, tokens) as t2:
            assert raw_bytes(pool.gather(t1)) == raw_bytes(kv1)
            assert raw_bytes(pool.gather(t2)) == raw_bytes(kv2)
            assert not set(t1.blocks) & set(t2.blocks)


def _tree(path):
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "LOCK"
    }


@pytest.mark.parametrize(
    "model",
    ["org/model@rev2", "org/model@REV1", "org/model@rev1 ", "ORG/MODEL@REV1", "org/model"],
)
def test_other_fingerprint_is_refused_and_writes_nothing(tmp_path, layout, model):
    """A store is bound to one fingerprint (README, Errors); any other string
    (case, whitespace, a prefix) is LayoutMismatch, and the refused open changes
    no file and makes no hot-tier arena."""
    path, hot = tmp_path / "s", tmp_path / "hot"
    hot.mkdir()
    tokens = seq(0, 16)
    with _open(path, layout) as s:
        s.put(tokens, kv_for(layout, tokens))
        s.save_session("x", tokens, kv_for(layout, tokens))
    before = _tree(path)
    with pytest.raises(kvstore.LayoutMismatch):
        kvstore.open(path, layout=layout, model=model, hot_bytes=4 << 20, hot_dir=hot)
    with pytest.raises(kvstore.LayoutMismatch):
        kvstore.open(path, layout=layout, model=model, salt=b"x", durability="sync")
    assert _tree(path) == before
    assert list(hot.iterdir()) == []
    with _open(path, layout) as s:
        assert s.lookup(tokens) == 16 and s.sessions() == ["x"]


def test_equal_layout_spelled_differently_shares(tmp_path):
    """The same layout (dtype "half" is float16) is the same binding: same ids, hits."""
    path = tmp_path / "s"
    lay = small_layout("float16")
    alias = kvstore.Layout(
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        dtype="half",
        block_size=lay.block_size,
    )
    tokens = seq(0, 16)
    with _open(path, lay) as s:
        s.put(tokens, kv_for(lay, tokens))
    with _open(path, alias) as s:
        assert_kv_equal(s.get(tokens), kv_for(lay, tokens))
