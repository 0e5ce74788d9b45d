"""Isolation (SPEC 5.6) and model identity on open: same salt hits, different
salt (or none vs one) misses, sessions stay with their tenant; a store opened
for another model fingerprint or layout raises LayoutMismatch naming both."""

from __future__ import annotations

import pytest
from conftest import assert_kv_equal, kv_for, seq, small_layout

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
