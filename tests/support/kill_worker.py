"""The worker processes of the kill loop (tests/test_kill_loop.py, benches/soak_kill.py).

Run as `PYTHONPATH=tests python -m support.kill_worker ROLE CONFIG_JSON`; each
worker opens the store, prints "ready", then loops until it is killed. Every
line goes to stdout and is flushed at once, so the parent knows what happened
before the kill:

    writer     "p KEY" before a put, "A KEY" after it returned (acknowledged)
    reader     "R READS HITS" now and then (cumulative)
    auditor    "R READS HITS": gets acknowledged keys (tailing the acks file
               the parent keeps) and checks they are all there, bit-exact
    compactor  "c" before a compaction or gc, "C MOVED REWRITTEN DROPPED" after
    monitor    never killed: answers "stats" on stdin with the arena's figures

A wrong byte exits with WRONG_READ (printing "WRONG ..."); an acknowledged
put that is not there exits with LOST (printing "LOST ..."); any other
exception escapes (exit code 1 with a traceback on stderr). No torch here:
workers are respawned a hundred times and must start fast.

Keys name token sequences (and are what the parent records):

    f:I      "frontier" sequence I, which every writer puts at about the same
             time (I follows the clock): concurrent puts of the same blocks,
             one copy wins and the others are dead bytes for compaction
    o:K:N    the N-th own sequence of writer incarnation K (always new blocks)
    s:K:N    the same, saved as session "sK-N"

Each sequence is a shared first block (one of 8), 2 blocks of its own and a
partial block: 3 full blocks.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
from conftest import kv_for, raw_bytes, small_layout

import kvstore

B = 8
LAYOUT = small_layout("float16", block_size=B, D=32)  # 4 KiB blocks
MODEL = "test/kill-loop@1"
FULL = 3 * B
PREFIXES = 8
FRONTIER_HZ = 20  # frontier ticks per second; each tick offers 4 new sequences

WRONG_READ = 3
LOST = 4
BAD_PUT = 5


def tokens_of(key: str) -> list[int]:
    kind, *nums = key.split(":")
    if kind == "f":
        (i,) = map(int, nums)
        head, mark = i, 0x4000_0000 | i
        own = [[mark, b, *range(2, B)] for b in range(2)]
    else:
        k, n = map(int, nums)
        head, mark = k + n, 0x8000_0000 | k
        own = [[mark, n, b, *range(3, B)] for b in range(2)]
    pre = [(head % PREFIXES) * B + j for j in range(B)]
    return pre + own[0] + own[1] + [7, 7, 7]


def session_name(key: str) -> str:
    _, k, n = key.split(":")
    return f"s{k}-{n}"


def expected(tokens: list[int]) -> np.ndarray:
    return kv_for(LAYOUT, tokens)


def frontier_now(epoch: float) -> int:
    return int((time.time() - epoch) * FRONTIER_HZ) * 4


def open_store(cfg: dict, hot: bool) -> kvstore.Store:
    kw: dict = {}
    if hot:
        kw = {"hot_bytes": cfg["hot_bytes"], "hot_dir": cfg["hot_dir"]}
    return kvstore.open(
        cfg["path"],
        layout=LAYOUT,
        model=MODEL,
        durability="sync",
        segment_bytes=cfg["segment_bytes"],
        **kw,
    )


def say(line: str) -> None:
    print(line, flush=True)


def check_kv(got: np.ndarray, tokens: list[int], what: str) -> int:
    """Exits with WRONG_READ unless `got` is the exact KV of a prefix of full blocks."""
    m = got.shape[2]
    if m % B or m > FULL:
        say(f"WRONG {what}: {m} tokens returned")
        sys.exit(WRONG_READ)
    if raw_bytes(got) != raw_bytes(expected(tokens)[:, :, :m]):
        say(f"WRONG {what}: bytes differ in the first {m} tokens")
        sys.exit(WRONG_READ)
    return m


def writer(s: kvstore.Store, cfg: dict, rng: random.Random) -> None:
    k, n = cfg["incarnation"], 0
    while True:
        if rng.random() < 0.5:
            key = f"f:{frontier_now(cfg['epoch']) + rng.randrange(4)}"
        else:
            n += 1
            key = f"{'s' if n % 8 == 0 else 'o'}:{k}:{n}"
        toks = tokens_of(key)
        kv = expected(toks)
        say(f"p {key}")
        session = key[0] == "s"
        covered = s.save_session(session_name(key), toks, kv) if session else s.put(toks, kv)
        if covered != FULL:
            say(f"BAD put {key} covered {covered}")
            sys.exit(BAD_PUT)
        say(f"A {key}")


def reader(s: kvstore.Store, cfg: dict, rng: random.Random) -> None:
    reads = hits = 0
    out = np.empty(LAYOUT.kv_shape(FULL + 3), dtype=np.float16)
    while True:
        now = frontier_now(cfg["epoch"])
        key = f"f:{max(0, now - rng.randrange(400))}"
        toks = tokens_of(key)
        r = rng.random()
        if r < 0.6:
            m = check_kv(s.get(toks), toks, key)
        elif r < 0.9:
            out.view(np.uint16)[...] = 0xFFFF  # NaN garbage: a short fill must not pass
            m = s.get(toks, out=out)
            check_kv(out[:, :, :m], toks, f"{key} (out=)")
        else:
            m = s.lookup(toks)
            if m % B or m > FULL:
                say(f"WRONG lookup {key}: {m}")
                sys.exit(WRONG_READ)
        reads += 1
        hits += m == FULL
        if reads % 25 == 0:
            say(f"R {reads} {hits}")
        time.sleep(0.001)  # leave some CPU to the others (2-core CI machines)


def auditor(s: kvstore.Store, cfg: dict, rng: random.Random) -> None:
    """Every key in the acks file was acknowledged by a writer before it was
    written there: it must be visible here, all of it, bit-exact."""
    acks = Path(cfg["acks_file"])
    keys: list[str] = []
    fresh: list[str] = []
    pos = 0
    reads = 0
    while True:
        with acks.open("rb") as f:
            f.seek(pos)
            data = f.read()
        done = data.rfind(b"\n") + 1  # a half-written last line waits for the next round
        pos += done
        new = data[:done].decode().split()
        keys += new
        fresh += new
        if not keys:
            time.sleep(0.01)
            continue
        key = fresh.pop() if fresh and rng.random() < 0.7 else rng.choice(keys)
        toks = tokens_of(key)
        m = s.lookup(toks)
        if m != FULL:
            say(f"LOST {key}: lookup {m}")
            sys.exit(LOST)
        got = s.get(toks)
        if check_kv(got, toks, key) != FULL:
            say(f"LOST {key}: get returned {got.shape[2]} tokens")
            sys.exit(LOST)
        if key[0] == "s":
            name = session_name(key)
            st = s.session_tokens(name).tolist()
            if st != toks:
                say(f"WRONG session {name}: tokens {st[:4]}...")
                sys.exit(WRONG_READ)
        reads += 1
        if reads % 25 == 0:
            say(f"R {reads} {reads}")
        if not fresh:
            time.sleep(0.002)


def compactor(s: kvstore.Store, cfg: dict, rng: random.Random) -> None:
    while True:
        time.sleep(rng.uniform(0, cfg["compact_pause"]))
        say("c")
        try:
            # gc() without limits evicts nothing (acknowledged puts must
            # survive) and then compacts: the same work by another door.
            r = s.compact() if rng.random() < 0.5 else s.gc()["compact"]
        except kvstore.StoreLocked:
            say("L")  # another compactor holds the lock: expected with several
            continue
        say(f"C {r['records_moved']} {r['segments_rewritten']} {r['records_dropped']}")


def monitor(s: kvstore.Store, cfg: dict, rng: random.Random) -> None:
    """Reports the arena's slot figures as the other processes leave them.
    Opening reclaimed torn slots once; stats() itself reclaims nothing."""
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        st = s.stats()
        say(json.dumps({k: st[k] for k in ("hot_slots", "hot_slots_used", "hot_slots_torn")}))
    s.close()


def final_check(cfg: dict) -> None:
    """In a fresh process, after every worker is dead: recovery runs on open;
    every acknowledged key is there and bit-exact, every key in flight at a
    kill reads right (whatever part of it is there), verify finds nothing; then
    through the hot tier (opening it reclaims the slots killed writers tore)."""
    acked = json.loads(Path(cfg["acked_file"]).read_text())
    suspects = json.loads(Path(cfg["suspects_file"]).read_text())
    report: dict = {"acked": len(acked), "suspects": len(suspects)}
    lost: list[str] = []
    with open_store(cfg, hot=False) as s:
        sessions = set(s.sessions())
        for key in acked:
            toks = tokens_of(key)
            got = s.get(toks)
            if check_kv(got, toks, key) != FULL:
                lost.append(key)
            elif key[0] == "s" and session_name(key) not in sessions:
                lost.append(f"{key} (session)")
        partial = 0
        for key in suspects:
            toks = tokens_of(key)
            partial += 0 < check_kv(s.get(toks), toks, f"{key} (in flight)") < FULL
        report["lost"] = lost
        report["suspects_partial"] = partial
        v = s.verify()
        report["damaged"] = v["damaged"]
        report["problems"] = v["problems"]
        report["records_checked"] = v["records_checked"]
        st = s.stats()
        report.update({k: st[k] for k in ("blocks", "segments", "live_bytes", "dead_bytes")})
    with open_store(cfg, hot=True) as s:
        st = s.stats()
        report.update({k: st[k] for k in ("hot_slots", "hot_slots_used", "hot_slots_torn")})
        for key in acked[-200:]:
            toks = tokens_of(key)
            check_kv(s.get(toks), toks, f"{key} (hot tier)")
        report["hot_hit_blocks"] = s.stats()["hot_hit_blocks"]
    say(json.dumps(report))


ROLES = {
    "writer": writer,
    "reader": reader,
    "auditor": auditor,
    "compactor": compactor,
    "monitor": monitor,
}


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "check":
        final_check(cfg)
        return
    rng = random.Random(f"{cfg['seed']}-{cfg['incarnation']}-{os.getpid()}")
    s = open_store(cfg, cfg["hot"])
    say("ready")
    ROLES[role](s, cfg, rng)


if __name__ == "__main__":
    main()
