"""Bad input (README, Errors: InvalidInput): typed exceptions whose message
names the expected and the given value, no crash, and nothing written
(blocks_written and the segment bytes unchanged). A closed handle raises
StoreClosed on every method."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_kv_equal, kv_for, segment_bytes_total, seq, small_layout

import kvstore

B = 8
LAYOUT = small_layout("float16", block_size=B)  # [2, 2, T, 2, 16] float16
GOOD_TOKENS = seq(0, 2 * B)


def _good_kv(t=2 * B):
    return kv_for(LAYOUT, seq(0, t))


@pytest.fixture
def s(tmp_path):
    st = kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", durability="none")
    # something already there, so a segment file exists and has a size
    st.put(seq(50_000, 2 * B), kv_for(LAYOUT, seq(50_000, 2 * B)))
    yield st
    st.close()


class Unchanged:
    """Snapshot of what a write would change."""

    def __init__(self, s):
        self.s = s
        self.before = self._snap()

    def _snap(self):
        st = self.s.stats()
        return (
            st["blocks"],
            st["blocks_written"],
            st["bytes_written"],
            st["sessions"],
            segment_bytes_total(self.s.path),
            sorted(self.s.sessions()),
        )

    def check(self):
        assert self._snap() == self.before


def _raises(s, exc, fn, *needles):
    snap = Unchanged(s)
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in message {msg!r}"
    snap.check()
    assert not s.closed
    return e.value


def torch_kv(dtype_name, shape=None):
    import torch

    shape = shape or LAYOUT.kv_shape(2 * B)
    return torch.zeros(shape, dtype=getattr(torch, dtype_name))


# ------------------------------------------------------------------------------- kv dtype


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64, np.int16, np.uint16])
def test_wrong_numpy_dtype(s, np_dtype):
    kv = np.zeros(LAYOUT.kv_shape(2 * B), np_dtype)
    e = _raises(
        s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, kv), "float16", np.dtype(np_dtype).name
    )
    assert isinstance(e, ValueError) and isinstance(e, kvstore.KVStoreError)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int16"])
def test_wrong_torch_dtype(s, name):
    _raises(s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, torch_kv(name)), "float16", name)


def test_wrong_dtype_for_bfloat16_store(tmp_path):
    lay = small_layout("bfloat16", block_size=B)
    with kvstore.open(tmp_path / "b", layout=lay, model="m", durability="none") as s:
        _raises(
            s,
            kvstore.InvalidInput,
            lambda: s.put(GOOD_TOKENS, torch_kv("float16")),
            "bfloat16",
            "float16",
        )
        # numpy has no bfloat16: a float16 numpy array is the wrong dtype
        _raises(
            s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, _good_kv()), "bfloat16", "float16"
        )


def test_kv_not_an_array(s):
    _raises(s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, _good_kv().tolist()), "list")
    _raises(s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, None), "NoneType")
    _raises(s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, b"\0" * 4096), "bytes")


# ------------------------------------------------------------------------------- kv shape


@pytest.mark.parametrize(
    "shape",
    [
        (2, 2, 16, 2, 17),  # D
        (2, 2, 16, 3, 16),  # H
        (3, 2, 16, 2, 16),  # L
        (2, 1, 16, 2, 16),  # K/V axis
        (2, 2, 2, 16, 16),  # T and H swapped
        (2, 2, 16, 32),  # 4-D
        (2, 2, 16, 2, 16, 1),  # 6-D
        (64,),
    ],
)
def test_wrong_shape(s, shape):
    kv = np.zeros(shape, np.float16)
    e = _raises(
        s,
        kvstore.InvalidInput,
        lambda: s.put(GOOD_TOKENS, kv),
        "[2, 2, T, 2, 16]",
        str(list(shape)),
    )
    assert isinstance(e, ValueError)


def test_wrong_shape_torch(s):
    kv = torch_kv("float16", (2, 2, 16, 2, 8))
    _raises(
        s,
        kvstore.InvalidInput,
        lambda: s.put(GOOD_TOKENS, kv),
        "[2, 2, T, 2, 16]",
        "[2, 2, 16, 2, 8]",
    )


def test_kv_shorter_than_full_blocks(s):
    tokens = seq(0, 3 * B + 5)  # 24 tokens of full blocks
    kv = _good_kv(3 * B - 1)  # one token short
    _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, kv), str(3 * B), str(3 * B - 1))
    # a kv of exactly the full-block tokens is enough (the partial block is not stored)
    assert s.put(tokens, _good_kv(3 * B)) == 3 * B


def test_kv_shorter_in_save_session(s):
    """A session binds all its tokens and stores the full blocks its KV covers (a cache
    after generate() lacks the last token); a KV of the wrong shape still writes nothing."""
    tokens = seq(0, 4 * B)
    assert s.save_session("x", tokens, _good_kv(2 * B)) == 2 * B
    assert list(s.session_tokens("x")) == list(tokens)
    assert s.lookup(tokens) == 2 * B
    _raises(
        s,
        kvstore.InvalidInput,
        lambda: s.save_session("y", tokens, _good_kv(2 * B)[:, :1]),
        "2, T",
        "1,",
    )
    assert "y" not in s.sessions()


# ------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize(
    "tokens,given",
    [
        ([-1] + seq(0, 15), "-1"),
        (seq(0, 15) + [2**32], "4294967296"),
        (np.array(seq(0, 15) + [-5], np.int64), "-5"),
        (np.array(seq(0, 15) + [2**40], np.int64), str(2**40)),
        (np.array(seq(0, 15) + [2**63], np.uint64), str(2**63)),
    ],
)
def test_token_out_of_u32_range(s, tokens, given):
    e = _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, _good_kv()), "4294967295", given)
    assert isinstance(e, ValueError)
    # the same checks guard reads
    _raises(s, kvstore.InvalidInput, lambda: s.lookup(tokens), given)
    _raises(s, kvstore.InvalidInput, lambda: s.get(tokens), given)


def test_token_far_out_of_range(s):
    """A Python int beyond int64 is still a typed error naming the value."""
    tokens = seq(0, 15) + [2**64]
    _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, _good_kv()), str(2**64))


def test_u32_max_is_fine(s):
    tokens = seq(0, 15) + [2**32 - 1]
    assert s.put(tokens, _good_kv()) == 16
    assert s.lookup(tokens) == 16


def test_token_torch_out_of_range(s):
    import torch

    tokens = torch.tensor(seq(0, 15) + [-3])
    _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, _good_kv()), "-3")


@pytest.mark.parametrize(
    "tokens,given",
    [
        ([0.5] * 16, "float64"),
        (np.arange(16, dtype=np.float32), "float32"),
        (["a"] * 16, "<U1"),
        ([True] * 16, "bool"),
    ],
)
def test_non_integer_tokens(s, tokens, given):
    _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, _good_kv()), "integer", given)


def test_float_torch_tokens(s):
    import torch

    _raises(
        s,
        kvstore.InvalidInput,
        lambda: s.put(torch.arange(16, dtype=torch.float32), _good_kv()),
        "integer",
        "float32",
    )


def test_two_dimensional_tokens(s):
    tokens = np.arange(16).reshape(2, 8)
    _raises(s, kvstore.InvalidInput, lambda: s.put(tokens, _good_kv()), "1-D", "(2, 8)")
    _raises(s, kvstore.InvalidInput, lambda: s.get(tokens), "1-D", "(2, 8)")
    _raises(s, kvstore.InvalidInput, lambda: s.put(5, _good_kv()), "1-D", "()")


def test_ragged_tokens(s):
    _raises(s, kvstore.InvalidInput, lambda: s.put([[1, 2], [3]], _good_kv()))


# ------------------------------------------------------------------------ other arguments


def test_bad_extra(s):
    _raises(
        s, kvstore.InvalidInput, lambda: s.put(GOOD_TOKENS, _good_kv(), extra=5), "bytes", "int"
    )


def test_bad_session_name(s):
    _raises(
        s, kvstore.InvalidInput, lambda: s.save_session(7, GOOD_TOKENS, _good_kv()), "str", "int"
    )
    _raises(s, kvstore.InvalidInput, lambda: s.save_session("", GOOD_TOKENS, _good_kv()), "0 bytes")
    _raises(
        s, kvstore.InvalidInput, lambda: s.save_session("x" * 401, GOOD_TOKENS, _good_kv()), "401"
    )
    # A lone surrogate: no UTF-8 for it (it raised UnicodeEncodeError, untyped).
    _raises(
        s, kvstore.InvalidInput, lambda: s.save_session("\ud800", GOOD_TOKENS, _good_kv()), "UTF-8"
    )
    _raises(s, kvstore.InvalidInput, lambda: s.load_session("\ud800"), "UTF-8")


def test_bad_out(s):
    s.put(GOOD_TOKENS, _good_kv())
    bad = [
        (np.zeros(LAYOUT.kv_shape(16), np.float32), ("float16", "float32")),
        (np.zeros((2, 2, 16, 2, 8), np.float16), ("[2, 2, T, 2, 16]", "[2, 2, 16, 2, 8]")),
        (np.zeros(LAYOUT.kv_shape(16), np.float16)[:, :, ::2], ("contiguous",)),
        (torch_kv("bfloat16", LAYOUT.kv_shape(16)), ("float16", "bfloat16")),
    ]
    ro = np.zeros(LAYOUT.kv_shape(16), np.float16)
    ro.flags.writeable = False
    bad.append((ro, ("writable",)))
    for out, needles in bad:
        _raises(s, kvstore.InvalidInput, lambda out=out: s.get(GOOD_TOKENS, out=out), *needles)
    assert not ro.any()


def test_bad_open_arguments(tmp_path):
    p = tmp_path / "x"
    with pytest.raises(kvstore.InvalidInput, match="durability.*sometimes"):
        kvstore.open(p, layout=LAYOUT, model="m", durability="sometimes")
    with pytest.raises(kvstore.InvalidInput, match="compression.*lz4"):
        kvstore.open(p, layout=LAYOUT, model="m", compression="lz4")
    with pytest.raises(kvstore.InvalidInput, match="model"):
        kvstore.open(p, layout=LAYOUT, model="")
    with pytest.raises(kvstore.InvalidInput):
        kvstore.open(p, layout=LAYOUT)  # model missing
    with pytest.raises(kvstore.InvalidInput, match="disk_bytes"):
        kvstore.open(p, layout=LAYOUT, model="m", disk_bytes=-1)
    with pytest.raises(kvstore.InvalidInput, match="salt"):
        kvstore.open(p, layout=LAYOUT, model="m", salt=12)
    with pytest.raises(kvstore.InvalidInput, match="no kvstore|no store"):
        kvstore.open(tmp_path / "missing")  # opening as the MANIFEST says, but there is none
    assert not (p / "MANIFEST").exists()


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=-1), "num_kv_heads"),
        (dict(head_dim=1.5), "head_dim"),
        (dict(block_size=True), "block_size"),
        (dict(dtype="int8"), "int8"),
    ],
)
def test_bad_layout(kw, needle):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=8)
    with pytest.raises(kvstore.InvalidInput, match=needle):
        kvstore.Layout(**{**args, **kw})


def test_disk_bytes_limit(tmp_path):
    """Past disk_bytes a put first evicts unpinned older blocks; a put that cannot fit
    even so raises StoreFull. Pinned blocks stay, nothing returned is wrong, and the
    segment files stay within the limit."""
    limit = 16 * 1024
    with kvstore.open(
        tmp_path / "s", layout=LAYOUT, model="m", durability="none", disk_bytes=limit
    ) as s:
        first = seq(0, 2 * B)
        s.put(first, kv_for(LAYOUT, first))
        s.pin(first, priority=1)
        big = seq(10_000, 20 * B)
        with pytest.raises(kvstore.StoreFull):
            s.put(big, kv_for(LAYOUT, big))
        assert s.stats()["disk_bytes"] <= limit
        assert_kv_equal(s.get(first), kv_for(LAYOUT, first))
        got = s.get(big)
        assert_kv_equal(got, kv_for(LAYOUT, big)[:, :, : got.shape[2]])


# --------------------------------------------------------------------------- closed store


def _every_method(s):
    kv = _good_kv()
    out = np.zeros(LAYOUT.kv_shape(16), np.float16)
    return {
        "put": lambda: s.put(GOOD_TOKENS, kv),
        "lookup": lambda: s.lookup(GOOD_TOKENS),
        "get": lambda: s.get(GOOD_TOKENS),
        "get_out": lambda: s.get(GOOD_TOKENS, out=out),
        "save_session": lambda: s.save_session("n", GOOD_TOKENS, kv),
        "load_session": lambda: s.load_session("n"),
        "sessions": lambda: s.sessions(),
        "delete_session": lambda: s.delete_session("n"),
        "flush": lambda: s.flush(),
        "stats": lambda: s.stats(),
        "segments": lambda: s.segments(),
        "verify": lambda: s.verify(),
        "compact": lambda: s.compact(),
        "gc": lambda: s.gc(max_bytes=1),
        "manifest": lambda: s.manifest(),
        "durability": lambda: s.durability,
    }


def test_closed_store_raises_store_closed(tmp_path):
    path = tmp_path / "s"
    s = kvstore.open(path, layout=LAYOUT, model="m", durability="batch")
    s.put(GOOD_TOKENS, _good_kv())
    s.save_session("n", GOOD_TOKENS, _good_kv())
    s.close()
    assert s.closed
    size = segment_bytes_total(path)
    for name, call in _every_method(s).items():
        with pytest.raises(kvstore.StoreClosed) as e:
            call()
        assert isinstance(e.value, kvstore.KVStoreError), name
        assert "closed" in str(e.value), (name, str(e.value))
    s.close()  # twice is fine
    s.close()
    assert segment_bytes_total(path) == size
    assert "closed" in repr(s)
    # and the data is intact for the next handle
    with kvstore.open(path, layout=LAYOUT, model="m") as s2:
        assert s2.lookup(GOOD_TOKENS) == 16
        assert s2.sessions() == ["n"]


def test_context_manager_closes(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", durability="none") as s:
        pass
    assert s.closed
    with pytest.raises(kvstore.StoreClosed):
        s.lookup(GOOD_TOKENS)


@pytest.mark.parametrize("durability", ["batch", "sync", "none"])
def test_close_while_other_threads_work(tmp_path, durability):
    """Closing a handle while other threads use it: each call either completes or
    raises StoreClosed (nothing else, no crash), and every put that returned is
    in the store afterwards (close commits what it let through)."""
    import threading
    import time

    s = kvstore.open(
        tmp_path / "s", layout=LAYOUT, model="m", durability=durability, batch_window_ms=50
    )
    errors = []
    stored: list[list[int]] = []

    def work(k):
        i = 0
        while True:
            toks = seq(100_000 * k + 16 * i, 2 * B)
            try:
                s.put(toks, kv_for(LAYOUT, toks))
                stored.append(toks)
                got = s.get(toks)
                assert_kv_equal(got, kv_for(LAYOUT, toks)[:, :, : got.shape[2]])
            except kvstore.StoreClosed:
                return
            except BaseException as e:
                errors.append(e)
                return
            i += 1

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    s.close()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert stored
    with kvstore.open(tmp_path / "s", layout=LAYOUT, model="m", durability="none") as v:
        lost = [t[0] for t in stored if v.lookup(t) != 2 * B]
        assert not lost, f"{len(lost)} of {len(stored)} returned puts lost by close()"
        for toks in stored[-20:]:
            assert_kv_equal(v.get(toks), kv_for(LAYOUT, toks))
        assert v.verify()["damaged"] == []


def test_odd_values_are_invalid_input_not_other_exceptions(tmp_path, s):
    """Each raised TypeError, OverflowError or UnicodeEncodeError, outside kvstore's
    exception tree (a review of the binding's edges)."""
    torch = pytest.importorskip("torch")
    calls = {
        "bfloat16 token ids": lambda: s.lookup(torch.arange(16, dtype=torch.bfloat16)),
        "complex token ids": lambda: s.lookup(torch.zeros(16, dtype=torch.complex64).conj()),
        "extra with a lone surrogate": lambda: s.lookup(GOOD_TOKENS, extra="\ud800"),
        "a negative hot slot": lambda: s.hot_unchanged([(-1, 0)]),
        "a hot slot past 2**64": lambda: s.hot_unchanged([(2**64, 0)]),
        "a negative counter": lambda: s.add_counters({"a": -1}),
        "a counter past 2**64": lambda: s.add_counters({"a": 2**64}),
        "a counter named by an int": lambda: s.add_counters({1: 1}),
        "a float counter": lambda: s.add_counters({"a": 1.9}),
        "a model with a lone surrogate": lambda: kvstore.open(
            tmp_path / "m", layout=LAYOUT, model="m\ud800"
        ),
        "durability 3": lambda: kvstore.open(
            tmp_path / "d", layout=LAYOUT, model="m", durability=3
        ),
    }
    for what, call in calls.items():
        with pytest.raises(kvstore.InvalidInput):
            call()
        assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists(), what


POOL_AFTER_FORK = """
import os, sys
import kvstore
from kvstore import store
from conftest import kv_for, seq, small_layout
layout = small_layout()
path = sys.argv[1]
with kvstore.open(path, layout=layout, model="m") as s:
    s.put(seq(0, 32), kv_for(layout, seq(0, 32)))
store._RESULTS._lock.acquire()  # another thread taking a result buffer, as the fork lands
pid = os.fork()
if pid == 0:
    with kvstore.open(path, layout=layout, model="m") as s:  # a handle of its own
        os._exit(0 if s.get(seq(0, 32)).shape[2] == 32 else 3)
store._RESULTS._lock.release()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_the_result_pool_is_locked_can_get(tmp_path):
    """The result pool's lock is held while a buffer is taken: a child forked then
    inherited it held, and its first get waited for ever (20 of 20 in a review)."""
    from conftest import run_child

    assert run_child(POOL_AFTER_FORK, tmp_path / "s", timeout=60).stdout.strip() == "0"
