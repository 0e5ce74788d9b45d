"""Smoke test of the benchmark code itself: runs bench_store.py at a tiny size.

    pytest benches/test_bench_smoke.py

Never asserts on timing: only that every measurement ran, round-tripped its data
and produced finite, positive figures. Uses posix_fadvise (not drop_caches) to
empty the page cache, so it leaves the rest of the machine alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvstore

_HERE = Path(__file__).resolve().parent
# tests/support (require.py), as for the tests themselves.
sys.path.insert(0, str(_HERE.parent / "tests"))


def _load(name: str, register: bool = False) -> Any:
    """The bench script `name`.py of this folder, loaded afresh; `register`: also
    as `sys.modules[name]`, for the benches that import it."""
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bs = _load("bench_store", register=True)
import peers  # noqa: E402  (on sys.path through bench_store)

SMALL = [
    "--size-gib",
    "0.03",
    "--repeat",
    "1",
    "--warm-runs",
    "2",
    "--lookup-tokens",
    "8192",
    "--lookup-runs",
    "3",
    "--restore-tokens",
    "256",
    "--cold-method",
    "fadvise",
    "--quiet",
]


def test_full_script_tiny(benchmark, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [*SMALL, "--dir", str(tmp_path), "--json", str(out)]
    res = benchmark.pedantic(bs.main, args=(argv,), rounds=1, iterations=1)
    sections = {r.section for r in res.rows}
    assert {"limits", "put", "get", "restore", "lookup", "compression"} <= sections
    for r in res.rows:
        assert math.isfinite(r.value) and r.value > 0, r
        if r.limit is not None:
            assert math.isfinite(r.limit) and r.limit > 0, r
    data = json.loads(out.read_text())
    assert data["meta"]["blocks"] == 15
    assert len(data["rows"]) == len(res.rows)
    assert data["meta"]["cold_method"] in ("drop_caches", "fadvise")
    # The temp dir is gone: only the JSON is left.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_only_compression_tiny(tmp_path: Path) -> None:
    """--only-compression: the compression rows and the puts and warm gets they are
    compared with, none of the cold, restore or lookup rows."""
    res = bs.main([*SMALL, "--dir", str(tmp_path), "--only-compression"])
    sections = {r.section for r in res.rows}
    assert sections == {"limits", "put", "get", "compression"}, sections
    puts = [r.what for r in res.rows if r.section == "compression" and r.what.startswith("put")]
    codecs = {w.split()[1].rstrip(",") for w in puts}
    assert codecs == {"zstd", "exponent"}, codecs
    refs = {r.limit for r in res.rows if r.section == "compression" and r.unit == "GiB/s"}
    assert all(x is not None and math.isfinite(x) and x > 0 for x in refs), refs


def test_plan_blocks() -> None:
    bb = bs.BIG.block_bytes
    assert bb == 2 << 20
    assert bs.plan_blocks(1.0, bs.BIG, 64) == [64] * 8
    assert bs.plan_blocks(0.03, bs.BIG, 64) == [15]
    assert bs.plan_blocks(0.3, bs.BIG, 64) == [64, 64, 25]
    assert bs.plan_blocks(0.0, bs.BIG, 64) == [1]


def test_aligned_buffer_and_kv_view() -> None:
    a = peers.aligned_empty(4 << 20)
    assert a.ctypes.data % peers.ALIGN == 0 and a.nbytes == 4 << 20
    kv = bs.as_kv(a, bs.BIG, 32)
    assert kv.shape == (32, 2, 32, 8, 128) and kv.dtype == torch.bfloat16
    kv.view(torch.int16).fill_(7)
    assert (a.view(np.int16) == 7).all()


def _fs_type(path: Path) -> str:
    """The type of the file system `path` is on (/proc/self/mountinfo: the mount
    point nearest above it)."""
    path = path.resolve()
    best, kind = -1, ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount, fstype = fields[4], fields[fields.index("-") + 1]
            inside = path == Path(mount) or Path(mount) in path.parents
            if inside and len(mount) > best:
                best, kind = len(mount), fstype
    return kind


def test_cold_cache_helpers(tmp_path: Path) -> None:
    """A file just written is all in the page cache; the fadvise eviction empties it
    where the pages have a disk behind them, and leaves it where the pages are the
    file itself (tmpfs, ramfs: nothing to evict to)."""
    f = tmp_path / "f"
    f.write_bytes(b"x" * (1 << 20))
    before, tool = bs.resident_bytes([f])
    assert tool in ("fincore", "mincore") and before == 1 << 20
    assert bs.drop_page_cache([f], "fadvise") == "fadvise"
    after, _ = bs.resident_bytes([f])
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        assert after == before
    else:
        assert after < before, _fs_type(tmp_path)


def test_device_use(tmp_path: Path) -> None:
    # 40 reads taking 120 ms in all, the device busy 300 ms of 0.5 s.
    assert peers.device_use((10, 1000, 2000), (50, 1120, 2300), 0.5) == (0.6, 3.0)
    assert peers.device_use(None, (1, 2, 3), 1.0) is None
    assert peers.device_use((0, 0, 0), (0, 0, 0), 0.0) is None
    f = tmp_path / "f"
    f.write_bytes(b"x" * 4096)
    a = peers.disk_counters(f)
    if a is not None:  # a device the kernel keeps counters for
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        b = peers.disk_counters(f)
        assert b is not None and all(y >= x >= 0 for x, y in zip(a, b, strict=True))


def test_lookup_tiny(benchmark, tmp_path: Path) -> None:
    tokens = np.arange(4096, dtype=np.uint32)
    kv = torch.zeros(bs.TINY.kv_shape(4096), dtype=torch.bfloat16)
    with bs.open_store(tmp_path / "s", bs.TINY, durability="none") as st:
        assert st.put(tokens, kv) == 4096
        assert benchmark(st.lookup, tokens) == 4096


@pytest.mark.parametrize("kind", ["random", "kvlike"])
def test_put_get_roundtrip_tiny(tmp_path: Path, kind: str) -> None:
    seqs = bs.make_seqs(bs.BIG, [2, 1], kind)
    t, stats = bs.put_all(tmp_path / "s", bs.BIG, seqs, "batch", compression="zstd")
    assert t > 0 and stats["blocks"] == 3
    outs = [bs.as_kv(peers.aligned_empty(s.nbytes), bs.BIG, len(s.tokens)) for s in seqs]
    with bs.open_store(tmp_path / "s", bs.BIG) as st:
        assert bs.get_into(st, seqs, outs) > 0
        bs.check_equal(seqs, outs)
        assert bs.get_alloc(st, seqs) > 0


def test_bench_remote_tiny(tmp_path: Path) -> None:
    """bench_remote.py at tiny sizes on its own 3-node cluster (skipped without the
    Redis tools, failed with KVSTORE_REQUIRE=redis): every row ran, checked its data
    (the bench asserts bit-exact gets and full uploads) and printed finite figures."""
    from support.require import need

    need("redis")
    br = _load("bench_remote")
    out = tmp_path / "remote.json"
    argv = ["--prefix", "64", "--tput-mib", "1", "--upload-gib", "0.005", "--quick"]
    rows = br.main([*argv, "--dir", str(tmp_path), "--json", str(out)])
    sections = {r["section"] for r in rows.rows}
    assert sections == {"prefix", "throughput", "upload"}
    for r in rows.rows:
        assert math.isfinite(r["value"]) and r["value"] >= 0, r  # a node may hold no key
    assert len(json.loads(out.read_text())["rows"]) == len(rows.rows)


def test_bench_deadlines_runs_every_row(tmp_path: Path) -> None:
    """bench_deadlines.py against its fake servers: every row ran (each open it
    expects to fail failed, or the bench raises) and reported a finite time beside
    its bound; whether a time is within its bound is reported, never asserted."""
    bd = _load("bench_deadlines")
    out = tmp_path / "deadlines.json"
    rows = bd.main(["--timeout", "0.3", "--dir", str(tmp_path), "--json", str(out)])
    assert len(rows) == 7, rows
    for r in rows:
        assert math.isfinite(r["seconds"]) and r["seconds"] >= 0 and r["bound"] > 0, r
        assert r["within"] == (r["seconds"] <= r["bound"]), r
    assert json.loads(out.read_text())["rows"] == rows


def test_bench_ttft_sweep_tiny(tmp_path: Path) -> None:
    """bench_ttft.py's restore sweep at tiny sizes: every restore checked bitwise by the
    bench (exit status 0), every method timed at every length, and the plot written
    exactly when matplotlib is installed (the bench says so otherwise)."""
    import importlib.util as iu

    bt = _load("bench_ttft")
    png, out = tmp_path / "restore.png", tmp_path / "ttft.json"
    argv = ["--sweep-only", "--hidden", "256", "--layers", "2", "--sweep", "32,64"]
    argv += ["--repeat", "1", "--cold-method", "fadvise", "--dir", str(tmp_path)]
    assert bt.main([*argv, "--plot", str(png), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["sweep"]) == set(bt.SWEEP_METHODS)
    for samples in data["sweep"].values():
        assert set(samples) == {"32", "64"}
        assert all(len(v) == 1 and v[0] > 0 for v in samples.values())
    assert png.exists() == (iu.find_spec("matplotlib") is not None), data["sweep_notes"]


@pytest.mark.parametrize("replay", [False, True])
def test_bench_cold_reads_tiny(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replay: bool
) -> None:
    """bench_cold_reads.py on a 16 MiB file: every pattern ran (each request must
    read all it asks for, or the bench raises, from whichever thread) and printed a
    finite figure; with `--direct-replay`, the scattered patterns (e) among them."""
    import errno

    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:  # a file system without O_DIRECT (tmpfs) refuses it at open
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        pytest.skip(f"no O_DIRECT in {tmp_path}")
    bc = _load("bench_cold_reads")
    argv = ["--mib", "16", "--repeat", "1", "--dir", str(tmp_path)]
    assert bc.main(argv + (["--direct-replay"] if replay else [])) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "GiB/s" in line]
    assert len(rows) == (17 if replay else 9), rows
    assert all(math.isfinite(float(r.split("GiB/s")[0].split()[-1])) for r in rows)
    assert sum("(e) records scattered" in r for r in rows) == (3 if replay else 0)


def test_bench_cold_reads_raises_a_short_read(tmp_path: Path) -> None:
    """A request that reads less than it asks for fails the bench, also from a
    reader thread (it used to be a warning on stderr and a smaller count)."""
    bc = _load("bench_cold_reads")
    path = tmp_path / "f"
    path.write_bytes(bytes(1000))
    with pytest.raises(RuntimeError, match="read 200 of 300 bytes at 800"):
        bc.read_spans(path, [(0, 300), (800, 300)], 2, None)
    assert bc.read_spans(path, [(0, 300), (500, 300)], 2, None) == 600


def test_bench_fingerprint_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_fingerprint.py on a 16 MiB checkpoint, as JSON and as text: every figure
    ran and is finite, and the checkpoint it wrote is gone afterwards."""
    bf = _load("bench_fingerprint")
    argv = ["--gib", "0.015", "--repeat", "1", "--dir", str(tmp_path)]
    assert bf.main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    for key in ("read", "fingerprint"):
        for cache in ("warm", "cold"):
            assert 0 < figures[f"{key}_{cache}_s"] < math.inf
    assert 0 < figures["ratio_warm"] < math.inf and 0 < figures["ratio_cold"] < math.inf
    assert 0 <= figures["peak_extra_bytes"] < 2**40 and figures["files"] == 2
    assert figures["memo_hit_s"] > 0 and figures["hub_snapshot_s"] > 0
    assert bf.main(argv) == 0
    out = capsys.readouterr().out
    assert all(f"  {part}" in out for part in ("warm:", "cold:", "peak extra memory"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape", ["whole", "heads", "latent"])
def test_bench_save_path_tiny(tmp_path: Path, shape: str) -> None:
    """The save path bench stores what the cache holds: each stored block equals the
    cache block read back through the same map (whole blocks, a rank's two heads, a
    latent), and its figures are finite."""
    from kvstore.heads import head_extra
    from kvstore.vllm.paged import PagedKV, paged_block_map

    sp = _load("bench_save_path")
    caches, lay, writer = sp.make_cache(shape, 4)
    seconds, nbytes, tokens = sp.save_once(shape, tmp_path, "batch", caches, lay, writer, 4, 2)
    assert math.isfinite(seconds) and seconds > 0 and nbytes > 0
    paged = PagedKV(caches, paged_block_map(writer, caches[0], lay), lay)
    want = torch.empty(lay.runs_shape(4 * lay.block_size), dtype=torch.bfloat16)
    paged.move([1, 2, 3, 4], want, into_cache=False)
    with kvstore.open(tmp_path / "store", array="torch") as s:
        if shape == "heads":
            heads = s.heads(create=False)
            assert heads is not None and s.stats()["blocks"] == 0
            for h in (0, 1):
                got = heads.store.get(tokens, extra=head_extra(b"", h))
                assert torch.equal(got, want[:, :, :, h : h + 1])
            assert heads.store.lookup(tokens, extra=head_extra(b"", 2)) == 0
        elif shape == "latent":
            halves = want.view(lay.num_layers, 2, -1, lay.head_dim // 2)
            assert torch.equal(s.get(tokens), halves.transpose(1, 2).flatten(2))
        else:
            assert torch.equal(s.get(tokens), want)
