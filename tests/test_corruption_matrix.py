"""Corruption matrix (README, Durability: how this is tested): every kind of
file a store has (segment, MANIFEST, LMDB index, hot-tier arena) damaged by bit
flips, truncation, zeroed pages and swapped records. Segments are damaged in two
shapes: small blocks (records back to back) and 128 KiB blocks, whose format-v2
records begin with the zero padding that puts their payload on a 4 KiB boundary
(damaged in their padding, header, token ids and payload alike).

Pass: no crash, no hang, a damaged block is a miss (never wrong bytes), `verify`
reports exactly the damaged records, the store stays writable. A damaged
MANIFEST or index is `CorruptStore` on open.

Every case runs on its own copy of a template store, in a process forked from a
worker (`_serve`, a fresh interpreter started by the test): a segfault shows as a
signal, a hang as a timeout, and neither takes pytest down. What each case
expects is recomputed from the bytes: a record is damaged exactly when its bytes
differ from the template's (or lie past the new end of file). Each test prints
how many cases it ran (`pytest -s`)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    TESTS_DIR,
    assert_kv_equal,
    kv_for,
    records_by_tokens,
    segment_file,
    seq,
    small_layout,
)

import kvstore

B = 8
LAYOUT = small_layout("float16", block_size=B)
MODEL = "test/corruption-matrix@1"
PER_SEGMENT = 8
# One block per document, so every block is found (or missed) on its own.
DOCS = [seq(10_000 * (k + 1), B) for k in range(2 * PER_SEGMENT)]
NEW_DOC = seq(7_777_000, B)
PAGE = 4096
# 128 KiB blocks: every raw record is padded (format v2: payloads of 64 KiB or
# more start on a page boundary). Damage cases pick offsets in each region of a
# record (padding, header, token ids, payload) rather than every page.
PB = 8
PADDED = small_layout("float16", block_size=PB, H=4, D=512)
PADDED_DOCS = [seq(20_000 * (k + 1) + 1, PB) for k in range(2 * PER_SEGMENT)]
PADDED_NEW_DOC = seq(8_888_000, PB)
SHAPES = {"small": (LAYOUT, DOCS, NEW_DOC), "padded": (PADDED, PADDED_DOCS, PADDED_NEW_DOC)}
META = 80 + 4 * B  # record header and token ids (B == PB)
HOT_BYTES = 4 << 20
CASE_TIMEOUT = 20.0

# Arena layout (rust/kvstore/src/arena.rs): header words, slot header fields.
A_HEADER_LEN = 4096
A_NSLOTS, A_SLOT_HDR, A_SLOT_SIZE, A_DATA_OFF, A_TOTAL = 16, 32, 40, 48, 56
A_S_STATE = 40


def _kind(compression: str | None) -> str:
    return {None: "random", "exponent": "kvlike"}.get(compression, "lowent")


_KV: dict[tuple[str, int], Any] = {}


def _kv(doc: list[int], kind: str = "random", shape: str = "small") -> Any:
    """kv_for, memoised (the worker fills the memo once, before it forks)."""
    key = (kind, doc[0])
    if key not in _KV:
        _KV[key] = kv_for(SHAPES[shape][0], doc, kind=kind)
    return _KV[key]


def _open(
    path: Path, compression: str | None = None, shape: str = "small", **kw: Any
) -> kvstore.Store:
    return kvstore.open(
        path,
        layout=SHAPES[shape][0],
        model=MODEL,
        durability="none",
        compression=compression,
        **kw,
    )


# ------------------------------------------------------------------------ templates


def _build(
    path: Path, compression: str | None, hot: Path | None = None, shape: str = "small"
) -> dict[str, Any]:
    """Two sealed segments of PER_SEGMENT one-block documents each. Returns the
    context a case needs: where each document's record lies, and its padding."""
    layout, docs, _ = SHAPES[shape]
    kw: dict[str, Any] = {}
    if hot is not None:
        hot.mkdir(parents=True)
        kw = {"hot_bytes": HOT_BYTES, "hot_dir": hot}
    for part in range(2):
        with _open(path, compression, shape, **kw) as s:
            for k in range(part * PER_SEGMENT, (part + 1) * PER_SEGMENT):
                assert s.put(docs[k], kv_for(layout, docs[k], kind=_kind(compression))) == B
    by_tokens = records_by_tokens(path)
    records = []
    for k, doc in enumerate(docs):
        bid, loc = by_tokens[tuple(doc)]
        records.append(
            {"doc": k, "bid": bid.hex(), "seg": loc.segment, "off": loc.offset,
             "len": loc.record_len, "pad": loc.record_len - META - loc.stored_len}
        )  # fmt: skip
    segs = sorted({r["seg"] for r in records})
    assert len(segs) == 2, segs
    for sg in segs:  # sealed: the file ends where its last record ends
        end = max(r["off"] + r["len"] for r in records if r["seg"] == sg)
        assert segment_file(path, sg).stat().st_size == end
    pads = {r["pad"] > 0 for r in records}
    assert pads == {shape == "padded" and compression is None}, f"{shape}: padding {pads}"
    for r in records:  # a padded record's payload starts on a page boundary
        assert r["pad"] == 0 or (r["off"] + r["pad"] + META) % PAGE == 0, r
    return {"compression": compression, "records": records, "segments": segs, "shape": shape}


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for name, comp in (("raw", None), ("zstd", "zstd"), ("exponent", "exponent")):
        out[name] = (root / name, _build(root / name, comp))
    out["padded"] = (root / "padded", _build(root / "padded", None, shape="padded"))
    hot_root = root / "hot"
    ctx = _build(hot_root / "store", None, hot=hot_root / "hot")
    (arena,) = (hot_root / "hot").iterdir()
    ctx["arena"] = str(arena.relative_to(hot_root))
    out["hot"] = (hot_root, ctx)
    return out


def _rel_segment(seg: int) -> str:
    return f"segments/{seg:016x}.kvseg"


# ------------------------------------------------------------------ worker + forks


def _mutate(root: Path, ops: list[dict]) -> None:
    for op in ops:
        kind = op["op"]
        if kind == "flip":
            with open(root / op["file"], "r+b") as f:
                f.seek(op["at"])
                b = f.read(1)
                f.seek(op["at"])
                f.write(bytes([b[0] ^ op["mask"]]))
        elif kind == "truncate":
            os.truncate(root / op["file"], op["len"])
        elif kind == "zero":
            with open(root / op["file"], "r+b") as f:
                f.seek(op["start"])
                f.write(b"\0" * (op["end"] - op["start"]))
        elif kind == "swap":  # two equally long ranges, possibly in two files
            (fa, oa, n), (fb, ob) = op["a"], op["b"]
            with open(root / fa, "rb") as f:
                f.seek(oa)
                a = f.read(n)
            with open(root / fb, "rb") as f:
                f.seek(ob)
                b = f.read(n)
            for name, at, data in ((fa, oa, b), (fb, ob, a)):
                with open(root / name, "r+b") as f:
                    f.seek(at)
                    f.write(data)
        elif kind == "copy":  # a range over another range
            (fa, oa, n), (fb, ob) = op["src"], op["dst"]
            with open(root / fa, "rb") as f:
                f.seek(oa)
                data = f.read(n)
            with open(root / fb, "r+b") as f:
                f.seek(ob)
                f.write(data)
        elif kind == "remove":
            os.unlink(root / op["file"])
        elif kind == "age":  # as if written two hours ago
            old = time.time() - 7200
            for p in (root / op["dir"]).iterdir():
                os.utime(p, (old, old))
        elif kind == "write":
            (root / op["file"]).write_bytes(bytes.fromhex(op["hex"]))
        else:
            raise ValueError(kind)


def _serve() -> None:
    """Worker: for each case, copies the template, damages the copy, and runs the
    check in a forked child with a timeout. One JSON line per case on stdout."""
    spec = json.loads(sys.stdin.read())
    template, scratch = Path(spec["template"]), Path(spec["scratch"])
    check = globals()[spec["check"]]
    shape = spec["context"].get("shape", "small")
    _, docs, new_doc = SHAPES[shape]
    for doc in [*docs, new_doc]:
        for kind in ("random", "lowent"):
            _kv(doc, kind, shape)
    scratch.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(spec["cases"]):
        d = scratch / f"case{i}"
        # fresh mtimes: the engine deletes unknown segment files a minute old
        shutil.copytree(template, d, symlinks=True, copy_function=shutil.copy)
        _mutate(d, case["ops"])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run the check, report, never return into the worker
            os.close(r)
            try:
                res = check(d, template, spec["context"], case)
            except BaseException as e:  # noqa: BLE001 - everything is a finding here
                res = {"outcome": "error", "why": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(res).encode())
            os._exit(0)
        os.close(w)
        deadline = time.monotonic() + spec["timeout"]
        status = None
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)
        with os.fdopen(r, "rb") as f:
            payload = f.read()
        if status is None:
            out = {"outcome": "hang", "why": f"no answer in {spec['timeout']}s"}
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            out = {
                "outcome": "crash",
                "why": f"killed by signal {sig} ({signal.Signals(sig).name})",
            }
        elif os.WEXITSTATUS(status) != 0 or not payload:
            out = {"outcome": "crash", "why": f"exit status {os.WEXITSTATUS(status)}, no report"}
        else:
            out = json.loads(payload)
        out["name"] = case["name"]
        print(json.dumps(out), flush=True)
        shutil.rmtree(d, ignore_errors=True)


def _run(
    template: Path, ctx: dict, check: str, cases: list[dict], scratch: Path, workers: int = 2
) -> list[dict]:
    """Runs `cases` through `workers` worker processes; results in case order."""
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); "
        "import test_corruption_matrix as m; m._serve()"
    )
    procs = []
    for w in range(workers):
        mine = cases[w::workers]
        if not mine:
            continue
        spec = {
            "template": str(template),
            "scratch": str(scratch / f"w{w}"),
            "check": check,
            "context": ctx,
            "cases": mine,
            "timeout": CASE_TIMEOUT,
        }
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdin is not None
        p.stdin.write(json.dumps(spec))
        p.stdin.close()
        procs.append((w, p))
    by_name: dict[str, dict] = {}
    for _, p in procs:
        assert p.stdout is not None and p.stderr is not None
        out = p.stdout.read()
        err = p.stderr.read()
        p.wait(timeout=600)
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
        for line in out.splitlines():
            res = json.loads(line)
            by_name[res["name"]] = res
    missing = [c["name"] for c in cases if c["name"] not in by_name]
    assert not missing, f"no result for {missing[:10]}"
    return [by_name[c["name"]] for c in cases]


def _summary(what: str, results: list[dict]) -> collections.Counter:
    counts = collections.Counter(r["outcome"] for r in results)
    print(f"\n{what}: {len(results)} cases: {dict(sorted(counts.items()))}")
    return counts


def _assert_all(results: list[dict], ok: set[str]) -> None:
    bad = [r for r in results if r["outcome"] not in ok]
    assert not bad, f"{len(bad)} of {len(results)} cases misbehaved:\n" + "\n".join(
        f"  {r['name']}: {r['outcome']}: {r.get('why', '')}" for r in bad[:25]
    )


# ------------------------------------------------------------------ segment checks


def _expected_damage(d: Path, template: Path, ctx: dict) -> tuple[set[int], set[int]]:
    """(documents whose record bytes changed or were cut off, segments whose own
    header changed or that lost bytes)."""
    damaged, seg_problems = set(), set()
    for sg in ctx["segments"]:
        orig = (template / _rel_segment(sg)).read_bytes()
        p = d / _rel_segment(sg)
        new = p.read_bytes() if p.exists() else None
        if new is None or new[:32] != orig[:32] or len(new) < len(orig):
            seg_problems.add(sg)
        for r in ctx["records"]:
            if r["seg"] != sg:
                continue
            a, b = r["off"], r["off"] + r["len"]
            if new is None or new[a:b] != orig[a:b]:
                damaged.add(r["doc"])
    return damaged, seg_problems


def _check_segments(d: Path, template: Path, ctx: dict, case: dict) -> dict:
    """verify names exactly the damaged records; each damaged document is a miss,
    every other one bit-exact; new and damaged blocks can be put (again) and read
    back, also after reopening; verify is clean of damage then."""
    comp, shape = ctx["compression"], ctx["shape"]
    _, docs, new_doc = SHAPES[shape]
    kind = _kind(comp)
    damaged, seg_problems = _expected_damage(d, template, ctx)
    bid = {r["doc"]: r["bid"] for r in ctx["records"]}
    want_ids = {bid[k] for k in damaged}
    with _open(d, comp, shape) as s:
        v = s.verify()
        got_ids = {x["block_id"] for x in v["damaged"]}
        if got_ids != want_ids:
            return _bad(f"verify named {_docs(got_ids, bid)}, damaged are {sorted(damaged)}", v)
        if bool(v["problems"]) != bool(seg_problems):
            return _bad(f"verify problems {v['problems']}, damaged segments {seg_problems}", v)
        for k, doc in enumerate(docs):
            got = s.get(doc)
            want = _kv(doc, kind, shape)
            if k in damaged:
                if got.shape[2] != 0:
                    return _bad(f"doc {k} is damaged but get returned {got.shape[2]} tokens")
                if s.lookup(doc) != 0:
                    return _bad(f"doc {k}: lookup still finds the damaged block")
            else:
                assert_kv_equal(got, want, f"doc {k}")
        v = s.verify()  # the reads moved the damaged blocks aside: still reported, once
        again = [x["block_id"] for x in v["damaged"]]
        if sorted(again) != sorted(want_ids):
            return _bad(f"after reads verify named {again}, want {sorted(want_ids)}")
        # writable: a new block, and every damaged one stored again
        assert s.put(new_doc, _kv(new_doc, kind, shape)) == B
        for k in damaged:
            assert s.put(docs[k], _kv(docs[k], kind, shape)) == B
        for doc in [*docs, new_doc]:
            assert_kv_equal(s.get(doc), _kv(doc, kind, shape), f"tokens {doc[0]}")
    with _open(d, comp, shape) as s:
        for doc in [*docs, new_doc]:
            assert_kv_equal(s.get(doc), _kv(doc, kind, shape), f"reopen {doc[0]}")
        v = s.verify()
        if v["damaged"]:
            return _bad(f"damage left after storing the blocks again: {v['damaged']}")
    return {"outcome": "ok", "damaged": len(damaged)}


def _bad(why: str, v: dict | None = None) -> dict:
    if v is not None:
        why += f" (verify: damaged {[x['reason'] for x in v['damaged']]})"
    return {"outcome": "wrong", "why": why}


def _docs(ids: set[str], bid: dict[int, str]) -> list:
    back = {h: k for k, h in bid.items()}
    return sorted(back.get(h, h) for h in ids)


def _seg_ctx(templates: dict, name: str) -> tuple[Path, dict]:
    return templates[name]


def _recs(ctx: dict, seg: int) -> list[dict]:
    return sorted((r for r in ctx["records"] if r["seg"] == seg), key=lambda r: r["off"])


def _flip_cases(ctx: dict, rng: random.Random) -> list[dict]:
    s1, s2 = ctx["segments"]
    cases = []
    # every byte of a segment header (bytes 28..31 are reserved)
    for at in range(32):
        cases.append({"name": f"seghdr@{at}", "ops": [_flip(_rel_segment(s1), at, 1 << at % 8)]})
    # one record's header and token ids: every 8-byte field, at sampled bytes
    r = _recs(ctx, s2)[3]
    for at in sorted({*range(0, 80, 4), *rng.sample(range(80 + 4 * B), 12)}):
        f = _flip(_rel_segment(s2), r["off"] + at, 1 << (at * 3) % 8)
        cases.append({"name": f"rec3meta@{at}", "ops": [f]})
    # sampled offsets anywhere, random bit
    for sg in (s1, s2):
        size = max(x["off"] + x["len"] for x in _recs(ctx, sg))
        for at in sorted(rng.sample(range(32, size), 16)):
            f = _flip(_rel_segment(sg), at, 1 << rng.randrange(8))
            cases.append({"name": f"seg{sg}@{at}", "ops": [f]})
    return cases


def _flip(file: str, at: int, mask: int) -> dict:
    return {"op": "flip", "file": file, "at": at, "mask": mask}


def _truncate_cases(ctx: dict) -> list[dict]:
    """At every record boundary, and inside every record: its header, token ids,
    payload start, middle and last byte; inside the segment header; at 0."""
    cases = []
    for sg in ctx["segments"][:1]:  # the other one is built the same way
        points = {0, 1, 16, 31, 32}
        for i, r in enumerate(_recs(ctx, sg)):
            o, n = r["off"], r["len"]
            points |= {o, o + 40, o + 80 + 2 * B, o + (80 + 4 * B + n) // 2, o + n - 1, o + n}
            if i % 3 == 0:
                points |= {o + 1, o + 79, o + 80, o + 80 + 4 * B}
        for at in sorted(points):
            cases.append(
                {"name": f"seg{sg}@{at}", "ops": [{"op": "truncate", "file": _rel_segment(sg),
                                                    "len": at}]}
            )  # fmt: skip
    return cases


def _zero_cases(ctx: dict, rng: random.Random) -> list[dict]:
    """Every 4 KiB page of both segments (a compressed segment may be shorter than a
    page: then the page is the whole file), and a few unaligned page-long ranges."""
    cases = []
    for sg in ctx["segments"]:
        size = max(x["off"] + x["len"] for x in _recs(ctx, sg))
        for start in range(0, size, PAGE):
            z = {"op": "zero", "file": _rel_segment(sg), "start": start,
                 "end": min(start + PAGE, size)}  # fmt: skip
            cases.append({"name": f"seg{sg}page@{start}", "ops": [z]})
        n = min(PAGE, size // 3)
        for start in rng.sample(range(1, size - n), 3):
            z = {"op": "zero", "file": _rel_segment(sg), "start": start, "end": start + n}
            cases.append({"name": f"seg{sg}range@{start}+{n}", "ops": [z]})
    return cases


COMPRESSIONS = pytest.mark.parametrize("comp", ["raw", "zstd", "exponent"])


@COMPRESSIONS
def test_segment_bit_flips(templates, tmp_path, comp):
    template, ctx = _seg_ctx(templates, comp)
    cases = [c for c in _flip_cases(ctx, random.Random(11)) if not c["name"].startswith("seghdr")]
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary(f"segment bit flips ({comp})", results)
    _assert_all(results, {"ok"})
    assert sum(r["damaged"] for r in results) == len(results), "every flip hit one record"


@pytest.mark.parametrize(
    "fields",
    [
        "checked",
        "reserved",
    ],
)
def test_segment_header_bit_flips(templates, tmp_path, fields):
    """Bytes 0..27 of a segment header are magic, version, length, number and
    checksum; 28..31 are reserved (zero). Each flip must be a `verify` problem;
    the records after the header still read."""
    template, ctx = _seg_ctx(templates, "raw")
    cases = [c for c in _flip_cases(ctx, random.Random(11)) if c["name"].startswith("seghdr")]
    lo, hi = (0, 28) if fields == "checked" else (28, 32)
    cases = [c for c in cases if lo <= int(c["name"].split("@")[1]) < hi]
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary(f"segment header bit flips ({fields})", results)
    _assert_all(results, {"ok"})


@COMPRESSIONS
def test_segment_truncated_everywhere(templates, tmp_path, comp):
    template, ctx = _seg_ctx(templates, comp)
    cases = _truncate_cases(ctx)
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary(f"segment truncations ({comp})", results)
    _assert_all(results, {"ok"})
    # the cut at a segment's end damages nothing; every other cut something
    assert {r["damaged"] for r in results} >= {0, 1, PER_SEGMENT}


@COMPRESSIONS
def test_segment_zeroed_pages(templates, tmp_path, comp):
    template, ctx = _seg_ctx(templates, comp)
    cases = _zero_cases(ctx, random.Random(12))
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary(f"segment zeroed pages ({comp})", results)
    _assert_all(results, {"ok"})


def test_segment_swapped_and_copied_records(templates, tmp_path):
    """Two records swapped between the two segments (and within one), or one
    record copied over another: every record whose place now holds other bytes
    is a miss, the copied one still reads where its index entry points."""
    template, ctx = _seg_ctx(templates, "raw")
    s1, s2 = ctx["segments"]
    r1, r2 = _recs(ctx, s1), _recs(ctx, s2)
    assert {r["len"] for r in r1 + r2} == {r1[0]["len"]}, "raw records: all the same length"
    n = r1[0]["len"]
    cases = []
    for i, j in [(0, 0), (2, 5), (7, 7), (4, 1)]:
        cases.append({"name": f"swap s1r{i}<->s2r{j}", "ops": [
            {"op": "swap", "a": [_rel_segment(s1), r1[i]["off"], n],
             "b": [_rel_segment(s2), r2[j]["off"]]}]})  # fmt: skip
    for i, j in [(0, 1), (3, 6)]:
        cases.append({"name": f"swap s1r{i}<->s1r{j}", "ops": [
            {"op": "swap", "a": [_rel_segment(s1), r1[i]["off"], n],
             "b": [_rel_segment(s1), r1[j]["off"]]}]})  # fmt: skip
    for i, j in [(1, 2), (6, 0)]:
        cases.append({"name": f"copy s1r{i}->s2r{j}", "ops": [
            {"op": "copy", "src": [_rel_segment(s1), r1[i]["off"], n],
             "dst": [_rel_segment(s2), r2[j]["off"]]}]})  # fmt: skip
    # half a record moved: the tail of one over the tail of another
    cases.append({"name": "copy tail s2r3->s1r4", "ops": [
        {"op": "copy", "src": [_rel_segment(s2), r2[3]["off"] + n // 2, n - n // 2],
         "dst": [_rel_segment(s1), r1[4]["off"] + n // 2]}]})  # fmt: skip
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary("segment swapped/copied records", results)
    _assert_all(results, {"ok"})
    assert [r["damaged"] for r in results] == [2, 2, 2, 2, 2, 2, 1, 1, 1]


# ------------------------------------------------------- padded (format v2) records


def _regions(r: dict) -> dict[str, int]:
    """Offsets in a padded record: its padding, header, token ids, payload."""
    o, pad, n = r["off"], r["pad"], r["len"]
    meta = o + pad
    return {
        "pad0": o, "padmid": o + pad // 2, "padlast": meta - 1,
        "magic": meta, "stored_len": meta + 16, "block_id": meta + 40, "hdr_crc": meta + 72,
        "token": meta + 80 + 4 * (B // 2), "payload0": meta + META,
        "payloadmid": meta + META + (n - pad - META) // 2, "last": o + n - 1,
    }  # fmt: skip


def _padded_recs(ctx: dict) -> list[tuple[str, dict]]:
    """The records damaged: the first of a segment (its padding follows the
    segment header), one in the middle, the last of the other segment."""
    s1, s2 = ctx["segments"]
    return [("s1r0", _recs(ctx, s1)[0]), ("s1r4", _recs(ctx, s1)[4]), ("s2r7", _recs(ctx, s2)[7])]


def _padded_cases(ctx: dict, kind: str, rng: random.Random) -> list[dict]:
    cases = []
    for name, r in _padded_recs(ctx):
        file, at = _rel_segment(r["seg"]), _regions(r)
        o, pad, n = r["off"], r["pad"], r["len"]
        if kind == "flips":
            for region, x in at.items():
                f = _flip(file, x, 1 << rng.randrange(8))
                cases.append({"name": f"{name} flip {region}@{x}", "ops": [f]})
        elif kind == "truncated":
            for region, x in [*at.items(), ("end", o + n)]:
                t = {"op": "truncate", "file": file, "len": x}
                cases.append({"name": f"{name} cut {region}@{x}", "ops": [t]})
        elif kind == "zeroed":
            payload, size = o + pad + META, max(x["off"] + x["len"] for x in _recs(ctx, r["seg"]))
            ranges = {
                "padding": (o + 1, o + pad),  # zeros over (mostly) zeros: a no-op
                "pad+header": (o + pad - 16, o + pad + 80),
                "header page": ((o + pad) // PAGE * PAGE, payload),
                "payload page": (payload + PAGE, payload + 2 * PAGE),
                "payload end+next": (o + n - 100, min(o + n + pad + 10, size)),
            }
            for region, (a, b) in ranges.items():
                z = {"op": "zero", "file": file, "start": a, "end": b}
                cases.append({"name": f"{name} zero {region}@{a}+{b - a}", "ops": [z]})
        elif kind == "nonzero padding":
            # Padding bytes made non-zero, meta and payload untouched: the
            # record is damaged (never served), like any other damage.
            for region in ("pad0", "padlast"):
                w = {
                    "op": "copy",
                    "src": [file, at["magic"], 4],
                    "dst": [file, at[region] - 3 * (region == "padlast")],
                }
                cases.append({"name": f"{name} magic in {region}", "ops": [w]})
        else:
            raise ValueError(kind)
    if kind == "zeroed":
        s1 = ctx["segments"][0]
        z = {"op": "zero", "file": _rel_segment(s1), "start": 0, "end": PAGE}
        cases.append({"name": "s1 first page", "ops": [z]})
    return cases


PADDED_KINDS = pytest.mark.parametrize("kind", ["flips", "truncated", "zeroed", "nonzero padding"])


@PADDED_KINDS
def test_padded_segment_damage(templates, tmp_path, kind):
    """Bit flips, truncations and zeroed ranges in every region of padded
    records (padding, header, token ids, payload, the record after): each
    damaged record is a miss in `verify`, reads and lookups, the others read
    bit-exact, and storing the blocks again heals the store."""
    template, ctx = templates["padded"]
    cases = _padded_cases(ctx, kind, random.Random(15))
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary(f"padded segment damage ({kind})", results)
    _assert_all(results, {"ok"})
    # Zeros over padding, and a cut at the end of the file, damage nothing;
    # every other case damages a record.
    harmless = [r["name"] for r in results if r["damaged"] == 0]
    assert harmless == [
        c["name"]
        for c in cases
        if " zero padding@" in c["name"] or c["name"].startswith("s2r7 cut end")
    ], harmless


def test_padded_swapped_records(templates, tmp_path):
    """Two padded records of the same length (not the first of a segment)
    swapped within and across segments: both places hold other bytes."""
    template, ctx = templates["padded"]
    s1, s2 = ctx["segments"]
    r1, r2 = _recs(ctx, s1), _recs(ctx, s2)
    n = r1[1]["len"]
    assert r1[1]["len"] == r1[5]["len"] == r2[3]["len"] and r1[0]["len"] != n
    cases = [
        {"name": f"swap {a}<->{b}", "ops": [
            {"op": "swap", "a": [_rel_segment(x["seg"]), x["off"], n],
             "b": [_rel_segment(y["seg"]), y["off"]]}]}
        for a, b, x, y in [("s1r1", "s1r5", r1[1], r1[5]), ("s1r5", "s2r3", r1[5], r2[3])]
    ]  # fmt: skip
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary("padded swapped records", results)
    _assert_all(results, {"ok"})
    assert [r["damaged"] for r in results] == [2, 2]


def _check_rebuilt(d: Path, template: Path, ctx: dict, case: dict) -> dict:
    """The index rebuilt from the damaged segments (the scanner behind
    `rebuild-index` and `verify --repair` of a lost index) agrees with reads
    and `verify`: every damaged record a miss (a record behind non-zero
    padding included), every other one bit-exact; storing the damaged
    blocks again leaves a store that verifies clean."""
    shape = ctx["shape"]
    _, docs, _ = SHAPES[shape]
    damaged, _ = _expected_damage(d, template, ctx)
    kvstore.rebuild_index(d)
    with _open(d, None, shape) as s:
        for k, doc in enumerate(docs):
            got = s.get(doc)
            if k in damaged and got.shape[2] != 0:
                return _bad(f"doc {k} is damaged but the rebuilt index serves it")
            if k not in damaged:
                assert_kv_equal(got, _kv(doc, "random", shape), f"doc {k}")
        for k in damaged:
            assert s.put(docs[k], _kv(docs[k], "random", shape)) == B
        v = s.verify()
        if v["damaged"]:
            return _bad(f"damage left after storing the blocks again: {v['damaged']}")
        for doc in docs:
            assert_kv_equal(s.get(doc), _kv(doc, "random", shape), f"again {doc[0]}")
    return {"outcome": "ok", "damaged": len(damaged)}


@pytest.mark.parametrize("kind", ["flips", "nonzero padding"])
def test_padded_damage_rebuilt_index(templates, tmp_path, kind):
    template, ctx = templates["padded"]
    cases = _padded_cases(ctx, kind, random.Random(16))
    results = _run(template, ctx, "_check_rebuilt", cases, tmp_path)
    _summary(f"padded damage, index rebuilt ({kind})", results)
    _assert_all(results, {"ok"})


def test_segment_file_missing(templates, tmp_path):
    template, ctx = _seg_ctx(templates, "raw")
    s1 = ctx["segments"][0]
    cases = [{"name": "seg1 removed", "ops": [{"op": "remove", "file": _rel_segment(s1)}]}]
    results = _run(template, ctx, "_check_segments", cases, tmp_path)
    _summary("segment file missing", results)
    _assert_all(results, {"ok"})


# ------------------------------------------------------------------------- MANIFEST


def test_manifest_every_bit_flipped(templates, tmp_path):
    """Every bit of the MANIFEST flipped, one at a time: CorruptStore on open.
    The only harmless flips: bit 5 of a hex letter a-f of the checksum value,
    which turns it into the same digit in upper case."""
    template, _ = templates["raw"]
    d = tmp_path / "s"
    shutil.copytree(template, d)
    m = d / "MANIFEST"
    orig = m.read_bytes()
    text = orig.decode()
    crc_at = text.rindex("crc32c ") + len("crc32c ")
    assert text[crc_at + 8 :] == "\n" and len(text) - crc_at == 9
    counts: collections.Counter = collections.Counter()
    fd = os.open(m, os.O_WRONLY)  # rewritten in place: truncating 2000 times is slow
    try:
        for at in range(len(orig)):
            for bit in range(8):
                os.pwrite(fd, bytes([orig[at] ^ 1 << bit]), at)
                harmless = crc_at <= at < crc_at + 8 and chr(orig[at]) in "abcdef" and bit == 5
                try:
                    s = _open(d)
                except kvstore.CorruptStore as e:
                    assert not harmless, f"byte {at} bit {bit}: {e}"
                    assert "MANIFEST" in str(e), str(e)
                    counts["refused"] += 1
                    continue
                finally:
                    os.pwrite(fd, orig[at : at + 1], at)
                with s:
                    assert harmless, f"a flip of byte {at} bit {bit} went unnoticed"
                    assert s.manifest()["fingerprint"] == MODEL
                    for doc in DOCS[:3]:
                        assert_kv_equal(s.get(doc), _kv(doc))
                    counts["harmless"] += 1
    finally:
        os.close(fd)
    assert m.read_bytes() == orig
    print(f"\nMANIFEST bit flips: {8 * len(orig)} cases: {dict(counts)}")
    assert counts["refused"] + counts["harmless"] == 8 * len(orig)


def test_manifest_truncated_zeroed_or_extended(templates, tmp_path):
    template, _ = templates["raw"]
    d = tmp_path / "s"
    shutil.copytree(template, d)
    m = d / "MANIFEST"
    orig = m.read_bytes()
    variants = {f"truncated to {n}": orig[:n] for n in range(len(orig))}
    variants["zeroed"] = b"\0" * len(orig)
    variants["zero page"] = b"\0" * PAGE
    variants["garbage line appended"] = orig + b"x\n"
    variants["second copy appended"] = orig + orig
    variants["not UTF-8"] = orig[:10] + b"\xff\xfe" + orig[12:]
    for what, data in variants.items():
        m.write_bytes(data)
        with pytest.raises(kvstore.CorruptStore, match="MANIFEST"):
            _open(d)
        # opening without layout and model reads the MANIFEST too
        with pytest.raises(kvstore.CorruptStore):
            kvstore.open(d, create=False)
        assert m.read_bytes() == data, f"{what}: open rewrote the damaged MANIFEST"
    print(f"\nMANIFEST truncated/zeroed/extended: {len(variants)} cases")
    m.write_bytes(orig)
    with _open(d) as s:
        assert_kv_equal(s.get(DOCS[0]), kv_for(LAYOUT, DOCS[0]))


# ---------------------------------------------------------------------- LMDB index


def _check_index(d: Path, template: Path, ctx: dict, case: dict) -> dict:
    """Open and read a store whose index was damaged. Acceptable: CorruptStore on
    open; or every get a miss or the exact bytes. Puts and close may raise a
    typed error (the index is damaged) but never crash or return wrong data. With
    case["strict"]: puts must work, and no segment file may be deleted."""
    try:
        s = _open(d)
    except kvstore.CorruptStore:
        return {"outcome": "refused"}
    except kvstore.KVStoreError as e:
        return {"outcome": "open-error", "why": f"{type(e).__name__}: {e}"}
    hits = misses = 0
    try:
        for k, doc in enumerate(DOCS):
            try:
                got = s.get(doc)
            except kvstore.CorruptStore:
                # LMDB found the damage on the way (MDB_CORRUPTED): a typed refusal.
                return {"outcome": "refused-on-read"}
            except kvstore.KVStoreError as e:
                return {"outcome": "get-error", "why": f"doc {k}: {type(e).__name__}: {e}"}
            if got.shape[2] == 0:
                misses += 1
                continue
            try:
                assert_kv_equal(got, _kv(doc), f"doc {k}")
            except AssertionError as e:
                return {"outcome": "WRONG", "why": str(e)}
            hits += 1
        note = ""
        try:
            s.put(NEW_DOC, _kv(NEW_DOC))
            got = s.get(NEW_DOC)
            if got.shape[2]:
                assert_kv_equal(got, _kv(NEW_DOC), "new doc")
        except kvstore.KVStoreError as e:
            if case.get("strict"):
                return {"outcome": "put-error", "why": f"{type(e).__name__}: {e}"}
            note = f"put: {type(e).__name__}"
        except AssertionError as e:
            return {"outcome": "WRONG", "why": str(e)}
    finally:
        with contextlib.suppress(kvstore.KVStoreError):
            s.close()
    if case.get("strict"):
        gone = []
        for n in sorted(os.listdir(template / "segments")):
            orig, now = template / "segments" / n, d / "segments" / n
            if not now.exists() or not now.read_bytes().startswith(orig.read_bytes()):
                gone.append(n)
        if gone:
            return {"outcome": "data-deleted", "why": f"segment files deleted/replaced: {gone}"}
    outcome = "served" if misses == 0 else "served-with-misses"
    return {"outcome": outcome, "why": note, "hits": hits, "misses": misses}


INDEX = "index/data.mdb"
# LMDB's two meta pages: a 16-byte page header, then magic, version, address, map
# size, the free and main database records (48 bytes each), last page, txn id.
LMDB_META_LEN = 16 + 136


def _index_cases(template: Path, kind: str, rng: random.Random) -> list[dict]:
    data = (template / INDEX).read_bytes()
    size = len(data)
    assert size % PAGE == 0 and size >= 4 * PAGE, size
    cases = []
    if kind == "meta":
        # every byte of the current meta page (the higher txn id), one bit each; a
        # sample of the other one
        txnid = [struct.unpack_from("<Q", data, p * PAGE + 144)[0] for p in (0, 1)]
        current = int(txnid[1] > txnid[0])
        for i in range(LMDB_META_LEN):
            at = current * PAGE + i
            cases.append({"name": f"flip meta@{at}", "ops": [_flip(INDEX, at, 1 << i % 8)]})
        for i in sorted(rng.sample(range(LMDB_META_LEN), 16)):
            at = (1 - current) * PAGE + i
            cases.append({"name": f"flip meta@{at}", "ops": [_flip(INDEX, at, 1 << i % 8)]})
    elif kind == "flips":
        # Sampled bytes of the other pages: 40 non-zero ones, 8 zero ones (the
        # candidates are drawn before looking at the bytes, so the choice does not
        # move with the few bytes that differ between runs: timestamps), and the
        # page headers (page number, flags, free-space bounds) of 8 pages.
        candidates = rng.sample(range(2 * PAGE, size), 1000)
        nonzero = [i for i in candidates if data[i]][:40]
        zeros = [i for i in candidates if not data[i]][:8]
        headers = [p * PAGE + rng.randrange(16) for p in rng.sample(range(2, size // PAGE), 8)]
        for at in sorted(nonzero + zeros + headers):
            cases.append({"name": f"flip@{at}", "ops": [_flip(INDEX, at, 1 << rng.randrange(8))]})
    elif kind == "zeroed":
        for start in range(0, size, PAGE):
            z = {"op": "zero", "file": INDEX, "start": start, "end": start + PAGE}
            cases.append({"name": f"zero page@{start}", "ops": [z]})
    elif kind == "truncated":
        cuts = set(range(PAGE, size, PAGE)) | {100, PAGE + 1000, size // 2 + 7, size - 1}
        for at in sorted(cuts):
            t = {"op": "truncate", "file": INDEX, "len": at}
            cases.append({"name": f"truncate@{at}", "ops": [t]})
    else:
        raise ValueError(kind)
    return cases


@pytest.mark.parametrize(
    "kind",
    [
        "meta",
        "flips",
        "zeroed",
        "truncated",
    ],
)
def test_index_damage(templates, tmp_path, kind):
    """A damaged index: CorruptStore on open (or on the read that meets the
    damage), or every get a miss or the exact bytes. Never a signal, a hang, an
    untyped error or wrong bytes."""
    template, ctx = templates["raw"]
    cases = _index_cases(template, kind, random.Random(13))
    results = _run(template, ctx, "_check_index", cases, tmp_path)
    _summary(f"LMDB index damage ({kind})", results)
    for r in results:
        if r["outcome"] not in ("served", "refused"):
            print(f"  {r['name']}: {r['outcome']} {r.get('why', '')}")
    _assert_all(results, {"refused", "refused-on-read", "served", "served-with-misses"})


@pytest.mark.parametrize("age", ["young", "old"])
def test_index_wiped(templates, tmp_path, age):
    """data.mdb emptied (or removed) while the segments remain: CorruptStore on
    open, or a store that works (every get a miss or exact, puts succeed). Either
    way the segment files, the only copy of the data, stay."""
    template, ctx = templates["raw"]
    aged = [{"op": "age", "dir": "segments"}] if age == "old" else []
    cases = [
        {"name": "empty", "ops": [{"op": "truncate", "file": INDEX, "len": 0}, *aged]},
        {"name": "removed", "ops": [{"op": "remove", "file": INDEX},
                                    {"op": "remove", "file": "index/lock.mdb"}, *aged]},
    ]  # fmt: skip
    for c in cases:
        c["strict"] = True
    results = _run(template, ctx, "_check_index", cases, tmp_path)
    _summary(f"LMDB index wiped ({age} segments)", results)
    for r in results:
        print(f"  {r['name']}: {r['outcome']} {r.get('why', '')}")
    _assert_all(results, {"refused", "served", "served-with-misses"})


# ---------------------------------------------------------------------- arena


def _check_arena(d: Path, template: Path, ctx: dict, case: dict) -> dict:
    """Reopen with the hot tier over a damaged arena: refused with CorruptStore
    naming the arena, or every get bit-exact (a damaged slot is a hot-tier miss;
    the block then comes from the segments)."""
    try:
        s = _open(d / "store", hot_bytes=HOT_BYTES, hot_dir=d / "hot")
    except kvstore.CorruptStore as e:
        if "arena" not in str(e):
            return {"outcome": "unclear", "why": str(e)}
        return {"outcome": "refused"}
    except kvstore.KVStoreError as e:
        return {"outcome": "open-error", "why": f"{type(e).__name__}: {e}"}
    with s:
        for k, doc in enumerate(DOCS):
            got = s.get(doc)
            try:
                assert_kv_equal(got, _kv(doc), f"doc {k}")
            except AssertionError as e:
                return {"outcome": "WRONG", "why": str(e)}
        hot = s.stats()["hot_hit_blocks"]
        s.put(NEW_DOC, _kv(NEW_DOC))
        assert_kv_equal(s.get(NEW_DOC), _kv(NEW_DOC), "new doc")
    return {"outcome": "served", "hot_hits": hot}


def _arena_geometry(template: Path, ctx: dict) -> dict:
    data = (template / ctx["arena"]).read_bytes()

    def word(off: int) -> int:
        return struct.unpack_from("<Q", data, off)[0]

    g = {
        "size": len(data),
        "nslots": word(A_NSLOTS),
        "slot_hdr": word(A_SLOT_HDR),
        "slot_size": word(A_SLOT_SIZE),
        "data_off": word(A_DATA_OFF),
        "total": word(A_TOTAL),
    }
    assert g["total"] == len(data)
    used = [
        i for i in range(g["nslots"]) if word(A_HEADER_LEN + i * g["slot_hdr"] + A_S_STATE) == 1
    ]
    assert len(used) == len(DOCS), f"{len(used)} used slots"
    g["used"] = used
    return g


def _arena_cases(template: Path, ctx: dict, region: str, rng: random.Random) -> list[dict]:
    f = ctx["arena"]
    g = _arena_geometry(template, ctx)
    cases = []
    if region == "header-identity":  # magic, version, store tag, ready flag, counters
        # magic, version, ready flag: every byte; tag, counters: a sample
        for at in [*range(0, 16), *range(64, 96, 2), *range(96, 104), *range(104, 128, 3)]:
            cases.append({"name": f"hdr@{at}", "ops": [_flip(f, at, 1 << (at * 5) % 8)]})
        for at in rng.sample(range(128, A_HEADER_LEN), 4):
            cases.append({"name": f"hdr-pad@{at}", "ops": [_flip(f, at, 1 << rng.randrange(8))]})
    elif region == "header-geometry":  # slot count, ways, slot sizes, data offset, total
        for at in range(16, 64):
            cases.append({"name": f"hdr@{at}", "ops": [_flip(f, at, 1 << (at * 5) % 8)]})
    elif region == "slot-header":
        for n in range(24):
            slot = g["used"][n % len(g["used"])]
            at = A_HEADER_LEN + slot * g["slot_hdr"] + rng.randrange(72 + 4 * B)
            cases.append(
                {"name": f"slot{slot}hdr@{at}", "ops": [_flip(f, at, 1 << rng.randrange(8))]}
            )
    elif region == "slot-data":
        for n in range(24):
            slot = g["used"][n % len(g["used"])]
            at = g["data_off"] + slot * g["slot_size"] + rng.randrange(LAYOUT.block_bytes)
            cases.append(
                {"name": f"slot{slot}data@{at}", "ops": [_flip(f, at, 1 << rng.randrange(8))]}
            )
    elif region == "truncated":
        for at in sorted(
            {
                0,
                100,
                A_HEADER_LEN - 1,
                A_HEADER_LEN,
                A_HEADER_LEN + 1000,
                g["data_off"],
                g["size"] // 2 + 5,
                g["size"] - PAGE,
                g["size"] - 1,
            }
        ):
            cases.append({"name": f"truncate@{at}", "ops": [{"op": "truncate", "file": f,
                                                              "len": at}]})  # fmt: skip
    elif region == "zeroed-meta":
        starts = {0, A_HEADER_LEN}
        starts |= {(A_HEADER_LEN + s * g["slot_hdr"]) // PAGE * PAGE for s in g["used"][:4]}
        for start in sorted(starts):
            z = {"op": "zero", "file": f, "start": start, "end": start + PAGE}
            cases.append({"name": f"zero page@{start}", "ops": [z]})
    elif region == "zeroed-data":
        starts = {(g["data_off"] + s * g["slot_size"]) // PAGE * PAGE for s in g["used"][:6]}
        for start in sorted(starts):
            z = {"op": "zero", "file": f, "start": start, "end": start + PAGE}
            cases.append({"name": f"zero page@{start}", "ops": [z]})
    else:
        raise ValueError(region)
    return cases


@pytest.mark.parametrize(
    "region",
    [
        "header-identity",
        "header-geometry",
        "slot-header",
        "slot-data",
        "truncated",
        "zeroed-meta",
        "zeroed-data",
    ],
)
def test_arena_damage(templates, tmp_path, region):
    template, ctx = templates["hot"]
    cases = _arena_cases(template, ctx, region, random.Random(14))
    results = _run(template, ctx, "_check_arena", cases, tmp_path)
    _summary(f"arena damage ({region})", results)
    _assert_all(results, {"refused", "served"})
