#!/usr/bin/env python3
"""How long the remote tier's deadlines take against servers that misbehave: the
wall-clock side of the claims `tests/test_remote.py` checks by counters and errors.

    python benches/bench_deadlines.py [--timeout 0.3] [--json OUT]

Fake RESP servers on 127.0.0.1 (tests/support/fake_resp.py), no Redis needed. Each
row is one measured run beside the bound the README states for it (`timeout` is
the option of the same name), plus 0.1 s for the scheduler:

1. `open` with a node whose name does not resolve: within one timeout.
2. `open` with a node that answers every command after 0.4 of the timeout: within
   one timeout (the steps share one deadline).
3. A lookup whose reply is trickled a byte at a time (each byte in time, the whole
   far past it): within one timeout; the next lookup, with the node's breaker
   open: free (no timeout).
4. Lookups redirected (MOVED) to a node that never answers: the first within one
   timeout, the next four free.
5. `close` with a server trickling every reply and uploads queued: within
   `close_timeout` (10 s) and one timeout.

Never asserts on the times: it reports them, and whether each is within its bound
(on a loaded machine a bound can be missed by the scheduler, not by the store).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))

import numpy as np  # noqa: E402
from support.fake_resp import CLUSTER_INFO, FakeServer, bulk, cluster_slots, trickle  # noqa: E402

import kvstore  # noqa: E402

LAYOUT = kvstore.Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
MODEL = "bench/deadlines@1"
B = LAYOUT.block_size
CLOSE_TIMEOUT = 10.0  # the engine's default close_timeout
# A call may end a few ms past its deadline (the kernel rounds socket timeouts up to
# its tick; README, Remote tier): the bounds below allow this much past it.
SLACK = 0.1


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def kv(tokens: list[int]) -> np.ndarray:
    return np.zeros(LAYOUT.kv_shape(len(tokens)), np.float16)


def timed(f: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def store(path: Path, node: str, timeout: float, **remote: Any) -> kvstore.Store:
    r = kvstore.Remote(nodes=[node], timeout=timeout, **remote)
    return kvstore.open(path, LAYOUT, MODEL, durability="none", remote=r)


def open_fails(path: Path, node: str, timeout: float) -> None:
    try:
        store(path, node, timeout).close()
    except kvstore.RemoteError:
        return
    raise RuntimeError(f"open with {node} did not fail")


def run(root: Path, timeout: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(what: str, seconds: float, bound: float) -> None:
        bound += SLACK
        rows.append({"what": what, "seconds": seconds, "bound": bound, "within": seconds <= bound})
        mark = "yes" if seconds <= bound else "NO"
        print(f"{what:<58} {seconds:8.3f} s   bound {bound:6.2f} s   within: {mark}", flush=True)

    # 1. A name that does not resolve.
    took = timed(lambda: open_fails(root / "1", "kvstore-test.invalid:6379", timeout))
    row("open, a name that does not resolve", took, timeout)

    # 2. Every command answered after 0.4 of the timeout.
    def slow(c: Any, a: list[bytes]) -> Any:
        time.sleep(0.4 * timeout)
        return None

    fake = FakeServer(slow)
    try:
        took = timed(lambda: open_fails(root / "2", fake.node, timeout))
    finally:
        fake.close()
    row("open, each command answered after 0.4 timeout", took, timeout)

    # 3. A trickled reply, then the breaker.
    def trickled(c: Any, a: list[bytes]) -> Any:
        if a[0].upper() == b"GETRANGE":
            return trickle(c, bulk(b"x" * 100), timeout / 6)
        return None

    fake = FakeServer(trickled)
    try:
        with store(root / "3", fake.node, timeout, breaker=600) as s:
            row("lookup, a trickled reply", timed(lambda: s.lookup(seq(500, 4 * B))), timeout)
            took = timed(lambda: s.lookup(seq(9000, 4 * B)))
            row("lookup, the node's breaker open (waits no timeout)", took, timeout)
    finally:
        fake.close()

    # 4. Redirects to a frozen node.
    frozen = FakeServer(lambda c, a: True)

    def redirecting(c: Any, a: list[bytes]) -> Any:
        verb = a[0].upper()
        if verb == b"INFO":
            return CLUSTER_INFO
        if verb == b"CLUSTER":
            return cluster_slots([(0, 16383, me.node)])
        if verb in (b"GETRANGE", b"STRLEN", b"EXISTS") and b":session:" not in a[1]:
            return b"-MOVED 0 %s\r\n" % frozen.node.encode()
        return None

    me = FakeServer(redirecting)
    try:
        with store(root / "4", me.node, timeout, breaker=600) as s:
            took = timed(lambda: s.lookup(seq(800, 16 * B)))
            row("lookup, redirected to a frozen node", took, timeout)

            def four() -> None:
                for k in range(1, 5):
                    s.lookup(seq(800 + 1000 * k, 16 * B))

            row("4 more lookups, its breaker open (wait no timeout)", timed(four), timeout)
    finally:
        me.close()
        frozen.close()

    # 5. close with uploads queued and a server trickling every reply.
    def trickling(c: Any, a: list[bytes]) -> Any:
        verb = a[0].upper()
        if verb in (b"STRLEN", b"SET"):
            return trickle(c, b":0\r\n" if verb == b"STRLEN" else b"+OK\r\n", 0.2)
        return None

    fake = FakeServer(trickling)
    try:
        s = store(root / "5", fake.node, timeout)
        tokens = seq(700, 16 * B)
        s.put(tokens, kv(tokens))
        row("close, uploads queued, every reply trickled", timed(s.close), CLOSE_TIMEOUT + timeout)
    finally:
        fake.close()
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--timeout", type=float, default=0.3, help="the remote tier's timeout, s")
    p.add_argument("--dir", help="where temporary stores go (default $TMPDIR)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    print(f"bench_deadlines: timeout {args.timeout} s, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="kvstore-deadlines-", dir=args.dir) as tmp:
        rows = run(Path(tmp), args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps({"timeout": args.timeout, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
