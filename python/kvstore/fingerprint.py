"""Model fingerprints from checkpoint files, never from a loaded model.

    from kvstore.fingerprint import checkpoint_fingerprint
    fp = checkpoint_fingerprint("/models/llama-3-8b")                    # a local directory
    fp = checkpoint_fingerprint("meta-llama/Llama-3.1-8B", revision="main")  # the hub cache
    kvstore.open(path, layout=layout, model=fp)

    $ kvstore fingerprint /models/llama-3-8b

The value, `"<model_type>@ckpt-v1:<64 hex>"`, is a SHA-256 over
- `config.json`, parsed, without the keys that say where or with which
  transformers version it was saved (`VOLATILE_CONFIG_KEYS`), and
- the weight files, each by name, size and a content hash: those named by
  `model.safetensors.index.json`, else `model.safetensors`, else every
  `*.safetensors` in the directory, else the same for `pytorch_model.bin`.

A weight file's content hash is
- for a file of a Hugging Face hub cache snapshot (`snapshots/<rev>/<name>`, a
  symlink to `blobs/<hash>`): the hub's own, the blob's name (the SHA-256 of
  the file, or git's SHA-1 for a small file kept out of LFS); nothing is read;
- for any other file: the BLAKE3 of its bytes (`kvstore._lib.blake3_file`: on
  every core, a 256 KiB buffer per thread, the GIL released), remembered in a
  memo by the file's path, size, mtime and ctime, so a restart does not read
  the file again (see `memo_path`).

The same bytes as a hub snapshot and as a plain copy (`hf download
--local-dir`, `save_pretrained`) therefore give two fingerprints, as do one
set of tensors saved whole and sharded: such stores do not share blocks, they
never serve wrong ones. A model id and revision that name a checkpoint are
looked up in the hub cache offline: this module never downloads, and never
imports torch or transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _lib
from .errors import InvalidInput

__all__ = [
    "LOCK_FILE",
    "MEMO_FILE",
    "SCHEME",
    "VOLATILE_CONFIG_KEYS",
    "Checkpoint",
    "WeightFile",
    "checkpoint_dir",
    "checkpoint_fingerprint",
    "memo_path",
    "read_checkpoint",
]

# The fingerprint's marker after the name; rust/kvstore/src/fingerprint.rs knows it, to
# explain a store of the first scheme (`<name>@sha256:<hex>`) opened with one of these.
SCHEME = "ckpt-v1"

# Config keys that say where or with what a model was saved, not what it computes.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")

# Which files hold the weights: an index naming the shards, or one file, by format in
# the order transformers and vLLM prefer them.
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"),
)

# config.json and shard indexes are kilobytes; past this a file is not one.
_JSON_MAX = 64 << 20

MEMO_FILE = "fingerprints.json"
LOCK_FILE = "fingerprints.lock"
_MEMO_VERSION = 1
# A few hundred bytes an entry: the memo stays under a few hundred KiB.
_MEMO_ENTRIES = 1024
_MEMO_MAX_BYTES = 4 << 20

_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class WeightFile:
    """One weight file: its name in the checkpoint, size, and content hash
    (`"blake3:<hex>"`, or the hub's `"sha256:<hex>"` / `"git-sha1:<hex>"`)."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's fingerprint and what it was computed from."""

    root: Path
    fingerprint: str
    weights: tuple[WeightFile, ...]


def checkpoint_dir(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    hub_cache: str | os.PathLike[str] | None = None,
) -> Path:
    """The directory of a checkpoint: `model` itself where it is a directory, else
    the snapshot of hub id `model` at `revision` (a branch, tag or commit; default
    "main") in the hub cache (`hub_cache`, default huggingface_hub's: $HF_HUB_CACHE,
    $HF_HOME/hub, ~/.cache/huggingface/hub), found offline. InvalidInput if neither."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise InvalidInput(
            f"model: {os.fspath(model)!r} is not a directory (and huggingface_hub, which "
            "finds hub ids in its cache, is not installed)"
        ) from None
    try:
        found = try_to_load_from_cache(
            os.fspath(model),
            "config.json",
            cache_dir=os.fspath(hub_cache) if hub_cache is not None else None,
            revision=revision,
        )
    except ValueError as e:  # not a valid repo id
        raise InvalidInput(
            f"model: {os.fspath(model)!r} is neither a directory nor a hub id ({e})"
        ) from None
    if not isinstance(found, str):
        where = f" in {os.fspath(hub_cache)}" if hub_cache is not None else ""
        raise InvalidInput(
            f"model: {os.fspath(model)!r} is neither a directory nor a hub id whose "
            f"config.json is in the hub cache{where} at revision {revision or 'main'!r} "
            "(download it first; the fingerprint never downloads)"
        )
    return Path(found).parent


def checkpoint_fingerprint(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    hub_cache: str | os.PathLike[str] | None = None,
    name: str | None = None,
    memo_dir: str | os.PathLike[str] | None = None,
    remember: bool = True,
) -> str:
    """The fingerprint of the checkpoint at `model` (a directory, or a hub id at
    `revision` in the hub cache): `read_checkpoint(...).fingerprint`."""
    return read_checkpoint(
        model,
        revision=revision,
        hub_cache=hub_cache,
        name=name,
        memo_dir=memo_dir,
        remember=remember,
    ).fingerprint


def read_checkpoint(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    hub_cache: str | os.PathLike[str] | None = None,
    name: str | None = None,
    memo_dir: str | os.PathLike[str] | None = None,
    remember: bool = True,
) -> Checkpoint:
    """A checkpoint's fingerprint (module doc) and the weight files it covers.

    - `model`, `revision`, `hub_cache`: where the checkpoint is (`checkpoint_dir`).
    - `name`: the fingerprint's prefix; default the config's `model_type`.
    - `memo_dir`: where hashes are remembered (`memo_path`); `remember=False` reads
      every file that is not a hub blob, and leaves the memo as it is.

    InvalidInput for a directory without `config.json` or weight files, or whose
    shard index names a file that is missing or outside it.
    """
    root = checkpoint_dir(model, revision=revision, hub_cache=hub_cache)
    config = _read_json(root / "config.json", "config.json")
    if not isinstance(config, dict):
        raise InvalidInput(f"{root / 'config.json'}: expected a JSON object")
    config = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    names = _weight_names(root)
    with _Memo(memo_dir) if remember else contextlib.nullcontext() as memo:
        weights = tuple(_weight_file(root, n, memo) for n in names)
    h = hashlib.sha256(f"kvstore.fingerprint/{SCHEME}\0".encode())
    manifest = {"config": config, "weights": [[w.name, w.size, w.digest] for w in weights]}
    h.update(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    prefix = name or str(config.get("model_type") or "model")
    return Checkpoint(root, f"{prefix}@{SCHEME}:{h.hexdigest()}", weights)


def _read_json(path: Path, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(_JSON_MAX + 1)
    except FileNotFoundError:
        raise InvalidInput(f"{path.parent}: no {what} (not a checkpoint directory)") from None
    if len(data) > _JSON_MAX:
        raise InvalidInput(f"{path}: larger than {_JSON_MAX} bytes, not a {what}")
    try:
        return json.loads(data)
    except ValueError as e:
        raise InvalidInput(f"{path}: not JSON ({e})") from None


def _weight_names(root: Path) -> list[str]:
    """The weight files of the checkpoint at `root`, as names relative to it."""
    for index, single, pattern in _WEIGHT_FORMATS:
        if (root / index).is_file():
            found_index = _read_json(root / index, index)
            weight_map = found_index.get("weight_map") if isinstance(found_index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise InvalidInput(f"{root / index}: expected a weight_map of tensor -> file")
            names = sorted(set(weight_map.values()))
            for n in names:
                p = Path(n)
                if p.is_absolute() or ".." in p.parts or not (root / p).is_file():
                    raise InvalidInput(f"{root / index}: names {n!r}, not a file of {root}")
            return names
        if (root / single).is_file():
            return [single]
        found = sorted(p.name for p in root.glob(pattern) if p.is_file())
        if found:
            return found
    raise InvalidInput(f"{root}: no weight files (*.safetensors or pytorch_model*.bin)")


def _weight_file(root: Path, name: str, memo: _Memo | None) -> WeightFile:
    path = root / name
    before = os.stat(path)
    hub = _hub_digest(root, path)
    if hub is not None:
        return WeightFile(name, before.st_size, hub)
    real = os.path.realpath(path)
    digest = memo.get(real, before) if memo is not None else None
    if digest is None:
        digest = "blake3:" + _lib.blake3_file(real)
        # A file that changed while it was read hashed some state of it: not to be
        # remembered as the hash of the state it is in now.
        if memo is not None and _signature(os.stat(real)) == _signature(before):
            memo.put(real, before, digest)
    return WeightFile(name, before.st_size, digest)


def _hub_digest(root: Path, path: Path) -> str | None:
    """The hub's content hash of a file of a hub cache snapshot: the name of the blob
    its symlink points to, where the layout is the hub cache's
    (`<repo>/snapshots/<rev>/...` -> `<repo>/blobs/<hex>`); else None."""
    if not path.is_symlink():
        return None
    snapshot = Path(os.path.abspath(root))
    while snapshot.parent.name != "snapshots":
        if snapshot.parent == snapshot:
            return None
        snapshot = snapshot.parent
    blob = Path(os.path.realpath(path))
    blobs = Path(os.path.realpath(snapshot.parent.parent / "blobs"))
    if blob.parent != blobs or not _HEX.fullmatch(blob.name):
        return None
    return ("sha256:" if len(blob.name) == 64 else "git-sha1:") + blob.name


# -- the memo ---------------------------------------------------------------------------------


def memo_path(memo_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where hashes of weight files are remembered: `<memo_dir>/fingerprints.json`.
    The vLLM connector and `kvstore.hf.open` pass the store's directory, so the memo
    lives beside the store and survives with it (a container's home may not). Without
    one: $KVSTORE_CACHE_DIR, else $XDG_CACHE_HOME/kvstore, else ~/.cache/kvstore.

    The memo is JSON, written atomically (temp file, fsync, rename) and 0600, holds
    the newest 1024 files, and is ignored where it is not the user's own, not
    private, or damaged; where it cannot be written the hashes are not remembered.
    Beside it, `fingerprints.lock` (0600, empty): processes hashing at once take
    turns, so a file is read once."""
    if memo_dir is not None:
        return Path(memo_dir) / MEMO_FILE
    base = os.environ.get("KVSTORE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg or os.path.expanduser("~/.cache"), "kvstore")
    return Path(base) / MEMO_FILE


def _signature(st: os.stat_result) -> list[int]:
    # ctime as well as mtime: a rewrite that sets mtime back still moves ctime.
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class _Memo:
    """Content hashes by real path and `_signature`: loaded on entry, saved on a clean
    exit, under an exclusive lock held in between, so processes that start together
    (a tensor-parallel vLLM's workers) read each file once, not once each: the first
    hashes, the others find its hashes in the memo."""

    def __init__(self, memo_dir: str | os.PathLike[str] | None) -> None:
        self.path = memo_path(memo_dir)
        # A store's directory is made as the store makes it (0700, in a parent that
        # exists); the user's cache directory with its parents.
        self.parents = memo_dir is None
        self.entries: dict[str, Any] = {}
        self.changed = False
        self.lock: int | None = None

    def __enter__(self) -> _Memo:
        try:
            self.path.parent.mkdir(mode=0o700, parents=self.parents, exist_ok=True)
            lock = self.path.with_name(LOCK_FILE)
            self.lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(self.lock, fcntl.LOCK_EX)
        except OSError:
            pass  # no lock, no memo to share: every process hashes for itself
        self.entries = self._load()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is None:
                self._save()
        finally:
            if self.lock is not None:
                os.close(self.lock)  # releases the flock

    def _load(self) -> dict[str, Any]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            # Another user's or a shared-writable memo could pose any hash as a file's.
            if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return {}
            data = f.read(_MEMO_MAX_BYTES + 1)
        try:
            memo = json.loads(data)
        except ValueError:
            return {}
        if not isinstance(memo, dict) or memo.get("version") != _MEMO_VERSION:
            return {}
        entries = memo.get("files")
        return entries if isinstance(entries, dict) else {}

    def get(self, real: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(real)
        if not isinstance(entry, dict) or entry.get("signature") != _signature(st):
            return None
        digest = entry.get("digest")
        return digest if isinstance(digest, str) else None

    def put(self, real: str, st: os.stat_result, digest: str) -> None:
        self.entries[real] = {"signature": _signature(st), "digest": digest, "at": time.time()}
        self.changed = True

    def _save(self) -> None:
        if not self.changed:
            return
        newest = sorted(
            self.entries.items(),
            key=lambda kv: kv[1].get("at", 0) if isinstance(kv[1], dict) else 0,
            reverse=True,
        )[:_MEMO_ENTRIES]
        data = json.dumps({"version": _MEMO_VERSION, "files": dict(newest)}, indent=1).encode()
        directory = self.path.parent
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{MEMO_FILE}.")  # 0600
        except OSError:
            return  # a memo saves time, never correctness
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
