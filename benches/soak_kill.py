"""Soak: the kill loop of tests/test_kill_loop.py, for as long as asked.

    python benches/soak_kill.py --cycles 2000             # ~15 min on 2 cores
    python benches/soak_kill.py --seconds 3600 --json soak.json
    python benches/soak_kill.py --cycles 0 --seconds 0    # until Ctrl-C stops the next epoch

A pool of worker processes (sync writers, readers, an auditor of acknowledged
puts, a compactor; some through the hot tier) shares one store; each cycle
one of them is SIGKILLed at a random moment and respawned. Every
`--epoch-cycles` cycles the workers are all killed, a fresh process checks
the store (every acknowledged put there and bit-exact, verify clean, no
stale LMDB reader or torn arena slot left), and the next epoch starts on a
new store, so disk use stays bounded (~1 MB per cycle at the defaults).

Prints per epoch and in total: cycles, puts acknowledged, reads checked,
wrong reads (must be 0), reader-slot and arena-slot figures. Exit status 1
if any guarantee broke (the store of the failing epoch is kept for a look).
Replay an epoch with --seed (each epoch's seed is printed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.kill_harness import Config, Figures, Harness  # noqa: E402

TOTALS = (
    "cycles",
    "early_kills",
    "kills_mid_put",
    "kills_mid_compaction",
    "puts_acked",
    "keys_acked",
    "reads_checked",
    "read_hits",
    "audits",
    "wrong_reads",
    "compactions",
    "records_moved",
    "segments_rewritten",
    "records_dropped",
    "kills_leaving_stale_reader",
    "kills_leaving_torn_slot",
)
MAXIMA = (
    "max_stale_readers",
    "max_reader_slots_in_use",
    "reader_high_water",
    "stale_readers_at_end",
    "max_torn_slots",
    "torn_slots_at_end",
    "max_start_seconds",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000, help="kills in all (0: no limit)")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: no limit)")
    ap.add_argument("--epoch-cycles", type=int, default=300, help="cycles per store")
    ap.add_argument("--dir", default=None, help="where the stores go (default: $TMPDIR)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--hot-writers", type=int, default=1)
    ap.add_argument("--readers", type=int, default=1)
    ap.add_argument("--hot-readers", type=int, default=1)
    ap.add_argument("--auditors", type=int, default=1)
    ap.add_argument("--compactors", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between cycles")
    ap.add_argument("--max-delay", type=float, default=0.05, help="kill within this after ready")
    ap.add_argument("--early", type=float, default=0.1, help="share of kills while starting")
    ap.add_argument("--json", default=None, help="also write every epoch's figures here")
    args = ap.parse_args()
    if args.cycles <= 0 and args.seconds <= 0:
        print("running until interrupted (no --cycles or --seconds)", flush=True)

    seed = args.seed if args.seed is not None else int(time.time())
    t0 = time.monotonic()
    epochs: list[dict] = []
    total = Figures()
    failed: list[str] = []
    epoch = 0
    try:
        while not failed:
            left = args.cycles - total.cycles if args.cycles > 0 else 0  # 0: no limit
            remaining = args.seconds - (time.monotonic() - t0) if args.seconds > 0 else 0.0
            if args.cycles > 0 and left <= 0 or args.seconds > 0 and remaining <= 0:
                break
            cycles = min([n for n in (left, args.epoch_cycles) if n > 0], default=0)
            work = Path(tempfile.mkdtemp(prefix="kvstore-soak-", dir=args.dir))
            cfg = Config(
                path=work / "store",
                cycles=cycles,
                seconds=remaining,
                writers=args.writers,
                hot_writers=args.hot_writers,
                readers=args.readers,
                hot_readers=args.hot_readers,
                auditors=args.auditors,
                compactors=args.compactors,
                seed=seed + epoch,
                interval=args.interval,
                max_delay=args.max_delay,
                early=args.early,
                log=sys.stdout,
            )
            print(f"== epoch {epoch}: seed {cfg.seed}, store {cfg.path}", flush=True)
            harness = Harness(cfg)
            try:
                f = harness.run()
            except KeyboardInterrupt:
                shutil.rmtree(work, ignore_errors=True)
                raise
            except AssertionError as e:  # a worker died by itself, hung, or a check failed
                f = harness.fig
                failed.append(str(e))
            failed += f.violations() if not failed else []
            print(f.summary(), flush=True)
            epochs.append(dict(asdict(f), seed=cfg.seed, store=str(cfg.path)))
            for k in TOTALS:
                setattr(total, k, getattr(total, k) + getattr(f, k))
            for k in MAXIMA:
                setattr(total, k, max(getattr(total, k), getattr(f, k)))
            if failed:
                print(f"!! epoch {epoch} failed; store kept at {cfg.path}", flush=True)
            else:
                shutil.rmtree(work, ignore_errors=True)
            epoch += 1
    except KeyboardInterrupt:
        print("interrupted", flush=True)

    secs = time.monotonic() - t0
    print(
        f"\n== soak: {epoch} epochs, {total.cycles} cycles in {secs:.0f} s\n"
        f"puts acked {total.puts_acked} ({total.keys_acked} distinct), reads checked "
        f"{total.reads_checked}, audits {total.audits}, wrong reads {total.wrong_reads}\n"
        f"kills: {total.kills_mid_put} mid-put, {total.kills_mid_compaction} mid-compaction, "
        f"{total.early_kills} while starting; compactions {total.compactions} "
        f"({total.records_moved} records moved, {total.records_dropped} dropped)\n"
        f"LMDB reader slots: max stale {total.max_stale_readers} "
        f"({total.kills_leaving_stale_reader} kills left one), max in use "
        f"{total.max_reader_slots_in_use}, high-water {total.reader_high_water}, stale at "
        f"epoch ends <= {total.stale_readers_at_end}\n"
        f"arena slots: max torn {total.max_torn_slots} ({total.kills_leaving_torn_slot} kills "
        f"left one), torn at epoch ends <= {total.torn_slots_at_end}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"seconds": secs, "failed": failed, "epochs": epochs}, indent=1)
        )
    for msg in failed:
        print(f"FAILED: {msg}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
