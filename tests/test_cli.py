"""The `kvstore` command: human and --json output, exit codes, and compact/gc
run while another process reads the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvstore

LAYOUT = kvstore.Layout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
MODEL = "cli-test@1"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and r.returncode != 0:
        raise AssertionError(f"kvstore {args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def kv_of(tokens: np.ndarray) -> np.ndarray:
    """KV that is a pure function of (position, token id)."""
    pos = np.arange(len(tokens), dtype=np.float32)
    base = (tokens.astype(np.float32) * 0.001 + pos * 0.01)[None, None, :, None, None]
    grid = np.arange(LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim)
    grid = grid.reshape(LAYOUT.num_layers, 2, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return (base + grid.astype(np.float32) * 0.5).astype(np.float16)


def fill(path: Path, n_seqs: int = 20, length: int = 64) -> list[np.ndarray]:
    seqs = [np.arange(length) + 1000 * i for i in range(n_seqs)]
    with kvstore.open(path, layout=LAYOUT, model=MODEL, durability="sync") as s:
        for t in seqs:
            s.put(t, kv_of(t))
        s.save_session("agent-1", seqs[0], kv_of(seqs[0]))
    return seqs


def test_info_shows_v1_segments_until_compact(tmp_path: Path) -> None:
    """The format-1 fixture store: info names its version-1 segments and format
    1 (reading does not upgrade the MANIFEST); compact rewrites them as version
    2, upgrading it; the KV reads the same before and after."""
    import shutil

    src = Path(__file__).resolve().parents[1] / "rust/kvstore/tests/fixtures/v1"
    store = tmp_path / "s"
    shutil.copytree(src, store, ignore=shutil.ignore_patterns("LOCK", "lock.mdb"))
    store.chmod(0o700)
    info = json.loads(cli("info", store, "--json").stdout)
    assert (info["manifest"]["format_version"], info["segments_v1"]) == (1, 2)
    assert "2 segments of version 1" in cli("info", store).stdout
    # The fixture's first sequence: tokens 0..7, KV bytes (31 * i) mod 256
    # (rust/kvstore/tests/golden.rs, fixture_data).
    tokens = list(range(8))
    want = bytes(31 * i % 256 for i in range(2 * 2 * 8 * 1 * 4 * 2))
    with kvstore.open(store) as s:
        assert np.asarray(s.get(tokens)).tobytes() == want
    cli("compact", store)
    info = json.loads(cli("info", store, "--json").stdout)
    assert (info["segments_v1"], info["segments"]) == (0, 1)
    assert info["manifest"]["format_version"] == kvstore.FORMAT_VERSION == 2
    with kvstore.open(store) as s:
        assert np.asarray(s.get(tokens)).tobytes() == want


def test_info_ls_stats_human_and_json(tmp_path: Path) -> None:
    fill(tmp_path)
    info = json.loads(cli("info", tmp_path, "--json").stdout)
    assert info["manifest"]["fingerprint"] == MODEL
    assert info["manifest"]["dtype"] == "float16"
    assert info["blocks"] == 20 * 16
    assert info["page_kind"] == "none"
    human = cli("info", tmp_path).stdout
    assert MODEL in human and "block_size=4" in human

    assert info["manifest"]["format_version"] == kvstore.FORMAT_VERSION == 2
    assert info["segments_v1"] == 0

    segs = json.loads(cli("ls", tmp_path, "--json").stdout)
    assert sum(s["live_records"] for s in segs) == 20 * 16
    sessions = json.loads(cli("ls", tmp_path, "--sessions", "--json").stdout)
    assert sessions == [{"name": "agent-1", "tokens": 64}]
    # Another tenant's salt sees none of them.
    assert json.loads(cli("ls", tmp_path, "--sessions", "--salt", "x", "--json").stdout) == []
    assert "agent-1" in cli("ls", tmp_path, "--sessions").stdout

    stats = json.loads(cli("stats", tmp_path, "--json").stdout)
    assert stats["store"]["blocks"] == 20 * 16
    assert stats["store"]["dead_bytes"] == 0
    assert "dead bytes per segment" in cli("stats", tmp_path).stdout


def test_hits_and_misses_add_up_across_processes(tmp_path: Path) -> None:
    seqs = fill(tmp_path, n_seqs=2)
    with kvstore.open(tmp_path, layout=LAYOUT, model=MODEL) as s:
        s.get(seqs[0])
        s.lookup(np.arange(8) + 777_777)  # 2 blocks, both misses
    stats = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]
    assert stats["total_hit_blocks"] >= 16
    assert stats["total_miss_blocks"] >= 2


def test_named_counters_add_up_across_processes(tmp_path: Path) -> None:
    """Clients' counters (the vLLM connector's `vllm.*`) in `kvstore stats`: each
    process's additions, saved at close, summed store-wide; bad names refused."""
    fill(tmp_path, n_seqs=1)
    added = [{"vllm.hit_tokens": 96, "vllm.load_bytes": 1 << 20}, {"vllm.hit_tokens": 32}]
    for counts in added:
        with kvstore.open(tmp_path, layout=LAYOUT, model=MODEL) as s:
            s.add_counters(counts)
            with pytest.raises(kvstore.InvalidInput):
                s.add_counters({"Not A Name": 1})
    stats = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]
    assert stats["counters"] == {"vllm.hit_tokens": 128, "vllm.load_bytes": 1 << 20}
    human = cli("stats", tmp_path).stdout
    assert "vllm.hit_tokens" in human and "128" in human


def test_verify_clean_then_damaged(tmp_path: Path) -> None:
    fill(tmp_path, n_seqs=2)
    r = cli("verify", tmp_path)
    assert "ok" in r.stdout
    report = json.loads(cli("verify", tmp_path, "--json").stdout)
    assert report["ok"] and report["records_checked"] == 32
    seg = sorted((tmp_path / "segments").iterdir())[0]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x55
    seg.write_bytes(bytes(data))
    r = cli("verify", tmp_path, check=False)
    assert r.returncode == 1
    assert "damaged block" in r.stdout
    report = json.loads(cli("verify", tmp_path, "--json", check=False).stdout)
    assert not report["ok"] and len(report["damaged"]) == 1
    assert report["damaged"][0]["block_id"] in r.stdout


def test_errors_are_one_line_with_exit_2(tmp_path: Path) -> None:
    r = cli("info", tmp_path / "missing", check=False)
    assert r.returncode == 2
    assert r.stderr.startswith("kvstore: error:") and r.stderr.count("\n") == 1
    (tmp_path / "notastore").mkdir()
    r = cli("verify", tmp_path / "notastore", check=False)
    assert r.returncode == 2 and "no kvstore" in r.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "MANIFEST").write_text("{}\n")
    r = cli("info", tmp_path / "broken", check=False)
    assert r.returncode == 2 and "corrupt" in r.stderr.lower()
    fill(tmp_path / "s", n_seqs=1)
    r = cli("gc", tmp_path / "s", check=False)
    assert r.returncode == 2 and "--max-bytes" in r.stderr
    r = cli("gc", tmp_path / "s", "--older-than", "soon", check=False)
    assert r.returncode == 2


def test_gc_and_compact_reclaim_space(tmp_path: Path) -> None:
    seqs = fill(tmp_path)
    before = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]
    r = json.loads(
        cli("gc", tmp_path, "--max-bytes", str(before["live_bytes"] // 2), "--json").stdout
    )
    assert r["blocks_evicted"] > 0
    after = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]
    assert after["live_bytes"] <= before["live_bytes"] // 2
    assert after["dead_bytes"] == 0
    assert after["disk_bytes"] < before["disk_bytes"]
    with kvstore.open(tmp_path, layout=LAYOUT, model=MODEL) as s:
        for t in seqs:
            got = s.get(t)
            m = got.shape[2]
            np.testing.assert_array_equal(got, kv_of(t)[:, :, :m])
    assert "rewrote" in cli("compact", tmp_path).stdout
    r = json.loads(cli("gc", tmp_path, "--older-than", "0s", "--json").stdout)
    assert json.loads(cli("stats", tmp_path, "--json").stdout)["store"]["blocks"] == 0
    assert r["blocks_evicted"] > 0


READER = textwrap.dedent(
    """
    import os, sys, numpy as np, kvstore
    sys.path.insert(0, {test_dir!r})
    from test_cli import LAYOUT, MODEL, kv_of
    seqs = [np.arange(64) + 1000 * i for i in range(20)]
    reads = 0
    with kvstore.open({path!r}, layout=LAYOUT, model=MODEL, durability="none") as s:
        while True:
            stop = os.path.exists({stop!r})  # read before the round: one more after
            for t in seqs:
                got = s.get(t)
                m = got.shape[2]
                if not np.array_equal(got, kv_of(t)[:, :, :m]):
                    print("WRONG", flush=True)
                    sys.exit(3)
                reads += 1
            if reads == len(seqs):
                print("READING", flush=True)
            if stop:
                break
    print("READS", reads, flush=True)
    """
)


@pytest.mark.slow
def test_compact_and_gc_while_another_process_reads(tmp_path: Path) -> None:
    """A reader in another process reads every sequence over and over, bit-exact
    or a miss, from before the first gc until after the last compaction: it says
    it is reading before they start and stops only when told, after they end."""
    fill(tmp_path)
    stop = tmp_path.parent / f"{tmp_path.name}.stop"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            READER.format(test_dir=str(Path(__file__).parent), path=str(tmp_path), stop=str(stop)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None
        assert reader.stdout.readline().strip() == "READING", "the reader did not start"
        live = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]["live_bytes"]
        for i in range(4):
            cli("gc", tmp_path, "--max-bytes", str(live * (9 - i) // 10))
            cli("compact", tmp_path)
        assert reader.poll() is None, "the reader ended before gc and compaction did"
        stop.touch()
        out, err = reader.communicate(timeout=120)  # only ends a hung reader
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, f"reader failed: {out}\n{err}"
    assert "WRONG" not in out
    assert int(out.split("READS")[1]) >= 2 * 20, out
    report = json.loads(cli("verify", tmp_path, "--json").stdout)
    assert report["ok"], report
    # The reader's open files of deleted segments are gone with it: disk use
    # is what the live records need.
    st = json.loads(cli("stats", tmp_path, "--json").stdout)["store"]
    assert st["dead_bytes"] == 0


def test_demo_quick_runs_and_checks_equality(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    r = cli("demo", tmp_path / "demo", "--quick")  # exits 0 only if every check passed
    rows = r.stdout.splitlines()
    for label in (
        "restored KV == KV as computed (bitwise)",
        "next-token logits: restored == from KV as computed",
        "restored continuation == recomputed",
        "workers: restored continuation == recomputed",
        "blocks stored once",
    ):
        row = next((x for x in rows if label in x), None)
        assert row is not None and row.rstrip(" │").endswith("yes"), (label, r.stdout)
    assert "time to first token, restored" in r.stdout and "all checks passed" in r.stdout


def test_verify_repair_rebuilds_a_garbled_index_and_drops_damaged_records(tmp_path: Path) -> None:
    seqs = fill(tmp_path, n_seqs=10, length=16)
    # One damaged payload (the first record after the segment header) ...
    seg = next((tmp_path / "segments").iterdir())
    with seg.open("r+b") as f:
        f.seek(32 + 80 + 16 + 5)
        f.write(b"\xff\xee\xdd")
    # ... and a garbled index.
    data = tmp_path / "index" / "data.mdb"
    data.write_bytes(b"\x5a" * data.stat().st_size)
    r = cli("verify", tmp_path, check=False)
    assert r.returncode == 2 and "corrupt store" in r.stderr, r.stderr

    r = cli("verify", "--repair", tmp_path, "--json")
    report = json.loads(r.stdout)
    assert report["ok"] and report["rebuilt"]["blocks"] == 10 * 4 - 1
    assert len(report["rebuilt"]["damaged"]) == 1
    assert list(tmp_path.glob("index.old-*")), "the old index is kept, not deleted"
    with kvstore.open(tmp_path) as s:
        # The damaged block is a miss (the first block of seqs[0]); the rest is exact.
        assert s.lookup(seqs[0]) == 0
        for t in seqs[1:]:
            np.testing.assert_array_equal(s.get(t), kv_of(t))
        s.put(seqs[0], kv_of(seqs[0]))
        np.testing.assert_array_equal(s.get(seqs[0]), kv_of(seqs[0]))
        assert s.sessions() == [], "sessions live only in the index"


def test_verify_repair_takes_damage_out_of_a_sound_index(tmp_path: Path) -> None:
    seqs = fill(tmp_path, n_seqs=4, length=16)
    seg = next((tmp_path / "segments").iterdir())
    with seg.open("r+b") as f:
        f.seek(32 + 80 + 16 + 5)
        f.write(b"\xff\xee\xdd")
    assert cli("verify", tmp_path, check=False).returncode == 1
    report = json.loads(cli("verify", "--repair", tmp_path, "--json").stdout)
    assert report["ok"] and len(report["damaged"]) == 1 and report["rebuilt"] is None
    with kvstore.open(tmp_path) as s:
        assert s.lookup(seqs[0]) == 0
        assert s.lookup(seqs[1]) == 16


def test_rebuild_index_needs_a_sound_manifest_and_a_closed_store(tmp_path: Path) -> None:
    fill(tmp_path, n_seqs=2, length=8)
    with kvstore.open(tmp_path) as s:
        with pytest.raises(kvstore.StoreLocked):
            kvstore.rebuild_index(tmp_path)
        assert s.lookup(np.arange(8)) == 8
    manifest = tmp_path / "MANIFEST"
    manifest.write_bytes(manifest.read_bytes().replace(b"float16", b"float32"))
    r = cli("rebuild-index", tmp_path, check=False)
    assert r.returncode == 2 and "MANIFEST" in r.stderr, r.stderr


def test_rebuild_index_waits_for_handles_open_in_other_processes(tmp_path: Path) -> None:
    """A handle open in another process that had not written yet did not stop a
    rebuild: it went on with the index moved aside, so its next put was acknowledged
    there and lost to the rebuilt one. The rebuild now refuses while any handle is
    open, and runs once it is closed."""
    fill(tmp_path, n_seqs=2, length=8)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, numpy as np, kvstore
                s = kvstore.open(sys.argv[1], durability="sync")
                print("open", flush=True)
                sys.stdin.readline()
                t = np.arange(100, 116)
                print(s.put(t, np.ones(s.layout.kv_shape(16), np.float16)), flush=True)
                s.close()
                """
            ),
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline() == "open\n"
    r = cli("rebuild-index", tmp_path, check=False)
    assert r.returncode == 2 and "open in another process" in r.stderr, r.stderr
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline() == "16\n"
    assert child.wait(timeout=60) == 0
    cli("rebuild-index", tmp_path)
    with kvstore.open(tmp_path) as s:
        assert s.lookup(np.arange(100, 116)) == 16
        assert s.lookup(np.arange(8)) == 8


def test_any_salt_bytes_and_the_empty_salt_name_their_tenant(tmp_path: Path) -> None:
    """A salt is bytes: one read from a file or the environment that is not UTF-8 used
    to end in a traceback, and `--salt ""` chose no salt, where the API's salt="" is a
    tenant of its own. Each names the tenant whose session it lists."""
    path = tmp_path / "s"
    t = np.arange(8)
    salts = {"none": None, "empty": b"", "binary": b"\xff\xfesecret"}
    for name, salt in salts.items():
        with kvstore.open(path, layout=LAYOUT, model=MODEL, salt=salt) as s:
            s.save_session(f"of-{name}", t, kv_of(t))

    def sessions(*flags: str, env: dict[bytes, bytes] | None = None) -> list[str]:
        r = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "ls", str(path), "--sessions", "--json", *flags],
            capture_output=True,
            env=None if env is None else {**os.environb, **env},
            timeout=120,
        )
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        return [x["name"] for x in json.loads(r.stdout)]

    salt_file = tmp_path / "salt"
    salt_file.write_bytes(b"\xff\xfesecret\n")
    assert sessions() == ["of-none"]
    assert sessions("--salt", "") == ["of-empty"]
    assert sessions("--salt-file", str(salt_file)) == ["of-binary"]
    assert sessions("--salt-env", "KV_SALT", env={b"KV_SALT": b"\xff\xfesecret"}) == ["of-binary"]


def test_out_of_range_arguments_and_a_closed_pipe_are_no_traceback(tmp_path: Path) -> None:
    fill(tmp_path / "s", n_seqs=1)
    r = cli("gc", tmp_path / "s", "--max-bytes", "9" * 400, check=False)
    assert r.returncode == 2 and "below 2**64" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "remote",
        "ping",
        tmp_path / "s",
        "--node",
        "127.0.0.1:1",
        "--timeout",
        "9" * 30 + "d",
        check=False,
    )
    assert r.returncode == 2 and "timeout" in r.stderr and "Traceback" not in r.stderr
    # A reader that stops at the first line (`| head -1`).
    p = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "ls", str(tmp_path / "s"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # closed before it writes
    assert p.wait(timeout=120) == 141
    assert b"Traceback" not in p.stderr.read()
