"""The kill loop: a pool of worker processes (tests/support/kill_worker.py) on one
store, one of them SIGKILLed and respawned per cycle; then a fresh process
checks everything acknowledged. Used by tests/test_kill_loop.py and
benches/soak_kill.py.

What it measures, besides the workers' own checks:
- LMDB reader slots, read from the index's lock file after every kill and
  before anything cleans up: slots held by dead processes ("stale") and the
  high-water mark of slots ever used. Every open of the store clears stale
  slots, so neither may grow with the number of kills. (Not through the
  `lmdb` package: its LMDB 0.9 refuses the lock file of the engine's LMDB,
  format 2, with MDB_VERSION_MISMATCH while a store process holds it.)
- Arena slots, through a monitor process that stays up and reads the arena's
  figures: torn slots (odd version: a writer was filling it) must stay bounded
  by the number of hot-tier processes, and a fresh open must reclaim them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import kvstore

TESTS_DIR = Path(__file__).resolve().parents[1]


# Runs support.kill_worker as `python -m` would, after asking for every thread's
# stack on stderr at SIGUSR1 (what `stuck` shows of a worker that hangs).
_WORKER_MAIN = (
    "import faulthandler, runpy, signal; "
    "faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "runpy.run_module('support.kill_worker', run_name='__main__', alter_sys=True)"
)


def _worker_argv(role: str, cfg: dict[str, Any]) -> list[str]:
    """A worker runs support.kill_worker as `python -m` would (through _WORKER_MAIN),
    `tests/` on its path (it imports conftest and support, as the tests do)."""
    return [sys.executable, "-c", _WORKER_MAIN, role, json.dumps(cfg)]


def _worker_env() -> dict[str, str]:
    path = [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@dataclass
class Config:
    path: Path
    cycles: int = 120
    seconds: float = 0.0  # > 0: also stop after this long
    writers: int = 2
    hot_writers: int = 1
    readers: int = 1
    hot_readers: int = 1
    auditors: int = 1
    compactors: int = 1
    seed: int = 0
    interval: float = 0.1  # pause between cycles: workers run undisturbed meanwhile
    max_delay: float = 0.05  # kill this long (uniform) after the victim is ready
    early: float = 0.1  # chance that a cycle kills a worker still starting or opening
    segment_bytes: int = 1 << 20  # the least allowed: about 40 puts per segment
    hot_bytes: int = 4 << 20
    compact_pause: float = 0.1
    log: IO[str] | None = None  # progress lines go here when set


@dataclass
class Figures:
    cycles: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    early_kills: int = 0
    kills_mid_compaction: int = 0
    kills_mid_put: int = 0
    puts_acked: int = 0
    keys_acked: int = 0
    reads_checked: int = 0
    read_hits: int = 0  # reads that found all 3 blocks
    audits: int = 0
    wrong_reads: int = 0
    compactions: int = 0
    records_moved: int = 0
    segments_rewritten: int = 0
    records_dropped: int = 0
    kills_leaving_stale_reader: int = 0
    max_stale_readers: int = 0
    max_reader_slots_in_use: int = 0
    reader_high_water: int = 0
    stale_readers_at_end: int = 0
    reader_slots_after_check: int = 0
    kills_leaving_torn_slot: int = 0
    max_torn_slots: int = 0
    torn_slots_at_end: int = 0
    max_hot_slots_used: int = 0
    hot_slots: int = 0
    hot_processes: int = 0
    processes: int = 0
    final: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    check_seconds: float = 0.0
    max_start_seconds: float = 0.0  # spawn to "ready", the slowest incarnation

    def summary(self) -> str:
        fin = self.final
        kills = ", ".join(f"{n} {role}" for role, n in sorted(self.kills.items()))
        return "\n".join(
            [
                f"cycles {self.cycles} in {self.seconds:.1f} s (final check "
                f"{self.check_seconds:.1f} s; slowest start {self.max_start_seconds:.1f} s); "
                f"kills: {kills}; {self.early_kills} while "
                f"starting, {self.kills_mid_put} mid-put, {self.kills_mid_compaction} "
                "mid-compaction",
                f"puts acked {self.puts_acked} ({self.keys_acked} distinct); reads checked "
                f"{self.reads_checked} ({self.read_hits} full hits); audits of acked puts "
                f"{self.audits}; wrong reads {self.wrong_reads}",
                f"compactions {self.compactions}: {self.records_moved} records moved, "
                f"{self.segments_rewritten} segments rewritten, {self.records_dropped} dropped",
                f"LMDB reader slots: max in use {self.max_reader_slots_in_use}, max stale "
                f"{self.max_stale_readers} ({self.kills_leaving_stale_reader} kills left one), "
                f"stale at the end {self.stale_readers_at_end}, high-water mark "
                f"{self.reader_high_water}, in use after the check {self.reader_slots_after_check}",
                f"arena slots: {self.hot_slots}, max used {self.max_hot_slots_used}, max torn "
                f"{self.max_torn_slots} ({self.kills_leaving_torn_slot} kills left one), torn "
                f"at the end {self.torn_slots_at_end}, after a fresh open "
                f"{fin.get('hot_slots_torn')}",
                f"final: {fin.get('acked')} acked keys checked, lost {len(fin.get('lost', []))}; "
                f"{fin.get('suspects')} in-flight keys read right; verify "
                f"{fin.get('records_checked')} records, {len(fin.get('damaged', []))} damaged, "
                f"{len(fin.get('problems', []))} problems; {fin.get('blocks')} blocks in "
                f"{fin.get('segments')} segments, {fin.get('dead_bytes')} dead bytes",
            ]
        )

    def violations(self) -> list[str]:
        """The guarantees this run broke (empty when all held)."""
        fin, bad = self.final, []

        def want(ok: bool, what: str) -> None:
            if not ok:
                bad.append(what)

        want(self.wrong_reads == 0, f"{self.wrong_reads} wrong reads")
        want(fin.get("acked") == self.keys_acked, "the final check did not see every ack")
        want(not fin.get("lost"), f"acknowledged puts lost: {fin.get('lost', [])[:10]}")
        want(not fin.get("damaged"), f"verify found damage: {fin.get('damaged', [])[:5]}")
        want(not fin.get("problems"), f"verify found problems: {fin.get('problems', [])[:5]}")
        want(self.records_dropped == 0, f"compaction dropped {self.records_dropped} records")
        # A killed worker leaves at most one reader slot (it reads from one
        # thread), and every open clears the stale ones: they never pile up.
        want(self.max_stale_readers <= 3, f"{self.max_stale_readers} stale reader slots")
        want(
            self.stale_readers_at_end <= self.processes,
            f"{self.stale_readers_at_end} stale reader slots after the last kills",
        )
        want(
            self.reader_high_water <= 2 * self.processes + 3,
            f"{self.reader_high_water} reader slots used at once",
        )
        want(self.reader_slots_after_check == 0, "reader slots still held after the check")
        # A process fills one arena slot at a time; opening reclaims torn ones.
        want(
            self.max_torn_slots <= self.hot_processes,
            f"{self.max_torn_slots} torn arena slots with {self.hot_processes} hot processes",
        )
        want(fin.get("hot_slots_torn") == 0, "a fresh open left torn arena slots")
        want(
            fin.get("hot_slots_used", 0) <= fin.get("hot_slots", 0),
            "more arena slots used than exist",
        )
        return bad


class WorkerDied(AssertionError):
    pass


class Worker:
    """One slot of the pool; each `spawn` is a new incarnation."""

    def __init__(self, harness: Harness, role: str, hot: bool, name: str) -> None:
        self.h, self.role, self.hot, self.name = harness, role, hot, name
        self.proc: subprocess.Popen[str] | None = None
        self.incarnation = -1

    def spawn(self) -> None:
        h = self.h
        self.incarnation = h.next_incarnation()
        cfg = dict(h.worker_cfg, hot=self.hot, incarnation=self.incarnation)
        self.err_path = h.logs / f"{self.name}-{self.incarnation}.err"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                _worker_argv(self.role, cfg),
                env=_worker_env(),
                stdin=subprocess.PIPE if self.role == "monitor" else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        h.spawned[self.proc.pid] = f"{self.name} (incarnation {self.incarnation})"
        self.spawned_at = time.monotonic()
        self.ready = threading.Event()
        self.lines: list[str] = []
        self.last, self.last_at = "", time.monotonic()
        self.in_flight: str | None = None
        self.reads = self.hits = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        h = self.h
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.endswith("\n"):
                break  # cut by the kill: not a report
            line = line.rstrip("\n")
            self.last, self.last_at = line, time.monotonic()
            tag, _, rest = line.partition(" ")
            if tag == "ready":
                with h.lock:
                    h.fig.max_start_seconds = max(
                        h.fig.max_start_seconds, time.monotonic() - self.spawned_at
                    )
                self.ready.set()
            elif tag == "p":
                self.in_flight = rest
            elif tag == "A":
                self.in_flight = None
                h.ack(rest)
            elif tag == "R":
                self.reads, self.hits = map(int, rest.split())
            elif tag == "C":
                moved, rewritten, dropped = map(int, rest.split())
                with h.lock:
                    h.fig.compactions += 1
                    h.fig.records_moved += moved
                    h.fig.segments_rewritten += rewritten
                    h.fig.records_dropped += dropped
            elif tag in ("c", "L"):
                pass
            else:
                if tag == "WRONG":
                    with h.lock:
                        h.fig.wrong_reads += 1
                self.lines.append(line)  # monitor answers, WRONG/LOST/BAD reports

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died_by_itself(self) -> WorkerDied:
        assert self.proc is not None
        self.thread.join(timeout=10)
        err = self.err_path.read_text()[-4000:]
        # An error naming another process (a LOCK's holder): which worker that was.
        named = {int(p) for p in re.findall(r"\bpid (\d+)", err)}
        whose = "".join(
            f"\n--- pid {p} was {self.h.spawned[p]}" for p in named & self.h.spawned.keys()
        )
        return WorkerDied(
            f"{self.name} (incarnation {self.incarnation}) exited {self.proc.returncode} "
            f"by itself\n--- its reports\n{self.lines[-10:]}\n--- stderr\n{err}{whose}"
        )

    def kill(self) -> None:
        """SIGKILL, reap, and account for what it reported."""
        assert self.proc is not None
        if not self.alive():
            raise self.died_by_itself()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.thread.join(timeout=60)
        if self.proc.returncode != -signal.SIGKILL:
            raise self.died_by_itself()
        h = self.h
        with h.lock:
            h.fig.kills[self.role] = h.fig.kills.get(self.role, 0) + 1
            if self.role == "auditor":
                h.fig.audits += self.reads
            else:
                h.fig.reads_checked += self.reads
                h.fig.read_hits += self.hits
            if self.role == "compactor" and self.last == "c":
                h.fig.kills_mid_compaction += 1
            if self.in_flight is not None:
                h.fig.kills_mid_put += 1
                h.suspects.add(self.in_flight)
        self.proc.stdout.close()  # type: ignore[union-attr]

    def ask(self, line: str, timeout: float = 60) -> str:
        """Monitor only: one request, one answer line."""
        assert self.proc is not None and self.proc.stdin is not None
        n = len(self.lines)
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        end = time.monotonic() + timeout
        while len(self.lines) == n:
            if not self.alive():
                raise self.died_by_itself()
            if time.monotonic() > end:
                raise AssertionError(f"monitor did not answer {line!r} in {timeout}s")
            time.sleep(0.001)
        return self.lines[n]


class Harness:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.fig = Figures()
        self.lock = threading.Lock()
        self.acked: set[str] = set()
        self.suspects: set[str] = set()
        self._incarnation = 0
        self.spawned: dict[int, str] = {}  # pid -> which worker, for error messages
        work = Path(cfg.path).parent
        self.logs = work / "kill-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.acks_path = work / "acks.log"
        self.acks_file = self.acks_path.open("a")
        # the arena on tmpfs, in a directory of its own that is removed at the end
        self.hot_dir = Path(tempfile.mkdtemp(prefix="kvstore-kill-", dir=_shm_dir()))
        self.worker_cfg = {
            "path": str(cfg.path),
            "hot_dir": str(self.hot_dir),
            "hot_bytes": cfg.hot_bytes,
            "segment_bytes": cfg.segment_bytes,
            "compact_pause": cfg.compact_pause,
            "acks_file": str(self.acks_path),
            "epoch": time.time(),
            "seed": cfg.seed,
        }

    def next_incarnation(self) -> int:
        self._incarnation += 1
        return self._incarnation

    def ack(self, key: str) -> None:
        with self.lock:
            self.fig.puts_acked += 1
            if key not in self.acked:
                self.acked.add(key)
                self.acks_file.write(key + "\n")
                self.acks_file.flush()

    def log(self, msg: str) -> None:
        if self.cfg.log is not None:
            print(msg, file=self.cfg.log, flush=True)

    # -------------------------------------------------------------- measurements

    def reader_slots(self) -> tuple[int, int, int]:
        """(slots in use, of them held by dead processes, high-water mark)."""
        pids, high = lmdb_readers(Path(self.cfg.path) / "index")
        stale = sum(1 for p in pids if not _pid_alive(p))
        return len(pids), stale, high

    def arena_slots(self, monitor: Worker) -> dict[str, int]:
        return json.loads(monitor.ask("stats"))

    def measure(self, monitor: Worker) -> tuple[int, int]:
        in_use, stale, high = self.reader_slots()
        a = self.arena_slots(monitor)
        f = self.fig
        f.max_reader_slots_in_use = max(f.max_reader_slots_in_use, in_use)
        f.max_stale_readers = max(f.max_stale_readers, stale)
        f.reader_high_water = max(f.reader_high_water, high)
        f.max_torn_slots = max(f.max_torn_slots, a["hot_slots_torn"])
        f.max_hot_slots_used = max(f.max_hot_slots_used, a["hot_slots_used"])
        f.hot_slots = a["hot_slots"]
        return stale, a["hot_slots_torn"]

    # -------------------------------------------------------------- diagnosis

    def stuck(self, w: Worker) -> str:
        """What a worker that is not getting ready is doing, and who holds the
        locks an opener waits on: its Python stacks (faulthandler, on SIGUSR1),
        its threads' kernel states, the store LOCK's and the arena's holders
        from /proc/locks, and where every other worker is."""
        assert w.proc is not None
        out = []
        try:
            w.proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
        except ProcessLookupError:
            pass
        out.append(f"--- {w.name} (pid {w.proc.pid}) threads: {_threads(w.proc.pid)}")
        out.append(f"--- its stderr\n{w.err_path.read_text()[-6000:]}")
        store = Path(self.cfg.path)
        files = [store / "LOCK", store / "COMPACT.lock", *sorted(self.hot_dir.glob("*.arena"))]
        ids = {}  # "maj:min:inode" as /proc/locks writes it -> name
        for f in files:
            with contextlib.suppress(OSError):
                st = f.stat()
                dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
                ids[f"{dev}:{st.st_ino}"] = f.name
        with contextlib.suppress(OSError):
            out.append(f"--- LOCK names pid {(store / 'LOCK').read_text().strip() or '?'}")
        locks = ""
        with contextlib.suppress(OSError):
            locks = Path("/proc/locks").read_text()
        for line in locks.splitlines():
            parts = line.split()
            if len(parts) >= 8 and parts[-3] in ids:
                pid = int(parts[-4]) if parts[-4].lstrip("-").isdigit() else -1
                out.append(f"/proc/locks {ids[parts[-3]]}: {line} ({self.spawned.get(pid, '?')})")
        for o in self.pool:
            if o.proc is None:
                continue
            state = "ready" if o.ready.is_set() else "not ready"
            alive = "alive" if o.alive() else f"exited {o.proc.returncode}"
            out.append(
                f"{o.name} pid {o.proc.pid} {alive}, {state}, last {o.last!r} "
                f"{time.monotonic() - o.last_at:.1f}s ago, threads {_threads(o.proc.pid)}"
            )
        return "\n".join(out)

    # ---------------------------------------------------------------------- run

    def run(self) -> Figures:
        cfg, rng, f = self.cfg, self.rng, self.fig
        t0 = time.monotonic()
        monitor = Worker(self, "monitor", True, "monitor")
        pool: list[Worker] = []
        self.pool = [monitor]
        try:
            monitor.spawn()  # creates the store
            _wait_ready([monitor], 60)
            for role, n, hot in (
                ("writer", cfg.writers, False),
                ("writer", cfg.hot_writers, True),
                ("reader", cfg.readers, False),
                ("reader", cfg.hot_readers, True),
                ("auditor", cfg.auditors, True),
                ("compactor", cfg.compactors, False),
            ):
                for i in range(n):
                    pool.append(Worker(self, role, hot, f"{role}{'-hot' if hot else ''}{i}"))
            self.pool = [monitor, *pool]
            f.hot_processes = 1 + sum(w.hot for w in pool)
            f.processes = 1 + len(pool)
            for w in pool:
                w.spawn()
            for w in pool:
                _wait_ready([w], 60)
            last = pool[0]
            while f.cycles < cfg.cycles or cfg.cycles <= 0:
                if cfg.seconds > 0 and time.monotonic() - t0 > cfg.seconds:
                    break
                time.sleep(cfg.interval)
                for w in pool:
                    if not w.alive():
                        raise w.died_by_itself()
                early = rng.random() < cfg.early
                if early:
                    # the latest respawn is likely still importing, opening or recovering
                    victim = last
                    time.sleep(rng.uniform(0, 0.4))
                    f.early_kills += 1
                else:
                    # one that is up and working (others may still be starting;
                    # if all are, the first to be ready)
                    victim = rng.choice(_wait_ready(pool, 60))
                    if victim.role == "compactor" and _wait_compacting(victim, 1):
                        time.sleep(rng.uniform(0, 0.01))
                    else:
                        time.sleep(rng.uniform(0, cfg.max_delay))
                stale_before, torn_before = self.measure(monitor)
                victim.kill()
                stale, torn = self.measure(monitor)
                f.kills_leaving_stale_reader += stale > stale_before
                f.kills_leaving_torn_slot += torn > torn_before
                victim.spawn()
                last = victim
                f.cycles += 1
                if f.cycles % 20 == 0:
                    self.log(
                        f"cycle {f.cycles}: {f.puts_acked} puts acked, "
                        f"{f.reads_checked} reads, {f.audits} audits, "
                        f"{f.compactions} compactions, stale readers <= "
                        f"{f.max_stale_readers}, torn slots <= {f.max_torn_slots}"
                    )
            # The end: every worker killed at once, mid-whatever.
            for w in pool:
                _wait_ready([w], 60)
            time.sleep(rng.uniform(0, cfg.max_delay))
            for w in pool:
                w.kill()
            in_use, stale, high = self.reader_slots()
            f.stale_readers_at_end = stale
            f.reader_high_water = max(f.reader_high_water, high)
            a = self.arena_slots(monitor)
            f.torn_slots_at_end = a["hot_slots_torn"]
            f.max_torn_slots = max(f.max_torn_slots, a["hot_slots_torn"])
            assert monitor.proc is not None and monitor.proc.stdin is not None
            monitor.proc.stdin.write("quit\n")
            monitor.proc.stdin.close()
            assert monitor.proc.wait(timeout=60) == 0, monitor.died_by_itself()
            # A fresh process: its open runs recovery, clears the stale reader
            # slots and (through the hot tier) reclaims the torn arena slots.
            t1 = time.monotonic()
            f.final = self.final_check()
            f.check_seconds = time.monotonic() - t1
            f.reader_slots_after_check = self.reader_slots()[0]
        finally:
            for w in [*pool, monitor]:
                if w.alive():
                    assert w.proc is not None
                    w.proc.kill()
                    w.proc.wait()
            self.acks_file.close()
            f.keys_acked = len(self.acked)
            f.seconds = time.monotonic() - t0
            self.cleanup()
        return f

    def final_check(self) -> dict[str, Any]:
        work = Path(self.cfg.path).parent
        acked, suspects = work / "acked.json", work / "suspects.json"
        acked.write_text(json.dumps(sorted(self.acked)))
        suspects.write_text(json.dumps(sorted(self.suspects - self.acked)))
        cfg = dict(
            self.worker_cfg,
            hot=False,
            incarnation=0,
            acked_file=str(acked),
            suspects_file=str(suspects),
        )
        p = subprocess.run(
            _worker_argv("check", cfg),
            env=_worker_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if p.returncode != 0:
            raise WorkerDied(
                f"final check exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                f"\n--- stderr\n{p.stderr[-4000:]}"
            )
        return json.loads(p.stdout.strip().splitlines()[-1])

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):  # no store if the very first open failed
            kvstore.remove_arena(self.cfg.path, self.hot_dir)
        shutil.rmtree(self.hot_dir, ignore_errors=True)


LMDB_MAGIC = 0xBEEFC0DE
LMDB_LOCK_VERSION = 2  # mdb.master, which the engine links through heed
READER = struct.Struct("<QiiQ")  # MDB_reader: txnid, pid, (pad), tid; one cache line each


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def lmdb_readers(index_dir: Path) -> tuple[list[int], int]:
    """(pid of each reader slot in use, the table's high-water mark), read from
    `lock.mdb` without taking any lock or changing anything.

    The table starts after two cache lines' worth of header (MDB_txbody: magic,
    format, txnid, numreaders, reader mutex; then the writer mutex), whose size
    depends on the pthread mutex size the format word encodes."""
    data = (index_dir / "lock.mdb").read_bytes()
    magic, fmt, _txnid, high = struct.unpack_from("<IIQI", data, 0)
    desc = (fmt >> 12) & 0x7FFF  # MDB_lock_desc, below the 32/64-bit flags
    lock_type = desc // 270
    if magic != LMDB_MAGIC or fmt % 4096 != LMDB_LOCK_VERSION or desc % 6 or lock_type < 10:
        # not: LMDB lock format 2, 64-byte cache lines, POSIX mutexes
        raise AssertionError(f"unknown LMDB lock file: magic {magic:#x}, format {fmt:#x}")
    mutex = 4 * ((lock_type - 10) // 5)
    start = _up(_up(20, 8) + mutex, 64) + _up(mutex, 64)
    pids = []
    for i in range(high):
        _, pid, _, _ = READER.unpack_from(data, start + 64 * i)
        if pid:
            pids.append(pid)
    return pids, high


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _threads(pid: int) -> str:
    """Each thread's state and kernel wait channel, e.g. `S futex_wait_queue x2`."""
    seen: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                what = f"{state} {(task / 'wchan').read_text().strip() or '-'}"
                seen[what] = seen.get(what, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in seen.items()) or "(gone)"


def _wait_compacting(w: Worker, timeout: float) -> bool:
    """Waits until `w` is in a compaction that has lasted 2 ms (most find nothing
    to do and take less): a kill soon after lands while it rewrites segments."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and w.alive():
        if w.last == "c" and time.monotonic() - w.last_at > 0.002:
            return True
        time.sleep(0.0005)
    return False


def _wait_ready(workers: list[Worker], timeout: float) -> list[Worker]:
    """Those of `workers` that are ready, waiting until one is."""
    end = time.monotonic() + timeout
    while True:
        ready = [w for w in workers if w.ready.is_set()]
        if ready:
            return ready
        for w in workers:
            if not w.alive():
                raise w.died_by_itself()
        if time.monotonic() > end:
            first = min(workers, key=lambda w: w.spawned_at)
            names = ", ".join(w.name for w in workers)
            raise AssertionError(
                f"none of {names} ready within {timeout}s; {first.name}, the longest "
                f"starting:\n{first.h.stuck(first)}"
            )
        time.sleep(0.01)
