"""Model-based test (hypothesis.stateful): random sequences of put / get / lookup /
sessions / pin / unpin / flush / close+reopen / gc / compact on a real store, checked
after every step against a plain-Python model of what the API promises.

The model knows, per block (keyed by extra + the token ids of its whole prefix):
- whether it is stored: yes, no, or "maybe" (after a gc whose choice of victims
  depends on last-use times, or a block that may live only in the hot tier);
- which bytes it may hold: the KV of the first put that stored it (`kv_for` with a
  seed: a later put of the same tokens with another seed must not change them);
- whether it is pinned (yes, no, maybe).
A read must be consistent with the model (no block the model says is absent, none
missing that it says is stored, bytes bit-exact), and then narrows the "maybe"s.

Tokens come from a three-letter alphabet with block_size 4, so prefixes overlap
and blocks dedupe all the time.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from conftest import kv_for, raw_bytes, small_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore

B = 4
MAX_LEN = 24
MODEL = "model-test@1"
TOKENS = st.integers(0, 2)
# Three fixed "conversations" sharing their first block (a system prompt): sequences are
# cuts of them plus a random tail, so prefixes overlap and blocks dedupe all the time.
BASES = (
    (0, 1, 2, 0, 1, 1, 2, 2, 0, 0, 1, 2, 2, 1, 0, 0, 2, 1, 1, 0, 2, 0, 1, 2),
    (0, 1, 2, 0, 2, 2, 1, 0, 0, 1, 1, 1, 2, 0, 2, 1, 0, 2, 2, 2, 1, 0, 0, 1),
    (0, 1, 2, 0, 1, 1, 2, 2, 1, 0, 2, 0, 0, 2, 1, 1, 2, 2, 0, 1, 0, 1, 1, 0),
)
SEQS = st.builds(
    lambda base, n, tail: (BASES[base][:n] + tuple(tail))[:MAX_LEN],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 24),
    st.lists(TOKENS, max_size=6),
)
NAMES = st.sampled_from(["a", "b", "c", "sess-ü"])
EXTRAS = st.sampled_from([None, "adapter"])


@dataclass
class Block:
    present: bool | None  # True: stored; None: maybe (False is "not in the dict")
    seeds: set[int] = field(default_factory=set)  # the KV seeds its bytes may come from


Key = tuple[bytes, tuple[int, ...]]


def torch_like():
    import torch

    return torch.empty(0)


def full(n: int) -> int:
    return n // B * B


def keys_of(tokens: tuple[int, ...], extra: str | None) -> list[Key]:
    ex = (extra or "").encode()
    return [(ex, tokens[: (i + 1) * B]) for i in range(len(tokens) // B)]


@lru_cache(maxsize=8192)
def expected(layout: kvstore.Layout, kind: str, prefix: tuple[int, ...], seed: int) -> bytes:
    """Bytes of the last block of `prefix` as put with `seed`."""
    kv = kv_for(layout, prefix, seed=seed, kind=kind)
    return np.ascontiguousarray(kv[:, :, -B:]).tobytes()


class StoreMachine(RuleBasedStateMachine):
    """One handle on a fresh store; subclasses choose layout and open options."""

    LAYOUT = small_layout("float16", block_size=B)  # 1 KiB blocks
    KIND = "random"  # kv_for kind: "lowent" compresses
    OPEN: dict = {"durability": "none"}
    HOT = False
    base: Path | None = None

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(dir=self.base))
        self.path = self.dir / "s"
        self.blocks: dict[Key, Block] = {}
        self.pins: dict[Key, bool | None] = {}  # True pinned, None maybe
        self.sessions: dict[str, tuple[int, ...]] = {}
        self.pinned: list[tuple[tuple[int, ...], str | None]] = []  # for unpin to pick
        self.store = self._open()

    # -- helpers -----------------------------------------------------------------------

    def _open(self) -> kvstore.Store:
        kw = dict(self.OPEN)
        if self.HOT:
            kw["hot_dir"] = self.dir
        return kvstore.open(self.path, layout=self.LAYOUT, model=MODEL, **kw)

    def expected(self, prefix: tuple[int, ...], seed: int) -> bytes:
        return expected(self.LAYOUT, self.KIND, prefix, seed)

    def kv(self, tokens: tuple[int, ...], seed: int, total: int, contiguous: bool = True):
        kv = kv_for(self.LAYOUT, tokens, seed=seed, total=total, kind=self.KIND)
        if not contiguous:  # same values, negative stride along T
            kv = np.flip(np.flip(kv, 2).copy(), 2)
            assert kv.shape[2] < 2 or not kv.flags.c_contiguous
        return kv

    def stored(self, key: Key) -> bool | None:
        b = self.blocks.get(key)
        return False if b is None else b.present

    def record_put(self, keys: list[Key], seed: int) -> tuple[int, int]:
        """Model of a put of these blocks; returns (fewest, most) blocks it may write."""
        lo = hi = 0
        for k in keys:
            b = self.blocks.get(k)
            if b is None:
                self.blocks[k] = Block(True, {seed})
                lo, hi = lo + 1, hi + 1
            elif b.present is None:
                # Maybe still stored (then kept), maybe not (then written with `seed`).
                b.present = True
                b.seeds.add(seed)
                hi += 1
        return lo, hi

    def observe(
        self, tokens: tuple[int, ...], extra: str | None, m: int, what: str, disk: bool = False
    ) -> None:
        """Checks a stored-prefix length `m` against the model, then narrows it.
        `disk`: `m` counts blocks on disk only (pin), not those only in the hot tier."""
        keys = keys_of(tokens, extra)
        assert m % B == 0 and 0 <= m <= len(keys) * B, f"{what}: {m} of {len(tokens)} tokens"
        k = m // B
        for i in range(k):
            assert self.stored(keys[i]) is not False, (
                f"{what}: block {i} of {tokens} found, but it was never stored or was evicted"
            )
        if k < len(keys):
            assert self.stored(keys[k]) is not True, f"{what}: block {k} of {tokens} was lost"
        if not self.HOT:  # with a hot tier a hit may come from memory only: stays maybe
            for i in range(k):
                self.blocks[keys[i]].present = True
        if k < len(keys) and self.stored(keys[k]) is None and not (disk and self.HOT):
            del self.blocks[keys[k]]  # a miss is a miss in both tiers

    def check_bytes(
        self, tokens: tuple[int, ...], extra: str | None, got, m: int, what: str
    ) -> None:
        """Every block of `got` (the KV of the first m tokens) is bytes put for it."""
        for i, key in enumerate(keys_of(tokens, extra)[: m // B]):
            block = raw_bytes(got[:, :, i * B : (i + 1) * B])
            match = [s for s in sorted(self.blocks[key].seeds) if self.expected(key[1], s) == block]
            assert match, f"{what}: block {i} of {tokens}: bytes are not what was put"
            if not self.HOT:
                self.blocks[key].seeds = {match[0]}

    def live_counts(self) -> tuple[int, int]:
        certain = sum(1 for b in self.blocks.values() if b.present is True)
        maybe = sum(1 for b in self.blocks.values() if b.present is None)
        return certain, maybe

    # -- blocks ------------------------------------------------------------------------

    @rule(
        t=SEQS,
        seed=st.sampled_from([0, 1]),
        extra=EXTRAS,
        pad=st.integers(0, B + 1),
        contiguous=st.booleans(),
    )
    def put(self, t, seed, extra, pad, contiguous):
        before = self.store.stats()
        n = self.store.put(t, self.kv(t, seed, full(len(t)) + pad, contiguous), extra=extra)
        assert n == full(len(t))
        lo, hi = self.record_put(keys_of(t, extra), seed)
        after = self.store.stats()
        wrote = after["blocks_written"] - before["blocks_written"]
        deduped = after["blocks_deduped"] - before["blocks_deduped"]
        assert wrote + deduped == len(t) // B
        assert lo <= wrote <= hi, f"put wrote {wrote} blocks, the model expects {lo}..{hi}"

    @rule(t=SEQS, extra=EXTRAS)
    def lookup(self, t, extra):
        self.observe(t, extra, self.store.lookup(t, extra=extra), "lookup")

    @rule(
        t=SEQS,
        extra=EXTRAS,
        how=st.sampled_from(["numpy", "torch", "out"]),
        spare=st.integers(-B - 1, B + 1),
    )
    def get(self, t, extra, how, spare):
        if how == "out":
            cap = max(0, len(t) + spare)
            out = np.full(self.LAYOUT.kv_shape(cap), np.float16(-7.0))
            m = self.store.get(t, out=out, extra=extra)
            # `out` holds at most `cap` tokens: the answer is the stored prefix of t[:cap]
            self.observe(t[:cap], extra, m, "get(out=)")
            self.check_bytes(t, extra, out[:, :, :m], m, "get(out=)")
            return
        got = self.store.get(t, extra=extra, like=torch_like() if how == "torch" else None)
        m = got.shape[2]
        assert tuple(got.shape) == self.LAYOUT.kv_shape(m)
        self.observe(t, extra, m, "get")
        self.check_bytes(t, extra, got, m, "get")

    # -- sessions ----------------------------------------------------------------------

    @rule(name=NAMES, t=SEQS, seed=st.sampled_from([0, 1]), cover=st.integers(0, MAX_LEN + B))
    def save_session(self, name, t, seed, cover):
        n = self.store.save_session(name, t, self.kv(t, seed, cover))
        assert n == full(min(len(t), cover))
        self.record_put(keys_of(t[:n], None), seed)
        self.sessions[name] = t

    @rule(name=NAMES, how=st.sampled_from(["numpy", "torch", "tokens"]))
    def load_session(self, name, how):
        if name not in self.sessions:
            with pytest.raises(kvstore.SessionNotFound):
                if how == "tokens":
                    self.store.session_tokens(name)
                else:
                    self.store.load_session(name)
            return
        t = self.sessions[name]
        if how == "tokens":
            got = self.store.session_tokens(name)
            assert got.dtype == np.int64 and got.tolist() == list(t)
            return
        toks, kv = self.store.load_session(name, like=torch_like() if how == "torch" else None)
        assert [int(x) for x in toks] == list(t)
        self.observe(t, None, kv.shape[2], "load_session")
        self.check_bytes(t, None, kv, kv.shape[2], "load_session")

    @rule(name=NAMES)
    def delete_session(self, name):
        assert self.store.delete_session(name) is (name in self.sessions)
        self.sessions.pop(name, None)

    # -- pins --------------------------------------------------------------------------

    @rule(
        t=SEQS,
        extra=EXTRAS,
        priority=st.integers(1, 5),
        ttl=st.sampled_from([None, 1e6]),
    )
    def pin(self, t, extra, priority, ttl):
        keys = keys_of(t, extra)
        try:
            m = self.store.pin(t, priority=priority, ttl=ttl, extra=extra)
        except kvstore.StoreFull:
            assert self.HOT, "StoreFull from pin without a hot tier"
            # A refused pin should pin nothing new; the model asks no more than that
            # the blocks of the stored prefix are pinned or not, and pins stay pins.
            for k in keys:
                if self.stored(k) is False:
                    break
                if self.pins.get(k) is not True:
                    self.pins[k] = None
            return
        # pin returns the prefix stored on disk (a block only in memory is not pinned)
        self.observe(t, extra, m, "pin", disk=True)
        for k in keys[: m // B]:
            self.blocks[k].present = True
            self.pins[k] = True
        if m:
            self.pinned.append((t, extra))

    @rule(t=SEQS, extra=EXTRAS, data=st.data())
    def unpin(self, t, extra, data):
        if self.pinned and data.draw(st.booleans(), label="a pinned sequence"):
            t, extra = data.draw(st.sampled_from(self.pinned), label="pinned")
        assert self.store.unpin(t, extra=extra) == full(len(t))
        for k in keys_of(t, extra):
            self.pins.pop(k, None)

    # -- maintenance -------------------------------------------------------------------

    @rule(what=st.sampled_from(["flush", "reopen", "compact"]))
    def maintain(self, what):
        if what == "flush":
            self.store.flush()
            assert self.store.stats()["pending_blocks"] == 0
        elif what == "reopen":
            self.store.close()
            assert self.store.closed
            with pytest.raises(kvstore.StoreClosed):
                self.store.lookup((0,) * B)
            self.store = self._open()
        else:
            r = self.store.compact()
            assert r["records_dropped"] == 0, r

    @rule(how=st.sampled_from(["all", "some", "none"]), frac=st.floats(0.0, 1.0))
    def gc(self, how, frac):
        unpinned = [k for k in self.blocks if self.pins.get(k) is not True]
        if how == "none":
            r = self.store.gc(older_than=1e6)
            assert r["blocks_evicted"] == 0, r
            r = self.store.gc(max_bytes=1 << 60)
            assert r["blocks_evicted"] == 0, r
        elif how == "some":
            r = self.store.gc(max_bytes=int(self.store.stats()["live_bytes"] * frac))
            # Which blocks go depends on last-use times: every unpinned block is "maybe".
            assert r["blocks_evicted"] <= len(unpinned), (r, len(unpinned))
            for k in unpinned:
                self.blocks[k].present = None
        else:  # everything not pinned goes
            certain = [k for k in unpinned if self.stored(k) is True and k not in self.pins]
            r = self.store.gc(max_bytes=0)
            assert len(certain) <= r["blocks_evicted"] <= len(unpinned), (r, certain, unpinned)
            for k in unpinned:
                if k in self.pins or self.HOT:  # maybe pinned; or lingering in the hot tier
                    self.blocks[k].present = None
                else:
                    del self.blocks[k]

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def sessions_match(self):
        assert sorted(self.store.sessions()) == sorted(self.sessions)
        assert self.store.session_sizes() == {n: len(t) for n, t in self.sessions.items()}

    @invariant()
    def block_count_matches(self):
        s = self.store.stats()
        certain, maybe = self.live_counts()
        n = s["blocks"] + s["pending_blocks"]
        assert certain <= n <= certain + maybe, (s["blocks"], s["pending_blocks"], certain, maybe)
        assert s["sessions"] == len(self.sessions)
        assert s["damaged_blocks"] == 0

    def teardown(self):
        try:
            if not self.store.closed:
                v = self.store.verify()
                assert v["damaged"] == [] and v["problems"] == [], v
                self.store.close()
            if self.HOT:
                kvstore.remove_arena(self.path, hot_dir=self.dir)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class SyncSaltedMachine(StoreMachine):
    """durability="sync", a tenant salt, zstd: every put durable before it returns."""

    OPEN = {"durability": "sync", "salt": b"tenant-1", "compression": "zstd"}
    KIND = "lowent"


class HotMachine(StoreMachine):
    """A hot tier of 8 slots (128 KiB blocks in a 4 MiB arena): blocks are evicted from
    memory all the time, pins compete for slots (StoreFull), and gc leaves blocks that
    may still be served from memory."""

    LAYOUT = small_layout("float16", block_size=B, H=4, D=1024)
    # A long window: stats() reads `blocks` and `pending_blocks` at two moments, so a
    # group commit from the background flusher in between would undercount.
    OPEN = {"durability": "batch", "hot_bytes": 4 << 20, "batch_window_ms": 60_000}
    HOT = True

    @initialize()
    def small_arena(self):
        st_ = self.store.stats()
        assert st_["hot_slots"] == 8, st_["hot_slots"]

    @rule(t=SEQS, extra=EXTRAS)
    def read_arena_directly(self, t, extra):
        """The zero-copy path: bytes read from the arena mapping, confirmed by
        hot_unchanged, are bytes that were put for that block."""
        from kvstore.torch import arena_view

        view = arena_view(self.store)
        size = self.LAYOUT.block_bytes
        for key, hot in zip(keys_of(t, extra), self.store.hot_blocks(t, extra=extra), strict=True):
            if hot is None:
                continue
            slot, version, offset = hot
            data = view[offset : offset + size].numpy().tobytes()
            if not self.store.hot_unchanged([(slot, version)])[0]:
                continue
            assert self.stored(key) is not False, f"{key[1]} is hot but was never stored"
            seeds = self.blocks[key].seeds
            assert any(self.expected(key[1], s) == data for s in seeds), key[1]


# A shrunk failure replays without a database; keep the repository free of .hypothesis/.
COMMON = dict(
    deadline=None,
    stateful_step_count=30,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize(
    "machine,examples",
    [(StoreMachine, 100), (SyncSaltedMachine, 50), (HotMachine, 50)],
    ids=["none", "sync-salted-zstd", "hot-tier"],
)
def test_store_matches_model(tmp_path, machine, examples):
    machine.base = tmp_path
    try:
        run_state_machine_as_test(machine, settings=settings(max_examples=examples, **COMMON))
    finally:
        machine.base = None
