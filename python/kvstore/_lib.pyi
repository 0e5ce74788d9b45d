"""Type stubs of the compiled engine binding (rust/kvstore-py)."""

from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = ["FORMAT_VERSION", "Store", "rebuild_index"]

FORMAT_VERSION: int

@final
class Store:
    @staticmethod
    def open(
        path: str,
        fingerprint: str | None,
        layout: tuple[int, int, int, str, int] | None,
        salt: bytes | None,
        durability: str,
        disk_bytes: int | None,
        compression_level: int,
        segment_bytes: int,
        batch_window_ms: int,
        create: bool,
        hot_bytes: int | None,
        hot_dir: str | None,
        index_bytes: int | None = None,
    ) -> Store: ...
    @property
    def path(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def layout(self) -> tuple[int, int, int, str, int]: ...
    def manifest(self) -> dict[str, Any]: ...
    def durability(self) -> str: ...
    def put(
        self,
        tokens: npt.NDArray[np.uint32],
        kv: npt.NDArray[np.uint8],
        kv_tokens: int,
        extra: bytes,
    ) -> int: ...
    def lookup(self, tokens: npt.NDArray[np.uint32], extra: bytes, count: bool) -> int: ...
    def get_into(
        self,
        tokens: npt.NDArray[np.uint32],
        extra: bytes,
        out: npt.NDArray[np.uint8],
        out_tokens: int,
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
    def stats(self) -> dict[str, Any]: ...
    def segments(self) -> list[dict[str, Any]]: ...
    def verify(
        self, progress: Callable[[int, int], None] | None = None, repair: bool = False
    ) -> dict[str, Any]: ...
    def compact(self, progress: Callable[[int, int], None] | None = None) -> dict[str, int]: ...
    def gc(
        self,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]: ...

def rebuild_index(
    path: str, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]: ...
