"""The exception tree (README, Errors): importable from `kvstore`, rooted at
KVStoreError, picklable (also when raised by the engine), with the builtin bases
users catch (InvalidInput is a ValueError, SessionNotFound a KeyError)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from conftest import seq, small_layout

import kvstore

NAMES = [
    "KVStoreError",
    "LayoutMismatch",
    "InvalidInput",
    "StoreFull",
    "StoreClosed",
    "StoreLocked",
    "CorruptStore",
    "SessionNotFound",
    "StoreIOError",
]


@pytest.mark.parametrize("name", NAMES)
def test_importable_and_rooted(name):
    cls = getattr(kvstore, name)
    assert issubclass(cls, kvstore.KVStoreError)
    assert issubclass(cls, Exception)
    assert name in kvstore.__all__
    from kvstore import errors

    assert getattr(errors, name) is cls


@pytest.mark.parametrize("name", NAMES)
def test_pickle_round_trip(name):
    cls = getattr(kvstore, name)
    e = cls(f"something about {name}: expected 1, got 2")
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(e, protocol=proto))
        assert type(back) is cls
        assert str(back) == str(e)
        assert back.args == e.args


def test_builtin_bases():
    assert issubclass(kvstore.InvalidInput, ValueError)
    assert issubclass(kvstore.SessionNotFound, KeyError)
    # KeyError's quoting is not applied to the message
    assert str(kvstore.SessionNotFound("no session 'x'")) == "no session 'x'"


def test_session_not_found(tmp_path):
    with kvstore.open(tmp_path / "s", layout=small_layout(), model="m", durability="none") as s:
        with pytest.raises(kvstore.SessionNotFound) as e:
            s.load_session("nobody")
        assert "nobody" in str(e.value)
        with pytest.raises(KeyError):
            s.load_session("nobody")
        with pytest.raises(kvstore.KVStoreError):
            s.load_session("nobody")
        back = pickle.loads(pickle.dumps(e.value))
        assert type(back) is kvstore.SessionNotFound and str(back) == str(e.value)
        assert s.delete_session("nobody") is False


def test_engine_errors_pickle(tmp_path):
    """Exceptions raised from the Rust engine are the same picklable classes."""
    layout = small_layout()
    path = tmp_path / "s"
    with (
        kvstore.open(path, layout=layout, model="m", durability="none") as s,
        pytest.raises(kvstore.InvalidInput) as bad,
    ):
        s.put(seq(0, 16), np.zeros(layout.kv_shape(4), "float16"))
    caught = [bad.value]
    with pytest.raises(kvstore.LayoutMismatch) as e:
        kvstore.open(path, layout=layout, model="other")
    caught.append(e.value)
    s = kvstore.open(path, layout=layout, model="m")
    s.close()
    with pytest.raises(kvstore.StoreClosed) as e:
        s.stats()
    caught.append(e.value)
    for exc in caught:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)


def test_exceptions_cross_processes(tmp_path):
    """An exception raised in a worker process arrives intact (multiprocessing
    pickles it)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    ) as ex:
        fut = ex.submit(_raise_in_child, str(tmp_path / "s"))
        with pytest.raises(kvstore.SessionNotFound, match="ghost"):
            fut.result(timeout=120)


def _raise_in_child(path):
    from conftest import small_layout

    import kvstore

    with kvstore.open(path, layout=small_layout(), model="m", durability="none") as s:
        s.load_session("ghost")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("op", ["gc", "verify", "rebuild_index"])
def test_progress_callback_exception_is_raised_after_the_work(tmp_path, op):
    """A progress callback that raises (Ctrl-C in the CLI) is not swallowed: the
    work, which cannot stop half way, completes, then the exception is raised."""
    from conftest import kv_for

    layout = small_layout()
    path = tmp_path / "s"
    calls = []

    def progress(done, total):
        calls.append(done)
        raise _Stop(f"{done}/{total}")

    seqs = [seq(1000 * i, 64) for i in range(8)]
    with kvstore.open(path, layout=layout, model="m", durability="sync") as s:
        for t in seqs:
            s.put(t, kv_for(layout, t))
        live = s.stats()["live_bytes"]
    # closed: its segment is sealed, so gc's compaction rewrites it
    with pytest.raises(_Stop):
        if op == "rebuild_index":
            kvstore.rebuild_index(path, progress=progress)
        else:
            with kvstore.open(path) as s:
                if op == "gc":
                    s.gc(max_bytes=live // 2, progress=progress)
                else:
                    s.verify(progress=progress)
    assert len(calls) == 1, "the callback is not called again once it raised"
    with kvstore.open(path) as s:
        assert s.verify()["damaged"] == []
        kept = [t for t in seqs if s.lookup(t) == 64]
        assert len(kept) == (4 if op == "gc" else 8), "the work was done in full"
        for t in kept:
            np.testing.assert_array_equal(s.get(t), kv_for(layout, t))
