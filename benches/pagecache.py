"""Page-cache helpers the benches share: how much of a file is resident, and
evicting files from the page cache (bench_store.py, bench_ttft.py and the others
import them from here, so no bench imports another for them)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

_libc = None


def mincore_resident(path: Path) -> int:
    """Resident bytes of a file via mmap + mincore (ctypes), when fincore is missing."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in vec.raw) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(files: Sequence[Path]) -> tuple[int, str]:
    """Bytes of `files` in the page cache, and the tool that said so."""
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return sum(int(x) for x in out.split()), "fincore"
    return sum(mincore_resident(p) for p in files), "mincore"


def drop_page_cache(files: Sequence[Path], method: str = "auto") -> str:
    """Evicts `files` from the page cache. `method`: "drop_caches" (the whole
    machine's clean cache, needs root and a writable /proc/sys), "fadvise"
    (fsync + POSIX_FADV_DONTNEED on each file) or "auto" (the first that works).
    Returns the method used."""
    os.sync()
    if method in ("auto", "drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            if method == "drop_caches":
                raise
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def evict(files: Sequence[Path], method: str) -> tuple[str, int]:
    """Evicts `files` from the page cache; (method used, bytes still resident, by
    mincore). "fadvise" touches only these files; "drop_caches" empties the whole
    machine's clean page cache (root only), which disturbs anyone else's measurements."""
    used = drop_page_cache(files, method)
    return used, sum(mincore_resident(p) for p in files)
