"""A private hugetlbfs mount for a test: reserves 8 more huge pages, mounts
hugetlbfs (2 MiB pages) under the test's tmp dir, and restores both after.
Skips the test where that is impossible (not root, no pages, no mount)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def hugetlbfs_mount(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to set vm.nr_hugepages and mount hugetlbfs")
    nr = Path("/proc/sys/vm/nr_hugepages")
    before = nr.read_text().strip()
    mnt = tmp_path / "huge"
    mnt.mkdir()
    try:
        try:
            nr.write_text(str(int(before) + 8))
        except OSError as e:
            pytest.skip(f"cannot set vm.nr_hugepages: {e}")
        if int(nr.read_text()) < int(before) + 4:
            pytest.skip("the kernel gave no huge pages (memory too fragmented?)")
        r = subprocess.run(
            ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mnt)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount hugetlbfs: {r.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
    finally:
        nr.write_text(before)
