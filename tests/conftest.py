"""Shared helpers of the kvstore test suite.

Everything here is importable from child processes too (`run_child` puts this
directory on `sys.path`, so a child does `from conftest import kv_for`). Keep
torch out of module level: children that only need numpy start fast.

Deterministic KV: `kv_for(layout, tokens)` derives the KV of each position from
a rolling hash of the token prefix up to it, so
- two sequences that share a prefix have bitwise the same KV over it (what a
  content-addressed store must dedupe), and
- any process can recompute the exact expected bytes of any prefix.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore

TESTS_DIR = Path(__file__).resolve().parent
U32_MAX = 2**32 - 1

# ---------------------------------------------------------------------------------- layouts


def small_layout(dtype: str = "float16", block_size: int = 8, L: int = 2, H: int = 2, D: int = 16):
    """A layout whose blocks are a few KiB (2 KiB for the defaults)."""
    return kvstore.Layout(
        num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, block_size=block_size
    )


def pytest_sessionstart(session):
    """With `KVSTORE_REQUIRE` (tests/support/require.py, set by scripts/test.sh) a
    required component that is missing ends the run before any test, naming it: a run
    that would skip its remote, TLS or vLLM tests cannot pass as green."""
    from support import require

    try:
        gone = require.missing_required()
    except ValueError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR)
    if gone:
        pytest.exit(
            "KVSTORE_REQUIRE: required and missing: " + "; ".join(gone),
            returncode=pytest.ExitCode.TESTS_FAILED,
        )


@pytest.fixture(scope="session", autouse=True)
def session_hot_dir():
    """Every arena a test makes without its own `hot_dir` lands in one directory of
    this session (`$KVSTORE_HOT_DIR`, children inherit it); the session fails if any
    arena is left there at the end: the suite cleans up the shared memory it takes."""
    import shutil
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    hot = Path(tempfile.mkdtemp(prefix="kvstore-tests-", dir=base))
    old = os.environ.get("KVSTORE_HOT_DIR")
    os.environ["KVSTORE_HOT_DIR"] = str(hot)
    try:
        yield hot
    finally:
        if old is None:
            os.environ.pop("KVSTORE_HOT_DIR", None)
        else:
            os.environ["KVSTORE_HOT_DIR"] = old
        left = sorted(p.name for p in hot.glob("kvstore-*.arena"))
        shutil.rmtree(hot, ignore_errors=True)
        if left:
            pytest.fail(f"the test suite left {len(left)} arena(s) in {hot}: {left}")


@pytest.fixture(scope="session", autouse=True)
def session_cache_dir(tmp_path_factory):
    """kvstore's user cache (the memo of checkpoint hashes, `kvstore.fingerprint.memo_path`)
    in this session's temporary directory rather than ~/.cache; children inherit it."""
    old = os.environ.get("KVSTORE_CACHE_DIR")
    os.environ["KVSTORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvstore-cache"))
    yield
    if old is None:
        os.environ.pop("KVSTORE_CACHE_DIR", None)
    else:
        os.environ["KVSTORE_CACHE_DIR"] = old


@pytest.fixture
def layout():
    return small_layout()


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path, layout):
    s = kvstore.open(store_path, layout=layout, model="test/model@1", durability="none")
    yield s
    s.close()


@pytest.fixture
def split_k(monkeypatch):
    """Split-K on short contexts (paged-attention tests): partitions of 32 tokens and
    two threads, so that one sequence with one kv head (fewer pairs than 2 * threads)
    is split."""
    import torch

    monkeypatch.setenv("KVSTORE_SPLIT_MIN_TOKENS", "32")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_threads(monkeypatch):
    """Two threads and the default split-K threshold (paged-attention tests that check
    which kernel and split a long context gets)."""
    import torch

    monkeypatch.delenv("KVSTORE_SPLIT_MIN_TOKENS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------ deterministic KV

_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def prefix_keys(tokens: Sequence[int], seed: int = 0, total: int | None = None) -> np.ndarray:
    """uint64 key per position: a rolling hash of seed and tokens[0..=i].

    Positions past the end of `tokens` (when `total` > len) hash a sentinel, so
    padding KV is deterministic too.
    """
    toks = [int(t) for t in tokens]
    n = len(toks) if total is None else total
    keys = np.empty(n, dtype=np.uint64)
    h = (seed * 0x2545F4914F6CDD1D + 0x1234567) & _M64
    for i in range(n):
        t = toks[i] if i < len(toks) else (1 << 40) + i
        h = ((h ^ t) * 0x100000001B3 + 0x9E3779B97F4A7C15) & _M64
        h ^= h >> 29
        keys[i] = h
    return keys


_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _lowent_table(dtype: str) -> np.ndarray:
    """Bit patterns of a few small values: compresses well after byte-plane shuffle."""
    vals = np.array([0.0, 0.5, -1.0, 2.0], dtype=np.float32)
    if dtype == "float16":
        return vals.astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":
        return (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    if dtype == "float32":
        return vals.view(np.uint32)
    return np.array([0x00, 0x30, 0xB8, 0x40], dtype=np.uint8)  # float8_e4m3fn 0, .5, -1, 2


def kv_bits(
    layout, tokens: Sequence[int], *, seed: int = 0, kind: str = "random", total: int | None = None
) -> np.ndarray:
    """The KV of `tokens` as unsigned-integer bit patterns, shape [L, 2, T, H, D].

    kind="random": every bit pattern is possible (NaNs, infinities, subnormals
    included: a store must copy bits, never values). kind="lowent": a few small
    values, so zstd really compresses. kind="kvlike" (16-bit dtypes): those values'
    high (sign and exponent) bytes with random low bytes, what the "exponent" codec
    compresses while every stored byte still matters.
    """
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    keys = prefix_keys(tokens, seed, total)
    T = len(keys)
    elems = np.arange(L * 2 * H * D, dtype=np.uint64).reshape(L, 2, 1, H, D)
    with np.errstate(over="ignore"):
        x = _splitmix64(keys.reshape(1, 1, T, 1, 1) ^ (elems * np.uint64(0xD6E8FEB86659FD93)))
    size = _ITEM[layout.dtype]
    if kind == "random":
        return x.astype(_UINT[size])  # keeps the low bits
    if kind == "lowent":
        table = _lowent_table(layout.dtype)
        return table[(x & np.uint64(3)).astype(np.intp)]
    if kind == "kvlike" and size == 2:
        high = _lowent_table(layout.dtype) & np.uint16(0xFF00)
        return high[(x & np.uint64(3)).astype(np.intp)] | (
            (x >> np.uint64(8)) & np.uint64(0xFF)
        ).astype(np.uint16)
    raise ValueError(kind)


def kv_for(
    layout,
    tokens: Sequence[int],
    *,
    seed: int = 0,
    kind: str = "random",
    family: str | None = None,
    total: int | None = None,
) -> Any:
    """Deterministic KV of `tokens` as a numpy array or torch tensor of the layout dtype.

    `family` defaults to numpy, or torch for dtypes numpy lacks (bfloat16, float8).
    """
    bits = kv_bits(layout, tokens, seed=seed, kind=kind, total=total)
    if family is None:
        family = "numpy" if layout.dtype in ("float16", "float32") else "torch"
    if family == "numpy":
        return bits.view({"float16": np.float16, "float32": np.float32}[layout.dtype])
    import torch

    signed = {1: np.int8, 2: np.int16, 4: np.int32}[bits.dtype.itemsize]
    t = torch.from_numpy(np.ascontiguousarray(bits).view(signed))
    return t.view(getattr(torch, layout.dtype))


def raw_bytes(x: Any) -> bytes:
    """The bytes of a numpy array or torch tensor in C order."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    import torch

    assert isinstance(x, torch.Tensor), type(x)
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def assert_kv_equal(got: Any, want: Any, what: str = "kv") -> None:
    """Same shape, same dtype, bitwise the same bytes."""
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    )
    assert dtype_name(got) == dtype_name(want), f"{what}: dtype {got.dtype} != {want.dtype}"
    g, w = raw_bytes(got), raw_bytes(want)
    if g != w:
        ga, wa = np.frombuffer(g, np.uint8), np.frombuffer(w, np.uint8)
        bad = np.flatnonzero(ga != wa)
        raise AssertionError(
            f"{what}: {bad.size} of {ga.size} bytes differ, first at byte {bad[0]}"
        )


def full_tokens(layout, n: int) -> int:
    """Tokens covered by the full blocks of n tokens."""
    return n // layout.block_size * layout.block_size


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------- child processes


def child_code(code: str) -> str:
    prelude = f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return prelude + textwrap.dedent(code)


def child_argv(code: str, *args: Any) -> list[str]:
    return [sys.executable, "-c", child_code(code), *[str(a) for a in args]]


def run_child(
    code: str, *args: Any, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (`sys.argv[1:]` = args); raises with its
    output when it fails and `check` is set."""
    p = subprocess.run(child_argv(code, *args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(
            f"child exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
        )
    return p


# ------------------------------------------------------------------------ on-disk access

LOCATION = struct.Struct("<5Q")
RECORD_HEADER_LEN = 80
SEGMENT_HEADER_LEN = 32


@dataclass(frozen=True)
class Location:
    segment: int
    offset: int
    record_len: int
    stored_len: int
    created_ms: int

    @classmethod
    def decode(cls, b: bytes) -> Location:
        return cls(*LOCATION.unpack(b[:40]))

    def encode(self) -> bytes:
        return LOCATION.pack(
            self.segment, self.offset, self.record_len, self.stored_len, self.created_ms
        )


def open_index(path: Path | str, readonly: bool = True):
    """The store's LMDB environment through the Python `lmdb` package."""
    import lmdb

    if readonly:
        return lmdb.open(
            str(Path(path) / "index"), readonly=True, lock=False, max_dbs=16, subdir=True
        )
    return lmdb.open(str(Path(path) / "index"), max_dbs=16, subdir=True, map_size=64 << 30)


def index_blocks(path: Path | str) -> dict[bytes, Location]:
    """block id -> Location, read straight from LMDB (close the store first)."""
    env = open_index(path)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): Location.decode(bytes(v)) for k, v in txn.cursor()}
    finally:
        env.close()


PAYLOAD_ALIGN = 4096


def payload_offset(loc: Location) -> int:
    """Where the record at `loc` has its payload (its last `stored_len` bytes;
    on a PAYLOAD_ALIGN boundary in a version-2 segment)."""
    return loc.offset + loc.record_len - loc.stored_len


def meta_offset(loc: Location, block_size: int) -> int:
    """Where the record at `loc` has its header (after its padding, if any)."""
    return payload_offset(loc) - RECORD_HEADER_LEN - 4 * block_size


def segment_file(path: Path | str, segment: int) -> Path:
    return Path(path) / "segments" / f"{segment:016x}.kvseg"


@dataclass(frozen=True)
class Record:
    magic: bytes
    version: int
    flags: int
    n_tokens: int
    stored_len: int
    raw_len: int
    block_id: bytes
    stored_crc: int
    raw_crc: int
    header_crc: int
    tokens: tuple[int, ...]
    meta: bytes
    payload: bytes


def read_record(path: Path | str, loc: Location) -> Record:
    with open(segment_file(path, loc.segment), "rb") as f:
        f.seek(loc.offset)
        data = f.read(loc.record_len)
    # A version-2 record starts with the zeros that put its payload on a
    # 4 KiB boundary: they end where the meta (and its magic) starts.
    pad = len(data) - len(data.lstrip(b"\0")) if data[:4] != b"KVRC" else 0
    data = data[pad:]
    magic, version, flags, n, _res, stored_len, raw_len = struct.unpack_from("<4sHHIIQQ", data, 0)
    block_id = data[32:64]
    stored_crc, raw_crc, header_crc = struct.unpack_from("<III", data, 64)
    meta_len = RECORD_HEADER_LEN + 4 * n
    tokens = struct.unpack_from(f"<{n}I", data, RECORD_HEADER_LEN)
    return Record(
        magic,
        version,
        flags,
        n,
        stored_len,
        raw_len,
        block_id,
        stored_crc,
        raw_crc,
        header_crc,
        tuple(tokens),
        data[:meta_len],
        data[meta_len : meta_len + stored_len],
    )


def records_by_tokens(path: Path | str) -> dict[tuple[int, ...], tuple[bytes, Location]]:
    """Token ids of each indexed record -> (block id, location). Tests give every
    block distinct token ids so that this names blocks unambiguously."""
    out = {}
    for bid, loc in index_blocks(path).items():
        rec = read_record(path, loc)
        assert rec.tokens not in out, "test data must give each block distinct token ids"
        out[rec.tokens] = (bid, loc)
    return out


def block_record(path, layout, tokens: Sequence[int], i: int) -> tuple[bytes, Location]:
    """(block id, location) of block i of `tokens` (found by its token ids)."""
    b = layout.block_size
    return records_by_tokens(path)[tuple(int(t) for t in tokens[i * b : (i + 1) * b])]


def segment_bytes_total(path: Path | str) -> int:
    d = Path(path) / "segments"
    return sum(p.stat().st_size for p in d.iterdir()) if d.is_dir() else 0


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """Pure-Python CRC-32C (Castagnoli), as in the record format."""
    c = crc ^ 0xFFFFFFFF
    t = _CRC32C
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def unshuffle(planes: bytes, elem: int) -> bytes:
    """Inverse byte-plane shuffle: plane j holds byte j of every element."""
    a = np.frombuffer(planes, np.uint8)
    return a.reshape(elem, -1).T.copy().tobytes()


# --------------------------------------------------------------------------------- CLI

HAVE_CLI = importlib.util.find_spec("kvstore.cli") is not None
needs_cli = pytest.mark.skipif(not HAVE_CLI, reason="kvstore.cli is not in this build yet")


def run_cli(*args: Any, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            *[os.fspath(a) if isinstance(a, Path) else str(a) for a in args],
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
