"""The CPUs the store's threads may run on inside vLLM's worker. Imports no vLLM.

vLLM's CPU worker binds its main thread (OpenMP's thread 0) to one core, and a
thread inherits the mask of the thread that starts it: the store's reader threads,
started by a load on the main thread or a save on the connector's save thread, would
all share that core, and the engine, which sizes its reader threads by the CPUs the
calling thread may use (`available_parallelism`, counted once per process), would
start one. Measured in bench_vllm.py (2 cores): the load's engine call ran on one
core, at 0.35-0.38x memcpy from a warm page cache."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def every_cpu() -> Iterator[None]:
    """Lets the calling thread, and the threads it starts, run on every CPU of the
    process's cpuset; puts the calling thread's mask back afterwards."""
    try:
        mask = os.sched_getaffinity(0)
        cpus = os.cpu_count() or 1
        widen = len(mask) < cpus
        if widen:  # the kernel keeps the process's cpuset: CPUs outside it are left out
            os.sched_setaffinity(0, range(cpus))
    except (AttributeError, OSError):  # no affinity here (not Linux), or refused
        widen = False
    try:
        yield
    finally:
        if widen:
            os.sched_setaffinity(0, mask)
