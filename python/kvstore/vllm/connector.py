"""kvstore.vllm.KVStoreConnector: the scheduler and worker halves (see the package doc).
Imports vLLM."""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..errors import InvalidInput
from ..heads import head_extra
from ..layout import Layout, dtype_name
from ..remote import Remote
from ..store import Store
from ..store import open as open_store
from .keys import (
    check_speculative,
    keyed_by_tokens,
    latent_tag,
    parse_extra,
    request_extra,
    tagged,
    vllm_fingerprint,
)
from .paged import PagedKV, paged_block_map
from .shard import Shard, shard

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorStats"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 16 << 20  # per staging buffer (one for loads, one for saves)

# vLLM sums the figures of its tensor-parallel workers: token counts come from rank 0
# alone (every rank moves the same tokens), bytes and errors from every rank.
_STAT_KEYS = (
    "hit_tokens",  # tokens loaded from the store into vLLM's cache
    "load_bytes",
    "load_us",  # microseconds in loads (store read and scatter); integers, because
    # vLLM's metrics reader (LLM.get_metrics) reads counters as ints
    "load_error_blocks",  # blocks planned for loading that the store could not serve
    "save_tokens",  # tokens handed to the store (new blocks or already stored)
    "save_bytes",
    "save_us",  # microseconds in saves (gather and put, on the save thread)
    "save_errors",
    "lookup_errors",  # scheduler half: lookups the store could not answer (misses)
)


# -- identity -----------------------------------------------------------------------------------


def _layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[Layout, list[str]]:
    """The store layout of vLLM's KV cache (the whole model's: every KV head, whatever
    the tensor-parallel size), and the attention layer names in layer order."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    pc = vllm_config.parallel_config
    split = {
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "decode_context_parallel_size": pc.decode_context_parallel_size,
        "prefill_context_parallel_size": pc.prefill_context_parallel_size,
    }
    unsupported = {k: v for k, v in split.items() if v != 1}
    if unsupported:
        raise InvalidInput(
            f"KVStoreConnector: {unsupported}: a worker holding part of a block's layers or "
            "tokens is not supported (tensor parallelism is)"
        )
    check_speculative(vllm_config.speculative_config)
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec) for g in groups]
    if len(groups) != 1 or kinds[0] not in (FullAttentionSpec, MLAAttentionSpec):
        raise InvalidInput(
            f"KVStoreConnector: expected one group of full-attention or MLA layers, got "
            f"{[k.__name__ for k in kinds]}; sliding-window and hybrid caches do not hold a "
            "reusable prefix block by block"
        )
    spec = groups[0].kv_cache_spec
    if vllm_config.cache_config.cache_dtype not in ("auto", str(spec.dtype).removeprefix("torch.")):
        raise InvalidInput(
            f"KVStoreConnector: kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} is "
            "quantized; the store keeps the model dtype's KV"
        )
    names = sorted(groups[0].layer_names, key=extract_layer_index)
    if isinstance(spec, MLAAttentionSpec):
        layout = Layout(
            num_layers=len(names),
            num_kv_heads=1,
            head_dim=int(spec.head_size),
            dtype=dtype_name(spec.dtype),
            block_size=int(spec.block_size),
            kind="latent",
        )
    else:
        layout = Layout(
            num_layers=len(names),
            num_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
            head_dim=int(spec.head_size),
            dtype=dtype_name(spec.dtype),
            block_size=int(spec.block_size),
        )
    return layout, names


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """The fingerprint of the checkpoint vLLM serves (`kvstore.fingerprint`: its
    config.json and weight files, its path or its hub id at its revision, found
    offline in the hub cache or vLLM's `download_dir`), which `kvstore.hf.fingerprint`
    gives a model loaded from the same files, so both key blocks alike; bound to
    vLLM's config and settings (`vllm_fingerprint`) where vLLM changes what
    transformers would load (`hf_overrides`, quantization). Never loads the model;
    the weight files' hashes are remembered beside the store."""
    from ..fingerprint import VOLATILE_CONFIG_KEYS, checkpoint_fingerprint

    mc = vllm_config.model_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    fp = checkpoint_fingerprint(
        mc.model,
        revision=mc.revision,
        hub_cache=vllm_config.load_config.download_dir,
        memo_dir=extra.get("path"),
    )
    if not mc.hf_overrides and mc.quantization is None:
        return fp
    config = {k: v for k, v in mc.hf_config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return vllm_fingerprint(fp, config, quantization=mc.quantization, dtype=str(mc.dtype))


def _open(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]
) -> tuple[Store, list[str]]:
    layout, names = _layout(vllm_config, kv_cache_config)
    fp = extra.get("fingerprint") or model_fingerprint(vllm_config)
    remote = extra.get("remote")
    store = open_store(
        extra["path"],
        layout=layout,
        model=fp,
        salt=extra.get("salt"),
        hot_bytes=extra.get("hot_bytes"),
        disk_bytes=extra.get("disk_bytes"),
        durability=extra.get("durability", "batch"),
        array="torch",
        remote=Remote(**remote) if remote is not None else None,
    )
    return store, names


# -- what the scheduler half tells the worker half ----------------------------------------------


@dataclass
class _Transfer:
    req_id: str
    tokens: list[int]  # token ids from 0 to the end of the range
    start: int  # first token of the range (a block boundary)
    block_ids: list[int]  # vLLM's blocks of tokens[start:], in order
    extra: bytes | None  # the request's cache_salt and adapter (see request_extra)
    # Saves: vLLM's blocks of tokens[:start], whose KV the range was computed against.
    context: list[int] = field(default_factory=list)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # Stale blocks (see _SchedulerHalf._stale) this step writes again, a request computing
    # them over good blocks or a load landing them: saves using them are good again (a
    # step's saves read vLLM's cache after its forward pass).
    recomputed: set[int] = field(default_factory=set)


@dataclass
class _Tracked:
    request: Any
    extra: bytes | None
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # tokens whose blocks are stored or handed to the worker to store
    # The tokens [from, to) whose blocks were handed to the worker to store (see matched).
    handed: tuple[int, int] | None = None
    any_save: bool = False
    load: _Transfer | None = None
    # The token from which the request computed only over good blocks (None: its last
    # step read a stale one, see _SchedulerHalf._stale).
    clean_from: int | None = 0


# -- stats --------------------------------------------------------------------------------------


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters of the worker half since the last report (summed by `aggregate`)."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _STAT_KEYS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in _STAT_KEYS}
        for kind in ("load", "save"):  # bytes per microsecond = MB/s
            us = d.get(f"{kind}_us", 0)
            out[f"{kind}_MBps"] = round(d.get(f"{kind}_bytes", 0) / us, 1) if us else 0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _STAT_KEYS)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per stat: `vllm:kvstore_<stat>` (e.g. hit_tokens)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for key in _STAT_KEYS:
            counter = self._counter_cls(
                name=f"vllm:kvstore_{key}",
                documentation=f"kvstore connector: {key.replace('_', ' ')}",
                labelnames=labelnames,
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[engine, key] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in _STAT_KEYS:
            value = transfer_stats_data.get(key, 0)
            if value and (engine_idx, key) in self._counters:
                self._counters[engine_idx, key].inc(value)


# -- the connector ------------------------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's KV through a kvstore store (see the module doc)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config  # kv_role: "kv_both", "kv_producer" or "kv_consumer"
        extra = parse_extra(tc.kv_connector_extra_config)
        self._store, self._layer_names = _open(vllm_config, kv_cache_config, extra)
        self._sched: _SchedulerHalf | None = None
        self._worker_half: _WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            recompute = tc.kv_load_failure_policy == "recompute"
            tp = vllm_config.parallel_config.tensor_parallel_size
            tag = latent_tag(tp) if self._store.layout.latent else None
            self._sched = _SchedulerHalf(
                self._store, tc.is_kv_consumer, tc.is_kv_producer, recompute, tag
            )
        else:
            depth = int(extra.get("save_queue", 64))
            part = _rank_shard(vllm_config, self._store.layout)
            self._worker_half = _WorkerHalf(
                self._store, self._layer_names, vllm_config, depth, part
            )

    # -- scheduler half ---------------------------------------------------------------------

    def _scheduler(self) -> _SchedulerHalf:
        assert self._sched is not None, "a scheduler-half call on the worker half"
        return self._sched

    def _worker(self) -> _WorkerHalf:
        assert self._worker_half is not None, "a worker-half call on the scheduler half"
        return self._worker_half

    def _metadata(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().matched(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Blocks whose load failed: stale until recomputed, then saved again (the store heals).
        if connector_output.invalid_block_ids:
            self._scheduler().invalidated(connector_output.invalid_block_ids)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request.request_id), None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never wrong KV

    # -- worker half ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are reused from this step on: its saves must
        # have read them first.
        assert isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        self._worker().drain(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        self._worker().load(meta.loads, meta.recomputed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv lands every layer before the forward pass begins

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved once per step, all layers together, by wait_for_save

    def wait_for_save(self) -> None:
        self._worker().save(self._metadata().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker_half is None:
            errors = self._scheduler().take_lookup_errors()
            return KVStoreConnectorStats(data={"lookup_errors": errors}) if errors else None
        data = self._worker_half.take_stats()
        return KVStoreConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker_half is not None:
            self._worker_half.close()
        if not self._store.closed:
            self._store.flush()
            self._store.close()


def _rank_shard(vllm_config: VllmConfig, layout: Layout) -> Shard:
    """This worker's shard of the tensor-parallel group (`kvstore.vllm.shard`)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return shard(layout, 0, 1)
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return shard(layout, get_tensor_model_parallel_rank(), tp)


def _kv_writer(layer: Any) -> Any:
    """The attention backend's cache writer of a K/V layer, as `paged_block_map`
    calls it."""
    impl = layer.impl

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        impl.do_kv_cache_update(layer, key, value, cache, slots)

    return write


def _mla_writer(layer: Any) -> Any:
    """An MLA layer's cache writer, as `paged_block_map` calls it: `key` and `value`
    (`[B, 1, W / 2]`) are the two halves of the latent it writes (`Layout.runs_shape`),
    cut where vLLM cuts it, into the compressed KV and the rope part."""
    impl = layer.impl
    rank = int(impl.kv_lora_rank)

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        latent = torch.cat([key, value], dim=-1).squeeze(1)
        k_pe = latent[:, rank:].unsqueeze(1)
        impl.do_kv_cache_update(
            latent[:, :rank], k_pe, cache, slots, layer.kv_cache_dtype, layer._k_scale
        )

    return write


def _count(store: Store, figures: dict[str, int]) -> None:
    """Adds the connector's figures to the store's named counters as `vllm.<name>`
    (`kvstore stats`); advisory, so a store that cannot take them loses them."""
    try:
        store.add_counters({f"vllm.{k}": v for k, v in figures.items() if v})
    except Exception as e:
        log.debug("kvstore connector: counters not added: %s", e)


def _first_in(ids: list[int], blocks: set[int]) -> int | None:
    """The index of the first of `ids` in `blocks`, if any."""
    return next((i for i, blk in enumerate(ids) if blk in blocks), None)


class _SchedulerHalf:
    def __init__(
        self, store: Store, loads: bool, saves: bool, recompute: bool, tag: bytes | None = None
    ) -> None:
        self._store = store
        self._loads, self._saves = loads, saves
        self._tag = tag  # ahead of every request's extra (keys.latent_tag), if any
        # vLLM recomputes the blocks of a failed load (kv_load_failure_policy), so a
        # load may count on saves this process cannot see yet (see `matched`).
        self._recompute = recompute
        self._block = store.layout.block_size
        self._reqs: dict[str, _Tracked] = {}
        # req_id -> (vLLM's local hit, the store's hit), from the last lookup
        self._hits: dict[str, tuple[int, int]] = {}
        # req_id -> its extra, as the last lookup keyed it: a load promised there is
        # keyed the same way, even if the extra cannot be computed again (a LoRA
        # adapter's files replaced in between).
        self._extras: dict[str, bytes | None] = {}
        # vLLM's blocks whose KV is not their tokens': a failed load's, and every block
        # computed over one. vLLM keeps them in its prefix cache under "recompute" and
        # lets the requests sharing them go on, but only the first request holding them
        # recomputes them, maybe over several steps (chunked prefill), maybe never (it
        # is aborted or preempted). A block stays here until a step writes it again
        # (see _rewritten); no save is planned that reads one.
        self._stale: set[int] = set()
        # The block lists of requests finished or preempted in the last two steps
        # (older, newer): a failed load of theirs may be reported after they are gone
        # (an abort between a step's scheduling and its output), and what they computed
        # over it is stale all the same.
        self._gone: list[list[list[int]]] = [[], []]
        self._recomputed: set[int] = set()  # see KVStoreConnectorMetadata.recomputed
        self._lookup_errors = 0

    def matched(self, request: Request, num_computed_tokens: int) -> int:
        if not keyed_by_tokens(request):
            return 0
        b = self._block
        tokens = request.prompt_token_ids or []
        # The last prompt token is always computed: its logits start the output.
        upto = (len(tokens) - 1) // b * b
        try:
            # Looked up even when vLLM's own hit covers it: what is stored needs no save.
            extra = self._extras[request.request_id] = tagged(request_extra(request), self._tag)
            stored = self._store.lookup(tokens[:upto], extra=extra, count=False)
        except Exception as e:  # a store that cannot answer is a miss; vLLM goes on
            self._lookup_errors += 1
            _count(self._store, {"lookup_errors": 1})
            log.warning("kvstore connector: lookup of %s failed: %s", request.request_id, e)
            stored = 0
        t = self._reqs.get(request.request_id)
        if t is not None and t.handed is not None and self._recompute and stored >= t.handed[0]:
            # Asked again for a request it already scheduled: a preempted one, resuming.
            # Its saves finish in the worker before vLLM reuses its blocks
            # (handle_preemptions), so before any later step loads; but a batch put
            # becomes visible to this process only at its group commit (SPEC 3), which
            # may come later. So the handed blocks count where what precedes them is
            # found; a save that failed after all is a failed load: recomputed.
            stored = max(stored, min(t.handed[1], upto))
        self._hits[request.request_id] = (num_computed_tokens, stored)
        return max(stored - num_computed_tokens, 0) if self._loads else 0

    def allocated(self, request: Request, block_ids: list[int], num_external: int) -> None:
        rid = request.request_id
        if rid not in self._hits and rid not in self._reqs:
            return  # not keyed by tokens (or its lookup never ran): not tracked
        local, stored = self._hits.pop(rid, (0, 0))
        t = self._reqs.get(rid)
        if t is None:
            try:
                extra = (
                    self._extras[rid]
                    if rid in self._extras
                    else tagged(request_extra(request), self._tag)
                )
            except Exception as e:  # its lookup failed too: no load was promised
                log.warning("kvstore connector: %s not tracked: %s", rid, e)
                return
            t = self._reqs[rid] = _Tracked(request, extra)
        self._extras.pop(rid, None)
        t.block_ids = list(block_ids)
        # The blocks the store holds need no save; a load lands [local, local + external).
        t.saved_upto = max(t.saved_upto, stored)
        t.load = None
        if num_external > 0:
            b = self._block
            end = local + num_external
            t.load = _Transfer(
                rid,
                list(request.prompt_token_ids or [])[:end],
                local,
                t.block_ids[local // b : end // b],
                t.extra,
            )

    def invalidated(self, block_ids: set[int]) -> None:
        """The loads of `block_ids` failed: they, and every block after one in a request
        holding it (computed over it since), are stale; each such request saves again
        from its first stale block, once recomputed."""
        b = self._block
        self._stale |= block_ids
        for t in self._reqs.values():
            bad = _first_in(t.block_ids, block_ids)
            if bad is not None:
                t.saved_upto = min(t.saved_upto, bad * b)
                t.clean_from = None
                self._stale.update(t.block_ids[bad:])
        for ids in self._gone[0] + self._gone[1]:
            bad = _first_in(ids, block_ids)
            if bad is not None:
                self._stale.update(ids[bad:])

    def _rewritten(self, steps: dict[str, tuple[int, int]], loads: list[_Transfer]) -> None:
        """Follows this step's writes (`steps`: req_id -> its computed tokens before the
        step and after) of stale blocks: a load lands its blocks; a request that reads
        only good blocks (vLLM's attention reads a block a request of the same step
        writes, once written) computes good ones; one that reads a stale block computes
        stale ones. Blocks no longer stale go to the worker as `recomputed`."""
        b = self._block
        before = self._stale
        stale = before.difference(*(tr.block_ids for tr in loads))
        spans: dict[str, tuple[int, int, int]] = {}  # first block written, end, full end
        for rid, (c0, done) in steps.items():
            n = len(self._reqs[rid].block_ids)
            spans[rid] = (c0 // b, min(-(-done // b), n), min(done // b, n))
        # A block written this step is good for the others once its writer is found clean.
        unknown = stale.union(*(self._reqs[r].block_ids[lo:hi] for r, (lo, hi, _) in spans.items()))
        todo = dict(spans)
        progress = True
        while progress:
            progress = False
            for rid, (lo, _, full) in list(todo.items()):
                t = self._reqs[rid]
                c0 = steps[rid][0]
                ids = t.block_ids
                # A stale block it began in an earlier step is good only if begun clean.
                begun = c0 % b != 0 and lo < len(ids) and ids[lo] in stale
                if begun and (t.clean_from is None or t.clean_from > lo * b):
                    continue
                if not unknown.isdisjoint(ids[:lo]):
                    continue
                del todo[rid]
                progress = True
                if t.clean_from is None or t.clean_from > c0:
                    t.clean_from = c0
                stale.difference_update(ids[lo:full])
                unknown.difference_update(ids[lo:full])
        for rid, (lo, hi, _) in todo.items():  # it read a stale block: it wrote stale ones
            t = self._reqs[rid]
            t.clean_from = None
            stale.update(t.block_ids[lo:hi])
        self._recomputed |= before - stale
        self._stale = stale

    def build(self, so: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(preempted=set(so.preempted_req_ids or ()))
        b = self._block
        self._gone = [self._gone[1], []]
        for rid in meta.preempted:
            t = self._reqs.get(rid)
            if t is not None and t.block_ids:  # freed now; resumed, it gets new ones
                self._gone[1].append(t.block_ids)
                t.block_ids = []
        done: dict[str, int] = {}
        before: dict[str, int] = {}  # req_id -> its computed tokens before this step
        for new in so.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            before[new.req_id] = new.num_computed_tokens
            done[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._reqs.get(rid)
            if t is None:
                continue
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(ids[0]) if ids is not None else []
            elif ids is not None:
                t.block_ids.extend(ids[0])
            before[rid] = cached.num_computed_tokens[i]
            done[rid] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        for rid in done:
            t = self._reqs[rid]
            if t.load is not None:
                meta.loads.append(t.load)
                t.load = None
        if self._stale:
            self._rewritten({r: (before[r], done[r]) for r in done}, meta.loads)
        meta.recomputed, self._recomputed = self._recomputed, set()
        for rid, computed in done.items():
            t = self._reqs[rid]
            tokens = t.request.all_token_ids
            full = min(computed, len(tokens)) // b * b
            full = min(full, len(t.block_ids) * b)
            stale = _first_in(t.block_ids[: full // b], self._stale) if self._stale else None
            if stale is not None:
                # Saves nothing from its first stale block on: planned again once recomputed.
                full = stale * b
            if self._saves and full > t.saved_upto:
                meta.saves.append(
                    _Transfer(
                        rid,
                        list(tokens[:full]),
                        t.saved_upto,
                        t.block_ids[t.saved_upto // b : full // b],
                        t.extra,
                        t.block_ids[: t.saved_upto // b],
                    )
                )
                start = t.saved_upto if t.handed is None else min(t.handed[0], t.saved_upto)
                t.handed = (start, full)
                t.saved_upto = full
                t.any_save = True
        return meta

    def take_lookup_errors(self) -> int:
        errors, self._lookup_errors = self._lookup_errors, 0
        return errors

    def finished(self, req_id: str) -> bool:
        """Whether the request's blocks stay allocated until the worker has saved them."""
        self._hits.pop(req_id, None)
        self._extras.pop(req_id, None)
        t = self._reqs.pop(req_id, None)
        if t is not None and t.block_ids:
            self._gone[1].append(t.block_ids)
        return t is not None and t.any_save


class _WorkerHalf:
    def __init__(
        self,
        store: Store,
        layer_names: list[str],
        vllm_config: VllmConfig,
        depth: int,
        part: Shard | None = None,
    ) -> None:
        self._store = store
        self._layout = store.layout
        self._names = layer_names
        self._config = vllm_config
        # What this worker holds of a block (None: all of it, a single worker).
        self._shard = part if part is not None else shard(self._layout, 0, 1)
        # This rank's part of a block: its heads of a K/V layout; a latent whole.
        lay = self._layout
        self._local = (
            lay if lay.latent else dataclasses.replace(lay, num_kv_heads=self._shard.local_heads)
        )
        self._part_bytes = self._local.block_bytes
        # Staging buffers of at most _STAGING_BYTES each (whole blocks): a transfer
        # moves in chunks of `self._chunk` tokens, so memory stays bounded.
        self._chunk = max(_STAGING_BYTES // lay.block_bytes, 1) * lay.block_size
        self._buffers: dict[str, torch.Tensor] = {}
        # Blocks whose load failed, until the scheduler half sees them written again
        # (`recomputed`): what was computed against them (by any request sharing them)
        # is not saved meanwhile. Once vLLM has told the scheduler half, it plans no
        # such save (_SchedulerHalf._stale); this covers the steps before.
        self._failed: set[int] = set()
        self._paged: PagedKV | None = None  # vLLM's caches, once registered
        self._dtype = getattr(torch, self._layout.dtype)
        self._lock = threading.Lock()
        self._stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
        self._load_errors: set[int] = set()
        self._pending: dict[str, int] = {}  # req_id -> save jobs not done
        self._saving: set[str] = set()  # requests that had a save: reported when done
        self._finished: set[str] = set()  # finished by the scheduler, saves maybe pending
        self._idle = threading.Condition(self._lock)
        self._jobs: queue.Queue[_Transfer | None] = queue.Queue(maxsize=max(depth, 1))
        self._thread = threading.Thread(target=self._save_loop, name="kvstore-save", daemon=True)
        self._thread.start()

    # -- layout ---------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._names if n not in kv_caches]
        if missing:
            raise InvalidInput(f"KVStoreConnector: no KV cache for layers {missing}")
        caches = [kv_caches[n] for n in self._names]
        first = caches[0]
        for name, c in zip(self._names, caches, strict=True):
            if c.device.type != "cpu" or c.shape != first.shape or c.stride() != first.stride():
                raise InvalidInput(
                    f"KVStoreConnector: layer {name}: expected CPU caches of one shape and "
                    f"strides, got {c.device} {tuple(c.shape)} {c.stride()}"
                )
        layer = self._config.compilation_config.static_forward_context[self._names[0]]
        write = _mla_writer(layer) if self._layout.latent else _kv_writer(layer)
        local = self._local
        self._paged = PagedKV(caches, paged_block_map(write, first, local), local)
        if not self._paged.strided and (local.latent or self._shard.per_head):
            raise InvalidInput(
                f"KVStoreConnector: the attention backend's cache of shape {tuple(first.shape)} "
                "keeps a block's values in no strided order; MLA and tensor-parallel caches "
                "need one"
            )
        log.info(
            "kvstore connector: %s, %d layers of %s strides %s, %s copies, TP rank %d of %d "
            "(heads %d-%d%s)",
            self._store.path,
            len(caches),
            tuple(first.shape),
            first.stride(),
            "strided" if self._paged.strided else "element-wise",
            self._shard.rank,
            self._shard.size,
            self._shard.heads.start,
            self._shard.heads.stop - 1,
            "" if self._shard.writes else ", stored by another rank",
        )

    def _caches(self) -> PagedKV:
        assert self._paged is not None, "a transfer before register_kv_caches"
        return self._paged

    def _staging(self, which: str, tokens: int) -> torch.Tensor:
        """A reused `[L, 2, tokens, H, D]` buffer, `tokens` at most `self._chunk` (a new
        one's page faults cost about as much as the copy)."""
        shape = self._layout.kv_shape(tokens)
        buf = self._buffers.get(which)
        if buf is None:
            buf = self._buffers[which] = torch.empty(
                self._layout.kv_shape(self._chunk), dtype=self._dtype
            ).view(-1)
        return buf[: math.prod(shape)].view(shape)  # contiguous, as Store.get(out=) needs

    def _chunks(self, tr: _Transfer) -> list[tuple[int, int, list[int]]]:
        """`tr`'s range in pieces of at most `self._chunk` tokens: (start, end, blocks)."""
        b = self._layout.block_size
        end = tr.start + len(tr.block_ids) * b
        return [
            (s, min(s + self._chunk, end), tr.block_ids[(s - tr.start) // b :][: self._chunk // b])
            for s in range(tr.start, end, self._chunk)
        ]

    # -- loads ----------------------------------------------------------------------------

    def load(self, loads: list[_Transfer], recomputed: set[int]) -> None:
        self._failed -= recomputed
        b = self._layout.block_size
        for tr in loads:
            t0 = time.perf_counter()
            got = 0  # tokens landed in vLLM's cache from tr.start
            try:
                got = self._load_one(tr)
            except Exception as e:  # a load that fails is a miss: vLLM recomputes it
                log.warning("kvstore connector: load of %s failed: %s", tr.req_id, e)
                got = 0
            failed = tr.block_ids[got // b :]
            self._failed.update(failed)
            with self._lock:
                self._load_errors.update(failed)
            self._add_stats(
                hit_tokens=got if self._shard.rank == 0 else 0,  # once, not per rank
                load_bytes=got // b * self._part_bytes,
                load_error_blocks=len(failed),
                load_us=round((time.perf_counter() - t0) * 1e6),
            )

    def _add_stats(self, **figures: int) -> None:
        """Adds to the figures vLLM's stats take, and to the store's named counters
        (`kvstore stats`, all processes)."""
        with self._lock:
            for k, v in figures.items():
                self._stats[k] += v
        _count(self._store, figures)

    def _load_one(self, tr: _Transfer) -> int:
        """Lands what is stored of `tr` in vLLM's cache: the tokens landed from tr.start."""
        b = self._layout.block_size
        paged = self._caches()
        end = tr.start + len(tr.block_ids) * b
        got = 0
        if paged.strided:  # the engine checks and lands each block in place
            got = self._load_paged(tr, tr.tokens[:end])
            if got == end - tr.start or not self._shard.per_head:
                return got
        # Element-wise caches; or a rank's heads of whole blocks (stored by TP=1
        # writers): read whole through a staging buffer, this rank's heads landed.
        heads = slice(self._shard.heads.start, self._shard.heads.stop)
        staged = 0
        for s, e, blocks in self._chunks(tr):
            buf = self._staging("load", e - s)
            m = self._store.get(tr.tokens[:e], start=s, out=buf, extra=tr.extra)
            n = max(m - s, 0) // b * b
            if n:
                paged.move(blocks[: n // b], buf[:, :, :n, heads].contiguous(), True)
            staged += n
            if s + n < e:
                break
        return max(got, staged)

    def _load_paged(self, tr: _Transfer, tokens: list[int]) -> int:
        """`_load_one` by the engine's paged path: from the heads store for a rank that
        stores per head; else from the main store, then, for a K/V layout, the heads
        store (blocks a tensor-parallel vLLM stored). Tokens landed from tr.start."""
        paged = self._caches()
        b, start, ex = self._layout.block_size, tr.start, tr.extra or b""

        def landed(m: int) -> int:
            return max(m - start, 0) // b * b

        def per_head(local: bool) -> int:
            parts = self._store.heads(create=False)
            if parts is None:
                return 0
            got = None
            heads = self._shard.heads if local else range(self._layout.num_kv_heads)
            for j, g in enumerate(heads):
                m = paged.load(parts.store, tokens, start, head_extra(ex, g), tr.block_ids, j)
                got = landed(m) if got is None else min(got, landed(m))
                if not got:
                    break
            return got or 0

        if self._shard.per_head:
            return per_head(local=True)
        got = landed(paged.load(self._store, tokens, start, tr.extra, tr.block_ids))
        if got < len(tr.block_ids) * b and not self._layout.latent:
            got = max(got, per_head(local=False))
        return got

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------

    def save(self, saves: list[_Transfer]) -> None:
        for tr in saves:
            # Reported by `finished` even when skipped below: the scheduler half keeps
            # the blocks of every request it handed a save until then.
            with self._lock:
                self._saving.add(tr.req_id)
            if not self._shard.writes:
                continue  # another rank stores these heads (or this latent)
            if not self._failed.isdisjoint(tr.context) or not self._failed.isdisjoint(tr.block_ids):
                continue  # saved once recomputed (the scheduler plans it again)
            with self._lock:
                self._pending[tr.req_id] = self._pending.get(tr.req_id, 0) + 1
            self._jobs.put(tr)  # waits when the queue is full

    def _save_loop(self) -> None:
        while True:
            tr = self._jobs.get()
            if tr is None:
                return
            try:
                self._save_and_count(tr)
            finally:
                # Whatever happened (a Rust panic reaches Python as a BaseException):
                # the request is no longer waiting on this save, or vLLM would hold
                # its blocks, and a preemption's drain would wait, for ever.
                with self._lock:
                    self._pending[tr.req_id] -= 1
                    if not self._pending[tr.req_id]:
                        del self._pending[tr.req_id]
                    self._idle.notify_all()

    def _save_and_count(self, tr: _Transfer) -> None:
        t0 = time.perf_counter()
        n = len(tr.tokens) - tr.start
        try:
            self._save_one(tr)
            ok = True
        except BaseException as e:  # noqa: BLE001 - a failed save is a future miss; vLLM goes on
            log.warning("kvstore connector: save of %s failed: %r", tr.req_id, e)
            ok = False
        blocks = n // self._layout.block_size if ok else 0
        self._add_stats(
            save_tokens=n if ok and self._shard.rank == 0 else 0,
            save_bytes=blocks * self._part_bytes,
            save_errors=0 if ok else 1,
            save_us=round((time.perf_counter() - t0) * 1e6),
        )

    def _save_one(self, tr: _Transfer) -> None:
        """Stores `tr`'s blocks out of vLLM's cache."""
        paged = self._caches()
        end = tr.start + len(tr.block_ids) * self._layout.block_size
        if self._shard.per_head:  # this rank's heads, one record each (kvstore.heads)
            parts = self._store.heads(create=True)
            assert parts is not None, "a K/V layout of several heads has a heads store"
            ex = tr.extra or b""
            for j, g in enumerate(self._shard.heads):
                paged.save(
                    parts.store, tr.tokens[:end], tr.start, head_extra(ex, g), tr.block_ids, j
                )
            return
        if paged.strided:  # the engine gathers each block itself
            paged.save(self._store, tr.tokens[:end], tr.start, tr.extra, tr.block_ids)
            return
        for s, e, blocks in self._chunks(tr):
            kv = self._staging("save", e - s)  # only this thread uses it
            paged.move(blocks, kv, False)
            self._store.put(tr.tokens[:e], kv, start=s, extra=tr.extra)

    def drain(self, req_ids: set[str]) -> None:
        """Waits until no save of `req_ids` is pending."""
        if not req_ids:
            return
        with self._idle:
            self._idle.wait_for(lambda: not req_ids & self._pending.keys())

    def finished(self, finished_req_ids: set[str]) -> set[str] | None:
        with self._lock:
            self._finished |= finished_req_ids & self._saving
            done = {r for r in self._finished if r not in self._pending}
            self._finished -= done
            self._saving -= done
        return done or None

    def take_stats(self) -> dict[str, Any]:
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(_STAT_KEYS, 0)
        return stats

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
