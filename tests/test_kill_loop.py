"""Kill loops (README, Durability and Concurrency together): writers
(`durability="sync"`), readers, an auditor and a compactor share one store, some
through the hot tier; every cycle one of them is SIGKILLed at a random moment
(mid-put, mid-read, mid-compaction, or while still opening) and respawned.

Shown, over 100+ kills:
- no read ever returns a wrong byte (readers and the auditor compare every
  byte with the KV recomputed from the token ids);
- every acknowledged sync put is visible to the others at once and, after
  the last kill, to a fresh process, bit-exact; verify finds no damage (a
  killed writer's torn tail is truncated by recovery: not damage);
- LMDB reader slots left by killed readers, and arena slots left torn by
  killed writers, stay bounded (each open clears them) instead of piling up.

The workers are in tests/support/kill_worker.py, the loop and its checks in
tests/support/kill_harness.py; benches/soak_kill.py runs the same loop for as long
as asked."""

from __future__ import annotations

import os
import shutil

import pytest
from support.kill_harness import Config, Harness

CYCLES = 120


def _seed() -> int:
    return int(os.environ.get("KVSTORE_CRASH_SEED") or int.from_bytes(os.urandom(4), "little"))


@pytest.mark.slow
def test_kill_loop_put_get_compact(tmp_path):
    seed = _seed()
    print(f"kill loop seed={seed} (set KVSTORE_CRASH_SEED to replay)")
    f = Harness(Config(path=tmp_path / "store", cycles=CYCLES, seed=seed)).run()
    print(f.summary())

    assert f.violations() == [], f.summary()
    # the loop did what it is for
    assert f.cycles == CYCLES
    assert f.puts_acked > 0 and f.reads_checked > 0 and f.audits > 0
    assert f.compactions > 0
    assert f.kills.get("writer", 0) > 0 and f.kills.get("compactor", 0) > 0
    shutil.rmtree(tmp_path / "store")  # ~100 MB; kept when the test fails
