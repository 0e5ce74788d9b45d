"""Runs one vLLM process for tests/test_vllm.py and benches/bench_vllm.py.

Run by the vLLM python (scripts/vllm_env.sh) with a JSON spec as its argument:

    {"model": dir, "store": path or null (no connector), "extra": {...} (more
     kv_connector_extra_config), "prefix_caching": bool, "batched_tokens": int,
     "max_model_len": int, "kv_bytes": int, "lora_rank": int (enables LoRA),
     "kv_cache_dtype": str, "processes": 3, 2 or 1 (see below),
     "tp": int (tensor-parallel size, default 1), "block_size": int (default 32),
     "dtype": str (default "bfloat16"),
     "phases": [{"name": str, "prompts": [[token ids]], "max_tokens": int,
                 "cache_salt": str or null, "evict": path or null, "sleep": s,
                 "lora": {"name": str, "id": int, "path": dir} or null,
                 "stored": {"layout": {...}, "model": str, "tokens": [ids]} or null,
                 "barrier": {"dir": path, "all": [names]} or null}]}

One LLM instance serves the phases in order; after each phase it prints a line
`PHASE <json>` with the greedy tokens of each prompt, the wall-clock `start` and
`end` (time.time()) and seconds of its generate call, and the connector's counters
as vLLM's Prometheus metrics show them (cumulative, summed over engines). Last
comes `DONE`. Before its generate call a phase may: with `evict`, drop the files
under that path from the page cache (fsync + posix_fadvise DONTNEED), for cold
reads; with `stored`, wait until the store holds the whole computable prefix of
`tokens` (saves are asynchronous); with `barrier`, mark itself ready in `dir` and
wait until every phase named in `all` (in any process) is, so they run at once.
A phase with `barrier` also marks in `dir` when its generate call starts and ends,
and reports in `peers_at_end` what each other phase of `all` was doing when its own
call ended ("not started", "running" or "ended"): that they ran at once is then
shown by events, not by comparing clocks.

The argument may also be a JSON list of specs: each is served in turn by an LLM
instance of its own, shut down before the next starts, in this one process (their
`PHASE` lines in order, one `DONE` at the end).

`processes` is how many processes vLLM runs in. 3 (the default): vLLM's own
arrangement, the engine core and the worker each in a process it spawns. 2: the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the worker still
in its own, so the connector's scheduler half and worker half are still separate
instances in separate processes, talking through vLLM's messages and the store.
1: the worker in this process too (the "uni" executor); for runs without the
connector. Each spawned process imports vLLM again (about 11 s on a 2-core
machine), which is most of a small run's cost. The specs of one list agree on
whether the engine core runs here (3, or 2 and 1).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def evict(root: str) -> None:
    """Drops the files under `root` from the page cache (bench_store's fadvise eviction;
    pages a process maps, such as the index's, stay)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    from bench_store import drop_page_cache

    drop_page_cache([p for p in Path(root).rglob("*") if p.is_file()], "fadvise")


def wait_until(ready: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.01)


def wait_stored(path: str, want: dict[str, Any]) -> None:
    """Until the store at `path` holds every full block of `want["tokens"]` but the
    last token's (what a request with that prompt saves)."""
    import kvstore
    from kvstore.layout import Layout

    layout = Layout(**want["layout"])
    tokens = want["tokens"]
    upto = (len(tokens) - 1) // layout.block_size * layout.block_size
    with kvstore.open(path, layout=layout, model=want["model"]) as s:
        wait_until(lambda: s.lookup(tokens[:upto], count=False) == upto, "the saves")


def barrier(name: str, spec: dict[str, Any]) -> None:
    d = Path(spec["dir"])
    d.mkdir(parents=True, exist_ok=True)
    (d / name).touch()
    wait_until(lambda: all((d / n).exists() for n in spec["all"]), f"phases {spec['all']}")


def mark(name: str, spec: dict[str, Any], event: str) -> None:
    """Marks in the barrier's dir that phase `name`'s generate call has `event`
    ("started" or "ended")."""
    (Path(spec["dir"]) / f"{name}.{event}").touch()


def peers(name: str, spec: dict[str, Any]) -> dict[str, str]:
    """What each other phase of the barrier is doing now, by its marks."""
    d = Path(spec["dir"])
    out = {}
    for n in spec["all"]:
        if n != name:
            ended, started = (d / f"{n}.ended").exists(), (d / f"{n}.started").exists()
            out[n] = "ended" if ended else "running" if started else "not started"
    return out


def connector_counters(llm: Any) -> dict[str, float]:
    """The `vllm:kvstore_*` counters, read back through vLLM's metrics API, and vLLM's
    own count of preempted requests (as `vllm_preemptions`)."""
    out: dict[str, float] = {"vllm_preemptions": 0.0}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvstore_"):
            key = m.name.removeprefix("vllm:kvstore_")
            out[key] = out.get(key, 0.0) + float(m.value)
        elif m.name == "vllm:num_preemptions":
            out["vllm_preemptions"] += float(m.value)
    return out


_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def bind_threads(tp: int) -> None:
    """One core per tensor-parallel rank (read by the workers vLLM starts next):
    without a binding, vLLM's CPU workers refuse to start on a machine of fewer NUMA
    nodes than ranks. A single worker keeps the caller's setting."""
    if tp > 1:
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
    elif _BIND is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _BIND


def serve(spec: dict[str, Any]) -> None:
    """Serves `spec`'s phases with an LLM instance of its own, then shuts it down."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {}
    if spec.get("lora_rank"):
        kwargs.update(enable_lora=True, max_lora_rank=spec["lora_rank"], max_loras=2)
    if spec.get("store") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"path": spec["store"], **spec.get("extra", {})},
        )
    bind_threads(spec.get("tp", 1))
    processes = spec.get("processes", 3)
    if processes < 3:
        kwargs["distributed_executor_backend"] = "uni" if processes == 1 else "mp"
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        block_size=spec.get("block_size", 32),
        tensor_parallel_size=spec.get("tp", 1),
        max_model_len=spec.get("max_model_len", 512),
        max_num_batched_tokens=spec.get("batched_tokens", 512),
        enable_chunked_prefill=True,
        enforce_eager=True,
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    for phase in spec["phases"]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=phase.get("max_tokens", 8),
            min_tokens=phase.get("max_tokens", 8),
            detokenize=False,
        )
        prompts: list[Any] = []
        for p in phase["prompts"]:
            prompt: dict[str, Any] = {"prompt_token_ids": p}
            if phase.get("cache_salt") is not None:
                prompt["cache_salt"] = phase["cache_salt"]
            prompts.append(prompt)
        time.sleep(phase.get("sleep", 0))  # e.g. for background saves to finish
        if phase.get("evict"):
            evict(phase["evict"])
        if phase.get("stored"):
            wait_stored(spec["store"], phase["stored"])
        if phase.get("barrier"):
            barrier(phase["name"], phase["barrier"])
            mark(phase["name"], phase["barrier"], "started")
        start = time.time()
        t0 = time.perf_counter()
        lora = phase.get("lora")
        adapter = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        seconds = time.perf_counter() - t0
        at_end = None
        if phase.get("barrier"):
            mark(phase["name"], phase["barrier"], "ended")
            at_end = peers(phase["name"], phase["barrier"])
        result = {
            "name": phase["name"],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "start": start,
            "end": time.time(),
            "seconds": seconds,
            "counters": connector_counters(llm),
        }
        if at_end is not None:
            result["peers_at_end"] = at_end
        print("PHASE " + json.dumps(result), flush=True)
    if processes < 3:
        # The engine core lives here: shut it down now (its worker exits, both
        # connector halves flush and close their stores), not whenever the
        # collector finds it, so the next spec's engine starts on a clean slate.
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main() -> None:
    arg = json.loads(sys.argv[1])
    specs = arg if isinstance(arg, list) else [arg]
    here = {s.get("processes", 3) < 3 for s in specs}
    if len(here) != 1:
        raise SystemExit("vllm_driver: the specs disagree on where the engine core runs")
    in_process = here.pop()
    if in_process:
        # Read by vLLM when it starts an engine: set before anything imports it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for spec in specs:
        serve(spec)
    print("DONE", flush=True)
    if in_process:
        # Every engine here was shut down (its worker gone, both connector halves'
        # stores flushed and closed): nothing is left to finalize but the
        # interpreter's teardown of torch and vLLM's modules, ~2.5 s on 2 cores.
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
