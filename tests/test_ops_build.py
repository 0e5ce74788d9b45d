"""Building kvstore.ops from the environments programs really run in.

A service or a cron job runs a virtualenv's python by absolute path, without
activating the virtualenv: the `ninja` package is installed, but its binary is
not on PATH, and torch's extension builder runs `ninja` from PATH. kvstore.ops
finds the package's binary itself, or says what to do."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import run_child

pytest.importorskip("torch")
pytest.importorskip("ninja")

from kvstore import ops  # noqa: E402


def _path_without_ninja() -> str:
    """PATH less this interpreter's folder and every folder that holds a ninja
    (pyenv shims included): what a program started by absolute path sees."""
    own = Path(sys.executable).parent
    keep = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and Path(d) != own and not shutil.which("ninja", path=d)
    ]
    return os.pathsep.join(keep)


LOAD = """
import os, shutil, sys
import torch
from kvstore import ops

assert shutil.which("ninja") is None, shutil.which("ninja")
before = os.environ["PATH"]
ops.load()
assert os.environ["PATH"] == before, "PATH must be restored after the build"
k = torch.zeros(2, 4, 1, 8)
v = torch.zeros(2, 4, 1, 8)
x = torch.ones(1, 1, 8)
ops.write_kv(x, 2 * x, k, v, torch.tensor([5]))
assert k[1, 1].eq(1).all() and v[1, 1].eq(2).all()
print("loaded", flush=True)
"""


def test_ops_load_finds_the_ninja_package_off_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reuses the build cache of the other ops tests ($TORCH_EXTENSIONS_DIR or
    # ~/.cache/kvstore): torch runs ninja even when the library is up to date.
    monkeypatch.setenv("PATH", _path_without_ninja())
    p = run_child(LOAD, timeout=900)
    assert "loaded" in p.stdout


def test_ops_load_without_any_ninja_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ops, "_ninja_dir", lambda: None)
    monkeypatch.setattr(ops, "_loaded", False)
    with pytest.raises(RuntimeError, match=r"needs ninja.*-m pip install ninja"):
        ops.load()
