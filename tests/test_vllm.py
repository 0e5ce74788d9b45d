"""kvstore.vllm.KVStoreConnector against real vLLM processes (vLLM 0.32, CPU build).

vLLM runs in its own virtualenv (scripts/vllm_env.sh), one process at a time
except where two share a store on purpose; each serves several phases
(tests/support/vllm_driver.py) so the file costs a handful of vLLM start-ups.
The reference for every generated token is a vLLM run without the connector,
and for the stored KV transformers on the same weights.

Start-up is most of a run's cost (each process vLLM spawns imports vLLM again,
about 11 s on a 2-core machine), so runs with the connector keep only the
processes the connector needs: the engine core (its scheduler half) in the
driver's process, the worker (its worker half) in its own. The references, which
have no connector, run every engine in one process, one after the other.

Without the vLLM virtualenv these tests skip; with vllm required (KVSTORE_REQUIRE,
set by scripts/test.sh; see tests/support/require.py) that is a failure instead.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import require, vllm_driver, vllm_run
from support.vllm_run import by_name, delta

# Checked before anything can skip this file: where vllm is required (CI) a missing
# vLLM fails instead of skipping.
require.need("vllm")
PY = vllm_run.vllm_python()
assert PY is not None

import kvstore  # noqa: E402

if require.required("vllm"):
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kvstore import hf  # noqa: E402

pytestmark = pytest.mark.slow

B = 32  # vLLM's block size here (the CPU backend needs a multiple of 32)
NEW = 8  # greedy tokens per prompt


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


class Prompts:
    """Token-id prompts: two with a shared prefix, one sharing part of it, one to plant
    KV under, one for a transformers session, and batches for the concurrency and kill
    tests."""

    def __init__(self) -> None:
        rng = random.Random(14)
        prefix = _tokens(rng, 200)
        self.a = prefix + _tokens(rng, 40)
        self.b = prefix + _tokens(rng, 50)
        self.partial = prefix[:100] + _tokens(rng, 150)  # 3 blocks in common with a
        self.planted = _tokens(rng, 130)
        self.session = _tokens(rng, 170)
        self.x = [_tokens(rng, 230) for _ in range(2)]
        self.y = [self.x[0][:96] + _tokens(rng, 150), _tokens(rng, 260)]
        self.kill = [_tokens(rng, 400) for _ in range(20)]
        self.preempt = [_tokens(rng, 220) for _ in range(3)]
        self.busy = [_tokens(rng, 300) for _ in range(6)]
        self.damage = _tokens(rng, 200)  # 6 blocks stored by transformers, the last damaged
        # Its 6 blocks (the damaged one too) and more: served in one batch with it.
        self.damage2 = self.damage[: 6 * B] + _tokens(rng, 40)
        # Its first 2 blocks, served first so that vLLM's own prefix cache holds them.
        self.warm = self.damage[: 2 * B] + _tokens(rng, 40)
        self.lora = [_tokens(rng, 170), _tokens(rng, 150)]


P = Prompts()


def phase(name: str, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
    return {"name": name, "prompts": prompts, "max_tokens": NEW, **kw}


SHARED = [phase("shared", [P.a, P.b])]
PARTIAL = [phase("partial", [P.partial])]
LATER = [
    phase("salted", [P.a], cache_salt="tenant-2"),
    phase("planted", [P.planted]),
    phase("session", [P.session]),
]
CONCURRENT_X = [phase("x", P.x)]
CONCURRENT_Y = [phase("y", P.y)]
# Run at once (a barrier in the drivers), once x's saves of P.x are in the store.
AT_ONCE = ("x-busy", "y")
KILL = [phase("kill-warm", P.kill[:1]), phase("kill", P.kill[1:])]
# 3 prompts of 7 blocks growing to 8 in 23 usable blocks: vLLM preempts one. Its
# reference runs in as little memory (a run that preempts nothing batches otherwise).
PREEMPT = [phase("preempt", P.preempt, max_tokens=12)]
# B computes and stores P.damage's KV, which the damage runs then find with its 6th
# block damaged: the blocks that load are vLLM's own KV, as in a run without the store.
SEED = [phase("damage-seed", [P.damage])]
DAMAGE = [
    phase("damage", [P.damage, P.damage2]),
    phase("salted-again", [P.a], cache_salt="tenant-2"),
]
WARM = [phase("warm", [P.warm])]
SMALL = 24 * 4 * B * 2 * 2 * 64 * 2  # bytes of 24 blocks (one is vLLM's null block)


def store_stats(path: Path) -> dict[str, Any]:
    """The store's figures for every process, as `kvstore stats --json` reports them."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--json", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout)["store"])


def store_hits(path: Path) -> int:
    """Blocks served by the store to every process, as `kvstore stats` reports it."""
    return int(store_stats(path)["total_hit_blocks"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm")
    model_dir = vllm_run.save_model(root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return {
        "root": root,
        "model_dir": str(model_dir),
        "model": model.eval(),
        "fingerprint": hf.fingerprint(model),
        "logs": root / "logs",
    }


def spec(world: dict[str, Any], store: Path | None, phases: list[Any], **kw: Any) -> dict:
    return {
        "model": world["model_dir"],
        "store": str(store) if store is not None else None,
        "phases": phases,
        "batched_tokens": 64,  # chunked prefill: a 240-token prompt takes 4 steps
        # The scheduler half in the driver's process, the worker half in vLLM's worker
        # process (tests/support/vllm_driver.py): one vLLM import fewer than vLLM's
        # default three processes.
        "processes": 2,
        **kw,
    }


def run(world: dict[str, Any], name: str, s: vllm_run.Spec) -> list[dict[str, Any]]:
    world["logs"].mkdir(exist_ok=True)
    return vllm_run.run(PY, s, world["logs"] / f"{name}.log")


@pytest.fixture(scope="module")
def reference(world: dict[str, Any], adapters: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Greedy tokens of every prompt from vLLM without the connector: with the default
    KV memory, with as little as the preemption phase's run (24 blocks), and with LoRA
    enabled (P.lora with no adapter, adapter A, adapter B). Three LLM instances, one
    after the other in one process, every part of vLLM in it (no connector here)."""
    phases = SHARED + PARTIAL + LATER + CONCURRENT_X + CONCURRENT_Y + KILL + DAMAGE[:1] + WARM
    engines = [
        spec(world, None, phases, processes=1),
        spec(world, None, PREEMPT, kv_bytes=SMALL, processes=1),
        spec(
            world,
            None,
            lora_phases(adapters, "base", "lora-a", "lora-b"),
            lora_rank=LORA_RANK,
            processes=1,
        ),
    ]
    return by_name(run(world, "reference", engines))


@pytest.fixture(scope="module")
def stored(world: dict[str, Any]) -> dict[str, Any]:
    """Process A serves the shared-prefix prompts into a fresh store."""
    path = world["root"] / "store"
    results = run(world, "A", spec(world, path, SHARED))
    return {"path": path, "A": by_name(results)}


def expected_blocks(store: kvstore.Store, seqs: list[list[int]]) -> set[bytes]:
    """Block ids of every full block whose KV a request computed (prompt and output,
    less the last output token, whose KV is never computed)."""
    ids: set[bytes] = set()
    for s in seqs:
        n = (len(s) - 1) // B * B
        ids.update(store.block_ids(s[:n]))
    return ids


def test_process_a_stores_each_block_once(world, reference, stored):
    a = stored["A"]["shared"]
    assert a["tokens"] == reference["shared"]["tokens"]
    assert a["counters"]["hit_tokens"] == 0
    assert a["counters"]["load_error_blocks"] == 0
    # Chunked prefill (64 tokens a step) hands each completed block over once per
    # request: a's 7 blocks, b's 8 at most (fewer if a's were stored before b's
    # lookup); re-copying earlier blocks at each step would exceed this.
    assert a["counters"]["save_tokens"] <= 7 * B + 8 * B
    with hf.open(
        stored["path"], world["model"], fingerprint=world["fingerprint"], block_size=B
    ) as s:
        seqs = [p + t for p, t in zip([P.a, P.b], a["tokens"], strict=True)]
        want = expected_blocks(s, seqs)
        st = s.stats()
        assert st["blocks"] == len(want)
        for seq in seqs:  # the whole computed prefix is stored, under hf's keys
            assert s.lookup(seq, count=False) == (len(seq) - 1) // B * B


def kv_of(model: Any, tokens: list[int]):
    """transformers' `[L, 2, T, H, D]` KV of `tokens` on `model`."""
    with torch.inference_mode():
        return hf.cache_to_kv(model(torch.tensor([tokens]), use_cache=True).past_key_values)


def assert_kv_close(kv, bf16, f32) -> None:
    """vLLM's `kv` is as close to the float32 reference `f32` as transformers' own
    bfloat16 run `bf16` is, layer by layer, K and V."""
    for layer in range(kv.shape[0]):
        for j in range(2):
            ours = (kv[layer, j].float() - f32[layer, j]).abs().max().item()
            theirs = (bf16[layer, j].float() - f32[layer, j]).abs().max().item()
            assert ours <= 1.5 * theirs + 0.02, (layer, j, ours, theirs)


def assert_kv_like_transformers(world: dict[str, Any], tokens: list[int], kv, at: slice) -> None:
    """`kv` (tokens `at` of `tokens`' KV, stored by vLLM) against transformers' on the
    same weights and tokens: layer 0's V is the same math (bit-exact); elsewhere vLLM
    is as close to a float32 reference as transformers' own bfloat16 run is."""
    bf16 = kv_of(world["model"], tokens)[:, :, at]
    m32 = transformers.AutoModelForCausalLM.from_pretrained(
        world["model_dir"], dtype=torch.float32
    ).eval()
    f32 = kv_of(m32, tokens)[:, :, at]
    assert torch.equal(kv[0, 1], bf16[0, 1])
    assert_kv_close(kv, bf16, f32)


def test_stored_kv_equals_transformers(world, stored):
    n = (len(P.a) - 1) // B * B
    with hf.open(
        stored["path"], world["model"], fingerprint=world["fingerprint"], block_size=B
    ) as s:
        kv = s.get(P.a[:n], like=torch.empty(0))
    assert kv.shape[2] == n
    assert_kv_like_transformers(world, P.a[:n], kv, slice(0, n))


@pytest.fixture(scope="module")
def fresh_b(world, stored):
    """Plants KV (random under one prompt, transformers' session under another), then a
    fresh process B on the same store serves the shared prompts and the later phases,
    and last P.damage (SEED: the KV the damage runs find, one block damaged)."""
    path = stored["path"]
    with hf.open(path, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        n = len(P.planted) // B * B
        g = torch.Generator().manual_seed(3)
        planted = torch.randn(s.layout.kv_shape(n), generator=g).mul(4).to(torch.bfloat16)
        assert s.put(P.planted[:n], planted) == n
        ids = torch.tensor([P.session])
        with torch.inference_mode():
            cache = world["model"](ids, use_cache=True).past_key_values
        hf.save_session(s, "transformers", ids, cache)
    before = store_stats(path)
    results = run(world, "B", spec(world, path, PARTIAL + SHARED + LATER + SEED))
    after = store_stats(path)
    return {
        "results": results,
        "hits": after["total_hit_blocks"] - before["total_hit_blocks"],
        "counters": {k: v - before["counters"].get(k, 0) for k, v in after["counters"].items()},
    }


def test_fresh_process_loads_and_matches(world, reference, stored, fresh_b):
    b = by_name(fresh_b["results"])
    shared = delta(fresh_b["results"], "shared")
    # vLLM's own cache holds the first 3 blocks (from "partial"): a loads its 4 others
    # from the store; b shares 6 blocks with a (local hits once a's are loaded, loads
    # otherwise) and loads its 7th.
    assert 4 * B + B <= shared["hit_tokens"] <= 4 * B + 4 * B
    assert shared["load_error_blocks"] == 0
    assert b["shared"]["tokens"] == stored["A"]["shared"]["tokens"]
    assert b["shared"]["tokens"] == reference["shared"]["tokens"]
    # The store (`kvstore stats`, every process) counted each load's blocks, and the
    # stored prefix before a load's start that the range get checked: up to the end of
    # each loaded prompt's stored prefix. B loaded partial, a, b, planted and session.
    # partial: 3 blocks, a: 7, b: 7, planted: 4, session: 5.
    assert fresh_b["hits"] == 3 + 7 + 7 + 4 + 5
    # The connector's own figures reached `kvstore stats` too (its named counters),
    # equal to what vLLM's metrics read from it over B's run.
    final = fresh_b["results"][-1]["counters"]
    for k in ("hit_tokens", "load_bytes", "load_error_blocks"):
        assert fresh_b["counters"].get(f"vllm.{k}", 0) == final[k], k
    assert final["hit_tokens"] > 0


def test_partial_hit(fresh_b, reference):
    """A prompt sharing 3 blocks with a stored one: those load, the rest is computed."""
    d = delta(fresh_b["results"], "partial")
    assert d["hit_tokens"] == 3 * B
    assert d["load_error_blocks"] == 0
    assert by_name(fresh_b["results"])["partial"]["tokens"] == reference["partial"]["tokens"]


def test_other_cache_salt_gets_no_hit(fresh_b, reference):
    d = delta(fresh_b["results"], "salted")
    assert d["hit_tokens"] == 0
    assert by_name(fresh_b["results"])["salted"]["tokens"] == reference["salted"]["tokens"]


def test_planted_kv_is_used(fresh_b, reference):
    d = delta(fresh_b["results"], "planted")
    assert d["hit_tokens"] == len(P.planted) // B * B
    assert by_name(fresh_b["results"])["planted"]["tokens"] != reference["planted"]["tokens"]


def test_transformers_session_is_a_hit(fresh_b, reference):
    d = delta(fresh_b["results"], "session")
    assert d["hit_tokens"] == (len(P.session) - 1) // B * B
    assert by_name(fresh_b["results"])["session"]["tokens"] == reference["session"]["tokens"]


def damage_stored_block(world: dict[str, Any], path: Path) -> int:
    """Damages the record of P.damage's 6th block in the store at `path` (a copy of B's
    store: the KV vLLM computed in B's seed phase) and returns the tokens of its 6 blocks.
    Stored KV from transformers instead (as these tests once did) differs from vLLM's in
    its last bits, and on an AVX2 CPU P.damage2's greedy tokens then left the reference's
    at a near-tie: the run must differ from a run without the store only by the damage."""
    n = len(P.damage) // B * B
    with hf.open(path, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        assert s.lookup(P.damage[:n], count=False) == n
        block_id = s.block_ids(P.damage[:n])[-1]
    # The record's header holds its block id; 512 bytes on is inside its payload (the
    # probe below checks that exactly this block is damaged).
    found = []
    for seg in sorted((path / "segments").glob("*.kvseg")):
        data = bytearray(seg.read_bytes())
        at = data.find(block_id)
        if at >= 0:
            found.append((seg, data, at))
    assert len(found) == 1, [f[0].name for f in found]
    seg, data, at = found[0]
    data[at + 512] ^= 0x5A
    seg.write_bytes(bytes(data))
    # The reference split, by kvstore's own check of a copy: exactly that block.
    probe = path.with_name(path.name + "-probe")
    shutil.copytree(path, probe)
    with hf.open(probe, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        bad = {bytes.fromhex(d["block_id"]) for d in s.verify()["damaged"]}
    assert bad == {block_id}
    return n


def assert_healed(world: dict[str, Any], path: Path, n: int) -> None:
    """The store at `path` holds P.damage's `n` tokens again, its last block stored again
    from vLLM's recomputed KV, not the damaged record."""
    with hf.open(path, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        assert s.lookup(P.damage[:n], count=False) == n
        healed = s.get(P.damage[:n], like=torch.empty(0))
    at = slice(n - B, n)
    assert_kv_like_transformers(world, P.damage[:n], healed[:, :, at], at)


@pytest.fixture(scope="module")
def damaged_run(world, stored, fresh_b):
    """A copy of B's store where P.damage's 6th block is damaged (damage_stored_block).
    Served by a vLLM with little KV memory (24 blocks) that also runs the preemption
    phase, and no prefix cache of its own (else a resumed request finds its blocks
    there, and a salted prompt B served is a local hit)."""
    damaged = world["root"] / "damaged"
    shutil.copytree(stored["path"], damaged)
    n = damage_stored_block(world, damaged)
    s = spec(world, damaged, DAMAGE + PREEMPT, kv_bytes=SMALL, prefix_caching=False)
    return {"results": run(world, "damaged", s), "path": damaged, "n": n}


def test_damaged_block_misses_and_is_recomputed_and_stored_again(world, damaged_run, reference):
    """Two requests served together share 6 stored blocks, the last damaged (P.damage,
    P.damage2); the scheduler plans loads from the index; 5 land, the damaged one is
    reported to vLLM, which recomputes it for each request whose load failed: both get
    the tokens of a run without the store. The recomputed block is saved again, so the
    store heals."""
    results = damaged_run["results"]
    d = delta(results, "damage")
    # The first request's load: 5 blocks land, the damaged one is reported (and leaves
    # the index). The second's, by when vLLM plans it: in the same step, the same
    # (5 and 1); after the first read quarantined the block, 5 planned and landed; after
    # the first stored it again, 6 landed. Never a damaged block served.
    outcomes = {(10 * B, 2), (10 * B, 1), (11 * B, 1)}
    assert (d["hit_tokens"], d["load_error_blocks"]) in outcomes, d
    assert by_name(results)["damage"]["tokens"] == reference["damage"]["tokens"]
    assert_healed(world, damaged_run["path"], damaged_run["n"])


def test_same_cache_salt_hits(damaged_run, reference):
    """B served P.a under cache_salt tenant-2 (a miss, then stored under that salt): the
    same salt is a hit in another process (SPEC 5.6)."""
    d = delta(damaged_run["results"], "salted-again")
    assert d["hit_tokens"] == (len(P.a) - 1) // B * B
    assert d["load_error_blocks"] == 0
    tokens = by_name(damaged_run["results"])["salted-again"]["tokens"]
    assert tokens == reference["salted"]["tokens"]


def test_preempted_request_resumes_from_the_store(damaged_run, reference):
    """A preempted request's blocks are freed once its saves have read them; resumed,
    it loads its prompt's stored blocks (new ones: the damage predates them)."""
    d = delta(damaged_run["results"], "preempt")
    assert d["vllm_preemptions"] >= 1
    assert d["hit_tokens"] > 0
    assert d["load_error_blocks"] == 0
    assert by_name(damaged_run["results"])["preempt"]["tokens"] == reference["preempt"]["tokens"]


# -- a failed load of blocks vLLM's own prefix cache also holds ----------------------------------


@pytest.fixture(scope="module")
def damaged_cached_run(world, stored, fresh_b):
    """A copy of B's store, P.damage's 6th block damaged, served with vLLM's prefix
    cache on: P.warm first (vLLM then caches P.damage's first 2 blocks), then P.damage
    and P.damage2 together, then both again."""
    path = world["root"] / "damaged-cached"
    shutil.copytree(stored["path"], path)
    n = damage_stored_block(world, path)
    phases = WARM + [
        phase("damage-cached", [P.damage, P.damage2]),
        phase("damage-again", [P.damage, P.damage2]),
    ]
    results = run(world, "damaged-cached", spec(world, path, phases))
    log = (world["logs"] / "damaged-cached.log").read_text()
    return {"results": results, "path": path, "n": n, "log": log}


def test_failed_load_behind_prefix_cache_hits_is_recomputed(world, damaged_cached_run, reference):
    """P.damage's first 2 blocks are vLLM prefix-cache hits, its next 4 loads, the last
    of which fails; P.damage2, scheduled in the same step (or the next), finds all 6 (the
    failed one too, cached by vLLM when the load was planned) in vLLM's prefix cache and
    loads nothing. vLLM recomputes the block for the first (and reschedules the second if
    it computed against the failed block): both get the tokens of a run without the
    store, and so do both again from vLLM's cache, which then holds the recomputed
    block; the store heals."""
    results = damaged_cached_run["results"]
    got = by_name(results)
    warm = delta(results, "warm")
    assert (warm["hit_tokens"], warm["load_error_blocks"]) == (2 * B, 0)
    assert got["warm"]["tokens"] == reference["warm"]["tokens"]
    d = delta(results, "damage-cached")
    # 3 blocks land and 1 fails, for P.damage only: P.damage2 never asked the store.
    assert (d["hit_tokens"], d["load_error_blocks"]) == (3 * B, 1), d
    # vLLM's own account, by when P.damage2 reached vLLM's engine: in the failed load's
    # step, both held the failed block (P.damage2 its 40 tokens computed against it,
    # P.damage the block itself) and both were rescheduled; a step later, only P.damage
    # was, and P.damage2 computed with the block being recomputed in the same step.
    log = damaged_cached_run["log"]
    accounts = [
        "KV load failure: 2 request(s) rescheduled (72 tokens affected)",
        "KV load failure: 1 request(s) rescheduled (32 tokens affected)",
    ]
    assert sum(log.count(a) for a in accounts) == 1, log[-4000:]
    assert got["damage-cached"]["tokens"] == reference["damage"]["tokens"]
    again = delta(results, "damage-again")
    assert (again["hit_tokens"], again["load_error_blocks"]) == (0, 0), again
    assert got["damage-again"]["tokens"] == reference["damage"]["tokens"]
    assert_healed(world, damaged_cached_run["path"], damaged_cached_run["n"])


# -- LoRA adapters: part of the block keys -------------------------------------------------------

LORA_RANK = 8


@pytest.fixture(scope="module")
def adapters(world) -> dict[str, dict[str, Any]]:
    """Two adapters of the test model (random, different weights) as vLLM requests them."""
    from support.lora import save_adapter

    out = {}
    for i, name in enumerate(("lora-a", "lora-b"), start=1):
        path = save_adapter(world["root"] / name, world["model"].config, seed=i, rank=LORA_RANK)
        out[name] = {"name": name, "id": i, "path": str(path)}
    return out


def lora_phases(adapters: dict[str, dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    """P.lora under each adapter named ("base": none)."""
    return [phase(n, P.lora, lora=adapters.get(n)) for n in names]


def stored_under(
    world: dict[str, Any], path: Path, adapters: dict[str, dict[str, Any]]
) -> dict[str, list[int]]:
    """Tokens of each P.lora prompt's computed prefix the store at `path` holds under
    each adapter's key extra ("base": none, kvstore.hf's keys)."""
    from kvstore.vllm.keys import adapter_digest, key_extra

    extra = {n: key_extra(None, adapter_digest(a["path"])) for n, a in adapters.items()}
    extra["base"] = None
    with hf.open(path, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        return {
            n: [s.lookup(p[: (len(p) - 1) // B * B], extra=e, count=False) for p in P.lora]
            for n, e in extra.items()
        }


@pytest.fixture(scope="module")
def lora_runs(world, adapters, reference):
    """vLLM with LoRA enabled: without the connector (the reference, from `reference`);
    process LA serving P.lora under adapter A into a fresh store; a fresh process LB on
    that store serving it with no adapter, adapter B, then adapter A."""
    ref = [reference[name] for name in ("base", "lora-a", "lora-b")]
    path = world["root"] / "lora-store"
    la = run(world, "LA", spec(world, path, lora_phases(adapters, "lora-a"), lora_rank=LORA_RANK))
    after_la = stored_under(world, path, adapters)
    before = store_hits(path)
    phases = lora_phases(adapters, "base", "lora-b", "lora-a")
    lb = run(world, "LB", spec(world, path, phases, lora_rank=LORA_RANK))
    return {
        "reference": by_name(ref),
        "LA": la,
        "after_LA": after_la,
        "LB": lb,
        "LB_hits": store_hits(path) - before,
        "path": path,
    }


def test_lora_adapters_change_the_output(lora_runs):
    """The instrument: each adapter changes the greedy tokens (it changes K and V), so a
    block served across adapters would show in the tokens."""
    ref = lora_runs["reference"]
    assert ref["lora-a"]["tokens"] != ref["base"]["tokens"]
    assert ref["lora-b"]["tokens"] != ref["base"]["tokens"]
    assert ref["lora-a"]["tokens"] != ref["lora-b"]["tokens"]


def test_lora_blocks_are_stored_under_the_adapter(lora_runs):
    """What LA stored is keyed by adapter A's files: found with its key extra, not
    without (the base model's keys, kvstore.hf's) nor with adapter B's."""
    assert (
        by_name(lora_runs["LA"])["lora-a"]["tokens"] == lora_runs["reference"]["lora-a"]["tokens"]
    )
    computed = [(len(p) - 1) // B * B for p in P.lora]
    assert lora_runs["after_LA"] == {"lora-a": computed, "lora-b": [0, 0], "base": [0, 0]}


def test_lora_kv_equals_transformers_with_the_adapter_merged(world, adapters, lora_runs):
    """The KV LA stored under adapter A against transformers' with A merged into the
    weights (W + scale * B @ A, computed here from the adapter's files): as close to
    the float32 merge as its bfloat16 run is, and far from the base model's KV."""
    from support.lora import merged

    from kvstore.vllm.keys import adapter_digest, key_extra

    path = adapters["lora-a"]["path"]
    m16, m32 = (merged(world["model_dir"], path, d) for d in (torch.bfloat16, torch.float32))
    extra = key_extra(None, adapter_digest(path))
    with hf.open(
        lora_runs["path"], world["model"], fingerprint=world["fingerprint"], block_size=B
    ) as s:
        for p in P.lora:
            n = (len(p) - 1) // B * B
            kv = s.get(p[:n], extra=extra, like=torch.empty(0))
            assert_kv_close(kv, kv_of(m16, p[:n]), kv_of(m32, p[:n]))
            base = kv_of(world["model"], p[:n])
            assert (kv[-1].float() - base[-1].float()).abs().max().item() > 1.0


def test_lora_prefix_is_a_hit_only_for_its_adapter(lora_runs):
    """In a fresh process, adapter A's stored prefix is no hit for the base model nor for
    adapter B, and is one for adapter A; every run's tokens equal vLLM's without the
    connector under the same adapter."""
    ref, lb = lora_runs["reference"], lora_runs["LB"]
    got = by_name(lb)
    for name in ("base", "lora-b", "lora-a"):
        assert got[name]["tokens"] == ref[name]["tokens"], name
        assert delta(lb, name)["load_error_blocks"] == 0, name
    assert delta(lb, "base")["hit_tokens"] == 0
    assert delta(lb, "lora-b")["hit_tokens"] == 0
    want = sum((len(p) - 1) // B * B for p in P.lora)
    assert delta(lb, "lora-a")["hit_tokens"] == want
    # The store's own count (every process): only adapter A's blocks were served.
    assert lora_runs["LB_hits"] == want // B


# -- a quantized vLLM KV cache ------------------------------------------------------------------


def test_fp8_kv_cache_is_refused_at_start_up(world):
    """vLLM's CPU backend runs an fp8 KV cache, which the store does not keep (it keeps
    the model dtype's KV): the connector refuses it when vLLM starts, naming the
    setting, before it creates a store."""
    path = world["root"] / "fp8-store"
    log = world["logs"] / "fp8.log"
    world["logs"].mkdir(exist_ok=True)
    s = spec(world, path, [phase("never", [P.a])], kv_cache_dtype="fp8")
    with pytest.raises(AssertionError, match="vLLM driver failed"):
        vllm_run.run(PY, s, log)
    assert "KVStoreConnector: kv_cache_dtype 'fp8' is quantized" in log.read_text()
    assert not path.exists()


def test_two_processes_then_sigkill_then_fresh(world, reference):
    """x serves its prompts, then x and y serve at once (the one whose generate call
    ends first finds the other's running); y loads the blocks its first prompt shares
    with x's. Then x goes on to
    the kill phases and is killed mid-save, and a fresh process serves every prompt
    from the store correctly."""
    path = world["root"] / "shared-store"
    world["logs"].mkdir(exist_ok=True)
    with hf.open(path, world["model"], fingerprint=world["fingerprint"], block_size=B) as s:
        layout = dataclasses.asdict(s.layout)
    at_once = {"dir": str(world["root"] / "barrier"), "all": list(AT_ONCE)}
    # x's process then serves the kill phases (a vLLM start-up fewer than a process of
    # their own): killed once "kill-warm" is reported, inside "kill".
    stored_x = {"layout": layout, "model": world["fingerprint"], "tokens": P.x[0]}
    # Saves are asynchronous and a batch put commits up to 20 ms after it returns, so
    # "kill" starts once kill-warm's saves are committed: on 2 busy cores they may lag
    # the reported phase by more than the 0.5 s the kill waits (seen once in CI).
    stored_kw = {**stored_x, "tokens": P.kill[0]}
    kill = [KILL[0], {**KILL[1], "stored": stored_kw}]
    x_phases = CONCURRENT_X + [phase("x-busy", P.busy, barrier=at_once)] + kill
    y_phases = [{**CONCURRENT_Y[0], "stored": stored_x, "barrier": at_once}]
    x = vllm_run.VLLM(PY, spec(world, path, x_phases), world["logs"] / "X.log")
    y = vllm_run.VLLM(PY, spec(world, path, y_phases), world["logs"] / "Y.log")
    while (got := x.next_phase()) is not None and got["name"] != "kill-warm":
        pass
    assert got is not None, f"x ended before its kill phases; see {x.log}"
    # kill-warm done and stored (x waits for that too): the engine is up and saving.
    vllm_driver.wait_stored(str(path), stored_kw)
    time.sleep(0.5)  # into the long phase: prefills, decodes and saves in flight
    x.kill()
    names = [r["name"] for r in x.results]
    assert names == ["x", "x-busy", "kill-warm"], "the killed process finished its work"
    rx, ry = by_name(x.results), by_name(y.wait())
    assert rx["x"]["tokens"] == reference["x"]["tokens"]
    assert ry["y"]["tokens"] == reference["y"]["tokens"]
    busy, yy = rx["x-busy"], ry["y"]
    # Shown by events (vllm_driver marks each call's start and end): when the first
    # of the two calls ended, the other had started and not ended.
    at_end = (busy["peers_at_end"]["y"], yy["peers_at_end"]["x-busy"])
    assert "running" in at_end, (at_end, busy, yy)
    shared = 96  # y's first prompt shares 3 blocks with x's first
    assert P.y[0][:shared] == P.x[0][:shared]
    assert yy["counters"]["hit_tokens"] == shared
    assert yy["counters"]["load_error_blocks"] == 0

    fresh = run(
        world,
        "after-kill",
        spec(world, path, CONCURRENT_X + CONCURRENT_Y + KILL, prefix_caching=False),
    )
    got = by_name(fresh)
    for name in ("x", "y", "kill-warm", "kill"):
        pairs = zip(got[name]["tokens"], reference[name]["tokens"], strict=True)
        for i, (ours, ref) in enumerate(pairs):
            assert ours == ref, (name, i, ours, ref)
    # Without vLLM's prefix cache every stored prefix is a load: both processes'
    # prompts were stored (the killed one's too, as far as it got).
    assert delta(fresh, "x")["hit_tokens"] == sum((len(p) - 1) // B * B for p in P.x)
    assert delta(fresh, "y")["hit_tokens"] == sum((len(p) - 1) // B * B for p in P.y)
    assert delta(fresh, "kill-warm")["hit_tokens"] == (len(P.kill[0]) - 1) // B * B
    for name in ("x", "y", "kill-warm", "kill"):
        assert delta(fresh, name)["load_error_blocks"] == 0


def test_import_kvstore_does_not_import_vllm():
    """In vLLM's python, where vLLM is installed (checked: elsewhere this would pass by
    accident), importing kvstore, kvstore.hf and kvstore.vllm (the package under test)
    loads no vLLM module."""
    code = (
        "import importlib.util, pathlib, sys\n"
        "assert importlib.util.find_spec('vllm') is not None, 'vLLM is not installed here'\n"
        "import kvstore, kvstore.hf, kvstore.vllm\n"
        "here = str(pathlib.Path(kvstore.__file__).resolve())\n"
        "assert here == sys.argv[1], (here, sys.argv[1])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')\n"
        "assert not loaded, loaded\n"
    )
    assert PY is not None
    r = subprocess.run(
        [PY, "-c", code, str(Path(kvstore.__file__).resolve())],
        capture_output=True,
        text=True,
        env=vllm_run.env(),
        timeout=300,  # only ends a hung interpreter
    )
    assert r.returncode == 0, r.stderr


# Runs scripts one after the other, each in a namespace of its own, in one process of
# vLLM's python: one import of vLLM (which kvstore.vllm.connector imports, ~15 s on 2
# cores) for all. Each script's stdout and stderr start with a "SCRIPT <name>" line;
# one that raises has its traceback in its stderr, and the next one runs.
RUN_SCRIPTS = r"""
import json, sys, traceback
for name, code, args in json.loads(sys.argv[1]):
    print("SCRIPT " + name, flush=True)
    print("SCRIPT " + name, file=sys.stderr, flush=True)
    sys.argv = ["-c", *args]
    try:
        exec(compile(code, "<" + name + ">", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
"""


def sections(text: str) -> dict[str, str]:
    """RUN_SCRIPTS' output, by script."""
    out: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("SCRIPT "):
            lines = out.setdefault(line.removeprefix("SCRIPT "), [])
        else:
            lines.append(line)
    return {name: "\n".join(chunk) for name, chunk in out.items()}


@pytest.fixture(scope="module")
def connector_scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """STORE_ERRORS, RESUMED (in its own directory), EXTRA_GONE and RECOMPUTE_LATE, run
    by RUN_SCRIPTS."""
    scripts = [
        ("store_errors", STORE_ERRORS, []),
        ("resumed", RESUMED, [str(tmp_path_factory.mktemp("resumed"))]),
        ("extra_gone", EXTRA_GONE, []),
        ("recompute_late", RECOMPUTE_LATE, []),
    ]
    p = subprocess.run(
        [PY, "-c", RUN_SCRIPTS, json.dumps(scripts)],
        capture_output=True,
        text=True,
        env=vllm_run.env(),
        timeout=300,
    )
    return {"returncode": p.returncode, "stdout": sections(p.stdout), "stderr": p.stderr}


def script_result(run: dict[str, Any], name: str) -> dict[str, Any]:
    """The RESULT a script of `connector_scripts` printed; fails with its stderr."""
    err = sections(run["stderr"]).get(name, run["stderr"])[-4000:]
    assert run["returncode"] == 0, run["stderr"][-4000:]
    lines = [x for x in run["stdout"].get(name, "").splitlines() if x.startswith("RESULT ")]
    assert lines, err
    result: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return result


STORE_ERRORS = r"""
import json, sys, threading
from types import SimpleNamespace
import torch
from kvstore.errors import KVStoreError
from kvstore.layout import Layout
from kvstore.vllm import connector as c
from kvstore.vllm.paged import PagedKV

lay = Layout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=8)

class Failing:  # a store whose every call fails, as a broken disk or remote would
    layout = lay
    path = "failing"
    def fail(self, *a, **k):
        raise KVStoreError("injected")
    lookup = get = put = fail

sched = c._SchedulerHalf(Failing(), True, True, True)
req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(40)), cache_salt=None,
                      lora_request=None, mm_features=[], prompt_embeds=None)
matched = sched.matched(req, 0)
w = c._WorkerHalf(Failing(), ["l0", "l1"], None, 4)
caches = [torch.zeros(6, 2, 8, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
offsets = torch.arange(2 * 8 * 2 * 4).view(2, 8, 2, 4)
w._paged = PagedKV(caches, offsets.reshape(-1), lay)
w.load([c._Transfer("r", list(range(24)), 0, [3, 1, 4], None)], set())
w.save([c._Transfer("s", list(range(16)), 0, [2, 5], None)])
# Computed against a block whose load failed: not saved until vLLM recomputed it.
after = c._Transfer("t", list(range(32)), 24, [0], None, [3, 1, 4])
w.save([after])
w.drain({"s", "t"})
out = {"matched": matched, "lookup_errors": sched.take_lookup_errors(),
       "load_errors": sorted(w.take_load_errors()), "stats": w.take_stats(),
       "finished": sorted(w.finished({"s", "t"}) or ())}
w.load([], {1, 3, 4})
w.save([after])
w.drain({"t"})
out["after_recompute"] = w.take_stats()
w.close()
# A save that raises a BaseException (a Rust panic reaches Python as one): the save
# thread died with it, and the request stayed pending: drain and vLLM waited for ever.
class Panic(BaseException):
    pass
def panic(tr):
    raise Panic("injected")
wp = c._WorkerHalf(Failing(), ["l0", "l1"], None, 4)
wp._save_one = panic
wp.save([c._Transfer("p", list(range(16)), 0, [2, 5], None)])
drained = threading.Event()
threading.Thread(target=lambda: (wp.drain({"p"}), drained.set()), daemon=True).start()
out["panic_drained"] = drained.wait(30)
out["panic_thread_alive"] = wp._thread.is_alive()
out["panic_finished"] = sorted(wp.finished({"p"}) or ())
out["panic_save_errors"] = wp.take_stats()["save_errors"]
print("RESULT " + json.dumps(out))
"""


def test_store_errors_never_reach_vllm(connector_scripts):
    """A store that raises on every call, behind the connector's halves (in vLLM's
    python): a lookup is a miss, a load reports every block of its transfer for
    recompute, a save is skipped and counted; none raises into vLLM. A save computed
    against a block whose load failed waits until vLLM has recomputed that block."""
    r = script_result(connector_scripts, "store_errors")
    assert r["matched"] == 0
    assert r["lookup_errors"] == 1
    assert r["load_errors"] == [1, 3, 4]
    assert r["stats"]["hit_tokens"] == 0
    assert r["stats"]["load_error_blocks"] == 3
    assert r["stats"]["save_errors"] == 1  # s failed; t, after a failed block, skipped
    assert r["stats"]["save_tokens"] == 0
    # Both are reported, so vLLM frees their blocks: s although its save failed, t
    # although its save was skipped (reported only s, t's blocks were never freed).
    assert r["finished"] == ["s", "t"]
    assert r["after_recompute"]["save_errors"] == 1  # t tried once the block was recomputed
    # A save that raised a BaseException (a Rust panic): counted, and the request is
    # still reported; the save thread lives on.
    assert r["panic_drained"] and r["panic_thread_alive"], r
    assert r["panic_finished"] == ["p"] and r["panic_save_errors"] == 1


EXTRA_GONE = r"""
import json
from types import SimpleNamespace
from kvstore.layout import Layout
from kvstore.vllm import connector as c

lay = Layout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=8)
tokens = list(range(100, 140))
req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, all_token_ids=tokens,
                      cache_salt=None, lora_request=None, mm_features=[], prompt_embeds=None)

class Seen:  # a store that finds 4 blocks under whatever extra it is asked with
    layout = lay
    def __init__(self):
        self.extras = []
    def lookup(self, tokens, extra=None, count=True):
        self.extras.append(extra)
        return 32

calls = []
def extra_once(request):  # the LoRA adapter's files replaced after the lookup
    calls.append(1)
    if len(calls) > 1:
        raise OSError("adapter gone")
    return b"adapter-a"

c.request_extra = extra_once
store = Seen()
sched = c._SchedulerHalf(store, True, True, True)
promised = sched.matched(req, 0)
sched.allocated(req, [0, 1, 2, 3, 4], promised)
load = sched._reqs["r"].load
out = {"promised": promised, "looked_up_with": [e.decode() for e in store.extras],
       "load": [load.start, len(load.tokens), load.block_ids, load.extra.decode()],
       "extras_kept": len(sched._extras)}
sched.finished("r")
out["tracked_after"] = len(sched._reqs) + len(sched._extras) + len(sched._hits)
print("RESULT " + json.dumps(out))
"""


def test_a_promised_load_keeps_the_extra_of_its_lookup(connector_scripts):
    """The tokens vLLM was promised are loaded under the extra they were looked up
    with, even if the extra cannot be computed again by the time the blocks are
    allocated (a LoRA adapter's files replaced in between): before, the load was
    not planned and vLLM attended to blocks nobody wrote."""
    r = script_result(connector_scripts, "extra_gone")
    assert r["promised"] == 32 and r["looked_up_with"] == ["adapter-a"]
    assert r["load"] == [0, 32, [0, 1, 2, 3], "adapter-a"]
    assert r["extras_kept"] == 0 and r["tracked_after"] == 0


RECOMPUTE_LATE = r"""
import json
from types import SimpleNamespace
from kvstore.layout import Layout
from kvstore.vllm import connector as c
from kvstore.vllm.keys import request_extra

c.request_extra = request_extra  # EXTRA_GONE, in the same process, replaces it
lay = Layout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=8)
P = list(range(100, 164))  # a shared prefix of 8 blocks

def request(rid, tokens):
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens,
                           cache_salt=None, lora_request=None, mm_features=[],
                           prompt_embeds=None)

class Store:  # holds the prefix's first 4 blocks
    layout = lay
    path = "fake"
    def lookup(self, tokens, extra=None, count=True):
        return min(32, len(tokens) // 8 * 8)
    def add_counters(self, figures):
        pass
    def heads(self, create):
        return None  # no blocks of tensor-parallel workers

class Paged:  # vLLM's caches: a load lands 2 blocks, then finds the 3rd damaged
    strided = True
    def __init__(self):
        self.step, self.saved = 0, []
    def load(self, store, tokens, start, extra, blocks):
        return start + 16
    def save(self, store, tokens, start, extra, blocks):
        self.saved += [(self.step, b) for b in blocks]

def output(new=(), cached=(), sched=None):
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=n)
                            for r, ids, n in new],
        num_scheduled_tokens=dict(sched or {}),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], new_block_ids=[None] * len(cached),
            resumed_req_ids=set(), num_computed_tokens=[n for _, n in cached]))

def step(sched, w, paged, so, aborted=()):
    # One vLLM step: the metadata, start_load_kv, the forward, wait_for_save, and the
    # load errors vLLM hands back to the scheduler half (update_connector_output),
    # after the requests `aborted` meanwhile are finished.
    paged.step += 1
    meta = sched.build(so)
    w.load(meta.loads, meta.recomputed)
    w.save(meta.saves)
    w.drain(set(so.num_scheduled_tokens))
    for rid in aborted:
        sched.finished(rid)
    errors = w.take_load_errors()
    if errors:
        sched.invalidated(errors)
    return sorted(errors)

def case(variant):
    sched = c._SchedulerHalf(Store(), True, True, True)  # kv_load_failure_policy="recompute"
    w = c._WorkerHalf(Store(), ["l0", "l1"], None, 4)
    paged = w._paged = Paged()
    a, e = request("a", P + [1]), request("e", P + list(range(200, 217)))
    A, E = list(range(9)), list(range(8)) + [9, 10, 11]
    # Step 1: a loads the prefix's 4 stored blocks, computes 4..8; e, scheduled after a,
    # hits a's 8 blocks in vLLM's prefix cache (cached at a's allocation) and computes
    # its tail 9..11. a's load fails at block 2: vLLM truncates a to 16 computed tokens
    # (it recomputes 2..7), keeps e at 64 ("shared, recomputed by a") and, under
    # "recompute", keeps blocks 0..7 in its prefix cache.
    sched.allocated(a, A, sched.matched(a, 0))
    if variant == "gone":
        # a is aborted while its step runs: vLLM reports the failed load once a is
        # gone. Later blocks 2, 3 leave vLLM's prefix cache and are computed again
        # into 20, 21, while a's 4..7 (computed over the garbage) stay: c hits 0, 1,
        # 20, 21, 4..7 and computes its tail 30, 31.
        errors = step(sched, w, paged, output(new=[("a", A, 32)], sched={"a": 33}),
                      aborted=["a"])
        cc = request("c", P + list(range(300, 317)))
        C = [0, 1, 20, 21, 4, 5, 6, 7, 30, 31, 32]
        sched.allocated(cc, C, sched.matched(cc, 64))
        step(sched, w, paged, output(new=[("c", C, 64)], sched={"c": 17}))
        w.close()
        wrong = sorted({(s, b) for s, b in paged.saved if b in (4, 5, 6, 7, 30, 31)})
        return {"errors": errors, "wrong": wrong, "saved": sorted({b for _, b in paged.saved})}
    sched.allocated(e, E, sched.matched(e, 64))
    errors = step(sched, w, paged, output(new=[("a", A, 32), ("e", E, 64)],
                                          sched={"a": 33, "e": 17}))
    if variant == "chunked":
        # Step 2, long_prefill_token_threshold=16: a recomputes 2 and 3 only; e redoes
        # 16 tokens of its tail; c, new, hits blocks 0..7 and computes its tail.
        cc = request("c", P + list(range(300, 317)))
        C = list(range(8)) + [12, 13, 14]
        sched.allocated(cc, C, sched.matched(cc, 64))
        step(sched, w, paged, output(new=[("c", C, 64)], cached=[("a", 16), ("e", 64)],
                                     sched={"a": 16, "e": 16, "c": 16}))
        # Step 3: a recomputes 4..7 (and the last token).
        step(sched, w, paged, output(cached=[("a", 32), ("e", 80), ("c", 80)],
                                     sched={"a": 33, "e": 1, "c": 1}))
        good = {2: 2, 3: 2, 4: 3, 5: 3, 6: 3, 7: 3}  # block -> step that rewrote it
    else:
        # a is aborted before its recompute: nobody rewrites 2..7; e goes on over them.
        sched.finished("a")
        step(sched, w, paged, output(cached=[("e", 64)], sched={"e": 17}))
        good = {}
    w.close()
    # A block saved before the step that rewrote it (or never rewritten, or computed
    # over such a block: e's and c's tails) is wrong KV under a valid key.
    wrong = sorted({(s, b) for s, b in paged.saved if s < good.get(b, 99)})
    return {"errors": errors, "wrong": wrong, "saved": sorted({b for _, b in paged.saved})}

print("RESULT " + json.dumps({v: case(v) for v in ("chunked", "aborted", "gone")}))
"""


def test_a_failed_block_is_saved_only_once_recomputed(connector_scripts):
    """Under kv_load_failure_policy "recompute" vLLM keeps a failed load's blocks (and
    those computed after them) in its prefix cache, and lets the requests that share
    them go on as if they were computed: only the first request holding them
    recomputes them, maybe over several steps (chunked prefill), maybe never (aborted).
    Nothing read from those blocks is saved before that request has rewritten them:
    before, the worker forgot the failed blocks the step after vLLM was told, and the
    sharers' saves stored the blocks and what was computed over them."""
    r = script_result(connector_scripts, "recompute_late")
    chunked, aborted = r["chunked"], r["aborted"]
    assert chunked["errors"] == aborted["errors"] == [2, 3]
    assert chunked["wrong"] == [] and aborted["wrong"] == []
    # The store heals: the blocks are saved once rewritten; tails computed over
    # garbage (e's 9, 10; c's 12, 13) never are.
    assert chunked["saved"] == [2, 3, 4, 5, 6, 7]
    assert aborted["saved"] == []
    # Aborted before its failed load was reported: what it computed over the failed
    # blocks is stale all the same, and c's save, which reads it, is not planned.
    gone = r["gone"]
    assert gone["errors"] == [2, 3] and gone["wrong"] == [] and gone["saved"] == []


RESUMED = r"""
import json, sys
from types import SimpleNamespace
import torch
import kvstore
from kvstore.layout import Layout
from kvstore.vllm import connector as c
from kvstore.vllm.paged import PagedKV

lay = Layout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_size=8)
tokens = list(range(100, 140))  # 5 blocks; the last token's is computed, so 4 to load
req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, all_token_ids=tokens,
                      cache_salt=None, lora_request=None, mm_features=[], prompt_embeds=None)
FIRST, AGAIN = [0, 1, 2, 3, 4], [9, 8, 7, 6, 5]  # vLLM's blocks before and after

def output(new=(), cached=(), resumed=(), preempted=()):
    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=(FIRST,),
                                            num_computed_tokens=0)] if new else [],
        num_scheduled_tokens={"r": len(tokens)} if new or cached else {},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["r"] if cached else [], new_block_ids=[(AGAIN,)] if cached else [],
            resumed_req_ids=set(resumed), num_computed_tokens=[0] if cached else []))

def case(path, recompute, saves_run, saves=True):
    # Two handles, as vLLM's two processes hold. The worker's batch puts stay
    # uncommitted for the case's length (a minute's window): the scheduler cannot
    # see them, as it cannot in vLLM until the group commit.
    sched_store = kvstore.open(path, layout=lay, model="m", array="torch")
    worker_store = kvstore.open(path, layout=lay, model="m", array="torch",
                                batch_window_ms=60_000)
    sched = c._SchedulerHalf(sched_store, True, saves, recompute)
    w = c._WorkerHalf(worker_store, ["l0", "l1"], None, 4)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(10, 2, 8, 2, 4, generator=g).to(torch.bfloat16) for _ in range(2)]
    offsets = torch.arange(2 * 8 * 2 * 4).view(2, 8, 2, 4)
    w._paged = PagedKV(caches, offsets.reshape(-1), lay)
    computed = [c_[FIRST].clone() for c_ in caches]
    out = {"first": sched.matched(req, 0)}
    sched.allocated(req, FIRST, 0)
    meta = sched.build(output(new=True))  # the prefill: its 5 blocks are saved
    if saves_run:
        w.save(meta.saves)
    w.drain(sched.build(output(preempted={"r"})).preempted)  # handle_preemptions
    for c_ in caches:
        c_[FIRST] = 0  # vLLM hands the freed blocks to other requests
    out["visible"] = sched_store.lookup(tokens[:32], count=False)
    out["again"] = sched.matched(req, 0)
    sched.allocated(req, AGAIN, out["again"])
    w.load(sched.build(output(cached=True, resumed={"r"})).loads, set())
    out["stats"] = w.take_stats()
    out["load_errors"] = sorted(w.take_load_errors())
    n = out["stats"]["hit_tokens"] // 8
    out["landed"] = all(torch.equal(a[AGAIN[:n]], b[:n]) for a, b in zip(caches, computed))
    w.close()
    worker_store.close()
    sched_store.close()
    return out

class Scripted:  # a store whose lookups answer from a list: found, then gone
    layout = lay
    def __init__(self, answers):
        self.answers = answers
    def lookup(self, tokens, extra=None, count=True):
        return self.answers.pop(0)

def gone():
    # The prompt's first 4 blocks were found, then evicted while preempted: only the
    # 5th was handed to the worker, and what precedes it is not found: nothing counts.
    sched = c._SchedulerHalf(Scripted([32, 0]), True, True, True)
    sched.matched(req, 0)
    sched.allocated(req, FIRST, 32)
    saves = sched.build(output(new=True)).saves
    return {"handed": [(t.start, len(t.tokens)) for t in saves], "again": sched.matched(req, 0)}

root = sys.argv[1]
print("RESULT " + json.dumps({
    "saved": case(root + "/a", True, True),
    "save_lost": case(root + "/b", True, False),
    "policy_fail": case(root + "/c", False, True),
    "consumer": case(root + "/d", True, True, saves=False),
    "gone": gone(),
}))
"""


def test_resumed_request_loads_saves_the_scheduler_cannot_see_yet(connector_scripts):
    """A preempted request's saves are done in the worker before vLLM reuses its blocks
    (handle_preemptions), but a batch put is visible to the scheduler's handle only
    from its group commit. Resumed, the request is planned to load what it handed to
    the worker to save (its prompt's blocks), and the load lands the computed KV. If
    that save was lost, the load reports the blocks and vLLM recomputes them; under
    kv_load_failure_policy "fail", for a kv_consumer (which saves nothing), or where
    the blocks before the handed ones are gone from the store, only what the scheduler
    sees is planned."""
    r = script_result(connector_scripts, "resumed")
    gone = r.pop("gone")
    assert gone["handed"] == [[32, 40]] and gone["again"] == 0
    for case in r.values():
        assert case["first"] == 0
        assert case["visible"] == 0  # the group commit has not come
    saved, lost, fail = r["saved"], r["save_lost"], r["policy_fail"]
    assert saved["again"] == 32
    assert saved["stats"]["hit_tokens"] == 32 and saved["landed"]
    assert saved["load_errors"] == []
    assert lost["again"] == 32
    assert lost["stats"]["hit_tokens"] == 0
    assert lost["load_errors"] == [6, 7, 8, 9]  # reported: vLLM recomputes them
    assert fail["again"] == 0
    assert fail["stats"]["hit_tokens"] == 0 and fail["load_errors"] == []
    assert r["consumer"]["again"] == 0  # kv_consumer: it hands nothing to save
