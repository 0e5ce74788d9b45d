"""The remote tier on real Redis servers (started and stopped here): blocks put on
one host are bit-exact hits on another, verified like local blocks; every remote
failure after open is a miss plus a counter; failures at open are RemoteError."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
from conftest import (
    assert_kv_equal,
    block_record,
    kv_for,
    payload_offset,
    run_child,
    segment_file,
    seq,
    small_layout,
)
from support.redis_cluster import Cluster, RespError, cmd, free_ports
from support.require import need

import kvstore

# Skips the module without the Redis tools; with KVSTORE_REQUIRE=redis (CI) fails it.
need("redis")

MODEL = "test/remote@1"
LAYOUT = small_layout(block_size=4)  # 1 KiB blocks
B = LAYOUT.block_size


def _start(
    tmp_path_factory,
    n: int,
    cluster: bool,
    extra: list[str] | None = None,
    tls=None,
    replicas: int = 0,
) -> Cluster:
    """Started servers (stopped again if the start fails); `tls`: `Certs.server_args()`."""
    root = tmp_path_factory.mktemp("redis")
    c = Cluster(root, free_ports(n), cluster, extra or [], tls, replicas)
    try:
        c.start()
    except Exception:
        c.stop()
        raise
    return c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = _start(tmp_path_factory, 3, True)
    yield c
    c.stop()


@pytest.fixture
def clean(cluster):
    cluster.flushall()
    return cluster


@pytest.fixture
def fresh_cluster(tmp_path_factory):
    """A cluster of its own, for tests that kill nodes."""
    c = _start(tmp_path_factory, 3, True)
    yield c
    c.stop()


def open_host(path, c: Cluster, **kw):
    remote = kvstore.Remote(nodes=c.nodes, **kw.pop("remote", {}))
    return kvstore.open(path, LAYOUT, MODEL, remote=remote, durability="none", **kw)


def remote_stats(store) -> dict:
    r = store.stats()["remote"]
    assert r is not None
    return r


def block_key(c: Cluster, store, tokens, i: int) -> bytes:
    hexid = store.block_ids(tokens)[i].hex()
    (key,) = c.keys(f"kvstore:*:{hexid}")
    return key


def uploaded(c: Cluster, path, tokens, i: int) -> tuple[bytes, bytes]:
    """The key of block `i` of `tokens` and its value, put and uploaded by a host at
    `path`."""
    with open_host(path, c) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.flush()
        key = block_key(c, a, tokens, i)
    return key, c.call(key, "GET", key)


def open_error(path, secret: str, **remote) -> str:
    """The RemoteError message of opening a store at `path` with `Remote(**remote)`,
    checked to hold `secret` in neither its message nor its repr."""
    with pytest.raises(kvstore.RemoteError) as e:
        kvstore.open(path, LAYOUT, MODEL, remote=kvstore.Remote(**remote))
    msg = str(e.value)
    assert secret not in msg and secret not in repr(e.value)
    return msg


def upload_chains(c: Cluster, path, first: int, **kw) -> list[list[int]]:
    """Twelve distinct 16-block chains (tokens from `first` on), put and uploaded by
    a host at `path` (opened with `kw`): the data of the node failure tests."""
    chains = [seq(first + 1000 * k, 16 * B) for k in range(12)]
    with open_host(path, c, **kw) as a:
        for t in chains:
            a.put(t, kv_for(LAYOUT, t))
        a.flush()
        assert remote_stats(a)["blocks_uploaded"] == 12 * 16
    return chains


# Host A runs in another process: its own store directory, same cluster.
PUT_CHILD = """
import sys, kvstore
from conftest import kv_for, small_layout
path, nodes, n = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
layout = small_layout(block_size=4)
tokens = list(range(1000, 1000 + n))
with kvstore.open(path, layout, "test/remote@1", durability="none",
                  remote=kvstore.Remote(nodes=nodes)) as s:
    s.put(tokens, kv_for(layout, tokens))
    s.flush()
    r = s.stats()["remote"]
    print(r["blocks_uploaded"], r["writes_dropped"], r["write_failures"])
"""


def test_two_hosts_share_blocks_bit_exact(clean, tmp_path):
    n = 40 * B  # three hash-tag groups
    p = run_child(PUT_CHILD, tmp_path / "a", ",".join(clean.nodes), n)
    uploaded, dropped, failed = map(int, p.stdout.split())
    assert (uploaded, dropped, failed) == (40, 0, 0)
    assert len(clean.keys("kvstore:*")) == 40
    tokens = seq(1000, n)
    with open_host(tmp_path / "b", clean) as b:
        assert b.lookup(tokens + [1, 2, 3]) == n
        got = b.get(tokens)
        assert_kv_equal(got, kv_for(LAYOUT, tokens))
        r = remote_stats(b)
        assert r["hits"] == 40 and r["invalid"] == 0
        assert r["bytes_read"] > 40 * LAYOUT.block_bytes
        # Promoted: served locally now, without the cluster.
        clean.flushall()
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens))
        assert remote_stats(b)["hits"] == 40


def test_range_put_and_get_through_the_cluster(clean, tmp_path):
    """A chunked prefill (put with start=) uploads the blocks it was given; a range
    get on another host reads the rest of the chain from the cluster, lands it at
    the right place in `out`, and a prefix that ends before `start` lands nothing."""
    n = 36 * B
    tokens = seq(7000, n)
    kv = kv_for(LAYOUT, tokens)
    with open_host(tmp_path / "a", clean) as a:
        a.put(tokens[: 20 * B], kv[:, :, : 20 * B])
        a.put(tokens, kv[:, :, 20 * B :], start=20 * B)
        a.flush()
        assert remote_stats(a)["blocks_uploaded"] == 36
    with open_host(tmp_path / "b", clean) as b:
        out = np.zeros_like(kv[:, :, 8 * B :])
        assert b.get(tokens, start=8 * B, out=out) == n
        assert_kv_equal(out, kv[:, :, 8 * B :])
        key = block_key(clean, b, tokens, 3)
    assert clean.call(key, "DEL", key) == 1  # a hole before `start`
    with open_host(tmp_path / "c", clean) as c:
        out = np.full_like(kv[:, :, 8 * B :], 5)
        assert c.get(tokens, start=8 * B, out=out) == 3 * B
        assert (out == 5).all()


def test_shared_prefix_uploaded_once_and_sessions_travel(clean, tmp_path):
    shared = seq(5000, 12 * B)
    a_tokens, b_tokens = shared + seq(1, 4 * B), shared + seq(90000, 6 * B)
    with open_host(tmp_path / "a", clean) as a:
        a.put(a_tokens, kv_for(LAYOUT, a_tokens))
        a.save_session("agent-1", a_tokens, kv_for(LAYOUT, a_tokens))
        a.flush()
        assert remote_stats(a)["blocks_uploaded"] == 16
    with open_host(tmp_path / "b", clean) as b:
        b.put(b_tokens, kv_for(LAYOUT, b_tokens))
        b.flush()
        r = remote_stats(b)
        assert r["blocks_uploaded"] == 6, r
        assert r["blocks_present"] == 12, r
        assert len(clean.keys("kvstore:*:{*}:*")) == 16 + 6
        toks, kv = b.load_session("agent-1")
        assert list(toks) == a_tokens
        assert_kv_equal(kv, kv_for(LAYOUT, a_tokens))
        with pytest.raises(kvstore.SessionNotFound):
            b.load_session("nobody")


def test_deleted_key_mid_chain_ends_prefix(clean, tmp_path):
    tokens = seq(7000, 10 * B)
    with open_host(tmp_path / "a", clean) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.flush()
        key = block_key(clean, a, tokens, 6)
    assert clean.call(key, "DEL", key) == 1
    with open_host(tmp_path / "b", clean) as b:
        assert b.lookup(tokens) == 6 * B
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens[: 6 * B]))
        r = remote_stats(b)
        assert r["hits"] == 6 and r["misses"] >= 1 and r["invalid"] == 0


def test_every_wrong_value_is_a_counted_miss(clean, tmp_path):
    tokens = seq(9000, 8 * B)
    other = seq(123, 8 * B)
    with open_host(tmp_path / "a", clean) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.put(other, kv_for(LAYOUT, other))
        a.flush()
        key = block_key(clean, a, tokens, 3)
        good = clean.call(key, "GET", key)
        other_key = block_key(clean, a, other, 3)
        other_value = clean.call(other_key, "GET", other_key)
    with kvstore.open(
        tmp_path / "salted", LAYOUT, MODEL, salt="tenant-2", durability="none",
        remote=kvstore.Remote(nodes=clean.nodes),
    ) as t:  # fmt: skip
        t.put(tokens, kv_for(LAYOUT, tokens))
        t.flush()
    salted = [k for k in clean.keys("kvstore:*") if k.split(b":")[1] != key.split(b":")[1]]
    salted_value = clean.call(salted[0], "GET", salted[0])
    flipped = bytearray(good)
    flipped[200] ^= 1
    rng = np.random.default_rng(0)
    wrong = {
        "random bytes": rng.bytes(len(good)),
        "another block's value": other_value,
        "another tenant's value": salted_value,
        "truncated": good[:-1],
        "truncated record": good[:100],
        "oversized": good + b"\0" * 4096,
        "one bit flipped": bytes(flipped),
        "empty": b"",
    }
    for n, (what, value) in enumerate(wrong.items()):
        assert value != good
        clean.call(key, "SET", key, value)
        with open_host(tmp_path / f"b{n}", clean) as b:
            assert b.lookup(tokens) == 3 * B, what
            got = b.get(tokens)
            assert_kv_equal(got, kv_for(LAYOUT, tokens[: 3 * B]), what)
            r = remote_stats(b)
            assert r["hits"] == 3, (what, r)
            if what == "empty":  # reads as missing (GETRANGE)
                assert r["invalid"] == 0 and r["misses"] >= 1, (what, r)
            else:
                assert r["invalid"] >= 1, (what, r)
    clean.call(key, "SET", key, good)
    with open_host(tmp_path / "c", clean) as c:
        assert c.lookup(tokens) == 8 * B
        assert remote_stats(c)["invalid"] == 0


def test_invalid_value_is_replaced_by_the_next_upload(clean, tmp_path):
    """Garbage under a real key: a reader counts it invalid, recomputes and puts the
    block, and that put overwrites the garbage (the server "having" the key is not
    taken for having the block); a later reader hits."""
    tokens = seq(19000, 8 * B)
    key, good = uploaded(clean, tmp_path / "a", tokens, 3)
    # An empty value reads as missing, and STRLEN counts it missing: set over too.
    for n, garbage in enumerate([b"\x00garbage" * 50, b""]):
        clean.call(key, "SET", key, garbage)
        with open_host(tmp_path / f"b{n}", clean) as b:
            assert b.lookup(tokens) == 3 * B
            assert remote_stats(b)["invalid"] == int(garbage != b"")
            b.put(tokens, kv_for(LAYOUT, tokens))  # recomputed here
            b.flush()
            r = remote_stats(b)
            assert r["blocks_uploaded"] >= 1 and r["write_failures"] == 0, r
        assert clean.call(key, "GET", key) == good
    with open_host(tmp_path / "c", clean) as c:
        assert c.lookup(tokens) == 8 * B
        assert_kv_equal(c.get(tokens), kv_for(LAYOUT, tokens))
        r = remote_stats(c)
        assert r["hits"] == 8 and r["invalid"] == 0, r
    # A session's value likewise.
    short = tokens[: 2 * B]
    with open_host(tmp_path / "d", clean) as d:
        d.save_session("chat", short, kv_for(LAYOUT, short))
        d.flush()
    (skey,) = clean.keys("kvstore:*:session:*")
    sgood = clean.call(skey, "GET", skey)
    clean.call(skey, "SET", skey, b"not a session")
    with open_host(tmp_path / "e", clean) as e:
        with pytest.raises(kvstore.SessionNotFound):
            e.load_session("chat")
        assert remote_stats(e)["invalid"] == 1
        e.save_session("chat", short, kv_for(LAYOUT, short))
        e.flush()
    # Replaced by e's save (the same tokens, a later version).
    fixed = clean.call(skey, "GET", skey)
    assert fixed[:4] == sgood[:4] == b"KVSV" and len(fixed) == len(sgood)
    with open_host(tmp_path / "f", clean) as f:
        toks, kv = f.load_session("chat")
        assert list(toks) == short
        assert_kv_equal(kv, kv_for(LAYOUT, short))


def test_a_session_loads_as_saved_last_on_any_host(clean, tmp_path):
    """A session is a name bound to the tokens saved last, on any host: saved again
    (longer or shorter), another host loads the new tokens; an agent that moved to
    another host and back loads what it saved there, not its first host's older
    copy; a handle whose own save is still queued loads its own; a deleted session
    is gone from the server."""
    tokens = seq(39000, 6 * B)

    def load(host):
        got, kv = host.load_session("chat")
        assert_kv_equal(kv, kv_for(LAYOUT, list(got)))
        return list(got)

    with open_host(tmp_path / "a", clean) as a:
        for n in (2 * B, 5 * B, 3 * B):
            a.save_session("chat", tokens[:n], kv_for(LAYOUT, tokens[:n]))
            a.flush()
            with open_host(tmp_path / f"b{n}", clean) as b:
                assert load(b) == tokens[:n]
        with open_host(tmp_path / "b", clean) as b:  # the agent moves to b
            assert load(b) == tokens[: 3 * B]
            b.save_session("chat", tokens, kv_for(LAYOUT, tokens))
            b.flush()
        assert load(a) == tokens  # and back to a
    with open_host(tmp_path / "a", clean) as a:
        assert load(a) == tokens  # a reopened: its store holds b's copy now
    with open_host(tmp_path / "c", clean) as c:
        assert load(c) == tokens
        c.save_session("chat", tokens[:B], kv_for(LAYOUT, tokens[:B]))
        assert load(c) == tokens[:B]  # its own, whether or not the upload is done
        c.flush()
        assert c.delete_session("chat")
        c.flush()
    (skey,) = clean.keys("kvstore:*:session:*")
    assert clean.call(skey, "GET", skey).startswith(b"KVSV")  # a versioned tombstone
    with open_host(tmp_path / "d", clean) as d, pytest.raises(kvstore.SessionNotFound):
        d.load_session("chat")
    # A host with an older local copy takes the newer delete too.
    with open_host(tmp_path / "a", clean) as a, pytest.raises(kvstore.SessionNotFound):
        a.load_session("chat")


@pytest.fixture
def single(tmp_path_factory):
    """One plain (non-cluster) server of its own, for tests that refuse its writes."""
    c = _start(tmp_path_factory, 1, False)
    yield c
    c.stop()


def refuse_writes(c: Cluster, refuse: bool) -> None:
    """A full server with `noeviction`: writes fail (counted), reads go on."""
    port = c.ports[0]
    cmd(port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    cmd(port, "CONFIG", "SET", "maxmemory", "1" if refuse else "0")


def session_len(store, name: str) -> int:
    return len(store.load_session(name)[0])


def test_a_restart_keeps_a_save_and_a_delete_whose_upload_failed(single, tmp_path):
    """A save (or delete) acknowledged here whose upload failed is newer than the
    server's copy: a restarted handle loads it, and never writes the server's older
    copy over it; a deleted session stays deleted. Once the server takes writes
    again, the next load repairs it."""
    path = tmp_path / "a"
    t1, t2 = seq(100, 2 * B), seq(100, 5 * B)
    with open_host(path, single) as s:
        s.save_session("chat", t1, kv_for(LAYOUT, t1))
        s.flush()
    refuse_writes(single, True)
    with open_host(path, single) as s:
        s.save_session("chat", t2, kv_for(LAYOUT, t2))
        s.flush()
        assert remote_stats(s)["errors_oom"] > 0
    refuse_writes(single, False)
    with open_host(path, single) as s:  # restarted
        assert session_len(s, "chat") == len(t2)
        s.flush()  # the load sent the newer copy to the server
    with kvstore.open(path, LAYOUT, MODEL) as s:  # the local copy is still the newer
        assert session_len(s, "chat") == len(t2)
    with open_host(tmp_path / "b", single) as b:  # repaired: another host gets it
        assert session_len(b, "chat") == len(t2)
    refuse_writes(single, True)
    with open_host(path, single) as s:
        assert s.delete_session("chat")
        s.flush()
    refuse_writes(single, False)
    for _ in range(2):  # the second open: after the tombstone reached the server
        with open_host(path, single) as s:
            with pytest.raises(kvstore.SessionNotFound):
                s.load_session("chat")
            assert "chat" not in s.sessions()
            s.flush()
    with open_host(tmp_path / "b", single) as b, pytest.raises(kvstore.SessionNotFound):
        b.load_session("chat")  # b held the old copy; the delete is newer


def test_two_handles_on_one_store_load_the_newer_save(single, tmp_path):
    """Handle A saves (committed here, upload still queued: the server pauses
    writes); handle B on the same store loads A's save, not the server's older copy,
    and does not write that copy over A's."""
    path = tmp_path / "a"
    t1, t2 = seq(100, 2 * B), seq(100, 5 * B)
    with open_host(path, single) as s:
        s.save_session("chat", t1, kv_for(LAYOUT, t1))
        s.flush()
    with open_host(path, single, remote={"timeout": 3}) as a, \
            open_host(path, single, remote={"timeout": 3}) as b:  # fmt: skip
        cmd(single.ports[0], "CLIENT", "PAUSE", "1500", "WRITE")
        a.save_session("chat", t2, kv_for(LAYOUT, t2))
        assert session_len(b, "chat") == len(t2)
        assert session_len(a, "chat") == len(t2)
        a.flush()
    with kvstore.open(path, LAYOUT, MODEL) as s:
        assert session_len(s, "chat") == len(t2)


def test_a_late_upload_of_an_older_session_keeps_the_newer_one(single, tmp_path):
    """Host B's save reaches the server only after host A's later save of the same
    session (B's requests held up in the network): the server keeps A's newer
    version, so a third host loads A's tokens. Before, B's late SET replaced it,
    and every host without a newer copy of its own loaded B's older tokens."""
    from support.held_proxy import HeldProxy

    old, new = seq(100, 2 * B), seq(300, 5 * B)
    proxy = HeldProxy(single.ports[0])
    try:
        with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none",
                          remote=kvstore.Remote([proxy.node], timeout=5)) as b:  # fmt: skip
            proxy.hold()
            b.save_session("chat", old, kv_for(LAYOUT, old))  # its upload waits
            with open_host(tmp_path / "a", single, remote={"write": "through"}) as a:
                a.save_session("chat", new, kv_for(LAYOUT, new))
            proxy.release()
            b.flush()
            r = remote_stats(b)
            assert r["write_failures"] == 0 and r["writes_dropped"] == 0, r
        with open_host(tmp_path / "c", single) as c:
            assert list(c.load_session("chat")[0]) == new
    finally:
        proxy.close()


EXEC_DONE = b"*1\r\n+OK\r\n"  # the reply of a transaction that set its one key


@contextlib.contextmanager
def _on_fake(path, handler, **remote):
    """A store whose only node is a fake server answering through `handler`
    (`support.fake_resp`), writing through."""
    from support.fake_resp import FakeServer

    fake = FakeServer(handler)
    try:
        with _fake_store(path, fake, write="through", **remote) as s:
            yield s
    finally:
        fake.close()


def _save_chat(s, n: int = 2 * B) -> dict:
    """Saves session "chat" of `n` tokens; the remote counters after it."""
    tokens = seq(5, n)
    s.save_session("chat", tokens, kv_for(LAYOUT, tokens))
    return remote_stats(s)


def test_a_raced_session_upload_reads_the_key_again(tmp_path):
    """A session is set in an optimistic transaction (WATCH, GETRANGE, then MULTI,
    SET, EXEC): where another client changed the key in between, EXEC sets
    nothing, and the upload reads the key again and sets it then."""
    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        if seen[-1] == b"EXEC":
            return b"*-1\r\n" if seen.count(b"EXEC") == 1 else EXEC_DONE
        return None

    with _on_fake(tmp_path / "s", handler) as s:
        r = _save_chat(s)
    assert r["write_failures"] == 0, r
    assert seen.count(b"WATCH") == 2 and seen.count(b"EXEC") == 2, seen


def test_a_refused_key_does_not_turn_off_the_session_transaction(tmp_path):
    """WATCH refused for the key (a key pattern revoked, then given back), not for
    the command: the plain SET is refused too, so the next save still compares
    versions (WATCH) instead of setting without asking from then on."""
    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        if seen.count(b"WATCH") <= 1 and seen[-1] in (b"WATCH", b"SET", b"STRLEN"):
            return b"-NOPERM No permissions to access a key\r\n"  # the first save's
        return EXEC_DONE if seen[-1] == b"EXEC" else None

    with _on_fake(tmp_path / "s", handler) as s:
        assert _save_chat(s)["errors_permission"] >= 1
        r = _save_chat(s)
    assert seen.count(b"WATCH") == 2 and seen.count(b"EXEC") == 1, (seen, r)


@pytest.mark.parametrize("deny", ["-@transaction", "-watch", "-multi", "-exec"])
def test_sessions_travel_for_a_user_without_transactions(
    tmp_path_factory, tmp_path, monkeypatch, deny
):
    """A user refused WATCH, MULTI or EXEC (an ACL without them) still uploads its
    sessions: set without asking, counted as no failure; its blocks upload too. A
    refused EXEC (EXECABORT) failed every session upload before."""
    secret = "tx-Pa55"
    single = _start(tmp_path_factory, 1, False, ["--requirepass", secret])
    try:
        cmd(single.ports[0], "ACL", "SETUSER", "kv", "on", ">" + secret, "~kvstore:*",
            "+@all", deny, password=secret)  # fmt: skip
        monkeypatch.setenv("KV_TX_PW", secret)
        remote = kvstore.Remote(single.nodes, username="kv", password_env="KV_TX_PW")
        tokens, other = seq(7, 3 * B), seq(900, 4 * B)
        with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none", remote=remote) as a:
            for n in (B, 3 * B):
                a.save_session("chat", tokens[:n], kv_for(LAYOUT, tokens[:n]))
                a.flush()
            a.put(other, kv_for(LAYOUT, other))
            a.flush()
            r = remote_stats(a)
            assert r["write_failures"] == 0 and r["errors_permission"] == 0, r
        with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none", remote=remote) as b:
            assert list(b.load_session("chat")[0]) == tokens
            assert b.lookup(other) == len(other)
    finally:
        single.stop()


def test_sessions_travel_where_watch_is_unknown(tmp_path_factory, tmp_path):
    """A server whose WATCH is renamed away (or a proxy that lacks it) answers
    `unknown command`: sessions are set without asking, as before versions were
    compared, instead of failing every upload."""
    single = _start(tmp_path_factory, 1, False, ["--rename-command", "WATCH", ""])
    try:
        tokens = seq(7, 3 * B)
        with open_host(tmp_path / "a", single) as a:
            a.save_session("chat", tokens, kv_for(LAYOUT, tokens))
            a.flush()
            assert remote_stats(a)["write_failures"] == 0
        with open_host(tmp_path / "b", single) as b:
            assert list(b.load_session("chat")[0]) == tokens
    finally:
        single.stop()


def _session_head(version: int) -> bytes:
    return b"KVSV" + version.to_bytes(8, "little")


def test_a_session_upload_reads_only_the_head_of_an_older_copy(tmp_path):
    """The server's copy is read whole (up to 64 MiB, to check its MAC) only where
    its head names a version at least as new: an older copy costs 12 bytes, and a
    copy whose head claims a newer version but fails its check is set over (a
    forged version cannot hold a session's uploads back)."""
    from support.fake_resp import bulk

    head = {"version": 1}  # older than any save's (the wall clock in ns)
    ranges: list[int] = []

    def handler(c, a):
        if a[0].upper() == b"GETRANGE" and b":session:" in a[1]:
            ranges.append(int(a[3]))
            value = _session_head(head["version"]) + b"\x01" + b"x" * 100
            return bulk(value[: int(a[3]) + 1])
        return EXEC_DONE if a[0].upper() == b"EXEC" else None

    with _on_fake(tmp_path / "s", handler) as s:
        _save_chat(s)
        assert ranges == [11], ranges  # the head only, then set
        head["version"] = 2**64 - 1  # a forged, newer head over no valid frame
        ranges.clear()
        r = _save_chat(s)
        assert ranges == [11, 64 << 20], ranges  # read whole, checked, set over
        assert r["write_failures"] == 0 and r["bytes_written"] > 0, r


@pytest.mark.parametrize("delay", [0, 0.1])
def test_a_contended_session_key_gives_up_without_blaming_the_node(tmp_path, delay):
    """Other clients change the key between every WATCH and EXEC: the upload
    gives up after a few tries, or once the call has no time for another, counted
    as a failed write (not a timeout), and the node's breaker stays closed, so the
    next read still goes to the server. (`delay`: seconds a reply to EXEC takes.)"""
    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        if seen[-1] == b"EXEC":
            time.sleep(delay)
            return b"*-1\r\n"
        return None

    # With a delay, time for two tries and a half: the third would time out.
    with _on_fake(tmp_path / "s", handler, timeout=2.5 * delay or 0.3) as s:
        _save_chat(s)
        assert s.lookup(seq(900, 4 * B)) == 0
        r = remote_stats(s)
    assert 1 <= seen.count(b"EXEC") <= 3, seen
    assert delay or seen.count(b"EXEC") == 3, seen  # without a delay, every try raced
    assert r["write_failures"] == 1 and r["errors_timeout"] == 0, r
    assert r["breaker_skips"] == 0, r


def test_a_loading_node_does_not_turn_off_the_session_transaction(tmp_path):
    """A node still loading its data refuses the first WATCH (-LOADING): that
    upload fails (counted), and later ones still compare versions. Before, any
    error reply fell back to a SET without comparing, for good once it went
    through."""
    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        if seen[-1] == b"WATCH" and seen.count(b"WATCH") == 1:
            return b"-LOADING Redis is loading the dataset in memory\r\n"
        return EXEC_DONE if seen[-1] == b"EXEC" else None

    with _on_fake(tmp_path / "s", handler) as s:
        assert _save_chat(s, 1)["write_failures"] == 1
        for n in (2, 3):  # under a block: the session is each save's only upload
            r = _save_chat(s, n)
    assert seen.count(b"WATCH") == 3 and seen.count(b"EXEC") == 2, (seen, r)


def test_a_refused_auth_does_not_turn_off_the_session_transaction(tmp_path, monkeypatch):
    """The uploader's first connection is refused at AUTH (a password rotating):
    that counts as a failed upload, and later uploads still compare versions."""
    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        if seen[-1] == b"AUTH" and seen.count(b"AUTH") == 2:  # the uploader's first
            return b"-WRONGPASS invalid username-password pair\r\n"
        return EXEC_DONE if seen[-1] == b"EXEC" else None

    monkeypatch.setenv("KV_ROT_PW", "pw")
    with _on_fake(tmp_path / "s", handler, password_env="KV_ROT_PW") as s:
        for n in (1, 2, 3):  # under a block: the session is each save's only upload
            _save_chat(s, n)
    assert seen.count(b"WATCH") >= 2 and seen.count(b"EXEC") >= 2, seen


def test_another_hosts_newer_save_wins_over_a_failed_one(single, tmp_path):
    """A's save failed to upload; host B then loads the session (A's earlier copy)
    and saves a newer one: A's handle, and A's store after a restart, load B's."""
    t1, t2, t3 = seq(100, 2 * B), seq(100, 5 * B), seq(900, 3 * B)
    with open_host(tmp_path / "a", single) as a:
        a.save_session("chat", t1, kv_for(LAYOUT, t1))
        a.flush()
        refuse_writes(single, True)
        a.save_session("chat", t2, kv_for(LAYOUT, t2))
        a.flush()
        refuse_writes(single, False)
        with open_host(tmp_path / "b", single) as b:
            assert session_len(b, "chat") == len(t1)
            b.save_session("chat", t3, kv_for(LAYOUT, t3))
            b.flush()
        assert list(a.load_session("chat")[0]) == t3
    with kvstore.open(tmp_path / "a", LAYOUT, MODEL) as a:
        assert list(a.load_session("chat")[0]) == t3


@pytest.mark.parametrize("paged", [False, True], ids=["get", "paged"])
def test_a_range_get_reads_local_blocks_after_the_server_fills_the_prefix(clean, tmp_path, paged):
    """get(start=k) on a host that holds blocks k.. but not the ones before: the
    server fills the prefix, then the local blocks from k are read (they were never
    asked for: the get returned k). The same for a paged get."""
    tokens = seq(3000, 8 * B)
    k = 4 * B
    kv = kv_for(LAYOUT, tokens)
    with open_host(tmp_path / "a", clean) as a:  # uploads blocks 0..3 only
        a.put(tokens[:k], kv[:, :, :k])
        a.flush()
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    path = tmp_path / "b"
    with kvstore.open(path, LAYOUT, MODEL) as local:  # blocks 4..7 only
        local.put(tokens, kv[:, :, k:], start=k)
    with open_host(path, clean) as b:
        if not paged:
            out = np.zeros_like(kv[:, :, k:])
            assert b.get(tokens, start=k, out=out) == len(tokens)
            assert_kv_equal(out, kv[:, :, k:])
        else:
            caches = [np.zeros((6, 2, B, H, D), np.float16) for _ in range(L)]
            spans = [c.reshape(-1).view(np.uint8) for c in caches]
            blocks = [5, 0, 3, 1]
            part = (H * D, D, 1)
            got = b._raw.get_paged(
                np.asarray(tokens, np.uint32), b"", k, spans, blocks,
                2 * B * H * D, ((0, part), (B * H * D, part)),
            )  # fmt: skip
            assert got == len(tokens)
            for j, cb in enumerate(blocks):
                at = k + j * B
                for layer in range(L):
                    assert_kv_equal(caches[layer][cb], kv[layer, :, at : at + B])
        assert b.lookup(tokens) == len(tokens)


def test_a_key_of_another_type_is_an_invalid_value_and_is_repaired(clean, tmp_path):
    """A list under a block's key (a foreign writer's): the blocks before it are
    served, it is counted invalid, and the next put sets the block over it."""
    tokens = seq(49000, 8 * B)
    key, good = uploaded(clean, tmp_path / "a", tokens, 3)
    clean.call(key, "DEL", key)
    clean.call(key, "RPUSH", key, b"x")
    with open_host(tmp_path / "b", clean) as b:
        assert b.lookup(tokens) == 3 * B
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens[: 3 * B]))
        r = remote_stats(b)
        assert r["hits"] == 3 and r["invalid"] >= 1 and r["errors_other"] == 0, r
        b.put(tokens, kv_for(LAYOUT, tokens))
        b.flush()
        assert remote_stats(b)["write_failures"] == 0
    assert clean.call(key, "GET", key) == good
    # Another host that never read it uploads over it too (STRLEN, not EXISTS).
    clean.call(key, "DEL", key)
    clean.call(key, "RPUSH", key, b"x")
    with open_host(tmp_path / "c", clean) as c:
        c.put(tokens, kv_for(LAYOUT, tokens))
        c.flush()
        r = remote_stats(c)
        assert r["write_failures"] == 0 and r["blocks_uploaded"] >= 1, r
    assert clean.call(key, "GET", key) == good


def test_a_read_takes_no_more_than_the_longest_valid_value(clean, tmp_path):
    """A value far longer than any block's or session's under a real key: a reader
    takes at most the longest valid value and one byte more of it (no more memory
    or network than a good read), counts it invalid, and a put repairs the key."""
    tokens = seq(29000, 8 * B)
    short = tokens[: 2 * B]
    with open_host(tmp_path / "a", clean) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.save_session("chat", short, kv_for(LAYOUT, short))
        a.flush()
        key = block_key(clean, a, tokens, 3)
    (skey,) = clean.keys("kvstore:*:session:*")
    good = clean.call(key, "GET", key)
    clean.call(key, "SET", key, good + b"\0" * (32 << 20))
    with open_host(tmp_path / "b", clean) as b:
        assert b.lookup(tokens) == 3 * B
        r = remote_stats(b)
        assert r["invalid"] == 1 and r["hits"] == 3, r
        # The group's 8 values, none longer than its record and MAC plus one byte.
        longest = 80 + 4 * B + LAYOUT.block_bytes + 32 + 1
        assert r["bytes_read"] <= 8 * longest, r
        b.put(tokens, kv_for(LAYOUT, tokens))
        b.flush()
    assert clean.call(key, "GET", key) == good
    session_max = 64 << 20  # SESSION_VALUE_MAX
    clean.call(skey, "SET", skey, b"\1" * (session_max + (16 << 20)))
    with open_host(tmp_path / "c", clean) as c:
        with pytest.raises(kvstore.SessionNotFound):
            c.load_session("chat")
        r = remote_stats(c)
        assert r["invalid"] == 1 and r["bytes_read"] == session_max + 1, r


def test_node_kill_and_restart(fresh_cluster, tmp_path):
    c = fresh_cluster
    timeout = 0.5
    chains = upload_chains(c, tmp_path / "a", 20000, remote={"timeout": timeout})
    victim = c.ports[1]
    on_victim = {k for k in cmd(victim, "KEYS", "kvstore:*")}
    assert on_victim, "the chains spread over every node"
    c.kill(victim)
    with open_host(tmp_path / "b", c, remote={"timeout": timeout}) as b:
        served = 0
        for t in chains:
            n = b.lookup(t)
            served += n == len(t)
            x = seq(70000 + len(t), 4 * B)
            b.put(t[:B] + x, kv_for(LAYOUT, t[:B] + x))  # local puts keep working
        r = remote_stats(b)
        assert 0 < served < len(chains), "live nodes serve, the dead node's chains miss"
        assert r["errors_connection"] + r["breaker_skips"] + r["errors_cluster_down"] > 0, r
        # A dead node refuses at once: no call waited out its deadline.
        assert r["errors_timeout"] == 0, r
    c.start_node(victim)
    c.wait_ok()
    time.sleep(3.2)  # the breaker's cool-down
    with open_host(tmp_path / "c", c, remote={"timeout": timeout}) as h:
        misses = [t for t in chains if h.lookup(t) < len(t)]
        assert misses, "the restarted node came back empty"
    with open_host(tmp_path / "a", c, remote={"timeout": timeout}) as a:
        deadline = time.monotonic() + 10
        while True:
            for t in chains:
                a.lookup(t)  # misses make the host forget what it uploaded...
                a.put(t, kv_for(LAYOUT, t))  # ...so the put sends it again
            a.flush()
            with open_host(tmp_path / f"d{time.monotonic_ns()}", c) as d:
                if all(d.lookup(t) == len(t) for t in chains):
                    assert_kv_equal(d.get(chains[0]), kv_for(LAYOUT, chains[0]))
                    break
            assert time.monotonic() < deadline, "blocks were not uploaded again"
            time.sleep(0.5)


# A breaker cool-down no test outlasts: "one timeout" is then a count, whatever the
# machine's speed (with the default 3 s a slow run could see the breaker probe again).
LONG_BREAKER = 600


def test_frozen_node_costs_one_timeout(fresh_cluster, tmp_path):
    c = fresh_cluster
    timeout = 0.5
    chains = upload_chains(c, tmp_path / "a", 40000, remote={"timeout": timeout})
    remote = {"timeout": timeout, "breaker": LONG_BREAKER}
    with open_host(tmp_path / "b", c, remote=remote) as b:
        c.kill(c.ports[2], signal.SIGSTOP)
        try:
            for t in chains:
                b.lookup(t)
            r = remote_stats(b)
        finally:
            c.kill(c.ports[2], signal.SIGCONT)
        # Without the breaker every chain on the frozen node would cost a timeout.
        assert r["errors_timeout"] == 1 and r["breaker_skips"] >= 1, r
        assert r["hits"] > 0, r


def test_a_frozen_node_costs_a_write_through_put_one_timeout(fresh_cluster, tmp_path):
    """Puts that upload as they go (write "through") with a node frozen: each group's
    pipeline (EXISTS, then SET, 16 commands each) gives up at the first timeout, and
    the breaker skips the node after that. The redis crate's cluster pipeline read a
    reply for every command after a timeout: 16 timeouts for one group."""
    c = fresh_cluster
    timeout = 0.5
    chains = [seq(90000 + 1000 * k, 16 * B) for k in range(12)]
    remote = {"timeout": timeout, "write": "through", "breaker": LONG_BREAKER}
    with open_host(tmp_path / "a", c, remote=remote) as a:
        a.put(seq(80000, 4 * B), kv_for(LAYOUT, seq(80000, 4 * B)))  # connections made
        c.kill(c.ports[2], signal.SIGSTOP)
        try:
            for t in chains:
                a.put(t, kv_for(LAYOUT, t))
            r = remote_stats(a)
        finally:
            c.kill(c.ports[2], signal.SIGCONT)
    assert r["errors_timeout"] == 1 and r["breaker_skips"] >= 1, r
    assert r["blocks_uploaded"] > 4, r  # the other nodes took theirs


def test_a_failover_is_followed(tmp_path_factory, tmp_path):
    """A master is killed and its replica takes its slots: a handle opened before
    serves them again once the breaker lets a call through, from the new master.
    (The redis crate learns a new slot map only from a redirect, which a dead master
    never sends: the slots stayed dead for the life of the handle.)"""
    c = _start(tmp_path_factory, 6, True, replicas=1)
    try:
        timeout = 0.5
        chains = upload_chains(c, tmp_path / "a", 60000, remote={"timeout": timeout})
        c.wait_synced()
        masters = [p for p in c.ports if cmd(p, "ROLE")[0] == b"master"]
        victim = masters[0]
        assert cmd(victim, "KEYS", "kvstore:*"), "the chains spread over every master"
        # Opened before the failover (its lookups keep what they find locally:
        # it looks nothing up before).
        with open_host(tmp_path / "b", c, remote={"timeout": timeout}) as b:
            c.kill(victim)
            alive = [p for p in c.ports if p != victim]
            deadline = time.monotonic() + 30
            while len([p for p in alive if cmd(p, "ROLE")[0] == b"master"]) < 3:
                assert time.monotonic() < deadline, "no replica took over"
                time.sleep(0.2)
            c.wait_ok_on(alive)
            deadline = time.monotonic() + 20
            while not all(b.lookup(t) == len(t) for t in chains):
                assert time.monotonic() < deadline, remote_stats(b)
                time.sleep(0.3)
            assert_kv_equal(b.get(chains[0]), kv_for(LAYOUT, chains[0]))
    finally:
        c.stop()


def test_a_cluster_that_lost_a_master_is_misses_without_a_timeout(tmp_path_factory, tmp_path):
    """With full coverage required (Redis's default) and no reads while down, a
    cluster that lost a master refuses every command on its live nodes too
    (CLUSTERDOWN). A refusal is a miss, not tried again (the redis crate's cluster
    client, used before, waited 1.28 s or more before its retry, whatever the
    timeout): no call waits out its deadline. (How long the lookups take:
    benches/bench_deadlines.py.)"""
    down = ["--cluster-require-full-coverage", "yes", "--cluster-allow-reads-when-down", "no"]
    c = _start(tmp_path_factory, 3, True, down)
    try:
        timeout = 0.5
        chains = upload_chains(c, tmp_path / "a", 50000, remote={"timeout": timeout})
        with open_host(tmp_path / "b", c, remote={"timeout": timeout}) as b:
            c.kill(c.ports[0])
            # The others mark the cluster failed once the node timeout (2 s) passes.
            deadline = time.monotonic() + 30
            while b"cluster_state:fail" not in cmd(c.ports[1], "CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster did not go down"
                time.sleep(0.2)
            for t in chains:
                b.lookup(t)
            r = remote_stats(b)
        assert r["errors_cluster_down"] > 0, r
        assert r["errors_timeout"] == 0, r
    finally:
        c.stop()


def test_cluster_down_after_open_is_misses(fresh_cluster, tmp_path):
    c = fresh_cluster
    tokens = seq(3000, 8 * B)
    with open_host(tmp_path / "b", c, remote={"timeout": 0.3}) as b:
        for p in c.ports:
            c.kill(p)
        assert b.lookup(tokens) == 0
        b.put(tokens, kv_for(LAYOUT, tokens))
        assert b.lookup(tokens) == 8 * B
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens))
        b.flush()
        r = remote_stats(b)
        assert r["errors_connection"] + r["breaker_skips"] + r["errors_timeout"] > 0, r
        assert r["write_failures"] + r["writes_dropped"] > 0, r


def _with_users(tmp_path_factory, secret: str, **patterns: str) -> Cluster:
    """One node with `requirepass secret` and an ACL user per key pattern (the same
    password)."""
    single = _start(tmp_path_factory, 1, False, ["--requirepass", secret])
    try:
        for user, pattern in patterns.items():
            cmd(single.ports[0], "ACL", "SETUSER", user, "on", ">" + secret, pattern, "+@all",
                password=secret)  # fmt: skip
    except Exception:
        single.stop()
        raise
    return single


def test_open_errors_name_node_and_user_not_password(tmp_path_factory, tmp_path, monkeypatch):
    secret = "s3cret-Pa55"
    single = _with_users(tmp_path_factory, secret, alice="~kvstore:*", mallory="~other:*")
    try:
        port = single.ports[0]
        monkeypatch.setenv("KV_PW", secret)
        monkeypatch.setenv("KV_BAD", "wrong-" + secret)
        node = f"127.0.0.1:{port}"
        msg = open_error(
            tmp_path / "x", secret, nodes=[node], username="alice", password_env="KV_BAD"
        )
        assert node in msg and "alice" in msg, msg
        msg = open_error(
            tmp_path / "y", secret, nodes=[node], username="mallory", password_env="KV_PW"
        )
        assert "mallory" in msg, msg
        free = free_ports(1)[0]
        msg = open_error(tmp_path / "z", secret, nodes=[f"127.0.0.1:{free}"], timeout=0.3)
        assert f"127.0.0.1:{free}" in msg, msg
        r = kvstore.Remote([node], username="alice", password_env="KV_PW")
        assert secret not in repr(r)
        tokens = seq(1, 4 * B)
        with kvstore.open(tmp_path / "ok", LAYOUT, MODEL, remote=r, durability="none") as s:
            s.put(tokens, kv_for(LAYOUT, tokens))
            s.flush()
            assert remote_stats(s)["blocks_uploaded"] == 4
            assert secret not in str(s.stats())
        with kvstore.open(tmp_path / "ok2", LAYOUT, MODEL, remote=r) as s2:
            assert_kv_equal(s2.get(tokens), kv_for(LAYOUT, tokens))
    finally:
        single.stop()


def test_password_in_a_node_url_is_refused_unechoed(clean, tmp_path):
    """A node URL with a user or password is InvalidInput without the secret, in
    Python and in the engine (reached here past the Python check); messages and
    reports show nodes as host:port."""
    secret = "url-Pa55"
    url = f"redis://kv:{secret}@{clean.nodes[0]}"
    for make in (
        lambda: kvstore.Remote(nodes=[url]),
        lambda: kvstore.Remote(nodes=url),
        lambda: kvstore.Remote.from_dict({"nodes": f"{clean.nodes[1]},{url}"}),
    ):
        with pytest.raises(kvstore.InvalidInput) as e:
            make()
        assert secret not in str(e.value) and "password" in str(e.value)
    r = kvstore.Remote(nodes=clean.nodes)
    object.__setattr__(r, "nodes", [url])  # as if the Python check were not there
    with pytest.raises(kvstore.InvalidInput) as e:
        kvstore.open(tmp_path / "x", LAYOUT, MODEL, remote=r)
    assert secret not in str(e.value) and "password" in str(e.value)
    free = free_ports(1)[0]
    with pytest.raises(kvstore.RemoteError) as e:
        url_node = kvstore.Remote([f"redis://127.0.0.1:{free}/0"], timeout=0.3)
        kvstore.open(tmp_path / "z", LAYOUT, MODEL, remote=url_node)
    assert f"remote node 127.0.0.1:{free} " in str(e.value), str(e.value)
    with open_host(tmp_path / "w", clean) as s:
        assert sorted(n["node"] for n in s.remote_nodes()) == sorted(clean.nodes)


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_small_maxmemory(tmp_path_factory, tmp_path, policy):
    single = _start(
        tmp_path_factory, 1, False, ["--maxmemory", "2mb", "--maxmemory-policy", policy]
    )
    try:
        chains = [seq(100000 * (k + 1), 128 * B) for k in range(24)]  # ~3.3 MiB of values
        with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none",
                          remote=kvstore.Remote(single.nodes)) as a:  # fmt: skip
            for t in chains:
                a.put(t, kv_for(LAYOUT, t))  # local puts succeed whatever the server does
                a.flush()
            assert all(a.lookup(t) == len(t) for t in chains)
            r = remote_stats(a)
        if policy == "noeviction":
            assert r["errors_oom"] > 0 and r["write_failures"] > 0, str(r)
        else:
            assert r["errors_oom"] == 0 and r["blocks_uploaded"] == 24 * 128, r
        with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none",
                          remote=kvstore.Remote(single.nodes)) as b:  # fmt: skip
            found = [b.lookup(t) for t in chains]
            assert any(n < len(t) for n, t in zip(found, chains, strict=True)), (
                "not all fit in 2 MiB"
            )
            for n, t in zip(found, chains, strict=True):
                if n:
                    assert_kv_equal(b.get(t[:n]), kv_for(LAYOUT, t[:n]))
            assert remote_stats(b)["invalid"] == 0
    finally:
        single.stop()


def test_write_through_and_bad_options(clean, tmp_path):
    tokens = seq(600, 5 * B)
    with open_host(tmp_path / "a", clean, remote={"write": "through"}) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        # No flush: through means the cluster has them when put returns.
        assert remote_stats(a)["blocks_uploaded"] == 5
    assert len(clean.keys("kvstore:*")) == 5
    for bad in ({"write": "sideways"}, {"timeout": 0}, {"ttl": -1}):
        with pytest.raises(kvstore.InvalidInput):
            open_host(tmp_path / "bad", clean, remote=bad)
    with pytest.raises(kvstore.InvalidInput, match="KV_NOT_SET"):
        open_host(tmp_path / "bad", clean, remote={"password_env": "KV_NOT_SET"})
    assert "KV_NOT_SET" not in os.environ
    with pytest.raises(RespError):
        cmd(clean.ports[0], "NOSUCHCOMMAND")


# ------------------------------------------------------------------ kvstore remote ...


def kv_cli(*args, env: dict | None = None, check: bool = True):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    if check and p.returncode != 0:
        raise AssertionError(f"kvstore {args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def test_cli_push_uploads_what_the_cluster_lacks(clean, tmp_path):
    """A store filled without a remote tier: chains sharing a prefix, a chain
    continued by a second put (its new blocks' parent is an old record), a chain
    longer than a hash-tag group, a compaction that moved records, and blocks put
    with `extra` (whose chain cannot be found again: reported unplaced). Push
    uploads every placeable block once; another host reads them bit-exact."""
    import json

    base = seq(50000, 20 * B)
    chains = [base + seq(60000, 5 * B), base + seq(61000, 3 * B), seq(70000, 40 * B)]
    chains.append(chains[2] + seq(80000, 9 * B))  # continued later
    with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none") as a:
        for t in chains[:3]:
            a.put(t, kv_for(LAYOUT, t))
        a.put(seq(90000, 4 * B), kv_for(LAYOUT, seq(90000, 4 * B)), extra="adapter-1")
        a.compact()
        a.put(chains[3], kv_for(LAYOUT, chains[3]))
        blocks = a.stats()["blocks"]
    placeable = blocks - 4
    assert placeable == 20 + 5 + 3 + 40 + 9
    nodes = ",".join(clean.nodes)
    r = json.loads(kv_cli("remote", "push", tmp_path / "a", "--node", nodes, "--json").stdout)
    assert (r["blocks"], r["uploaded"], r["present"]) == (blocks, placeable, 0), r
    assert (r["unplaced"], r["unreadable"], r["failed"]) == (4, 0, 0), r
    assert len(clean.keys("kvstore:*")) == placeable
    # Nodes from the environment this time; everything is there already.
    again = kv_cli("remote", "push", tmp_path / "a", "--json", env={"KVSTORE_REMOTE_NODES": nodes})
    r = json.loads(again.stdout)
    assert (r["uploaded"], r["present"]) == (0, placeable), r
    with open_host(tmp_path / "b", clean) as b:
        for t in chains:
            assert b.lookup(t) == len(t)
            assert_kv_equal(b.get(t), kv_for(LAYOUT, t))
        assert remote_stats(b)["invalid"] == 0
    # The human output names the counts.
    clean.flushall()
    out = kv_cli("remote", "push", tmp_path / "a", "--node", clean.nodes[0]).stdout
    assert f"{placeable} uploaded" in out and "4 not placed" in out


def test_cli_push_does_not_spread_bit_rot(clean, tmp_path):
    """A local record whose payload has a flipped bit (its header intact) is not
    uploaded: push reports it unreadable, and the cluster lacks its key."""
    import json

    tokens = seq(66000, 6 * B)
    with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none", compression=None) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        ids = a.block_ids(tokens)
    _, loc = block_record(tmp_path / "a", LAYOUT, tokens, 2)
    with open(segment_file(tmp_path / "a", loc.segment), "r+b") as f:
        at = payload_offset(loc) + loc.stored_len // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    nodes = ",".join(clean.nodes)
    r = json.loads(kv_cli("remote", "push", tmp_path / "a", "--node", nodes, "--json").stdout)
    assert (r["uploaded"], r["unreadable"], r["failed"]) == (5, 1, 0), r
    assert clean.keys(f"kvstore:*:{ids[2].hex()}") == []
    assert len(clean.keys("kvstore:*")) == 5


def test_cli_push_salted_store(clean, tmp_path):
    tokens = seq(1234, 18 * B)
    with kvstore.open(tmp_path / "s", LAYOUT, MODEL, salt="tenant-9", durability="none") as s:
        s.put(tokens, kv_for(LAYOUT, tokens))
    nodes = ",".join(clean.nodes)
    import json

    unsalted = json.loads(
        kv_cli("remote", "push", tmp_path / "s", "--node", nodes, "--json").stdout
    )
    assert (unsalted["uploaded"], unsalted["unplaced"]) == (0, 18), "another tenant's chain"
    # The salt (the MAC secret) from a file or a variable, not on the command line.
    salt_file = tmp_path / "salt"
    salt_file.write_text("tenant-9\n")
    push = ("remote", "push", tmp_path / "s", "--node", nodes, "--json")
    r = json.loads(kv_cli(*push, "--salt-file", salt_file).stdout)
    assert r["uploaded"] == 18, r
    again = json.loads(kv_cli(*push, "--salt-env", "KV_SALT", env={"KV_SALT": "tenant-9"}).stdout)
    assert (again["uploaded"], again["present"]) == (0, 18), again
    both = kv_cli(*push, "--salt", "x", "--salt-file", salt_file, check=False)
    assert both.returncode == 2 and "one of" in both.stderr
    with kvstore.open(
        tmp_path / "t", LAYOUT, MODEL, salt="tenant-9", durability="none",
        remote=kvstore.Remote(nodes=clean.nodes),
    ) as t:  # fmt: skip
        assert_kv_equal(t.get(tokens), kv_for(LAYOUT, tokens))
        assert remote_stats(t)["hits"] == 18


def test_cli_ping_and_stats(clean, tmp_path, tmp_path_factory):
    import json

    with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none"):
        pass
    nodes = ",".join(clean.nodes)
    r = json.loads(kv_cli("remote", "ping", tmp_path / "a", "--node", nodes, "--json").stdout)
    assert r["ok"] and sorted(n["node"] for n in r["nodes"]) == sorted(clean.nodes)
    assert all(n["rtt"] > 0 and n["error"] is None for n in r["nodes"])
    human = kv_cli("remote", "ping", tmp_path / "a", "--node", nodes).stdout
    assert all(n in human for n in clean.nodes)
    st = json.loads(kv_cli("remote", "stats", tmp_path / "a", "--node", nodes, "--json").stdout)
    for n in st["nodes"]:
        assert int(n["info"]["used_memory"]) > 0 and n["info"]["cluster_enabled"] == "1"
    assert "used_memory" in kv_cli("remote", "stats", tmp_path / "a", "--node", nodes).stdout

    secret = "cli-Pa55-word"
    single = _start(tmp_path_factory, 1, False, ["--requirepass", secret])
    try:
        node = single.nodes[0]
        pw = tmp_path / "pw"
        pw.write_text(secret + "\n")
        ok = kv_cli("remote", "ping", tmp_path / "a", "--node", node, "--password-file", pw)
        assert secret not in ok.stdout + ok.stderr
        env = {"KV_CLI_PW": "wrong", "KVSTORE_REMOTE_PASSWORD_ENV": "KV_CLI_PW"}
        bad = kv_cli("remote", "ping", tmp_path / "a", "--node", node, env=env, check=False)
        assert bad.returncode == 2 and node in bad.stderr and '"default"' in bad.stderr
        env = {"KV_CLI_PW": secret, "KVSTORE_REMOTE_PASSWORD_ENV": "KV_CLI_PW"}
        good = kv_cli("remote", "stats", tmp_path / "a", "--node", node, "--json", env=env)
        assert secret not in good.stdout + good.stderr
        assert json.loads(good.stdout)["nodes"][0]["info"]["role"] == "master"
    finally:
        single.stop()
    none = kv_cli("remote", "ping", tmp_path / "a", check=False)
    assert none.returncode == 2 and "KVSTORE_REMOTE_NODES" in none.stderr


def test_remote_calls_without_a_remote_tier(tmp_path):
    """remote_nodes and remote_push on a store opened without `remote=` name what is
    missing; the store stays usable."""
    layout = kvstore.Layout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
    with kvstore.open(tmp_path / "s", layout=layout, model="m@1") as s:
        with pytest.raises(kvstore.InvalidInput, match="without a remote tier"):
            s.remote_nodes()
        with pytest.raises(kvstore.InvalidInput, match="without a remote tier"):
            s.remote_push()
        with pytest.raises(kvstore.InvalidInput):
            s.remote_push(progress=3)  # type: ignore[arg-type]
        assert s.lookup(list(range(8))) == 0


def test_remote_from_dict():
    r = kvstore.Remote.from_dict(
        {"nodes": "a:1, b:2", "username": "kv", "password_env": "X", "ttl": 60, "write": "through"}
    )
    assert r.nodes == ["a:1", "b:2"] and r.username == "kv" and r.ttl == 60
    assert kvstore.Remote.from_dict({"nodes": ["a:1"]}) == kvstore.Remote(nodes=["a:1"])
    with pytest.raises(kvstore.InvalidInput, match="passwrd_env"):
        kvstore.Remote.from_dict({"nodes": ["a:1"], "passwrd_env": "X"})
    with pytest.raises(kvstore.InvalidInput, match="nodes"):
        kvstore.Remote.from_dict({"username": "kv"})
    with pytest.raises(kvstore.InvalidInput, match="write"):
        kvstore.Remote.from_dict({"nodes": ["a:1"], "write": "later"})
    for name in ("timeout", "ttl"):
        with pytest.raises(kvstore.InvalidInput, match=name):
            kvstore.Remote.from_dict({"nodes": ["a:1"], name: "5"})
    with pytest.raises(kvstore.InvalidInput, match="mapping"):
        kvstore.Remote.from_dict(["a:1"])  # type: ignore[arg-type]


# ------------------------------------------------------------- server limits and changes


def test_record_over_the_bulk_limit_is_counted_not_fatal(tmp_path_factory, tmp_path):
    """A block whose record is larger than the server's `proto-max-bulk-len` (1 MiB,
    its minimum; read with CONFIG GET at open): the put succeeds locally, the value
    is not sent and is counted, the node stays in service, smaller blocks still go
    up, and another host reads those."""
    single = _start(tmp_path_factory, 1, False, ["--proto-max-bulk-len", "1mb"])
    big = small_layout(block_size=64, L=8, H=8, D=128)  # 2 MiB blocks
    assert big.block_bytes > 1 << 20
    try:
        rng = np.random.default_rng(1)
        tokens = seq(1, 2 * big.block_size)
        kv = rng.standard_normal((8, 2, len(tokens), 8, 128)).astype(np.float16)  # no zstd gain
        with kvstore.open(tmp_path / "a", big, MODEL, durability="none",
                          remote=kvstore.Remote(single.nodes)) as a:  # fmt: skip
            a.put(tokens, kv)
            a.flush()
            assert_kv_equal(a.get(tokens), kv)
            r = remote_stats(a)
            assert r["write_failures"] == 2 and r["too_large"] == 2, r
            assert r["blocks_uploaded"] == 0 and r["errors_connection"] == 0, r
            # Not sent, so the server did not drop the connection: the node is not
            # taken for dead (no breaker skip on the next call).
            assert a.lookup(seq(9000, big.block_size)) == 0
            r = remote_stats(a)
            assert r["misses"] == 1 and r["breaker_skips"] == 0, r
        assert cmd(single.ports[0], "DBSIZE") == 0
        small = seq(77, 4 * B)
        with kvstore.open(tmp_path / "s", LAYOUT, MODEL, durability="none",
                          remote=kvstore.Remote(single.nodes)) as s:  # fmt: skip
            s.put(small, kv_for(LAYOUT, small))
            s.flush()
            assert remote_stats(s)["blocks_uploaded"] == 4
        with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none",
                          remote=kvstore.Remote(single.nodes)) as b:  # fmt: skip
            assert_kv_equal(b.get(small), kv_for(LAYOUT, small))
    finally:
        single.stop()


def test_permission_revoked_after_open(tmp_path_factory, tmp_path, monkeypatch):
    """The ACL user loses its key pattern under live handles: reads are misses and
    uploads failures, both counted as permission errors; local puts and gets work."""
    secret = "acl-Pa55"
    single = _with_users(tmp_path_factory, secret, kv="~kvstore:*")
    try:
        port = single.ports[0]
        monkeypatch.setenv("KV_ACL_PW", secret)
        remote = kvstore.Remote(single.nodes, username="kv", password_env="KV_ACL_PW")
        tokens, later = seq(400, 6 * B), seq(900, 3 * B)
        with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none", remote=remote) as a:
            a.put(tokens, kv_for(LAYOUT, tokens))
            a.flush()
            assert remote_stats(a)["blocks_uploaded"] == 6
            with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none",
                              remote=remote) as b:  # fmt: skip
                cmd(port, "ACL", "SETUSER", "kv", "resetkeys", "~other:*", password=secret)
                assert b.lookup(tokens) == 0
                assert b.get(tokens).shape[2] == 0
                rb = remote_stats(b)
                assert rb["errors_permission"] >= 1 and rb["hits"] == 0, rb
                a.put(later, kv_for(LAYOUT, later))
                a.flush()
                assert a.lookup(later) == len(later)
                assert_kv_equal(a.get(later), kv_for(LAYOUT, later))
                ra = remote_stats(a)
                assert ra["errors_permission"] >= 1 and ra["write_failures"] == 3, ra
                assert ra["blocks_uploaded"] == 6
        assert cmd(port, "DBSIZE", password=secret) == 6
    finally:
        single.stop()


def test_ttl_renewed_on_read(clean, tmp_path):
    tokens = seq(31000, 3 * B)
    ttl = 600.0
    with open_host(tmp_path / "a", clean, remote={"ttl": ttl}) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.flush()
        key = block_key(clean, a, tokens, 1)
    assert 0 < clean.call(key, "PTTL", key) <= ttl * 1000
    # Shortened by hand: a read must put the option's ttl back.
    assert clean.call(key, "PEXPIRE", key, 3000) == 1
    assert 0 < clean.call(key, "PTTL", key) <= 3000
    with open_host(tmp_path / "b", clean, remote={"ttl": ttl}) as b:
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens))
    after = clean.call(key, "PTTL", key)
    assert after > 100_000, after
    # Without a ttl option nothing expires.
    untimed = seq(32000, 2 * B)
    with open_host(tmp_path / "c", clean) as c:
        c.put(untimed, kv_for(LAYOUT, untimed))
        c.flush()
        k = block_key(clean, c, untimed, 0)
    assert clean.call(k, "PTTL", k) == -1


def test_reads_and_writes_follow_a_reshard(fresh_cluster, tmp_path):
    """Slots move between nodes under live handles (opened with the old slot
    map): reads still hit, and uploads into a moved slot land on its new owner."""
    c = fresh_cluster
    chains = [seq(110000 + 1000 * k, 16 * B) for k in range(3)]
    with open_host(tmp_path / "a", c) as a, open_host(tmp_path / "b", c) as b:
        for t in chains:
            a.put(t[: 8 * B], kv_for(LAYOUT, t[: 8 * B]))
        a.flush()
        assert remote_stats(a)["blocks_uploaded"] == 3 * 8
        owners = []
        for t in chains:
            first = block_key(c, a, t, 0)
            src = c.port_of(first)
            dst = next(p for p in c.ports if p != src)
            assert c.move_slot(cmd(src, "CLUSTER", "KEYSLOT", first), src, dst) == 8
            assert c.port_of(first) == dst
            owners.append(dst)
        c.wait_ok()
        for t in chains:
            assert b.lookup(t) == 8 * B
            assert_kv_equal(b.get(t[: 8 * B]), kv_for(LAYOUT, t[: 8 * B]))
        rb = remote_stats(b)
        assert rb["hits"] == 3 * 8 and rb["invalid"] == 0, rb
        # Blocks 8..15 share block 0's hash tag: the moved slot.
        for t in chains:
            a.put(t, kv_for(LAYOUT, t))
        a.flush()
        ra = remote_stats(a)
        assert ra["blocks_uploaded"] == 3 * 16 and ra["write_failures"] == 0, str(ra)
        for t, dst in zip(chains, owners, strict=True):
            tag = block_key(c, a, t, 0).split(b"{")[1].split(b"}")[0].decode()
            assert len(cmd(dst, "KEYS", f"*{{{tag}}}*")) == 16
    with open_host(tmp_path / "d", c) as d:
        for t in chains:
            assert_kv_equal(d.get(t), kv_for(LAYOUT, t))


def test_nodes_given_by_name(clean, tmp_path):
    """Nodes given by host name ("localhost", looked up on a thread of its own
    within the timeout) serve as their addresses do."""
    tokens = seq(160000, 4 * B)
    named = [n.replace("127.0.0.1", "localhost") for n in clean.nodes]
    assert all(n.startswith("localhost:") for n in named), named
    remote = kvstore.Remote(nodes=named)
    with kvstore.open(tmp_path / "a", LAYOUT, MODEL, remote=remote, durability="none") as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.flush()
        assert remote_stats(a)["blocks_uploaded"] == 4, remote_stats(a)
    with open_host(tmp_path / "b", clean) as b:
        assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens))


def _start_moving_group(c: Cluster, store, tokens) -> tuple[int, int, int]:
    """Starts moving the slot of `tokens`' first hash-tag group (uploaded by
    `store`) to another node: (slot, its node, the other)."""
    first = block_key(c, store, tokens, 0)
    src = c.port_of(first)
    dst = next(p for p in c.ports if p != src)
    slot = cmd(src, "CLUSTER", "KEYSLOT", first)
    c.start_move(slot, src, dst)
    return slot, src, dst


def _upload_and_start_moving(c: Cluster, path, tokens) -> tuple[int, int, int]:
    """Uploads `tokens` (one hash-tag group) from a host at `path`, then
    `_start_moving_group`."""
    with open_host(path, c) as a:
        a.put(tokens, kv_for(LAYOUT, tokens))
        a.flush()
        return _start_moving_group(c, a, tokens)


def test_reads_and_writes_during_a_slot_migration(fresh_cluster, tmp_path):
    """A slot half migrated (MIGRATING on its old node, IMPORTING on the new):
    the old node answers for the keys it still has and sends the others on with
    ASK, which only an ASKING before the command gets served (without it the new
    node sends it back, MOVED). Reads of the whole group hit, uploads of new keys
    land on the new node, and after the move ends every block is there."""
    c = fresh_cluster
    tokens = seq(150000, 16 * B)
    with open_host(tmp_path / "a", c) as a:
        a.put(tokens[: 8 * B], kv_for(LAYOUT, tokens[: 8 * B]))
        a.flush()
        slot, src, dst = _start_moving_group(c, a, tokens)
        try:
            assert c.migrate(slot, src, dst, most=4) == 4
            # Blocks 8..15 are new keys of the migrating slot: ASK sends them on.
            a.put(tokens, kv_for(LAYOUT, tokens))
            a.flush()
            ra = remote_stats(a)
            with open_host(tmp_path / "b", c) as b:
                got = b.get(tokens)
                rb = remote_stats(b)
            held = len(cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, 100))
            assert c.migrate(slot, src, dst) == held
        finally:
            c.end_move(slot, dst)
    assert ra["blocks_uploaded"] == 16 and ra["write_failures"] == 0, ra
    assert held == 4, held  # 4 of the first 8 still on the old node
    assert_kv_equal(got, kv_for(LAYOUT, tokens))
    assert rb["hits"] == 16 and rb["invalid"] == 0, rb
    c.wait_ok()
    assert len(cmd(dst, "CLUSTER", "GETKEYSINSLOT", slot, 100)) == 16
    with open_host(tmp_path / "d", c) as d:
        assert_kv_equal(d.get(tokens), kv_for(LAYOUT, tokens))


def test_a_user_refused_asking_reads_a_migrating_slot_as_refused(
    fresh_cluster, tmp_path, monkeypatch
):
    """A user whose ACL lacks ASKING (`@connection`) reads a half-migrated slot:
    the keys that moved are refused, counted as a permission error, and not sent
    back and forth between the two nodes (the new one answers MOVED without
    ASKING) until the redirects run out."""
    c = fresh_cluster
    secret = "ask-Pa55"
    for p in c.ports:
        cmd(p, "ACL", "SETUSER", "kv", "on", ">" + secret, "~kvstore:*", "+@all", "-asking")
    monkeypatch.setenv("KV_ASK_PW", secret)
    remote = {"username": "kv", "password_env": "KV_ASK_PW"}
    tokens = seq(180000, 16 * B)
    slot, src, dst = _upload_and_start_moving(c, tmp_path / "a", tokens)
    try:
        assert c.migrate(slot, src, dst, most=8) == 8
        with open_host(tmp_path / "b", c, remote=remote) as b:
            assert b.lookup(tokens) == 0
            r = remote_stats(b)
    finally:
        c.migrate(slot, src, dst)
        c.end_move(slot, dst)
    assert r["errors_permission"] >= 1 and r["errors_other"] == 0, r


def test_a_redirect_to_a_frozen_node_costs_one_timeout(tmp_path):
    """A node sends every group's reads on (MOVED) to a node that never answers,
    and its map keeps naming itself: the first call ends when its one deadline
    passes, counted as one timeout; the later ones stop at the redirect (the
    target's breaker is open), where each cost a timeout before."""
    from support.fake_resp import CLUSTER_INFO, FakeServer, cluster_slots

    frozen = FakeServer(lambda c, a: True)

    def handler(c, a):
        verb = a[0].upper()
        if verb == b"INFO":
            return CLUSTER_INFO
        if verb == b"CLUSTER":
            return cluster_slots([(0, 16383, me.node)])  # all slots here
        if verb in (b"GETRANGE", b"STRLEN", b"EXISTS") and b":session:" not in a[1]:
            return b"-MOVED 0 %s\r\n" % frozen.node.encode()
        return None

    me = FakeServer(handler)
    try:
        with _fake_store(tmp_path / "s", me, timeout=0.3, breaker=LONG_BREAKER) as s:
            assert s.lookup(seq(800, 16 * B)) == 0
            first = remote_stats(s)
            for k in range(1, 5):
                assert s.lookup(seq(800 + 1000 * k, 16 * B)) == 0
            r = remote_stats(s)
    finally:
        me.close()
        frozen.close()
    # The first call: one deadline, one timeout; each later one skipped at the
    # redirect, without a timeout of its own.
    assert first["errors_timeout"] == 1, first
    assert r["errors_timeout"] == 1 and r["breaker_skips"] >= 4, r


def test_a_frozen_migration_target_costs_one_timeout(fresh_cluster, tmp_path):
    """A slot migrates (every key moved, the move not ended), and the node it
    migrates to freezes: the old node sends each read on (ASK) while the map
    still names it; the first read costs a timeout, the next ones stop at the
    redirect, since the target's breaker is open."""
    c = fresh_cluster
    tokens = seq(210000, 16 * B)
    slot, src, dst = _upload_and_start_moving(c, tmp_path / "a", tokens)
    try:
        assert c.migrate(slot, src, dst) == 16
        remote = {"timeout": 0.5, "breaker": LONG_BREAKER}
        with open_host(tmp_path / "b", c, remote=remote) as b:
            c.kill(dst, signal.SIGSTOP)
            try:
                for _ in range(6):
                    assert b.lookup(tokens) == 0
                r = remote_stats(b)
            finally:
                c.kill(dst, signal.SIGCONT)
    finally:
        c.end_move(slot, dst)
    assert r["errors_timeout"] == 1 and r["breaker_skips"] >= 5, r


def test_slow_nodes_after_a_moved_keep_answering(tmp_path):
    """Two nodes whose every reply takes 0.6 of the timeout, after one read was
    redirected (MOVED: the map is read again before the next call). The map's
    read and the call each get a whole timeout, so neither times out; the
    call's time was spent on the read before, and the call then timed out and
    tripped a healthy node, again and again."""
    from support.fake_resp import CLUSTER_INFO, FakeServer, cluster_slots

    timeout = 0.4
    state = {"slow": 0.0, "move_once": False}
    nodes: dict[str, FakeServer] = {}

    def node(name: str):
        def handler(c, a):
            verb = a[0].upper()
            if verb == b"INFO":
                return CLUSTER_INFO
            if verb == b"CONFIG":
                return None
            time.sleep(state["slow"])
            if verb == b"CLUSTER":
                return cluster_slots([(0, 8191, nodes["A"].node), (8192, 16383, nodes["B"].node)])
            if verb == b"GETRANGE" and state["move_once"]:
                state["move_once"] = False
                return b"-MOVED 0 %s\r\n" % nodes["B" if name == "A" else "A"].node.encode()
            return None

        return handler

    nodes["A"], nodes["B"] = FakeServer(node("A")), FakeServer(node("B"))
    try:
        with _fake_store(tmp_path / "s", nodes["A"], timeout=timeout) as s:
            state["move_once"] = True
            s.lookup(seq(100, B))  # one MOVED, followed: the map is out of date
            state["slow"] = 0.6 * timeout
            for k in range(4):
                s.lookup(seq(5000 + 1000 * k, B))
            r = remote_stats(s)
    finally:
        for n in nodes.values():
            n.close()
    assert r["errors_timeout"] == 0 and r["breaker_skips"] == 0, r
    assert r["misses"] >= 4, r


def test_a_frozen_redirect_target_is_blamed_not_the_node_that_redirected(fresh_cluster, tmp_path):
    """A slot moves off a node after the reader opened, and its new node freezes:
    the read sent on there (MOVED) times out and trips the breaker of the frozen
    node, not of the healthy one that redirected, whose other chains still hit."""
    c = fresh_cluster
    timeout = 0.5
    chains = upload_chains(c, tmp_path / "a", 170000)
    with open_host(tmp_path / "a", c) as a:
        ports = [c.port_of(block_key(c, a, t, 0)) for t in chains]
    src = ports[0]
    stays = [t for t, p in zip(chains[1:], ports[1:], strict=True) if p == src]
    assert len(stays) >= 2, ports
    dst = next(p for p in c.ports if p != src)
    with open_host(tmp_path / "b", c, remote={"timeout": timeout}) as b:
        assert b.lookup(stays[0]) == len(stays[0])  # the connection to src is made
        first = block_key(c, b, chains[0], 0)
        assert c.move_slot(cmd(src, "CLUSTER", "KEYSLOT", first), src, dst) == 16
        c.wait_ok()
        c.kill(dst, signal.SIGSTOP)
        try:
            assert b.lookup(chains[0]) == 0  # src: MOVED to dst, frozen: a timeout
            n = b.lookup(stays[1])  # src serves this one
            r = remote_stats(b)
        finally:
            c.kill(dst, signal.SIGCONT)
    assert n == len(stays[1]), r
    assert r["errors_timeout"] >= 1, r


def test_a_single_servers_redirects_are_not_followed(tmp_path):
    """A single (non-cluster) server answering MOVED to ever other addresses: the
    client neither connects there (nor sends its password) nor keeps anything
    per address; each such read is a refusal, a miss."""
    from support.fake_resp import FakeServer

    reached = []
    target = FakeServer(lambda c, a: reached.append(a[0]))

    def handler(c, a):
        if a[0].upper() == b"GETRANGE" and b":session:" not in a[1]:
            return b"-MOVED 0 %s\r\n" % target.node.encode()
        return None

    me = FakeServer(handler)
    try:
        with _fake_store(tmp_path / "s", me, timeout=1.0) as s:
            for k in range(5):
                assert s.lookup(seq(500000 + 1000 * k, B)) == 0
            r = remote_stats(s)
    finally:
        me.close()
        target.close()
    assert reached == [], reached
    assert r["errors_other"] >= 1 and r["errors_timeout"] == 0, r


def test_a_cluster_that_lists_no_endpoints(tmp_path_factory, tmp_path):
    """A cluster announcing no endpoints (`cluster-preferred-endpoint-type
    unknown-endpoint`: CLUSTER SLOTS lists each master's port with a NULL host,
    its redirects `:port`) is mapped by the host that listed them: reads go
    straight to each slot's node, and a frozen node costs only its own chains."""
    unknown = ["--cluster-preferred-endpoint-type", "unknown-endpoint"]
    c = _start(tmp_path_factory, 3, True, unknown)
    try:
        chains = [seq(300000 + 1000 * k, 16 * B) for k in range(6)]
        with open_host(tmp_path / "a", c, remote={"timeout": 0.5}) as a:
            for t in chains:
                a.put(t, kv_for(LAYOUT, t))
            a.flush()
            ra = remote_stats(a)
        assert ra["blocks_uploaded"] == 6 * 16 and ra["write_failures"] == 0, ra
        with open_host(tmp_path / "b", c, remote={"timeout": 0.5}) as b:
            ports = [c.port_of(block_key(c, b, t, 0)) for t in chains]
            other = next(p for p in ports if p != c.ports[0])
            c.kill(other, signal.SIGSTOP)
            try:
                b.lookup(next(t for t, p in zip(chains, ports, strict=True) if p == other))
                got = [b.lookup(t) for t, p in zip(chains, ports, strict=True) if p != other]
                rb = remote_stats(b)
            finally:
                c.kill(other, signal.SIGCONT)
        assert got and all(g == 16 * B for g in got), (got, ports, rb)
    finally:
        c.stop()


def test_a_session_upload_follows_a_moved_slot_with_its_transaction(fresh_cluster, tmp_path):
    """A session's slot moves after the host opened: its next upload is sent on
    (MOVED) to the new node, and set there under WATCH as every session upload
    is (not by a plain SET, which could replace a newer save)."""
    c = fresh_cluster
    first, later = seq(5, 2 * B), seq(5, 3 * B)
    with open_host(tmp_path / "a", c) as a:
        a.save_session("chat", first, kv_for(LAYOUT, first))
        a.flush()
        (key,) = c.keys("kvstore:*:session:*")
        src = c.port_of(key)
        dst = next(p for p in c.ports if p != src)
        assert c.move_slot(cmd(src, "CLUSTER", "KEYSLOT", key), src, dst) == 1
        c.wait_ok()
        cmd(dst, "CONFIG", "RESETSTAT")
        a.save_session("chat", later, kv_for(LAYOUT, later))
        a.flush()
        r = remote_stats(a)
    stats = cmd(dst, "INFO", "commandstats").decode()
    assert "cmdstat_watch:calls=" in stats and "cmdstat_exec:calls=" in stats, stats
    assert r["write_failures"] == 0, r
    with open_host(tmp_path / "b", c) as b:
        toks, kv = b.load_session("chat")
    assert list(toks) == later
    assert_kv_equal(kv, kv_for(LAYOUT, later))


def test_breaker_follows_a_moved_slot(fresh_cluster, tmp_path):
    """A slot moves off a node after the reader opened (its client follows the
    redirect of a read silently); then the old node freezes. The reader must not
    blame the moved slot on the frozen node: its blocks still hit from the new
    owner once the frozen node's breaker has tripped."""
    c = fresh_cluster
    timeout = 0.5
    chains = upload_chains(c, tmp_path / "a", 130000)
    with open_host(tmp_path / "a", c) as a:
        ports = [c.port_of(block_key(c, a, t, 0)) for t in chains]
    moved = chains[0]
    src = ports[0]
    stays = next(t for t, p in zip(chains[1:], ports[1:], strict=True) if p == src)
    dst = next(p for p in c.ports if p != src)
    with open_host(tmp_path / "b", c, remote={"timeout": timeout}) as b:
        first = block_key(c, b, moved, 0)
        assert c.move_slot(cmd(src, "CLUSTER", "KEYSLOT", first), src, dst) == 16
        c.wait_ok()
        assert b.lookup(moved[: 4 * B]) == 4 * B  # read once through the redirect
        c.kill(src, signal.SIGSTOP)
        try:
            assert b.lookup(stays) == 0  # times out: the breaker trips
            n = b.lookup(moved)
            r = remote_stats(b)
        finally:
            c.kill(src, signal.SIGCONT)
        assert r["errors_timeout"] + r["errors_connection"] >= 1, r
        assert n == len(moved), r


# ------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from support.redis_tls import make_certs

    need("openssl")
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tls_with_the_private_ca(tmp_path_factory, tmp_path, certs):
    """A 3-node cluster serving TLS (its bus too): two hosts share blocks through it
    with `tls_ca`; a `rediss://` node with the CA works the same."""
    c = _start(tmp_path_factory, 3, True, tls=certs.server_args())
    try:
        tokens = seq(4000, 20 * B)
        remote = kvstore.Remote(nodes=c.tls_nodes, tls_ca=certs.ca)
        with kvstore.open(tmp_path / "a", LAYOUT, MODEL, durability="none", remote=remote) as a:
            a.put(tokens, kv_for(LAYOUT, tokens))
            a.flush()
            assert remote_stats(a)["blocks_uploaded"] == 20
            nodes = sorted(n["node"] for n in a.remote_nodes())
            assert nodes == sorted(c.tls_nodes), "the slot map names the TLS ports"
        assert len(c.keys("kvstore:*")) == 20  # seen through the plain ports
        url = kvstore.Remote(nodes=[f"rediss://{c.tls_nodes[1]}"], tls_ca=certs.ca)
        with kvstore.open(tmp_path / "b", LAYOUT, MODEL, durability="none", remote=url) as b:
            assert_kv_equal(b.get(tokens), kv_for(LAYOUT, tokens))
            assert remote_stats(b)["hits"] == 20
    finally:
        c.stop()


def test_tls_failures_at_open_name_node_and_user(tmp_path_factory, tmp_path, certs, monkeypatch):
    secret = "tls-Pa55"
    single = _start(tmp_path_factory, 1, False, ["--requirepass", secret], certs.server_args())
    monkeypatch.setenv("KV_TLS_PW", secret)
    try:
        tls_node, plain_node = single.tls_nodes[0], single.nodes[0]

        def fails(**kw) -> str:
            return open_error(tmp_path / "x", secret, password_env="KV_TLS_PW", timeout=0.5, **kw)

        # The server's certificate is not signed by the CA given.
        msg = fails(nodes=[tls_node], tls_ca=certs.other_ca, username="default")
        assert tls_node in msg and '"default"' in msg, msg
        assert "TLS connection failed" in msg and "UnknownIssuer" in msg, msg
        # A rediss:// node without tls_ca: the system's roots do not know the CA.
        msg = fails(nodes=[f"rediss://{tls_node}"])
        assert tls_node in msg and "rediss://" not in msg, msg
        assert "TLS connection failed" in msg and "UnknownIssuer" in msg, msg
        # Plain TCP to the TLS port.
        msg = fails(nodes=[tls_node])
        assert tls_node in msg and '"default"' in msg, msg
        assert "unreachable (if the port speaks TLS: give tls_ca" in msg, msg
        # TLS to the plain port.
        msg = fails(nodes=[plain_node], tls_ca=certs.ca)
        assert plain_node in msg and "TLS connection failed" in msg, msg
        # Nothing listens on the port: unreachable, not blamed on TLS.
        free = free_ports(1)[0]
        msg = fails(nodes=[f"127.0.0.1:{free}"], tls_ca=certs.ca)
        assert f"127.0.0.1:{free}" in msg and "unreachable" in msg, msg
        assert "TLS" not in msg, msg
        # A wrong password over TLS: an authentication failure, not a TLS one.
        monkeypatch.setenv("KV_TLS_BAD", "wrong-" + secret)
        msg = open_error(
            tmp_path / "x", secret, nodes=[tls_node], password_env="KV_TLS_BAD", tls_ca=certs.ca
        )
        assert tls_node in msg and "authentication failed" in msg and "TLS" not in msg, msg
        # A CA file that is not there.
        msg = fails(nodes=[tls_node], tls_ca=tmp_path / "nope.pem")
        assert "nope.pem" in msg
        # And the right CA with the password works, over TLS only.
        tokens = seq(5, 3 * B)
        remote = kvstore.Remote([tls_node], password_env="KV_TLS_PW", tls_ca=certs.ca)
        with kvstore.open(tmp_path / "ok", LAYOUT, MODEL, durability="none", remote=remote) as s:
            s.put(tokens, kv_for(LAYOUT, tokens))
            s.flush()
            assert remote_stats(s)["blocks_uploaded"] == 3
        assert cmd(single.ports[0], "DBSIZE", password=secret) == 3
    finally:
        single.stop()


# ----------------------------------------------------- deadlines (fake servers)


def _fake_store(path, fake, **remote):
    return kvstore.open(
        path, LAYOUT, MODEL, durability="none", remote=kvstore.Remote(nodes=[fake.node], **remote)
    )


def test_a_name_that_does_not_resolve_fails_open_naming_the_lookup(tmp_path):
    """A node whose name does not resolve (`.invalid` never does): open fails with
    a RemoteError that says so (not a hint about TLS ports). (That it fails within
    the timeout, whether the resolver answers at once or not at all, is measured by
    benches/bench_deadlines.py.)"""
    remote = kvstore.Remote(nodes=["kvstore-test.invalid:6379"], timeout=0.5)
    with pytest.raises(kvstore.RemoteError, match="unreachable: name lookup failed") as e:
        kvstore.open(tmp_path / "s", LAYOUT, MODEL, durability="none", remote=remote)
    assert "TLS" not in str(e.value), e.value
    assert "name lookup failed for kvstore-test.invalid: " in str(e.value), e.value


def test_open_gives_each_node_one_timeout(tmp_path):
    """A node that answers each command only after 0.4 of the timeout: open
    gives up on it once its steps (connect, INFO, CONFIG GET, the key check)
    together pass one timeout, and says so. Each step had a timeout of its own,
    so open took up to five timeouts per node given, and kept a node too slow
    for any call. Here every step answers within the timeout, so only a deadline
    shared by the steps makes open give up; and it gives up while its third
    command (at 0.8 s of the 1.0) is being answered, so the node sees no more."""
    from support.fake_resp import FakeServer

    seen: list[bytes] = []

    def handler(c, a):
        seen.append(a[0].upper())
        time.sleep(0.4)
        return None

    fake = FakeServer(handler)
    try:
        with pytest.raises(kvstore.RemoteError, match="no answer within the timeout"):
            _fake_store(tmp_path / "s", fake, timeout=1.0)
    finally:
        fake.close()
    assert 1 <= len(seen) <= 3, seen


def test_a_trickled_reply_costs_one_timeout(tmp_path):
    """A server that answers a read a byte at a time, each byte well inside the
    timeout: the call gives up when its one deadline passes (counted as a
    timeout, the breaker trips) instead of per socket read, where a lookup took
    37 s at a timeout of 0.5 s and every other thread's reads queued behind it."""
    from support.fake_resp import FakeServer, bulk, trickle

    def handler(c, a):
        if a[0].upper() == b"GETRANGE":
            return trickle(c, bulk(b"x" * 100), 0.05)  # 5 s a reply
        return None

    fake = FakeServer(handler)
    try:
        with _fake_store(tmp_path / "s", fake, timeout=0.3, breaker=LONG_BREAKER) as s:
            assert s.lookup(seq(500, 4 * B)) == 0
            # Per socket read every byte came in time: no timeout would be counted.
            r = remote_stats(s)
            assert r["errors_timeout"] == 1, r
            assert s.lookup(seq(9000, 4 * B)) == 0  # the breaker is open: no wait
            r = remote_stats(s)
            assert r["errors_timeout"] == 1 and r["breaker_skips"] >= 1, r
    finally:
        fake.close()


def test_close_returns_with_a_trickling_server_and_the_put_stays_local(tmp_path):
    """close() returns against a server trickling every reply (the uploader's
    batch once failed only after 30 s or more, and close() waited for it), and
    the local put is durable whatever the server did. (That close returns within
    close_timeout, 10 s, is measured by benches/bench_deadlines.py.)"""
    import threading

    from support.fake_resp import FakeServer, trickle

    def handler(c, a):
        if a[0].upper() in (b"STRLEN", b"SET"):
            return trickle(c, b":0\r\n" if a[0].upper() == b"STRLEN" else b"+OK\r\n", 0.2)
        return None

    fake = FakeServer(handler)
    try:
        s = _fake_store(tmp_path / "s", fake, timeout=0.3)
        tokens = seq(700, 16 * B)
        s.put(tokens, kv_for(LAYOUT, tokens))
        closer = threading.Thread(target=s.close, daemon=True)
        closer.start()
        closer.join(timeout=120)  # only ends a hung close
        assert not closer.is_alive(), "close() hung"
    finally:
        fake.close()
    # The local put is durable whatever the server did.
    with kvstore.open(tmp_path / "s", LAYOUT, MODEL) as s:
        assert s.lookup(tokens) == len(tokens)


def test_open_passes_over_a_node_that_fails_after_connecting(clean, tmp_path):
    """open() moves on to the next node when the first accepts the connection and
    then fails: a node still loading its data (-LOADING) or one that never
    answers. Before, only a refused connection moved on, and -LOADING was
    reported as a permission problem. A permission error still fails at once."""
    from support.fake_resp import FakeServer

    def loading(c, a):
        if a[0].upper() == b"EXISTS":
            return b"-LOADING Redis is loading the dataset in memory\r\n"
        return None

    def frozen(c, a):
        return True  # accepts, reads, never answers

    def noperm(c, a):
        if a[0].upper() == b"EXISTS":
            return b"-NOPERM this user has no permissions to access one of the keys\r\n"
        return None

    handlers = {"loading": loading, "frozen": frozen, "noperm": noperm}
    fakes = {k: FakeServer(h) for k, h in handlers.items()}
    try:
        for k in ("loading", "frozen"):
            remote = kvstore.Remote(nodes=[fakes[k].node, *clean.nodes], timeout=0.3)
            with kvstore.open(tmp_path / k, LAYOUT, MODEL, durability="none", remote=remote) as s:
                assert s.lookup(seq(1, 4 * B)) == 0
                # Served by the real cluster it moved on to.
                nodes = {n["node"] for n in s.remote_nodes()}
                assert nodes == set(clean.nodes), nodes
        msg = open_error(tmp_path / "x", "no-secret", nodes=[fakes["loading"].node], timeout=0.3)
        assert fakes["loading"].node in msg and "loading" in msg.lower(), msg
        assert "may not use" not in msg, msg
        msg = open_error(tmp_path / "y", "no-secret", nodes=[fakes["frozen"].node], timeout=0.3)
        assert "no answer within the timeout" in msg, msg
        msg = open_error(
            tmp_path / "z", "no-secret", nodes=[fakes["noperm"].node, *clean.nodes], timeout=0.3
        )
        assert fakes["noperm"].node in msg and "may not use the keys" in msg, msg
    finally:
        for f in fakes.values():
            f.close()


def test_a_frozen_cluster_costs_each_node_one_timeout(fresh_cluster, tmp_path):
    """Every node frozen: a lookup that times out reads the slot map again only
    within its own deadline, and a node that fails then trips its breaker, so
    each lookup costs at most two timeouts, each node one in all, and the
    breakers make the rest free. Before, each timeout walked every other node (a
    fresh connection and CLUSTER SLOTS, a timeout each, their breakers left
    closed): one lookup took 6 timeouts and twelve took 17."""
    c = fresh_cluster
    timeout = 0.5
    chains = upload_chains(c, tmp_path / "a", 150000, remote={"timeout": timeout})
    remote = {"timeout": timeout, "breaker": LONG_BREAKER}
    with open_host(tmp_path / "b", c, remote=remote) as b:
        for p in c.ports:
            c.kill(p, signal.SIGSTOP)
        try:
            per_lookup, before = [], 0
            for t in chains:
                b.lookup(t)
                now = remote_stats(b)["errors_timeout"]
                per_lookup.append(now - before)
                before = now
            r = remote_stats(b)
        finally:
            for p in c.ports:
                c.kill(p, signal.SIGCONT)
    assert max(per_lookup) <= 2, (per_lookup, r)
    assert sum(per_lookup) <= len(c.ports), (per_lookup, r)
    assert r["breaker_skips"] > 0, r
