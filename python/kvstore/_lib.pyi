"""Type stubs of the compiled engine binding (rust/kvstore-py)."""

import os
from collections.abc import Callable, Sequence
from typing import TypedDict, final, type_check_only

import numpy as np
import numpy.typing as npt
from typing_extensions import NotRequired

from .layout import Layout

__all__ = [
    "FORMAT_VERSION",
    "Store",
    "__version__",
    "arena_dirs",
    "arenas",
    "blake3_file",
    "rebuild_index",
    "remove_arena_file",
]

FORMAT_VERSION: int
__version__: str

# Dicts the binding reads and returns (rust/kvstore-py/src/options.rs, reports.rs).

@type_check_only
class OpenOptions(TypedDict):
    """What `Store.open` reads; keys left out take the engine's defaults."""

    durability: str
    create: bool
    fingerprint: NotRequired[str | None]
    layout: NotRequired[Layout | None]
    salt: NotRequired[bytes | None]
    disk_bytes: NotRequired[int | None]
    compression: NotRequired[str | None]
    compression_level: NotRequired[int | None]
    segment_bytes: NotRequired[int | None]
    batch_window_ms: NotRequired[int | None]
    hot_bytes: NotRequired[int | None]
    hot_dir: NotRequired[str | None]
    index_bytes: NotRequired[int | None]
    remote: NotRequired[RemoteOptions | None]

@type_check_only
class RemoteOptions(TypedDict):
    """What `kvstore.Remote` hands the binding (the password by reference only)."""

    nodes: list[str]
    username: str | None
    password_env: str | None
    password_file: str | None
    tls_ca: str | None
    prefix: str
    write: str
    ttl_ms: int | None
    timeout_ms: int | None
    breaker_ms: int | None

@type_check_only
class NodeReport(TypedDict):
    node: str
    rtt: float | None
    error: str | None
    info: dict[str, str]

@type_check_only
class PushReport(TypedDict):
    blocks: int
    unplaced: int
    unreadable: int
    uploaded: int
    present: int
    failed: int
    bytes_written: int

@type_check_only
class RemoteStats(TypedDict):
    hits: int
    misses: int
    invalid: int
    errors_timeout: int
    errors_connection: int
    errors_permission: int
    errors_oom: int
    errors_cluster_down: int
    errors_other: int
    breaker_skips: int
    bytes_read: int
    bytes_written: int
    blocks_uploaded: int
    blocks_present: int
    writes_dropped: int
    write_failures: int
    too_large: int
    queued_bytes: int

@type_check_only
class Manifest(TypedDict):
    format_version: int
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    created_unix: int
    store_id: str
    storage: str | None
    kind: str | None

# K's and V's (element offset in a block, (token, head, dim) element strides).
_PagedParts = tuple[tuple[int, tuple[int, int, int]], tuple[int, tuple[int, int, int]]]

@type_check_only
class Stats(TypedDict):
    blocks: int
    sessions: int
    segments: int
    segments_v1: int
    disk_bytes: int
    live_bytes: int
    dead_bytes: int
    raw_live_bytes: int
    damaged_blocks: int
    pending_blocks: int
    read_errors: int
    hit_blocks: int
    miss_blocks: int
    total_hit_blocks: int
    total_miss_blocks: int
    blocks_written: int
    blocks_deduped: int
    bytes_written: int
    bytes_read: int
    block_bytes: int
    hot_hit_blocks: int
    disk_hit_blocks: int
    hot_path: str | None
    hot_bytes: int
    hot_slots: int
    hot_slots_used: int
    hot_slots_pinned: int
    hot_blocks: int
    hot_evictions: int
    hot_inserts: int
    hot_slots_torn: int
    hot_lock_timeouts: int
    hot_fills_skipped: int
    page_kind: str
    hot_mapped: bool
    remote: RemoteStats | None
    counters: dict[str, int]

@type_check_only
class SegmentReport(TypedDict):
    segment: int
    sealed: bool
    file_bytes: int | None
    committed_bytes: int
    live_bytes: int
    live_records: int
    dead_bytes: int

@type_check_only
class Damage(TypedDict):
    block_id: str
    segment: int
    offset: int
    reason: str

@type_check_only
class VerifyReport(TypedDict):
    records_checked: int
    bytes_checked: int
    damaged: list[Damage]
    problems: list[str]

@type_check_only
class CompactReport(TypedDict):
    segments_rewritten: int
    records_moved: int
    records_dropped: int
    bytes_before: int
    bytes_after: int

@type_check_only
class GcReport(TypedDict):
    blocks_evicted: int
    bytes_evicted: int
    compact: CompactReport

@type_check_only
class RebuildDamage(TypedDict):
    segment: int
    start: int
    end: int
    block_id: str | None
    reason: str

@type_check_only
class ArenaInfo(TypedDict):
    path: str
    header: str
    reason: str
    store_id: str | None
    store_path: str | None
    store_exists: bool
    owned: bool
    orphan: bool
    bytes: int
    page_kind: str
    last_used_ms: int
    mapped_by: int
    pruned: bool

@type_check_only
class RebuildReport(TypedDict):
    segments: int
    records: int
    blocks: int
    damaged: list[RebuildDamage]
    skipped: list[str]
    old_index: str | None

@final
class Store:
    @staticmethod
    def open(path: str, options: OpenOptions) -> Store: ...
    @property
    def path(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def layout(self) -> tuple[int, int, int, str, int, str, str]: ...
    def manifest(self) -> Manifest: ...
    def durability(self) -> str: ...
    def put(
        self,
        tokens: npt.NDArray[np.uint32],
        kv: npt.NDArray[np.uint8],
        kv_tokens: int,
        extra: bytes,
        start: int = 0,
    ) -> int: ...
    def block_ids(self, tokens: npt.NDArray[np.uint32], extra: bytes) -> list[bytes]: ...
    def lookup(self, tokens: npt.NDArray[np.uint32], extra: bytes, count: bool) -> int: ...
    def get_into(
        self,
        tokens: npt.NDArray[np.uint32],
        extra: bytes,
        out: npt.NDArray[np.uint8],
        out_tokens: int,
        start: int = 0,
    ) -> int: ...
    def get_paged(
        self,
        tokens: npt.NDArray[np.uint32],
        extra: bytes,
        start: int,
        layers: list[npt.NDArray[np.uint8]],
        blocks: list[int],
        block_stride: int,
        parts: _PagedParts,
    ) -> int: ...
    def put_paged(
        self,
        tokens: npt.NDArray[np.uint32],
        extra: bytes,
        start: int,
        layers: list[npt.NDArray[np.uint8]],
        blocks: list[int],
        block_stride: int,
        parts: _PagedParts,
    ) -> int: ...
    def pin(
        self,
        tokens: npt.NDArray[np.uint32],
        extra: bytes,
        priority: int,
        ttl_s: float | None = None,
    ) -> int: ...
    def unpin(self, tokens: npt.NDArray[np.uint32], extra: bytes) -> int: ...
    def arena_region(self) -> tuple[int, int] | None: ...
    def hot_blocks(
        self, tokens: npt.NDArray[np.uint32], extra: bytes
    ) -> list[tuple[int, int, int] | None]: ...
    def hot_unchanged(self, slots: list[tuple[int, int]]) -> list[bool]: ...
    def arena_file(self) -> tuple[str, int, int, int] | None: ...
    def save_session(
        self,
        name: str,
        tokens: npt.NDArray[np.uint32],
        kv: npt.NDArray[np.uint8],
        kv_tokens: int,
    ) -> int: ...
    def session_tokens(self, name: str) -> npt.NDArray[np.uint32]: ...
    def sessions(self) -> list[tuple[str, int]]: ...
    def delete_session(self, name: str) -> bool: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def add_counters(self, counts: list[tuple[str, int]]) -> None: ...
    def stats(self) -> Stats: ...
    def remote_nodes(self) -> list[NodeReport]: ...
    def remote_push(self, progress: Callable[[int, int], None] | None = None) -> PushReport: ...
    def segments(self) -> list[SegmentReport]: ...
    def verify(
        self, progress: Callable[[int, int], None] | None = None, repair: bool = False
    ) -> VerifyReport: ...
    def compact(self, progress: Callable[[int, int], None] | None = None) -> CompactReport: ...
    def gc(
        self,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> GcReport: ...

def rebuild_index(
    path: str, progress: Callable[[int, int], None] | None = None
) -> RebuildReport: ...
def arena_dirs(hot_dir: str | os.PathLike[str] | None = None) -> list[str]: ...
def arenas(dirs: Sequence[str | os.PathLike[str]], prune: bool = False) -> list[ArenaInfo]: ...
def remove_arena_file(path: str | os.PathLike[str]) -> bool: ...
def blake3_file(path: str | os.PathLike[str], threads: int | None = None) -> str: ...
