"""`Store.block_ids`: the engine's block ids, as BlockPool keys blocks, and `__version__`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore

B = 8
LAYOUT = kvstore.Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=B)


def _open(path: Path, model: str = "m@1", **kw: Any) -> kvstore.Store:
    return kvstore.open(path, layout=LAYOUT, model=model, durability="none", **kw)


def test_one_32_byte_id_per_full_block(tmp_path):
    with _open(tmp_path / "s") as s:
        for n in (0, 1, B - 1, B, B + 1, 5 * B, 5 * B + 3):
            ids = s.block_ids(list(range(n)))
            assert len(ids) == n // B
            assert all(isinstance(i, bytes) and len(i) == 32 for i in ids)
        assert len(set(s.block_ids(list(range(5 * B))))) == 5


def test_equal_prefixes_equal_ids_then_the_chain_diverges(tmp_path):
    a = list(range(4 * B))
    b = a[: 2 * B] + [7] + a[2 * B + 1 :]  # differs in block 2 only
    with _open(tmp_path / "s") as s:
        ia, ib = s.block_ids(a), s.block_ids(b)
        assert ia[:2] == ib[:2]
        # Each id chains its parent: a change in block 2 changes every later id.
        assert ia[2] != ib[2] and ia[3] != ib[3]
        # A prefix's ids are the first ids of the longer sequence.
        assert s.block_ids(a[: 3 * B + 5]) == ia[:3]


def test_token_forms_agree_and_bad_tokens_are_refused(tmp_path):
    tokens = list(range(100, 100 + 3 * B))
    with _open(tmp_path / "s") as s:
        want = s.block_ids(tokens)
        assert s.block_ids(np.array(tokens, dtype=np.int64)) == want
        strided = np.repeat(np.array(tokens, dtype=np.uint32), 2)[::2]
        assert not strided.flags.c_contiguous and s.block_ids(strided) == want
        with pytest.raises(kvstore.InvalidInput, match="got -1"):
            s.block_ids([-1] * B)
        with pytest.raises(kvstore.InvalidInput, match="extra: expected bytes"):
            s.block_ids(tokens, extra=3)  # type: ignore[arg-type]
    with pytest.raises(kvstore.StoreClosed):
        s.block_ids(tokens)


def test_ids_are_stable_across_handles_and_keyed_by_salt_extra_and_model(tmp_path):
    tokens = list(range(2 * B))
    path = tmp_path / "s"
    with _open(path) as s:
        plain = s.block_ids(tokens)
        assert s.block_ids(tokens, extra=b"") == plain  # None and empty are the same key
        with_extra = s.block_ids(tokens, extra="adapter")
        assert s.block_ids(tokens, extra=b"adapter") == with_extra
    with _open(path) as again:
        assert again.block_ids(tokens) == plain
    with _open(path, salt=b"A") as a, _open(path, salt="A") as a2, _open(path, salt=b"B") as b:
        salted_a, salted_b = a.block_ids(tokens), b.block_ids(tokens)
        assert a2.block_ids(tokens) == salted_a
    with _open(tmp_path / "other", model="m@2") as other:
        other_model = other.block_ids(tokens)
    families = [plain, with_extra, salted_a, salted_b, other_model]
    firsts = {ids[0] for ids in families}
    assert len(firsts) == len(families)


def test_ids_name_stored_blocks(tmp_path):
    """The ids are the store's: a put stores its blocks in the index under exactly
    these ids (each record holding its block's tokens), and get finds them by the
    same tokens (a salted handle; another salt's ids name none of them)."""
    from conftest import index_blocks, read_record

    tokens = list(range(3 * B))
    kv = np.arange(LAYOUT.num_layers * 2 * 3 * B * 2 * 16, dtype=np.float16).reshape(
        LAYOUT.kv_shape(3 * B)
    )
    path = tmp_path / "s"
    with _open(path, salt=b"t") as s:
        assert s.put(tokens, kv) == 3 * B
        ids = s.block_ids(tokens)
        assert s.lookup(tokens) == 3 * B
        np.testing.assert_array_equal(s.get(tokens), kv)
    with _open(path, salt=b"u") as other:
        other_ids = other.block_ids(tokens)
    index = index_blocks(path)
    assert set(index) == set(ids) and len(ids) == 3
    for i, bid in enumerate(ids):
        assert read_record(path, index[bid]).tokens == tuple(tokens[i * B : (i + 1) * B])
    assert not set(other_ids) & set(index)


def test_block_pool_keys_blocks_by_the_store_ids(tmp_path):
    torch = pytest.importorskip("torch")
    from kvstore.torch import BlockPool

    layout = kvstore.Layout(2, 2, 16, "bfloat16", block_size=B)
    tokens = list(range(2 * B))
    with kvstore.open(tmp_path / "s", layout=layout, model="m", durability="none") as s:
        s.put(tokens, torch.randn(layout.kv_shape(2 * B)).to(torch.bfloat16))
        pool = BlockPool(layout, 8, device="cpu")
        ids = s.block_ids(tokens)
        assert s.block_ids(torch.tensor(tokens)) == ids
        assert pool.block_keys(s, tokens) == [(None, i) for i in ids]
        assert pool.block_keys(s, tokens, namespace="n") == [("n", i) for i in ids]

        class OtherIds:
            """The same handle, but naming every block differently."""

            layout = s.layout

            def block_ids(self, tokens: Any, extra: Any = None) -> list[bytes]:
                return [i[::-1] for i in s.block_ids(tokens, extra)]

            def __getattr__(self, name: str) -> Any:
                return getattr(s, name)

        first = pool.load(s, tokens)
        with pool.load(s, tokens) as same:  # same ids: the resident blocks are shared
            assert same.blocks == first.blocks
        with pool.load(OtherIds(), tokens) as other:  # type: ignore[arg-type]
            assert other.length == 2 * B and not set(other.blocks) & set(first.blocks)
        first.release()
        with pytest.raises(kvstore.InvalidInput, match="namespace: expected a hashable"):
            pool.load(s, tokens, namespace=[1])


def _project_version(pyproject: Path) -> str:
    """`[project] version` of a pyproject.toml: through tomllib where Python has it
    (3.11+), else read from the `[project]` table's `version = "..."` line, so that
    the check runs on every supported Python."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import re

        project = re.search(r"^\[project\]\n(.*?)(?=^\[)", pyproject.read_text(), re.M | re.S)
        assert project is not None, "no [project] table"
        version = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
        assert version is not None, "no version in [project]"
        return version.group(1)
    with pyproject.open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def test_version_is_the_package_version():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    want = _project_version(pyproject)
    assert kvstore.__version__ == want
    assert kvstore._lib.__version__ == want
