"""The `kvstore` command: inspect, verify, compact and garbage-collect stores, reach
their remote tier (`kvstore remote ping|stats|push`), and print a checkpoint's
model fingerprint (`kvstore fingerprint PATH`).

Every command works while other processes use the store. Human output by
default, `--json` for scripts; an error prints one line and exits 2;
`verify` exits 1 when it finds damage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from .errors import CorruptStore, InvalidInput, KVStoreError
from .remote import Remote
from .store import Store, arenas, rebuild_index, remove_arena
from .store import open as open_store

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_bytes(text: str) -> int:
    """'1048576', '512M', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {text!r}")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n < 2**64:
        raise argparse.ArgumentTypeError(f"expected a size below 2**64 bytes, got {text!r}")
    return int(n)


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 30m, 12h or 7d, got {text!r}"
        )
    return float(m.group(1)) * _DURATION[m.group(2) or "s"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _console() -> Any:
    from rich.console import Console

    return Console()


def _open(path: str, salt: str | bytes | None = None) -> Store:
    # "sync": compact and gc commit only what is on disk before deleting old segments.
    return open_store(path, salt=salt, create=False, durability="sync")


@contextmanager
def _progress(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar for long work; None (no bar) for --json or a non-terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _emit(args: argparse.Namespace, data: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        human()


def _table(title: str, rows: list[tuple[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def _hot_tier(st: Any) -> str:
    """The hot tier in one line: the store's arena, whether or not this handle maps it."""
    if st["hot_path"] is None:
        return "none (no arena)"
    return (
        f"{human_bytes(st['hot_bytes'])} ({st['page_kind']}), "
        f"{st['hot_slots_used']} of {st['hot_slots']} slots used, "
        f"{st['hot_slots_pinned']} pinned; {st['hot_path']}"
    )


def _layout_line(lay: Any) -> str:
    if lay.latent:
        shape = f"kind=latent L={lay.num_layers} latent_dim={lay.head_dim}"
    else:
        shape = f"L={lay.num_layers} H={lay.num_kv_heads} D={lay.head_dim}"
    storage = f" storage={lay.storage}" if lay.storage != "exact" else ""
    return f"{shape} {lay.dtype} block_size={lay.block_size}{storage}"


def cmd_info(args: argparse.Namespace) -> int:
    with _open(args.path) as s:
        m, st = s.manifest(), s.stats()
        heads = s.heads(create=False)
        hst = heads.store.stats() if heads is not None else None
        data = {
            "path": str(s.path),
            "manifest": m,
            # Blocks tensor-parallel workers stored one KV head per record (kvstore.heads).
            "heads": {k: hst[k] for k in ("blocks", "disk_bytes", "live_bytes")} if hst else None,
            "blocks": st["blocks"],
            "segments": st["segments"],
            "segments_v1": st["segments_v1"],
            "disk_bytes": st["disk_bytes"],
            "live_bytes": st["live_bytes"],
            "hot_bytes": st["hot_bytes"],
            "page_kind": st["page_kind"],
            "hot_path": st["hot_path"],
            "hot_slots": st["hot_slots"],
            "hot_slots_used": st["hot_slots_used"],
            "hot_slots_pinned": st["hot_slots_pinned"],
        }

        def human() -> None:
            created = datetime.fromtimestamp(m["created_unix"], tz=timezone.utc)
            _console().print(
                _table(
                    f"kvstore {s.path}",
                    [
                        ("model", m["fingerprint"]),
                        ("layout", _layout_line(s.layout)),
                        ("block bytes", human_bytes(s.layout.block_bytes)),
                        (
                            "format version",
                            f"{m['format_version']}"
                            + (
                                f" ({st['segments_v1']} segments of version 1: "
                                "`kvstore compact` rewrites them)"
                                if st["segments_v1"]
                                else ""
                            ),
                        ),
                        ("created", created.isoformat(timespec="seconds")),
                        ("store id", m["store_id"]),
                        ("blocks", st["blocks"]),
                        ("segments", st["segments"]),
                        ("disk tier", human_bytes(st["disk_bytes"])),
                        ("hot tier", _hot_tier(st)),
                        *(
                            [
                                (
                                    "heads store",
                                    f"{hst['blocks']} records of one KV head each, "
                                    f"{human_bytes(hst['disk_bytes'])} (tensor-parallel "
                                    f"workers'; {s.path / 'heads'})",
                                )
                            ]
                            if hst
                            else []
                        ),
                    ],
                )
            )

        _emit(args, data, human)
    return 0


def _salt(args: argparse.Namespace) -> str | bytes | None:
    """The tenant salt: `--salt` (shows in `ps`), or read from the environment
    variable `--salt-env` names or the file `--salt-file` (one trailing newline
    dropped), as bytes: any bytes, as the API takes (a str salt is its UTF-8). The
    salt is the MAC secret of the remote tier. An empty salt is a tenant of its own,
    not "no salt"."""
    names = ("salt", "salt_env", "salt_file")
    given = [(n, v) for n in names if (v := getattr(args, n)) is not None]
    if len(given) > 1:
        raise InvalidInput("give one of --salt, --salt-env, --salt-file")
    if not given:
        return None
    name, value = given[0]
    if name == "salt_env":
        key = os.fsencode(value)
        if key not in os.environb:
            raise InvalidInput(f"--salt-env: the environment variable {value!r} is not set")
        return os.environb[key]
    if name == "salt_file":
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InvalidInput(f"--salt-file {value}: {e.strerror}") from None
        return data[:-1] if data.endswith(b"\n") else data
    # What the command line gave: its bytes, undecodable ones included.
    return os.fsencode(value)


def _salt_flags(sp: argparse.ArgumentParser, what: str) -> None:
    sp.add_argument("--salt", help=f"{what} (default: no salt; visible in ps: see --salt-env)")
    sp.add_argument("--salt-env", metavar="VAR", help="environment variable holding the salt")
    sp.add_argument("--salt-file", metavar="FILE", help="file holding the salt")


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.path, _salt(args)) as s:
        if args.sessions:
            sessions = [{"name": n, "tokens": t} for n, t in s.session_sizes().items()]

            def human_sessions() -> None:
                from rich.table import Table

                t = Table("session", "tokens", title=f"sessions in {s.path}", title_justify="left")
                for x in sessions:
                    t.add_row(str(x["name"]), str(x["tokens"]))
                _console().print(t)

            _emit(args, sessions, human_sessions)
            return 0
        segs = s.segments()

        def human_segments() -> None:
            from rich.table import Table

            t = Table("segment", "state", "file", "live", "dead", "records", title_justify="left")
            t.title = f"segments in {s.path}"
            for x in segs:
                t.add_row(
                    f"{x['segment']:016x}",
                    "sealed" if x["sealed"] else "active",
                    human_bytes(x["file_bytes"] or 0) if x["file_bytes"] is not None else "missing",
                    human_bytes(x["live_bytes"]),
                    human_bytes(x["dead_bytes"]),
                    str(x["live_records"]),
                )
            _console().print(t)

        _emit(args, segs, human_segments)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _open(args.path) as s:
        st, segs = s.stats(), s.segments()
        data = {"store": st, "segments": segs}

        def human() -> None:
            from rich.table import Table

            c = _console()
            c.print(
                _table(
                    f"stats of {s.path}",
                    [
                        ("blocks", st["blocks"]),
                        ("live bytes", human_bytes(st["live_bytes"])),
                        ("dead bytes", human_bytes(st["dead_bytes"])),
                        ("disk bytes", human_bytes(st["disk_bytes"])),
                        ("compression ratio", f"{st['compression_ratio']:.3f}"),
                        ("damaged blocks (found on read)", st["damaged_blocks"]),
                        ("hot tier", _hot_tier(st)),
                        (
                            "hits / misses (blocks, all processes)",
                            f"{st['total_hit_blocks']} / {st['total_miss_blocks']}",
                        ),
                        # Clients' counters (e.g. the vLLM connector's), all processes.
                        *st["counters"].items(),
                    ],
                )
            )
            t = Table("segment", "live", "dead", "dead %", title="dead bytes per segment")
            for x in segs:
                total = x["live_bytes"] + x["dead_bytes"]
                pct = 100.0 * x["dead_bytes"] / total if total else 0.0
                t.add_row(
                    f"{x['segment']:016x}",
                    human_bytes(x["live_bytes"]),
                    human_bytes(x["dead_bytes"]),
                    f"{pct:.1f}",
                )
            c.print(t)

        _emit(args, data, human)
    return 0


def _rebuild(args: argparse.Namespace) -> dict[str, Any]:
    with _progress(not args.json, "scanning segments") as progress:
        return rebuild_index(args.path, progress)


def _say_rebuilt(r: dict[str, Any]) -> None:
    print(
        f"rebuilt the index from {r['segments']} segment(s): {r['blocks']} blocks, "
        f"{len(r['damaged'])} damaged range(s); sessions and pins were not recoverable"
    )
    for d in r["damaged"]:
        print(f"  segment {d['segment']:016x} bytes {d['start']}..{d['end']}: {d['reason']}")
    if r["old_index"]:
        print(f"the previous index is kept at {r['old_index']}")


def cmd_rebuild_index(args: argparse.Namespace) -> int:
    r = _rebuild(args)
    _emit(args, r, lambda: _say_rebuilt(r))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    rebuilt = None
    if args.repair:
        try:
            _open(args.path).close()
        except CorruptStore as e:
            # The index (or its files) cannot be opened: rebuild it from the
            # segments. A damaged MANIFEST makes the rebuild fail with its own error.
            print(f"kvstore: {e}; rebuilding the index from the segments", file=sys.stderr)
            rebuilt = _rebuild(args)
    with _open(args.path) as s, _progress(not args.json, "verifying") as progress:
        report = s.verify(progress, repair=args.repair)
        heads = s.heads(create=False)
        if heads is not None:  # what tensor-parallel workers stored, head by head
            report = _with_heads(report, heads.store.verify(progress, repair=args.repair))
    # Repaired damage is out of the index (a miss): the store is consistent again.
    ok = not report["problems"] and (args.repair or not report["damaged"])
    report["ok"] = ok
    report["repaired"] = bool(args.repair)
    report["rebuilt"] = rebuilt

    def human() -> None:
        if rebuilt is not None:
            _say_rebuilt(rebuilt)
        for d in report["damaged"]:
            print(
                f"damaged block {d['block_id']} segment {d['segment']:016x} "
                f"offset {d['offset']}: {d['reason']}"
            )
        for p in report["problems"]:
            print(f"problem: {p}")
        verdict = "ok" if ok else f"{len(report['damaged'])} damaged block(s)"
        if args.repair and report["damaged"]:
            verdict = f"{len(report['damaged'])} damaged block(s) taken out of the index"
        print(
            f"verified {report['records_checked']} records "
            f"({human_bytes(report['bytes_checked'])}): {verdict}"
        )

    _emit(args, report, human)
    return 0 if ok else 1


def _with_heads(report: dict[str, Any], heads: dict[str, Any]) -> dict[str, Any]:
    """The main store's verify report with the heads store's added: its damage marked
    `"store": "heads"`, its problems prefixed, its counts summed."""
    out = dict(report)
    out["damaged"] = [*report["damaged"], *({**d, "store": "heads"} for d in heads["damaged"])]
    out["problems"] = [*report["problems"], *(f"heads store: {p}" for p in heads["problems"])]
    for k, v in heads.items():
        if isinstance(v, int) and not isinstance(v, bool) and isinstance(report.get(k), int):
            out[k] = report[k] + v
    return out


def cmd_compact(args: argparse.Namespace) -> int:
    with _open(args.path) as s, _progress(not args.json, "compacting") as progress:
        r = s.compact(progress)

    def human() -> None:
        print(
            f"rewrote {r['segments_rewritten']} segment(s), moved {r['records_moved']} records, "
            f"dropped {r['records_dropped']} damaged; "
            f"{human_bytes(r['bytes_before'])} -> {human_bytes(r['bytes_after'])}"
        )

    _emit(args, r, human)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if args.max_bytes is None and args.older_than is None:
        raise KVStoreError("gc needs --max-bytes and/or --older-than")
    with _open(args.path) as s, _progress(not args.json, "compacting") as progress:
        r: dict[str, Any] = dict(s.gc(args.max_bytes, args.older_than, progress))
    # Where this store's processes put arenas: $KVSTORE_HOT_DIR when set, else
    # every place stores look.
    hot = os.environ.get("KVSTORE_HOT_DIR")
    found = arenas(prune=True, dirs=[hot] if hot else None)
    r["arenas_pruned"] = [a["path"] for a in found if a["pruned"]]

    def human() -> None:
        c = r["compact"]
        print(
            f"evicted {r['blocks_evicted']} blocks ({human_bytes(r['bytes_evicted'])}); "
            f"segments {human_bytes(c['bytes_before'])} -> {human_bytes(c['bytes_after'])}"
        )
        for p in r["arenas_pruned"]:
            print(f"removed orphaned arena {p}")

    _emit(args, r, human)
    return 0


def _arena_state(a: dict[str, Any]) -> str:
    if a["pruned"]:
        return "orphan, removed"
    if a["header"] == "foreign":
        return f"foreign: {a['reason']}"
    state = "in use" if a["owned"] else "orphan" if a["orphan"] else "store unknown"
    if a["orphan"]:
        state += ": store gone" if not a["store_exists"] else ": store has another id"
        if a["mapped_by"]:
            state += " (still mapped, kept)"
    if a["header"] == "damaged":
        state += f"; damaged header: {a['reason']}"
    return state


def cmd_arenas(args: argparse.Namespace) -> int:
    found = arenas(args.hot_dir, prune=args.prune, dirs=args.dir)

    def human() -> None:
        from rich.table import Table

        t = Table("arena", "store", "size", "pages", "last use", "mapped by", "state")
        for a in found:
            last = datetime.fromtimestamp(a["last_used_ms"] / 1000, tz=timezone.utc)
            t.add_row(
                a["path"],
                a["store_path"] or "?",
                human_bytes(a["bytes"]),
                a["page_kind"],
                last.isoformat(timespec="seconds") if a["last_used_ms"] else "?",
                str(a["mapped_by"]),
                _arena_state(a),
            )
        c = _console()
        c.print(t)
        orphans = [a for a in found if a["orphan"] and not a["pruned"]]
        if orphans and not args.prune:
            c.print(f"{len(orphans)} orphan(s): `kvstore arenas --prune` removes the unmapped ones")

    _emit(args, found, human)
    return 0


def cmd_remove_arena(args: argparse.Namespace) -> int:
    n = remove_arena(args.path, hot_dir=args.hot_dir)
    _emit(args, {"removed": n}, lambda: print(f"removed {n} arena file(s)"))
    return 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from .fingerprint import read_checkpoint

    c = read_checkpoint(
        args.path,
        revision=args.revision,
        hub_cache=args.hub_cache,
        memo_dir=args.memo_dir,
        remember=not args.no_memo,
    )
    data = {
        "fingerprint": c.fingerprint,
        "root": str(c.root),
        "weights": [{"name": w.name, "size": w.size, "digest": w.digest} for w in c.weights],
    }
    _emit(args, data, lambda: print(c.fingerprint))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args.path, quick=args.quick, model=args.model)


# The remote tier's options: flags, else these environment variables. The password
# itself is never a flag (it would show in `ps` and shell history): only the name of
# the variable or the file holding it.
_REMOTE_ENV = {
    "nodes": "KVSTORE_REMOTE_NODES",
    "username": "KVSTORE_REMOTE_USERNAME",
    "password_env": "KVSTORE_REMOTE_PASSWORD_ENV",
    "password_file": "KVSTORE_REMOTE_PASSWORD_FILE",
    "tls_ca": "KVSTORE_REMOTE_TLS_CA",
    "prefix": "KVSTORE_REMOTE_PREFIX",
    "timeout": "KVSTORE_REMOTE_TIMEOUT",
    "ttl": "KVSTORE_REMOTE_TTL",
}


def _remote(args: argparse.Namespace) -> Remote:
    """The `Remote` of the command line and the environment."""
    opts: dict[str, Any] = {}
    for name, var in _REMOTE_ENV.items():
        flag = getattr(args, name)
        value = flag if flag is not None else os.environ.get(var) or None
        if value is not None:
            opts[name] = value
    if "nodes" not in opts:
        raise InvalidInput(f"remote: no nodes (--node HOST:PORT, or ${_REMOTE_ENV['nodes']})")
    if isinstance(opts["nodes"], list):
        opts["nodes"] = ",".join(opts["nodes"])
    for name in ("timeout", "ttl"):
        if isinstance(opts.get(name), str):
            try:
                opts[name] = parse_duration(opts[name])
            except argparse.ArgumentTypeError as e:
                raise InvalidInput(f"remote {name} (${_REMOTE_ENV[name]}): {e}") from None
    return Remote.from_dict(opts)


def _open_remote(args: argparse.Namespace) -> Store:
    # "none": push reads the store and writes nothing to it.
    return open_store(
        args.path, salt=_salt(args), create=False, durability="none", remote=_remote(args)
    )


def _node_rows(nodes: list[Any]) -> None:
    from rich.table import Table

    t = Table("node", "round trip", "version", "role", "memory", "error", title_justify="left")
    for n in nodes:
        info = n["info"]
        t.add_row(
            n["node"],
            f"{n['rtt'] * 1000:.2f} ms" if n["rtt"] is not None else "-",
            info.get("valkey_version") or info.get("redis_version", "?"),
            info.get("role", "?"),
            human_bytes(int(info["used_memory"])) if "used_memory" in info else "?",
            n["error"] or "",
        )
    _console().print(t)


def cmd_remote_ping(args: argparse.Namespace) -> int:
    with _open_remote(args) as s:
        nodes = s.remote_nodes()
    ok = all(n["error"] is None for n in nodes)
    _emit(args, {"ok": ok, "nodes": nodes}, lambda: _node_rows(nodes))
    return 0 if ok else 1


def cmd_remote_stats(args: argparse.Namespace) -> int:
    with _open_remote(args) as s:
        nodes = s.remote_nodes()

    def human() -> None:
        c = _console()
        for n in nodes:
            info = n["info"]
            if n["error"] is not None:
                c.print(f"[bold]{n['node']}[/bold]: {n['error']}")
                continue
            rows: list[tuple[str, Any]] = [
                (k, human_bytes(int(v)) if k.startswith(("used_memory", "maxmemory")) and
                 v.isdigit() else v)
                for k, v in sorted(info.items())
            ]  # fmt: skip
            c.print(_table(f"node {n['node']}", rows))

    _emit(args, {"nodes": nodes}, human)
    return 0 if all(n["error"] is None for n in nodes) else 1


def cmd_remote_push(args: argparse.Namespace) -> int:
    with _open_remote(args) as s, _progress(not args.json, "pushing") as progress:
        r: dict[str, Any] = dict(s.remote_push(progress))
        remote: dict[str, int] = dict(s.stats()["remote"] or {})
    errors = {k: v for k, v in remote.items() if k.startswith("errors_") and v}
    r["errors"] = errors

    def human() -> None:
        print(
            f"{r['blocks']} blocks: {r['uploaded']} uploaded "
            f"({human_bytes(r['bytes_written'])}), {r['present']} already there, "
            f"{r['failed']} failed, {r['unplaced']} not placed in a chain, "
            f"{r['unreadable']} unreadable"
        )
        for k, v in errors.items():
            print(f"  {k}: {v}")

    _emit(args, r, human)
    return 0 if r["failed"] == 0 else 1


def _add_remote(sub: Any) -> None:
    rp = sub.add_parser(
        "remote",
        help="the store's remote tier (Redis/Valkey): ping, stats, push",
        description="The store's remote tier. Options come from flags, else from "
        + ", ".join(f"${v}" for v in _REMOTE_ENV.values())
        + ". The password is read from the variable named by --password-env or from "
        "--password-file, never from a flag.",
    )
    rsub = rp.add_subparsers(dest="remote_command", required=True, metavar="COMMAND")
    for name, fn, help in (
        ("ping", cmd_remote_ping, "round trip to every node; exit 1 if one does not answer"),
        ("stats", cmd_remote_stats, "memory, eviction, keys and hits of every node"),
        ("push", cmd_remote_push, "upload the store's blocks that the remote tier lacks"),
    ):
        sp = rsub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("path", help="store directory")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument(
            "--node",
            dest="nodes",
            action="append",
            metavar="HOST:PORT",
            help="a node of the server or cluster (repeatable, or comma-separated)",
        )
        sp.add_argument("--username", help="ACL user (default: 'default')")
        sp.add_argument(
            "--password-env", metavar="VAR", help="environment variable of the password"
        )
        sp.add_argument("--password-file", metavar="FILE", help="file holding the password")
        sp.add_argument("--tls-ca", metavar="PEM", help="CA certificate: connect with TLS")
        sp.add_argument("--prefix", help="key namespace on the server (default: kvstore)")
        sp.add_argument("--timeout", type=parse_duration, help="per-call deadline (default: 1s)")
        sp.add_argument("--ttl", type=parse_duration, help="time to live of pushed blocks")
        _salt_flags(sp, "the tenant salt of the blocks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore", description="Inspect and maintain kvstore KV-cache stores."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        if name not in ("demo", "arenas", "fingerprint"):
            sp.add_argument("path", help="store directory")
        if name != "demo":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    add("info", cmd_info, "manifest, layout, blocks, bytes per tier, segments, page kind")
    ls = add("ls", cmd_ls, "list segments, or sessions with --sessions")
    ls.add_argument("--sessions", action="store_true", help="list sessions instead of segments")
    _salt_flags(ls, "tenant salt whose sessions to list")
    add("stats", cmd_stats, "live and dead bytes per segment, compression ratio")
    verify = add(
        "verify", cmd_verify, "re-read and check every record; exit 1 if anything is damaged"
    )
    verify.add_argument(
        "--repair",
        action="store_true",
        help="take damaged records out of the index; rebuild an index that cannot be opened",
    )
    add(
        "rebuild-index",
        cmd_rebuild_index,
        "rebuild the index from the segment files (every handle on the store closed)",
    )
    add("compact", cmd_compact, "rewrite live records, drop dead ones, delete old segments")
    gc = add("gc", cmd_gc, "evict the oldest blocks, then compact")
    gc.add_argument("--max-bytes", type=parse_bytes, help="keep at most this many live bytes")
    gc.add_argument("--older-than", type=parse_duration, help="evict blocks older than this")
    hot_dir_help = "also look in this directory (a store's hot_dir)"
    ar = add(
        "arenas",
        cmd_arenas,
        "list the shared-memory arenas of all stores; --prune removes unmapped orphans",
    )
    ar.add_argument(
        "--prune",
        action="store_true",
        help="remove arenas whose store is gone or no longer owns them, if no process maps them",
    )
    ar.add_argument("--hot-dir", help=hot_dir_help)
    ar.add_argument(
        "--dir",
        action="append",
        help="look in this directory only (repeatable; instead of every place stores look)",
    )
    ra = add(
        "remove-arena",
        cmd_remove_arena,
        "delete a store's arena (PATH: the store, or the arena file); mappers keep their mapping",
    )
    ra.add_argument("--hot-dir", help=hot_dir_help)
    fp = add(
        "fingerprint",
        cmd_fingerprint,
        "the model fingerprint of a checkpoint (config.json and weight files), as the vLLM "
        "connector and kvstore.hf compute it; never loads the model",
    )
    fp.add_argument("path", help="checkpoint directory, or a hub id in the hub cache")
    fp.add_argument("--revision", help="hub revision: branch, tag or commit (default: main)")
    fp.add_argument("--hub-cache", help="hub cache directory (default: huggingface_hub's)")
    fp.add_argument(
        "--memo-dir",
        help="remember the files' hashes here, e.g. the store directory (default: "
        "$KVSTORE_CACHE_DIR, else ~/.cache/kvstore)",
    )
    fp.add_argument(
        "--no-memo", action="store_true", help="read every file, neither using nor saving the memo"
    )
    _add_remote(sub)
    demo = add("demo", cmd_demo, "the main job end to end: put, restart, lookup, get, timings")
    demo.add_argument("path", nargs="?", help="store directory (default: a temporary one)")
    demo.add_argument("--quick", action="store_true", help="small sizes (for CI)")
    demo.add_argument(
        "--model",
        help="local transformers checkpoint (default: $KVSTORE_DEMO_MODEL, else a small "
        "Llama with seeded random weights)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KVStoreError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`kvstore ls --json | head`): nothing left to tell it,
        # and the interpreter's last flush of stdout must not raise it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
