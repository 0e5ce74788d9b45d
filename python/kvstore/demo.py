"""`kvstore demo`: the main job end to end on synthetic KV.

An agent's conversations share a long system prompt. One process computes
(here: generates) their KV and puts it; a fresh process, as after a restart,
finds the longest stored prefix of each conversation, reads it back, and
checks it bit for bit against the KV recomputed from the token ids.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from .layout import Layout
from .store import open as open_store

MODEL = "kvstore-demo/synthetic@1"


def _layout(quick: bool) -> Layout:
    if quick:
        return Layout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16", block_size=16)
    return Layout(num_layers=16, num_kv_heads=8, head_dim=64, dtype="float16", block_size=16)


def conversations(quick: bool) -> list[np.ndarray]:
    """A shared system prompt, then a different user turn per conversation."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, 32000, 256 if quick else 2048)
    return [
        np.concatenate([system, rng.integers(0, 32000, (64 if quick else 512) + 5 * i)])
        for i in range(4)
    ]


def synthetic_kv(layout: Layout, tokens: np.ndarray) -> np.ndarray:
    """KV that depends only on (position, token id), like a model's: a prefix shared
    by two conversations has the same KV in both."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    out = np.empty(layout.kv_shape(len(tokens)), dtype=np.float16)
    for pos, tok in enumerate(tokens.tolist()):
        rng = np.random.default_rng((pos, tok))
        out[:, :, pos] = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    return out


def _child(path: str, quick: bool) -> int:
    """The 'restarted' process: lookup + get every conversation, compare, report."""
    layout = _layout(quick)
    convs = conversations(quick)
    ok = True
    with open_store(path, layout=layout, model=MODEL) as store:
        t0 = time.perf_counter()
        found = [store.lookup(c) for c in convs]
        t_lookup = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = [store.get(c) for c in convs]
        t_get = time.perf_counter() - t0
        for c, m, kv in zip(convs, found, got, strict=True):
            expect = synthetic_kv(layout, c[:m])
            ok &= m == len(c) // layout.block_size * layout.block_size
            ok &= kv.shape[2] == m and np.array_equal(kv, expect)
        st = store.stats()
    print(
        f"RESULT {int(ok)} {sum(found)} {t_lookup:.6f} {t_get:.6f} "
        f"{st['bytes_read']} {st['hit_blocks']} {st['miss_blocks']}"
    )
    return 0 if ok else 1


def run(path: str | None, quick: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tmp = None
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvstore-demo-")
        path = os.path.join(tmp.name, "store")
    layout = _layout(quick)
    convs = conversations(quick)
    console.print(
        f"[bold]kvstore demo[/bold]: {len(convs)} conversations sharing a "
        f"{len(convs[0]) - (64 if quick else 512)}-token system prompt; layout "
        f"L={layout.num_layers} H={layout.num_kv_heads} D={layout.head_dim} {layout.dtype}, "
        f"{layout.block_bytes // 1024} KiB per block; store at {path}"
    )
    t0 = time.perf_counter()
    kvs = [synthetic_kv(layout, c) for c in convs]
    t_compute = time.perf_counter() - t0
    with open_store(path, layout=layout, model=MODEL, durability="batch") as store:
        t0 = time.perf_counter()
        for c, kv in zip(convs, kvs, strict=True):
            store.put(c, kv)
        store.flush()
        t_put = time.perf_counter() - t0
        st = store.stats()
    child = subprocess.run(
        [sys.executable, "-m", "kvstore.demo", "--child", path] + (["--quick"] if quick else []),
        capture_output=True,
        text=True,
    )
    line = next((x for x in child.stdout.splitlines() if x.startswith("RESULT")), None)
    if child.returncode not in (0, 1) or line is None:
        console.print(f"[red]restarted process failed[/red]:\n{child.stdout}{child.stderr}")
        return 1
    _, ok, found, t_lookup, t_get, bytes_read, hits, misses = line.split()
    requested = sum(len(c) for c in convs)
    written = st["blocks_written"] * layout.block_bytes
    table = Table(title="kvstore demo", title_justify="left")
    table.add_column("step")
    table.add_column("figure", justify="right")
    rows: list[tuple[str, Any]] = [
        ("KV computed (synthetic, 1st process)", f"{t_compute * 1e3:.1f} ms"),
        ("put + flush (durable)", f"{t_put * 1e3:.1f} ms, {written / t_put / 2**20:.0f} MiB/s"),
        ("blocks written / deduplicated", f"{st['blocks_written']} / {st['blocks_deduped']}"),
        ("restart: lookup of all conversations", f"{float(t_lookup) * 1e3:.2f} ms"),
        ("restart: get of all conversations", f"{float(t_get) * 1e3:.1f} ms"),
        ("tokens requested / restored", f"{requested} / {found}"),
        ("bytes read", f"{int(bytes_read) / 2**20:.1f} MiB"),
        ("hit rate (blocks)", f"{int(hits) / max(1, int(hits) + int(misses)):.1%}"),
        ("restored KV == recomputed KV", "[green]yes[/green]" if ok == "1" else "[red]NO[/red]"),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok == "1" else 1


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2], "--quick" in sys.argv))
    sys.exit(run(None))
