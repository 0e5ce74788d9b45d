"""transformers attention over a BlockPool: `attn_implementation="kvstore"`.

```python
from kvstore import attention
from kvstore.torch import BlockPool

attention.register()                        # adds "kvstore" to transformers' AttentionInterface
model.set_attn_implementation("kvstore")    # or from_pretrained(..., attn_implementation=...)
pool = BlockPool(layout, num_blocks=1024)
seq = pool.load(store, prompt[:-1])         # KV of the longest stored prefix (1 token left to feed)
cache = attention.PagedCache(pool, [seq])
new = attention.greedy(model, cache, prompt[seq.length:], max_new_tokens=32)
# or model.generate(prompt[None], cache=cache, max_new_tokens=32, do_sample=False)
```

`PagedCache` is a transformers `Cache` whose layers keep their KV in the pool:
`update` writes the new tokens with `kvstore.ops.write_kv` (allocating blocks
as the sequences grow) and the registered attention function attends with
`kvstore.ops.paged_attention` through the block tables. The model does not
hand its cache to the attention function, so the cache's `update` leaves a note
for it (thread-local, matched by the identity of the key tensor it returns);
the forward kwarg `kvstore_cache=<PagedCache>` names the cache explicitly
instead. `model.generate(ids, cache=cache)` works too (`past_key_values=` in older
transformers).

Several query tokens per sequence (a prompt's remainder) are attended as one
decode query per position with causal lengths. One batch row per sequence; rows
may have different lengths (give explicit `position_ids`, as `greedy` does:
without them transformers gives every row the first row's positions, which
raises), but padding masks, sliding windows, soft-capping and attention sinks
are not supported and raise. The model's K/V must be in the pool's dtype (an
fp8 pool quantizes them). A sequence's `length` counts the tokens every layer
holds: a forward that fails part way leaves it as it was, and the next forward
writes those positions again.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from . import hf, ops
from .errors import InvalidInput
from .torch import BlockPool, BlockTable

__all__ = ["NAME", "PagedCache", "greedy", "paged_attention_forward", "register"]

NAME = "kvstore"

# The last (key tensor, cache, layer) a PagedCache.update returned in this thread: the
# model calls attention right after update with that very key tensor.
_handoff = threading.local()


class _PagedLayer(CacheLayerMixin):
    """One model layer of a PagedCache: the KV lives in the pool, not in `keys`/`values`."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.write(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.done()[0]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("PagedCache: release the sequences and build a new cache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedCache does not support beam search")


class PagedCache(Cache):
    """A transformers Cache over `pool`, one batch row per BlockTable in `seqs`.

    Each sequence starts at its `length` (e.g. what `pool.load` found in a store);
    every forward appends its tokens to every sequence. The sequences stay owned
    by the caller (release them when done).
    """

    def __init__(self, pool: BlockPool, seqs: list[BlockTable]) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidInput(f"pool: expected kvstore.torch.BlockPool, got {type(pool).__name__}")
        if not seqs or any(s.pool is not pool for s in seqs):
            raise InvalidInput("seqs: expected at least one BlockTable of this pool")
        self.pool = pool
        self.seqs = list(seqs)
        num_layers = pool.layout.num_layers
        self._lens = [[s.length for s in self.seqs] for _ in range(num_layers)]
        # What every layer holds (`done`), and the layers past it: a forward moves
        # each layer ahead once; when all are, `done` moves (O(layers) per forward).
        self._done = [s.length for s in self.seqs]
        self._ahead: set[int] = set()
        # Slots and block tables are the same for every layer of a forward: built once.
        self._slots_key: tuple[Any, ...] | None = None
        self._slots: torch.Tensor | None = None
        self._attn_key: tuple[Any, ...] | None = None
        self._attn: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pos_checked: tuple[Any, ...] | None = None
        super().__init__(layers=[_PagedLayer(self, layer) for layer in range(num_layers)])

    def lengths(self, layer: int = 0) -> list[int]:
        """Tokens of each sequence whose KV `layer` holds."""
        return list(self._lens[layer])

    def done(self) -> list[int]:
        """Tokens of each sequence whose KV every layer holds (its `length`)."""
        return list(self._done)

    def position_ids(self, query_length: int) -> torch.Tensor:
        """`[batch, query_length]` positions of the next tokens of each sequence."""
        starts = torch.tensor(self.done(), dtype=torch.long)
        return starts[:, None] + torch.arange(query_length)[None, :]

    def check_positions(self, layer: int, query_length: int, position_ids: Any) -> None:
        """Raises unless `position_ids` (the model's, or None) are the positions of the
        last `query_length` tokens written to `layer`: rows of different lengths need
        their own, which transformers does not derive from a cache."""
        ends = tuple(self._lens[layer])
        key = (id(position_ids), ends, query_length)
        if key == self._pos_checked:
            return  # the same forward's tensor, checked at an earlier layer
        want = torch.tensor(ends)[:, None] - query_length + torch.arange(query_length)[None, :]
        if position_ids is None:
            raise InvalidInput(
                f"position_ids: rows of different lengths {list(ends)} need their own "
                "positions; pass cache.position_ids(n) to the model (kvstore.attention.greedy "
                "does)"
            )
        got = position_ids.detach().to("cpu")
        if got.dim() != 2 or got.shape[1] != query_length or got.shape[0] not in (1, len(ends)):
            ok = False
        else:
            ok = torch.equal(got.expand(len(ends), query_length).long(), want)
        if not ok:
            raise InvalidInput(
                f"position_ids: expected {want.tolist()} (each row's next positions, "
                f"cache.position_ids), got {got.tolist()}"
            )
        self._pos_checked = key

    def write(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends `[batch, H, q, D]` keys and values of `layer` to the sequences."""
        pending = getattr(_handoff, "pending", None)
        if pending is not None and pending[1] is self:
            # The previous layer's attention did not come for its note: the model does not
            # run the "kvstore" attention, and another one would only see the new tokens.
            _handoff.pending = None
            raise RuntimeError(
                f'PagedCache needs attn_implementation="{NAME}" (kvstore.attention.register(), '
                f'then model.set_attn_implementation("{NAME}")); layer {pending[2]} ran another'
            )
        b, h, q, d = key_states.shape
        if b != len(self.seqs):
            raise InvalidInput(f"key_states: expected batch {len(self.seqs)} (sequences), got {b}")
        pool = self.pool
        if not _is_fp8(pool) and {key_states.dtype, value_states.dtype} != {pool.dtype}:
            # A cast would round (bfloat16) or overflow to inf (float16), and be stored.
            raise InvalidInput(
                f"key_states: expected {pool.dtype} (the pool's dtype), got "
                f"{key_states.dtype}; run the model in the pool's dtype"
            )
        if layer in self._ahead:
            # Ahead of the other layers at the start of its forward: a forward failed
            # after this layer wrote. Its tokens count for nothing and are written again.
            self._lens[layer] = list(self._done)
            self._ahead.discard(layer)
            self._pos_checked = None
        starts = tuple(self._lens[layer])
        key = (starts, q)
        if self._slots_key != key:
            for seq, start in zip(self.seqs, starts, strict=True):
                seq.reserve(start + q)
            self._slots = torch.cat(
                [s.slot_mapping(st, q) for s, st in zip(self.seqs, starts, strict=True)]
            )
            self._slots_key = key
        assert self._slots is not None
        # An fp8 pool quantizes the model's K/V (write_kv with its scales).
        k = key_states.transpose(1, 2).reshape(b * q, h, d)
        v = value_states.transpose(1, 2).reshape(b * q, h, d)
        ops.write_kv(
            k,
            v,
            pool.key_cache(layer),
            pool.value_cache(layer),
            self._slots,
            **_scales(pool, layer),
        )
        self._lens[layer] = [s + q for s in starts]
        self._ahead.add(layer)
        if len(self._ahead) == len(self._lens):
            # Only once every layer holds them: `save` must not store the KV of a layer
            # the forward did not reach (the block's previous sequence's).
            self._done = [min(col) for col in zip(*self._lens, strict=True)]
            self._ahead = {i for i, lens in enumerate(self._lens) if lens != self._done}
            for seq, n in zip(self.seqs, self._done, strict=True):
                seq.length = n
        _handoff.pending = (key_states, self, layer)
        return key_states, value_states

    def attention_inputs(self, layer: int, query_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables `[batch * q, max_blocks]` and causal lengths `[batch * q]` (int32, on
        the pool's device) for the last `query_length` tokens written to `layer`: query j of
        a sequence of length n sees its first n - q + j + 1 tokens."""
        ends = tuple(self._lens[layer])
        key = (ends, query_length, tuple(len(s.blocks) for s in self.seqs))
        if self._attn_key != key:
            width = max(len(s.blocks) for s in self.seqs)
            tables = torch.zeros((len(self.seqs), width), dtype=torch.int32)
            for i, s in enumerate(self.seqs):
                tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
            step = torch.arange(query_length, dtype=torch.int32)
            lens = torch.tensor(ends, dtype=torch.int32)[:, None] - query_length + 1 + step
            dev = self.pool.device
            self._attn = (
                tables.repeat_interleave(query_length, dim=0).to(dev),
                lens.reshape(-1).to(dev),
            )
            self._attn_key = key
        assert self._attn is not None
        return self._attn


def _is_fp8(pool: BlockPool) -> bool:
    return bool(pool.dtype == torch.float8_e4m3fn)


def _scales(pool: BlockPool, layer: int) -> dict[str, torch.Tensor]:
    """The fp8 scale keywords of ops.paged_attention and write_kv for `layer` (none for
    other pools)."""
    if not _is_fp8(pool):
        return {}
    return {"key_scales": pool.key_scales(layer), "value_scales": pool.value_scales(layer)}


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The "kvstore" attention: `query` `[batch, heads, q, D]` against the KV that the
    PagedCache holds for this layer, `key`/`value` included (the cache's `update` wrote
    them). The cache is the forward kwarg `kvstore_cache`, else the one whose `update`
    just returned `key`."""
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    cache = kwargs.get("kvstore_cache")
    pending = getattr(_handoff, "pending", None)
    _handoff.pending = None
    if cache is None and pending is not None and pending[0] is key and pending[2] == layer:
        cache = pending[1]
    if not isinstance(cache, PagedCache):
        raise ValueError(
            'attn_implementation="kvstore" needs a kvstore.attention.PagedCache as '
            "past_key_values (or the forward kwarg kvstore_cache=), got "
            f"{type(cache).__name__}"
        )
    if dropout and module.training:
        raise NotImplementedError("kvstore attention: dropout (training) is not supported")
    for option in ("sliding_window", "softcap"):
        if kwargs.get(option) is not None:
            raise NotImplementedError(f"kvstore attention: {option} is not supported")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("kvstore attention: attention sinks are not supported")
    if attention_mask is not None:
        raise NotImplementedError(
            "kvstore attention: attention masks (padding) are not supported; the block tables "
            "give each sequence its own length"
        )
    b, nh, q, d = query.shape
    pos = kwargs.get("position_ids")
    if pos is not None or len(set(cache.lengths(layer))) > 1:
        cache.check_positions(layer, q, pos)
    tables, lens = cache.attention_inputs(layer, q)
    pool = cache.pool
    # fp8 pools: the query stays in the model's dtype (the op dequantizes K/V).
    qf = query.transpose(1, 2).reshape(b * q, nh, d)
    qf = qf if _is_fp8(pool) else qf.to(pool.dtype)
    scale = float(scaling) if scaling is not None else d**-0.5
    out = ops.paged_attention(
        qf,
        pool.key_cache(layer),
        pool.value_cache(layer),
        tables,
        lens,
        scale,
        **_scales(pool, layer),
    )
    return out.view(b, q, nh, d).to(query.dtype), None


def register(name: str = NAME) -> str:
    """Registers the kvstore attention in transformers' AttentionInterface (idempotent);
    returns the name to give as `attn_implementation`."""
    AttentionInterface.register(name, paged_attention_forward)
    return name


@torch.inference_mode()
def greedy(
    model: Any, cache: PagedCache, input_ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """Feeds `input_ids` (`[n]` or `[batch, n]`, the tokens not yet in the cache) and
    then `max_new_tokens - 1` greedy tokens through `model` on `cache`; returns the
    `[batch, max_new_tokens]` greedy tokens."""
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if ids.shape[1] == 0 or max_new_tokens < 1:
        raise InvalidInput(
            "greedy: expected at least one token to feed and max_new_tokens >= 1, got "
            f"{ids.shape[1]} and {max_new_tokens} (load one token less than the prompt)"
        )
    ids = ids.to(model.device)
    out = []
    for _ in range(max_new_tokens):
        pos = cache.position_ids(ids.shape[1]).to(model.device)
        logits = model(input_ids=ids, position_ids=pos, **hf.cache_kwarg(cache)).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
        out.append(ids)
    return torch.cat(out, dim=1)
