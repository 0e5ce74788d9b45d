"""The components the tests need that a `pip install '.[test]'` does not bring, and the
one switch that makes them required.

Without the switch a test that needs a missing component skips (a laptop without
Redis still runs the rest). With it, the run fails instead, naming what is missing:

    KVSTORE_REQUIRE=redis,openssl,vllm   # or "all"; scripts/test.sh (CI) sets it

`KVSTORE_REQUIRE_VLLM=1`, the older switch for vLLM alone, still counts as "vllm".
The test session checks every required component once, at its start (conftest.py),
so a missing one fails the whole run however the tests are selected; each test that
needs a component calls `need(name)` too, which skips or fails it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable

import pytest


def _tools(*alternatives: tuple[str, ...]) -> Callable[[], str | None]:
    """A probe for commands on PATH: one of each tuple of alternatives."""

    def probe() -> str | None:
        gone = [" or ".join(alt) for alt in alternatives if not any(map(shutil.which, alt))]
        return f"not on PATH: {', '.join(gone)}" if gone else None

    return probe


def _vllm() -> str | None:
    from support import vllm_run

    if vllm_run.vllm_python() is None:
        return "no vLLM virtualenv (run scripts/vllm_env.sh, or set KVSTORE_VLLM_PYTHON)"
    return None


def _sglang() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not installed"
    return None


# Every component the tests know, with what probes it: None when it is there, else
# what is missing.
COMPONENTS: dict[str, Callable[[], str | None]] = {
    # The remote-tier tests start servers and inspect them with the client; the
    # remote bench drives them with redis-benchmark.
    "redis": _tools(
        ("redis-server", "valkey-server"),
        ("redis-cli", "valkey-cli"),
        ("redis-benchmark", "valkey-benchmark"),
    ),
    # The TLS tests make their certificates with it.
    "openssl": _tools(("openssl",)),
    "vllm": _vllm,
    "sglang": _sglang,
}


def required_components() -> list[str]:
    """The components this run must have: `KVSTORE_REQUIRE` (comma-separated, or
    "all"), plus "vllm" under `KVSTORE_REQUIRE_VLLM=1`. An unknown name is an error,
    so that a typo cannot quietly require nothing."""
    names = [n.strip() for n in os.environ.get("KVSTORE_REQUIRE", "").split(",") if n.strip()]
    if "all" in names:
        names = list(COMPONENTS)
    unknown = sorted(set(names) - set(COMPONENTS))
    if unknown:
        raise ValueError(
            f"KVSTORE_REQUIRE: unknown component(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(COMPONENTS)} or all"
        )
    if os.environ.get("KVSTORE_REQUIRE_VLLM") == "1" and "vllm" not in names:
        names.append("vllm")
    return names


def required(name: str) -> bool:
    assert name in COMPONENTS, name
    return name in required_components()


def missing(name: str) -> str | None:
    """What is missing of component `name`, or None when it is all there."""
    return COMPONENTS[name]()


def missing_required() -> list[str]:
    """One line per required component that is missing, naming it and what is gone."""
    return [
        f"{name}: {gone}" for name in required_components() if (gone := missing(name)) is not None
    ]


def need(name: str) -> None:
    """Skips the calling test (or module, at module level) when component `name` is
    missing; fails it instead when the component is required."""
    gone = missing(name)
    if gone is None:
        return
    if required(name):
        pytest.fail(f"KVSTORE_REQUIRE names {name}, which is missing: {gone}", pytrace=False)
    pytest.skip(f"needs {name}: {gone}", allow_module_level=True)
