#!/usr/bin/env python3
"""Time to first token with a 4K-token prefix: recompute vs restore, same model, same run.

    python benches/bench_ttft.py [--prefix 4096] [--suffix 16] [--repeat 3] [--json OUT]
        [--sweep 256,512,...,32768] [--sweep-only] [--plot restore.png]

A Llama-architecture model with seeded random weights (float32 on the CPU;
default hidden 1024, 8 layers, 16 heads, 4 KV heads, 89M non-embedding
parameters) gets a prompt of `--prefix` tokens already seen (a system prompt, a
conversation so far) plus `--suffix` new tokens. Time to first token (TTFT) is
the time from "here is the prompt" to the argmax of the first new token's logits:

1. recompute: prefill the whole prompt;
2. kvstore, hot tier: `hf.load` of the prefix from the store's shared-memory
   arena (`hot_bytes`), then prefill of the suffix;
3. kvstore, warm page cache: the same from the segment files (in the page cache),
   through a handle without a hot tier;
4. kvstore, cold page cache: the same after evicting the store's files from the
   page cache (fsync + posix_fadvise(DONTNEED) on each of its files, or with
   --cold-method drop_caches the whole machine's page cache; the residency left
   is measured with mincore and printed), with a handle opened after the eviction;
5. torch.save / torch.load of the DynamicCache (what users do by hand today),
   warm and cold page cache (same eviction), then prefill of the suffix.

Every restored path must produce the recompute's first token (and kvstore and
torch.load bitwise the same logits). Timings are the best of `--repeat` runs
(the median is printed too). Targets: kvstore >= 20x faster than recompute,
and its restore faster than torch.load's in every page-cache state (hot tier and
warm segments vs torch.load warm, cold segments vs torch.load cold).

Then the restore sweep (`--sweep`; `--sweep-only` skips the TTFT part): restore
time against prefix length, 256 to 32K tokens, for the hot tier, warm and cold
segments, cold segments into an empty hot tier (a restart after a reboot: such a
handle reads them with O_DIRECT and promotes them) and torch.load warm and cold,
with KV of the model's layout (random values: restore time does not depend on
them) put once as one 32K-token sequence and torch.save'd per length as the
DynamicCache a model would return.
Every restored cache is checked bitwise against the KV put. The plot (PNG,
`--plot`) is drawn when matplotlib is installed (`pip install kvstore[bench]`);
without it the table is printed and the bench says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import kvstore
from kvstore import hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagecache import evict  # noqa: E402


def build_model(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(build_config(hidden, layers, vocab)).eval()


def build_config(hidden: int = 1024, layers: int = 8, vocab: int = 32000) -> Any:
    """The model's config (its KV layout: hidden // 256 KV heads of 64, float32)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=vocab,
        max_position_embeddings=16384,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


# ------------------------------------------------------------------------------ page cache


def shm_or(base: Path) -> Path:
    """/dev/shm where it is a directory we may write (memory, as a hot tier wants),
    else `base`."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else base


def remove_arenas_in(hot_dir: Path) -> None:
    """Removes the arena files in `hot_dir` only (`kvstore.remove_arena(store,
    hot_dir=...)` would remove the store's arenas wherever its processes look, the
    default directory's too)."""
    for p in hot_dir.glob("kvstore-*.arena"):
        kvstore.remove_arena(p)


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


# -------------------------------------------------------------------------------- timings


class Timing:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft: list[float] = []
        self.restore: list[float] = []
        self.notes: list[str] = []

    @property
    def best(self) -> float:
        return min(self.ttft)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ttft_s": self.ttft,
            "restore_s": self.restore,
            "best_s": self.best,
            "notes": self.notes,
        }


def first_token(model: Any, rest: torch.Tensor, cache: Any) -> tuple[int, torch.Tensor]:
    logits = model(rest, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return int(logits[0, -1].argmax()), logits


def timed_restore(
    model: Any, rest: torch.Tensor, restore: Callable[[], Any], timing: Timing
) -> tuple[int, torch.Tensor]:
    t0 = time.perf_counter()
    cache = restore()
    t1 = time.perf_counter()
    token, logits = first_token(model, rest, cache)
    t2 = time.perf_counter()
    timing.restore.append(t1 - t0)
    timing.ttft.append(t2 - t0)
    return token, logits


# ------------------------------------------------------------------------- restore sweep

SWEEP = "256,512,1024,2048,4096,8192,16384,32768"
SWEEP_METHODS = {
    "kvstore-hot": "kvstore, hot tier",
    "kvstore-warm": "kvstore, segments warm",
    "kvstore-cold": "kvstore, segments cold",
    "kvstore-cold-hot": "kvstore, segments cold into an empty hot tier",
    "torch-warm": "torch.load, warm",
    "torch-cold": "torch.load, cold",
}
# Each kvstore row and the torch.load row in the same page-cache state.
SWEEP_PAIRS = (
    ("kvstore-hot", "torch-warm"),
    ("kvstore-warm", "torch-warm"),
    ("kvstore-cold", "torch-cold"),
    ("kvstore-cold-hot", "torch-cold"),
)


def torch_cache(kv: torch.Tensor, n: int, config: Any) -> Any:
    """The DynamicCache a model returns after `n` tokens, from `kv` ([L, 2, T, H, D]):
    contiguous [1, H, n, D] keys and values of their own per layer."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(kv.shape[0]):
        k, v = (kv[i, j, :n].transpose(0, 1)[None].contiguous() for j in (0, 1))
        cache.update(k, v, i)
    return cache


def cache_equals(cache: Any, kv: torch.Tensor, n: int) -> bool:
    """Whether every layer of `cache` holds exactly `kv`'s first `n` tokens."""
    layers = list(cache.layers)
    return len(layers) == kv.shape[0] and all(
        torch.equal(layer.keys[0].transpose(0, 1), kv[i, 0, :n])
        and torch.equal(layer.values[0].transpose(0, 1), kv[i, 1, :n])
        for i, layer in enumerate(layers)
    )


def restore_sweep(
    config: Any, lengths: Sequence[int], repeat: int, base: Path, cold_method: str
) -> tuple[dict[str, dict[int, list[float]]], list[str]]:
    """Restore times ({method: {prefix length: samples}}) and notes; see the docstring.
    Shared with bench_store.py's restore rows."""
    layout = hf.layout_of(config)
    fp = "bench/ttft-sweep@0"
    n_max = max(lengths)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, config.vocab_size, (n_max,), generator=g)
    kv = (torch.randn(layout.kv_shape(n_max), generator=g) * 0.05).to(getattr(torch, layout.dtype))
    kv_max = layout.block_bytes * (n_max // layout.block_size)
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in SWEEP_METHODS}
    notes: list[str] = []
    wrong: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-sweep-", dir=base) as tmp:
        root = Path(tmp)
        store_dir = root / "store"
        with kvstore.open(store_dir, layout=layout, model=fp, durability="batch") as st:
            assert st.put(ids, kv) == n_max
            st.flush()
        torch_files = {}
        for n in lengths:
            torch_files[n] = root / f"cache-{n}.pt"
            torch.save(torch_cache(kv, n, config), torch_files[n])
            with open(torch_files[n], "rb") as f:
                os.fsync(f.fileno())
        store_files = files_under(store_dir)
        hot_bytes = 2 * kv_max + (64 << 20)
        hot = kvstore.open(store_dir, layout=layout, model=fp, hot_bytes=hot_bytes)
        # The hot tier of a restart after a reboot: empty (an arena of its own,
        # removed after each restore), the segments cold.
        empty_hot = tempfile.TemporaryDirectory(prefix="kvstore-sweep-", dir=shm_or(root))
        empty_hot_dir = Path(empty_hot.name)
        warm = kvstore.open(store_dir, layout=layout, model=fp)  # segments only
        try:
            for s in (hot, warm):  # into the hot tier, and the page cache
                hf.load(s, ids, config=config)

            def timed(key: str, n: int, restore: Callable[[], Any], check: bool) -> None:
                t0 = time.perf_counter()
                cache = restore()
                times[key][n].append(time.perf_counter() - t0)
                if check and not cache_equals(cache, kv, n):
                    wrong.append(f"{key} at {n} tokens")

            def load(s: kvstore.Store, n: int) -> Callable[[], Any]:
                return lambda: hf.load(s, ids[:n], config=config)[0]

            def load_torch(path: Path) -> Callable[[], Any]:
                return lambda: torch.load(path, weights_only=False)

            for r in range(repeat):
                for n in lengths:
                    check = r == 0
                    # Each warm row is timed right after the same restore, as its peer
                    # torch.load warm is: the same bytes in the CPU's caches for all.
                    load(hot, n)()
                    timed("kvstore-hot", n, load(hot, n), check)
                    load(warm, n)()  # in the page cache again (the last cold read evicted it)
                    timed("kvstore-warm", n, load(warm, n), check)
                    used, left = evict(store_files, cold_method)
                    with kvstore.open(store_dir, layout=layout, model=fp) as cold:
                        timed("kvstore-cold", n, load(cold, n), check)
                    if r == 0 and n == n_max:
                        notes.append(f"cold: {used}, {left / 2**20:.1f} MiB of the store resident")
                    evict(store_files, cold_method)
                    with kvstore.open(
                        store_dir,
                        layout=layout,
                        model=fp,
                        hot_bytes=hot_bytes,
                        hot_dir=empty_hot_dir,
                    ) as cold:
                        timed("kvstore-cold-hot", n, load(cold, n), check)
                    remove_arenas_in(empty_hot_dir)
                    path = torch_files[n]
                    torch.load(path, weights_only=False)  # into the page cache
                    timed("torch-warm", n, load_torch(path), check)
                    evict([path], cold_method)
                    timed("torch-cold", n, load_torch(path), check)
            # Blocks the hot handle read from segments after its first, filling load.
            missed = hot.stats()["disk_hit_blocks"] - n_max // layout.block_size
            if missed:
                notes.append(f"hot tier: {missed} block reads came from segments (evicted)")
        finally:
            hot.close()
            warm.close()
            kvstore.remove_arena(store_dir)
            empty_hot.cleanup()
    if wrong:
        notes.append("WRONG KV restored: " + ", ".join(wrong))
    return times, notes


def print_sweep(times: dict[str, dict[int, list[float]]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="restore time against prefix length (best)", title_justify="left")
    lengths = sorted(next(iter(times.values())))
    table.add_column("method")
    for n in lengths:
        table.add_column(f"{n}", justify="right")
    for key, name in SWEEP_METHODS.items():
        table.add_row(name, *(f"{min(times[key][n]) * 1e3:.2f} ms" for n in lengths))
    for key, ref in SWEEP_PAIRS:
        table.add_row(
            f"{SWEEP_METHODS[key]} vs {SWEEP_METHODS[ref]}",
            *(f"{min(times[ref][n]) / min(times[key][n]):.2f}x" for n in lengths),
        )
    console.print(table)


def plot_sweep(times: dict[str, dict[int, list[float]]], path: Path, title: str) -> str:
    """Draws the sweep to `path` (PNG); what was done, for the report."""
    try:
        import matplotlib
    except ImportError:
        return (
            f"no plot: matplotlib is not installed (pip install kvstore[bench]); not written {path}"
        )
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    styles = {
        "kvstore-hot": ("tab:green", "-", "o"),
        "kvstore-warm": ("tab:blue", "-", "s"),
        "kvstore-cold": ("tab:purple", "-", "^"),
        "kvstore-cold-hot": ("tab:brown", "-", "v"),
        "torch-warm": ("tab:orange", "--", "s"),
        "torch-cold": ("tab:red", "--", "^"),
    }
    for key, name in SWEEP_METHODS.items():
        lengths = sorted(times[key])
        color, line, marker = styles[key]
        best_ms = [min(times[key][n]) * 1e3 for n in lengths]
        ax.plot(lengths, best_ms, line, color=color, marker=marker, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("restore time, best of runs (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix", type=int, default=4096, help="tokens restored (default 4096)")
    p.add_argument("--suffix", type=int, default=16, help="new tokens prefilled (default 16)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeat", type=int, default=3, help="runs per method; best kept")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--dir", help="where the temporary store goes (default $TMPDIR)")
    p.add_argument(
        "--cold-method",
        choices=("fadvise", "drop_caches"),
        default="fadvise",
        help="page cache eviction: fsync + posix_fadvise(DONTNEED) on the files (default), "
        "or drop_caches (root; the whole machine)",
    )
    p.add_argument("--json", help="also write every sample here")
    p.add_argument(
        "--sweep",
        default=SWEEP,
        help=f"prefix lengths of the restore sweep (default {SWEEP}; empty: none)",
    )
    p.add_argument("--sweep-only", action="store_true", help="only the restore sweep")
    p.add_argument(
        "--plot", default="bench_ttft_restore.png", help="the sweep's PNG (needs matplotlib)"
    )
    args = p.parse_args(argv)

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = build_config(args.hidden, args.layers, args.vocab)
    lengths = [int(x) for x in args.sweep.split(",") if x.strip()]
    data: dict[str, Any] = {}
    ok = True
    if not args.sweep_only:
        ok = ttft(args, build_model(args.hidden, args.layers, args.vocab), console, data)
    if lengths:
        layout = hf.layout_of(config)
        console.print(
            f"[bold]restore sweep[/bold]: {', '.join(map(str, lengths))} tokens, "
            f"{layout.block_bytes // 1024} KiB blocks, best of {args.repeat}; "
            f"load average {os.getloadavg()[0]:.1f} at the start"
        )
        base = Path(args.dir or tempfile.gettempdir())
        times, notes = restore_sweep(config, lengths, args.repeat, base, args.cold_method)
        print_sweep(times, console)
        title = (
            f"hf.load vs torch.load of a DynamicCache, L={layout.num_layers} "
            f"H={layout.num_kv_heads} D={layout.head_dim} {layout.dtype}, "
            f"{layout.block_bytes // 1024} KiB blocks; load avg {os.getloadavg()[0]:.1f}"
        )
        notes.append(plot_sweep(times, Path(args.plot), title))
        for note in notes:
            console.print(note, markup=False)  # plain text: "kvstore[bench]" is no style
        ok = ok and not any(n.startswith("WRONG") for n in notes)
        data["sweep"] = {k: {str(n): v for n, v in t.items()} for k, t in times.items()}
        data["sweep_notes"] = notes
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0 if ok else 1


def ttft(args: argparse.Namespace, model: Any, console: Any, data: dict[str, Any]) -> bool:
    """The TTFT part (see the docstring); fills `data`; whether every check passed."""
    from rich.table import Table

    layout = hf.layout_of(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (1, args.prefix + args.suffix), generator=g)
    prefix, rest = ids[:, : args.prefix], ids[:, args.prefix :]
    kv_bytes = layout.block_bytes * (args.prefix // layout.block_size)
    params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]TTFT bench[/bold]: Llama {params / 1e6:.0f}M params (float32, CPU, "
        f"{torch.get_num_threads()} threads); prefix {args.prefix} + suffix {args.suffix} tokens; "
        f"KV L={layout.num_layers} H={layout.num_kv_heads} D={layout.head_dim} "
        f"{layout.dtype}: {kv_bytes / 2**20:.0f} MiB"
    )
    # First-call costs (allocator, kernel choice) off the clock.
    warm = model(ids[:, :64], use_cache=True).past_key_values
    first_token(model, ids[:, 64:80], warm)
    del warm

    # The prefix's KV, as an agent has it after its last turn, and the reference logits.
    cache = model(prefix, use_cache=True, logits_to_keep=1).past_key_values
    want_logits = first_token(model, rest, copy.deepcopy(cache))[1]

    base = Path(args.dir or tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-", dir=base) as tmp:
        root = Path(tmp)
        store_dir = root / "store"
        fp = hf.fingerprint(model)
        with hf.open(store_dir, model, fingerprint=fp, durability="batch") as store:
            t0 = time.perf_counter()
            assert hf.save(store, prefix, cache) == args.prefix
            store.flush()
            t_save = time.perf_counter() - t0
            st = store.stats()
        torch_file = root / "cache.pt"
        t0 = time.perf_counter()
        torch.save(cache, torch_file)
        with open(torch_file, "rb") as f:
            os.fsync(f.fileno())
        t_torch_save = time.perf_counter() - t0
        del cache
        store_files = files_under(store_dir)
        seg_bytes = sum(p.stat().st_size for p in store_files if p.suffix == ".kvseg")
        torch_bytes = torch_file.stat().st_size

        # A server that restores again and again can keep one buffer (hf.load(out=)):
        # no first-touch page faults. Free again once the forward has copied it away.
        reused = torch.zeros(layout.kv_shape(args.prefix), dtype=getattr(torch, layout.dtype))

        def kvstore_restore(store: kvstore.Store, out: Any = None) -> Callable[[], Any]:
            def restore() -> Any:
                c, n = hf.load(store, prefix, config=model.config, out=out)
                assert n == args.prefix, n
                return c

            return restore

        def torch_restore() -> Any:
            return torch.load(torch_file, weights_only=False)

        names = {
            "recompute": "recompute (prefill all)",
            "kvstore-hot": SWEEP_METHODS["kvstore-hot"],
            "kvstore-hot-reused": SWEEP_METHODS["kvstore-hot"] + ", reused buf",
            "kvstore-warm": SWEEP_METHODS["kvstore-warm"],
            "kvstore-warm-reused": SWEEP_METHODS["kvstore-warm"] + ", reused buf",
            **{
                k: SWEEP_METHODS[k]
                for k in ("kvstore-cold", "kvstore-cold-hot", "torch-warm", "torch-cold")
            },
        }
        timings = {key: Timing(name) for key, name in names.items()}
        results: dict[str, tuple[int, torch.Tensor]] = {}
        warm_store = hf.open(store_dir, model, fingerprint=fp)  # no hot tier: segments only
        hf.load(warm_store, prefix)  # the page cache holds the segments
        hot_bytes = 2 * kv_bytes + (64 << 20)
        hot_store = hf.open(store_dir, model, fingerprint=fp, hot_bytes=hot_bytes)
        empty_hot = tempfile.TemporaryDirectory(prefix="kvstore-ttft-", dir=shm_or(root))
        empty_hot_dir = Path(empty_hot.name)
        hf.load(hot_store, prefix)  # read from the segments once, then served from memory
        hot_before = hot_store.stats()
        torch_restore()
        try:
            # Round-robin: a burst of other work on the machine hits every method alike.
            for r in range(args.repeat):
                if r < 2:  # the slow one: 2 runs are enough
                    t = timings["recompute"]
                    t0 = time.perf_counter()
                    out = model(ids, use_cache=True, logits_to_keep=1)
                    want = int(out.logits[0, -1].argmax())
                    t.ttft.append(time.perf_counter() - t0)
                    del out
                results["kvstore-hot"] = timed_restore(
                    model, rest, kvstore_restore(hot_store), timings["kvstore-hot"]
                )
                results["kvstore-hot-reused"] = timed_restore(
                    model, rest, kvstore_restore(hot_store, reused), timings["kvstore-hot-reused"]
                )
                results["kvstore-warm"] = timed_restore(
                    model, rest, kvstore_restore(warm_store), timings["kvstore-warm"]
                )
                results["kvstore-warm-reused"] = timed_restore(
                    model,
                    rest,
                    kvstore_restore(warm_store, reused),
                    timings["kvstore-warm-reused"],
                )
                method, left = evict(store_files, args.cold_method)
                timings["kvstore-cold"].notes.append(
                    f"{method}: {left / 2**20:.1f} MiB of the store still resident"
                )
                with hf.open(store_dir, model, fingerprint=fp) as store:  # opened after eviction
                    results["kvstore-cold"] = timed_restore(
                        model, rest, kvstore_restore(store), timings["kvstore-cold"]
                    )
                evict(store_files, args.cold_method)
                with hf.open(
                    store_dir, model, fingerprint=fp, hot_bytes=hot_bytes, hot_dir=empty_hot_dir
                ) as store:  # a restart after a reboot: the hot tier empty too
                    results["kvstore-cold-hot"] = timed_restore(
                        model, rest, kvstore_restore(store), timings["kvstore-cold-hot"]
                    )
                remove_arenas_in(empty_hot_dir)
                results["torch-warm"] = timed_restore(
                    model, rest, torch_restore, timings["torch-warm"]
                )
                evict([torch_file], args.cold_method)
                results["torch-cold"] = timed_restore(
                    model, rest, torch_restore, timings["torch-cold"]
                )
                torch_restore()  # back in the page cache for the next warm round
            hot = hot_store.stats()
        finally:
            warm_store.close()
            hot_store.close()
            kvstore.remove_arena(store_dir)
            empty_hot.cleanup()
        hot_served = hot["hot_hit_blocks"] - hot_before["hot_hit_blocks"]
        hot_disk = hot["disk_hit_blocks"] - hot_before["disk_hit_blocks"]

    checks: list[tuple[str, bool]] = []
    for key, (token, logits) in results.items():
        checks.append((f"{names[key]}: first token == recompute's", token == want))
        checks.append(
            (f"{names[key]}: logits == in-memory's (bitwise)", torch.equal(logits, want_logits))
        )
    checks.append(("hot tier served every timed block from memory", hot_disk == 0))

    recompute = timings["recompute"].best
    table = Table(title=f"time to first token, {args.prefix}-token prefix", title_justify="left")
    columns = ("method", "restore", "TTFT", "TTFT median", "TTFT speedup", "vs torch.load")
    for col in columns:
        table.add_column(col, justify="left" if col == "method" else "right")
    peer = dict(SWEEP_PAIRS)
    for key, t in timings.items():
        vs_torch = "-"
        if key.startswith("kvstore"):
            # Restore time ratio, then TTFT ratio (>1: kvstore faster).
            ref = timings[peer[key.removesuffix("-reused")]]
            vs_torch = f"{min(ref.restore) / min(t.restore):.2f}x / {ref.best / t.best:.2f}x"
        table.add_row(
            t.name,
            f"{min(t.restore) * 1e3:.1f} ms" if t.restore else "-",
            f"{t.best * 1e3:.1f} ms",
            f"{statistics.median(t.ttft) * 1e3:.1f} ms",
            f"{recompute / t.best:.1f}x",
            vs_torch,
        )
    console.print(table)
    cold = timings["kvstore-cold"]
    console.print(
        f"restore = hf.load (store -> DynamicCache) or torch.load; TTFT = restore + prefill of "
        f"the {args.suffix}-token suffix + argmax; best of {args.repeat} (recompute: of "
        f"{len(timings['recompute'].ttft)}). TTFT speedup = recompute / TTFT. vs torch.load = "
        f"its restore / ours, its TTFT / ours, same page-cache state (hot rows vs warm).\n"
        f"page cache eviction: {cold.notes[-1]}; segments {seg_bytes / 2**20:.1f} MiB, "
        f"torch.save file {torch_bytes / 2**20:.1f} MiB\n"
        f"hot tier: {hot['page_kind']} pages, {hot['hot_bytes'] / 2**20:.0f} MiB arena at "
        f"{hot['hot_path']}; {hot_served} blocks served from memory, {hot_disk} from segments\n"
        f"save: kvstore put + flush {t_save * 1e3:.0f} ms ({st['blocks']} blocks), "
        f"torch.save + fsync {t_torch_save * 1e3:.0f} ms"
    )

    def restore(key: str) -> float:
        return min(timings[key].restore)

    targets = [
        (
            "kvstore (every tier) >= 20x faster than recompute",
            all(recompute / timings[k].best >= 20 for k in timings if k.startswith("kvstore")),
        ),
    ]
    for ours, peer in SWEEP_PAIRS:
        targets.append(
            (f"restore: {names[ours]} faster than {names[peer]}", restore(ours) < restore(peer))
        )
    result = Table(title="checks and targets", title_justify="left")
    result.add_column("")
    result.add_column("", justify="right")
    for label, ok in checks + targets:
        result.add_row(label, "[green]yes[/green]" if ok else "[red]NO[/red]")
    console.print(result)
    data["meta"] = {
        "prefix": args.prefix,
        "suffix": args.suffix,
        "params": params,
        "layout": str(layout),
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "loadavg": os.getloadavg(),
    }
    data["timings"] = [t.as_dict() for t in timings.values()]
    data["checks"] = dict(checks)
    data["targets"] = dict(targets)
    return all(ok for _, ok in checks)


if __name__ == "__main__":
    sys.exit(main())
