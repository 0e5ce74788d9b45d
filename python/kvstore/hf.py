"""transformers helpers: a model's layout and fingerprint, Cache <-> store, generate.

    from kvstore import hf
    store = hf.open("/data/kv", model)                 # layout_of(model) + fingerprint(model)
    hf.save(store, input_ids, past_key_values)          # transformers Cache -> store
    cache, n = hf.load(store, input_ids)                # DynamicCache of the longest stored prefix
    out = hf.generate(model, store, input_ids, max_new_tokens=32)   # restore, prefill the rest

Batch size 1: the store keys KV by one token sequence. Full-attention layers
(`DynamicLayer`, `StaticLayer`) only: a sliding-window or quantized layer has
dropped or transformed the KV of earlier tokens, so it cannot be stored as a
prefix. transformers and torch are imported on first use, never by
`import kvstore`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._convert import is_torch
from .errors import InvalidInput
from .fingerprint import VOLATILE_CONFIG_KEYS, checkpoint_dir, checkpoint_fingerprint
from .layout import Layout, dtype_name
from .store import Store
from .store import open as open_store

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache

__all__ = [
    "cache_kwarg",
    "cache_to_kv",
    "fingerprint",
    "generate",
    "kv_to_cache",
    "layout_of",
    "load",
    "load_session",
    "open",
    "save",
    "save_session",
]


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if get_text_config is not None else config


def _model_dtype(model_or_config: Any) -> Any:
    """The dtype of the model's floating-point parameters, else the config's."""
    parameters = getattr(model_or_config, "parameters", None)
    if parameters is not None:
        for p in parameters():
            if p.is_floating_point():
                return p.dtype
    config = getattr(model_or_config, "config", model_or_config)
    for attr in ("dtype", "torch_dtype"):
        value = getattr(config, attr, None)
        if value is not None:
            return value
    return "float32"  # what transformers instantiates a config without a dtype in


# RoPE types whose rotation depends on the whole sequence's length (rescaled past
# the trained length, or switching factors there): a prefix's KV then depends on the
# tokens after it, so no prefix can be stored.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _check_rope(config: Any) -> None:
    """InvalidInput if the config's RoPE makes a prefix's KV depend on later tokens."""
    found = [getattr(config, a, None) for a in ("rope_parameters", "rope_scaling")]
    params = [p for p in found if isinstance(p, dict)]
    # Per layer type ({"full_attention": {...}, "sliding_attention": {...}}) or one dict.
    params += [v for p in list(params) for v in p.values() if isinstance(v, dict)]
    for p in params:
        kind = p.get("rope_type", p.get("type"))
        if kind in _LENGTH_DEPENDENT_ROPE:
            raise InvalidInput(
                f"model: rope_type {kind!r} rescales every position by the sequence's "
                "length, so a prefix's KV depends on the tokens after it and cannot be "
                "stored"
            )


def layout_of(model_or_config: Any, block_size: int = 16) -> Layout:
    """The KV layout of a transformers model (or its config): `num_hidden_layers`,
    `num_key_value_heads` (default: `num_attention_heads`), `head_dim` (default:
    `hidden_size // num_attention_heads`) and the dtype of the model's parameters
    (for a config: its `dtype` / `torch_dtype`, else float32). InvalidInput for a
    model whose prefix KV depends on later tokens (dynamic or LongRoPE scaling)."""
    config = _text_config(model_or_config)
    _check_rope(config)
    if getattr(config, "kv_lora_rank", None):
        # vLLM and SGLang cache the latent (`kind="latent"` stores); transformers
        # expands it into per-head K and V, with K wider than V, which no latent
        # restores bit for bit.
        raise InvalidInput(
            f"model_or_config: {getattr(config, 'model_type', 'this model')} uses MLA "
            f"(kv_lora_rank {config.kv_lora_rank}): transformers' cache holds the expanded "
            "K and V, not the latent a serving engine stores; kvstore.hf does not store it"
        )
    try:
        num_layers = int(config.num_hidden_layers)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        # Falcon and GPTBigCode name grouped KV heads their own way.
        if getattr(config, "new_decoder_architecture", False):
            num_kv_heads = int(getattr(config, "num_kv_heads", None) or num_kv_heads)
        elif getattr(config, "multi_query", False) is True:
            num_kv_heads = 1
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
    except AttributeError as e:
        raise InvalidInput(
            f"model_or_config: expected a transformers decoder model or config, got "
            f"{type(model_or_config).__name__} ({e})"
        ) from None
    return Layout(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        dtype=dtype_name(_model_dtype(model_or_config)),
        block_size=block_size,
    )


def _tensor_digest(t: torch.Tensor) -> bytes:
    import torch

    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.data).digest()  # releases the GIL: tensors hash in parallel


_SOURCES = ("auto", "files", "weights")

# Config keys a checkpoint's config may differ from the loaded model's in, the model
# still being the checkpoint's: where it was saved, and the dtype it was loaded in
# (which the layout binds, as the store's dtype).
_LOADED_AS_KEYS = (*VOLATILE_CONFIG_KEYS, "dtype", "torch_dtype")


def fingerprint(
    model: Any,
    *,
    name: str | None = None,
    source: str = "auto",
    memo_dir: str | os.PathLike[str] | None = None,
) -> str:
    """A model fingerprint for `kvstore.open(..., model=...)`; `source` says from what:

    - "files": the checkpoint the model was loaded from, found by its `name_or_path`
      (a directory, or a hub id in the hub cache at the commit transformers loaded):
      `kvstore.fingerprint.checkpoint_fingerprint`, `"<model_type>@ckpt-v1:<hex>"`,
      the value the vLLM connector computes for the same files and `kvstore
      fingerprint PATH` prints, so both share blocks. Reads each weight file once
      (BLAKE3; nothing for a hub cache snapshot) and remembers the hashes in
      `memo_dir` (`kvstore.fingerprint.memo_path`). InvalidInput if the model
      names no checkpoint.
    - "weights": the config (every field, sorted, except where and with which
      transformers version it was saved) and every tensor of the state dict (name,
      dtype, shape, raw bytes, in name order), SHA-256 on several threads:
      `"<name>@sha256:<hex>"`, kvstore's first scheme. For a model built or
      changed in memory.
    - "auto" (default): "files" where the model names a checkpoint whose config is
      the model's (apart from the dtype it was loaded in, which the layout binds),
      else "weights".

    "files" (and so "auto") cannot see weights changed in memory after loading
    (training, merged adapters, `load_state_dict`): pass source="weights" for such
    a model. `name` replaces the prefix (default: the config's `model_type`). A
    string you already trust (hub id + revision) can go to `kvstore.open` instead.
    """
    config = getattr(model, "config", None)
    state_dict = getattr(model, "state_dict", None)
    if config is None or state_dict is None:
        raise InvalidInput(
            f"model: expected a transformers model (with .config and .state_dict()), "
            f"got {type(model).__name__}"
        )
    if source not in _SOURCES:
        raise InvalidInput(f"source: expected one of {_SOURCES}, got {source!r}")
    if source != "weights":
        root = _checkpoint_of(model, strict=source == "files")
        if root is not None:
            return checkpoint_fingerprint(root, name=name, memo_dir=memo_dir)
    return _weights_fingerprint(model, name)


def _checkpoint_of(model: Any, *, strict: bool) -> Path | None:
    """The directory of the checkpoint `model` was loaded from. `strict`: that or
    InvalidInput; else None also where the checkpoint's config is not the model's."""
    config = model.config
    where = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "")
    if not where:
        if strict:
            raise InvalidInput(
                "model: built in memory (no name_or_path), so it has no checkpoint files; "
                "use source='weights'"
            )
        return None
    try:
        root = checkpoint_dir(where, revision=getattr(config, "_commit_hash", None))
    except InvalidInput:
        if strict:
            raise
        return None
    if strict:
        return root
    try:
        saved = type(config).from_pretrained(root)
    except (OSError, ValueError):
        return None
    return root if _as_loaded(config.to_dict()) == _as_loaded(saved.to_dict()) else None


def _as_loaded(d: Any) -> Any:
    """A config dict without `_LOADED_AS_KEYS`, at every depth (sub-configs)."""
    if isinstance(d, dict):
        return {k: _as_loaded(v) for k, v in d.items() if k not in _LOADED_AS_KEYS}
    return d


def _weights_fingerprint(model: Any, name: str | None) -> str:
    config = model.config
    cfg = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(b"kvstore.hf.fingerprint/1\0")
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    tensors = sorted(model.state_dict().items())
    # Tied weights (lm_head = embed_tokens) appear under two names: hash their bytes once.
    source: dict[str, str] = {}
    first_of: dict[tuple[Any, ...], str] = {}
    for key, t in tensors:
        if t.device.type == "meta":
            raise InvalidInput(f"model: tensor {key!r} is on the meta device (not loaded)")
        storage = t.untyped_storage().data_ptr()
        ident = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        source[key] = first_of.setdefault(ident, key) if t.numel() else key
    unique = [(k, t) for k, t in tensors if source[k] == k]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        hashed = pool.map(_tensor_digest, [t for _, t in unique])
        digests = {k: d for (k, _), d in zip(unique, hashed, strict=True)}
    for key, t in tensors:
        h.update(f"\0{key}\0{t.dtype}\0{list(t.shape)}\0{source[key]}\0".encode())
        h.update(digests[source[key]])
    prefix = name or str(getattr(config, "model_type", None) or type(model).__name__)
    return f"{prefix}@sha256:{h.hexdigest()}"


_fingerprint = fingerprint  # for `open`, whose argument of that name shadows it


def open(  # noqa: A001 - kvstore.hf.open mirrors kvstore.open
    path: str | os.PathLike[str],
    model: Any,
    *,
    fingerprint: str | None = None,
    block_size: int = 16,
    **open_kwargs: Any,
) -> Store:
    """`kvstore.open(path, layout=layout_of(model, block_size), model=fingerprint)`.

    `fingerprint` defaults to `fingerprint(model)` (its checkpoint files, remembered
    beside the store, or its weights; pass your own string, e.g. "org/model@rev", to
    skip that). Other arguments go to `kvstore.open`.
    """
    # The memo goes in the store's directory where the store may be created there.
    memo_dir = path if open_kwargs.get("create", True) else None
    fp = fingerprint if fingerprint is not None else _fingerprint(model, memo_dir=memo_dir)
    return open_store(path, layout=layout_of(model, block_size), model=fp, **open_kwargs)


# -- token ids and caches --------------------------------------------------------------------


def _token_ids(input_ids: Any, what: str = "input_ids") -> Any:
    """`input_ids` ([N], [1, N] tensor or array, or list of ints) as a 1-D int64 CPU tensor."""
    import numpy as np
    import torch

    if isinstance(input_ids, torch.Tensor):
        t = input_ids.detach()
    else:
        try:
            a = np.asarray(input_ids)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidInput(f"{what}: expected token ids, got {e}") from None
        if a.size == 0:  # np.asarray([]) is float64
            a = a.astype(np.int64)
        if a.dtype.kind not in "iu":
            raise InvalidInput(f"{what}: expected integer token ids, got dtype {a.dtype}")
        t = torch.as_tensor(a.astype(np.int64, copy=False))
    if t.ndim == 2:
        if t.shape[0] != 1:
            raise InvalidInput(
                f"{what}: expected batch size 1 (shape [1, N] or [N]), got shape {list(t.shape)}; "
                "the store keys KV by one token sequence: save/load each row separately"
            )
        t = t[0]
    if t.ndim != 1:
        raise InvalidInput(f"{what}: expected shape [1, N] or [N], got shape {list(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InvalidInput(f"{what}: expected integer token ids, got dtype {t.dtype}")
    return t.to("cpu", torch.int64)


def _layer_kv(past_key_values: Any) -> list[tuple[Any, Any, int]]:
    """(keys, values, valid tokens) per layer of a transformers Cache or a legacy tuple."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    layers = getattr(past_key_values, "layers", None)
    if layers is None:
        if isinstance(past_key_values, (tuple, list)) and all(
            isinstance(x, (tuple, list)) and len(x) >= 2 for x in past_key_values
        ):
            for i, (_, _, *rest) in enumerate(past_key_values):
                # tuple(DynamicCache) gives (keys, values, sliding window) per layer: a
                # window's keys are its last tokens', not the prefix's first.
                if any(r is not None for r in rest):
                    raise InvalidInput(
                        f"past_key_values: layer {i} of the tuple is a sliding window "
                        f"({rest[0]!r}); only full-attention layers keep the KV of every "
                        "token of a prefix"
                    )
            layer_kv = []
            for i, (k, v, *_) in enumerate(past_key_values):
                if not (is_torch(k) and is_torch(v)) or k.ndim != 4 or v.ndim != 4:
                    raise InvalidInput(
                        f"past_key_values: layer {i}: expected (keys, values) torch tensors of "
                        f"shape [1, H, T, D], got ({type(k).__name__}, {type(v).__name__})"
                    )
                layer_kv.append((k, v, min(int(k.shape[-2]), int(v.shape[-2]))))
            return layer_kv
        raise InvalidInput(
            "past_key_values: expected a transformers Cache (e.g. DynamicCache) or a tuple "
            f"of (key, value) per layer, got {type(past_key_values).__name__}"
        )
    out = []
    for i, layer in enumerate(layers):
        # Only these two keep every token's KV and nothing else (a sliding, quantized,
        # linear-attention or indexed layer drops, transforms or adds to it).
        if type(layer) not in (DynamicLayer, StaticLayer):
            raise InvalidInput(
                f"past_key_values: layer {i} is a {type(layer).__name__}; only full-attention "
                "layers (DynamicLayer, StaticLayer) keep the KV of every token of a prefix"
            )
        if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
            out.append((None, None, 0))  # lazily initialized, nothing cached yet
        else:
            # V shorter than K (a cache updated by hand) holds only V's tokens.
            t = min(int(layer.get_seq_length()), int(layer.values.shape[-2]))
            out.append((layer.keys, layer.values, t))
    return out


def cache_to_kv(past_key_values: Any, tokens: int | None = None) -> torch.Tensor:
    """The first `tokens` tokens (default: all) of a batch-1 cache as one contiguous
    CPU tensor `[L, 2, T, H, D]`, the store's order (per layer K then V, token-major)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # An offloading cache moves layers to the CPU with non_blocking=True, and back
        # on a stream of its own: wait for those copies before reading any of them.
        torch.cuda.synchronize()
    layers = _layer_kv(past_key_values)
    if not layers or layers[0][0] is None:
        raise InvalidInput("past_key_values: expected a cache holding KV, got an empty one")
    k0 = layers[0][0]
    if k0.ndim != 4 or k0.shape[0] != 1:
        raise InvalidInput(
            f"past_key_values: expected keys of shape [1, H, T, D] (batch size 1), "
            f"got {list(k0.shape)}"
        )
    have = min(t for _, _, t in layers)
    t = have if tokens is None else tokens
    if not 0 <= t <= have:
        raise InvalidInput(f"tokens: expected 0 to {have} (the cache's length), got {t}")
    _, h, _, d = k0.shape
    out = torch.empty((len(layers), 2, t, h, d), dtype=k0.dtype)
    for i, (k, v, _) in enumerate(layers):
        for j, x in enumerate((k, v)):
            if x is None:
                raise InvalidInput(f"past_key_values: layer {i} holds no KV")
            if x.ndim != 4 or x.shape[0] != 1 or x.shape[1] != h or x.shape[3] != d:
                raise InvalidInput(
                    f"past_key_values: layer {i} {'KV'[j]}: expected shape [1, {h}, T, {d}], "
                    f"got {list(x.shape)}"
                )
            if x.dtype != k0.dtype:
                raise InvalidInput(
                    f"past_key_values: layer {i}: expected dtype {k0.dtype}, got {x.dtype}"
                )
            # [1, H, T, D] -> [T, H, D]: one strided copy per layer straight into place.
            out[i, j].copy_(x[0, :, :t].transpose(0, 1))
    return out


# Whether a config's DynamicCache holds only DynamicLayers, and how many, by the
# text config's type and repr(vars()): equal configs give equal layer types, and
# deriving them (DynamicCache(config=...)) costs ~0.2 ms, as much as restoring
# 256 tokens from the hot tier. Bounded: cleared when full.
_FULL_LAYERS: dict[tuple[type, str], int | None] = {}
_FULL_LAYERS_MAX = 64


def _full_attention_layers(config: Any) -> int | None:
    """The layer count of `DynamicCache(config=config)` if its layers are all
    DynamicLayer (full attention), else None."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    text = config.get_text_config(decoder=True)  # what DynamicCache reads the types from
    key = (type(text), repr(vars(text)))
    if key not in _FULL_LAYERS:
        layers = DynamicCache(config=config).layers
        full = all(type(layer) is DynamicLayer for layer in layers)
        if len(_FULL_LAYERS) >= _FULL_LAYERS_MAX:
            _FULL_LAYERS.clear()
        _FULL_LAYERS[key] = len(layers) if full else None
    return _FULL_LAYERS[key]


def kv_to_cache(kv: torch.Tensor, config: Any = None, device: Any = None) -> DynamicCache:
    """A DynamicCache holding `kv` (`[L, 2, T, H, D]`), without copying it.

    Each full-attention layer's keys and values are `[1, H, T, D]` views of `kv`
    (strided, not contiguous): the model's next forward concatenates the new tokens
    onto them (`DynamicLayer.update`), which makes the one contiguous copy a restored
    cache needs; copying here too would double the cost of a restore. Other layer
    types get `kv` through their own `update`.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if device is not None:
        kv = kv.to(device)
    full = _full_attention_layers(config) if config is not None else 0
    if full is None:
        cache = DynamicCache(config=config)
    else:
        # What DynamicCache(config=config) builds when its layers are all full
        # attention, without deriving their types from the config again.
        cache = DynamicCache()
        if full:
            cache.layer_class_to_replicate = None  # the config's layers, as DynamicCache has it
            cache.layers = [DynamicLayer() for _ in range(full)]
    if kv.shape[2] == 0:
        return cache
    if not cache.layers:  # no config: DynamicCache would add DynamicLayers on first update
        cache.layers = [DynamicLayer() for _ in range(kv.shape[0])]
    if len(cache.layers) != kv.shape[0]:
        raise InvalidInput(
            f"kv: expected {len(cache.layers)} layers (the config's), got {kv.shape[0]}"
        )
    # [L, 2, T, H, D] -> per layer (keys, values), each [1, H, T, D]: views, made by two
    # unbinds rather than two index-transpose-unsqueeze chains per layer.
    views = kv.permute(0, 1, 3, 2, 4).unsqueeze(2).unbind(0)
    initialized: dict[str, Any] | None = None
    layers: list[Any] = list(cache.layers)  # some layer types' stubs lack `update`
    for layer, per_layer in zip(layers, views, strict=True):
        keys, values = per_layer.unbind(0)
        if type(layer) is DynamicLayer:
            if initialized is None:
                # An update with no tokens initializes a layer (dtype, device) through
                # its public method, whichever transformers version ...
                layer.update(keys[:, :, :0], values[:, :, :0])
                initialized = vars(layer)
            else:
                # ... and every other one gets that state (the same dtype and
                # device) copied: a fifth of the cost of an update each.
                vars(layer).update(initialized)
            layer.keys, layer.values = keys, values
        else:
            layer.update(keys, values)
    return cache


def _storable(store: Store, ids: Any, past_key_values: Any) -> int:
    """Tokens of `ids` whose KV the cache holds, rounded down to full blocks."""
    layers = _layer_kv(past_key_values)
    have = min((t for _, _, t in layers), default=0)
    if have and len(layers) != store.layout.num_layers:
        raise InvalidInput(
            f"past_key_values: expected {store.layout.num_layers} layers (the store's layout "
            f"{store.layout}), got {len(layers)}"
        )
    b = store.layout.block_size
    return min(len(ids), have) // b * b


def save(
    store: Store, input_ids: Any, past_key_values: Any, *, extra: bytes | str | None = None
) -> int:
    """Stores the full blocks of `input_ids` whose KV `past_key_values` holds; returns
    the tokens covered (a multiple of the block size). Blocks already stored (by any
    process, any session) are not written again.

    `input_ids`: [N] or [1, N]; `past_key_values`: a transformers Cache (or legacy
    tuple) of batch size 1 whose first N tokens are the KV of `input_ids` (a cache
    shorter than N covers only its own length).
    `extra`: what else the KV depends on besides the token ids and the model, bound
    into every block id (`Store.put`): a LoRA adapter's name, or a digest of the
    images or audio a multimodal model was fed. Without it a block is found by its
    tokens alone, so KV computed beside an image would serve a prompt with another
    image behind the same placeholder tokens.
    """
    ids = _token_ids(input_ids)
    n = _storable(store, ids, past_key_values)
    return store.put(ids[:n], cache_to_kv(past_key_values, n), extra=extra) if n else 0


_save = save  # for `generate`, whose argument of that name shadows it


def load(
    store: Store,
    input_ids: Any,
    *,
    config: Any = None,
    device: Any = None,
    max_tokens: int | None = None,
    out: torch.Tensor | None = None,
    extra: bytes | str | None = None,
) -> tuple[DynamicCache, int]:
    """`(cache, n)`: a DynamicCache of the KV of the longest stored prefix of
    `input_ids` (at most `max_tokens`), n tokens (a multiple of the block size,
    possibly 0: then the cache is empty). Feed the model `input_ids[n:]` next.

    `config`: the model's config (or the model), so the cache has the model's layer
    types (and a store of another layer count is refused), and a model that takes images,
    video or audio restores nothing from its first such token on unless `extra`
    names that media (see `save`); `device`: where the cache lives (default CPU).
    `out`: a contiguous CPU `[L, 2, T, H, D]` tensor to restore into (at most T
    tokens), for a process that restores again and again: a new buffer's first-touch
    page faults cost about as much as the copy. The cache's layers are views of
    `out` until the model's next forward replaces them (by concatenation): do not
    reuse `out` before that. Without `out`, the KV lands in a buffer of the store's
    result pool sized to what is stored.
    `extra`: as given to `save`.
    """
    import torch

    ids = _token_ids(input_ids)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidInput(f"max_tokens: expected an int >= 0, got {max_tokens!r}")
        ids = ids[:max_tokens]
    layout = store.layout
    if config is not None:
        config = _config_of(config)
        if extra is None:
            ids = ids[: _before_media(config, ids)]
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.ndim != 5:
            raise InvalidInput(f"out: expected a [L, 2, T, H, D] torch tensor, got {out!r:.60}")
        ids = ids[: out.shape[2]]
    if len(ids) < layout.block_size:
        return kv_to_cache(torch.empty(layout.kv_shape(0)), config=config), 0
    if out is None:
        # Sized to the stored prefix (not the request), in memory the store reuses
        # (already faulted in).
        kv = store.get(ids, like=torch.empty(0), extra=extra)
        n = kv.shape[2]
    else:
        n = store.get(ids, out=out, extra=extra)
        kv = out[:, :, :n]
    return kv_to_cache(kv, config=config, device=device), n


def _config_of(config: Any) -> Any:
    """A transformers config, given one or a model."""
    config = getattr(config, "config", config)
    if not callable(getattr(config, "get_text_config", None)):
        raise InvalidInput(
            f"config: expected a transformers config or model, got {type(config).__name__}"
        )
    return config


def _check_layout(store: Store, model: Any) -> None:
    """InvalidInput unless the store holds KV of the model's layer count and of the
    dtype of its parameters: KV of another dtype would be fed to it silently (other
    head counts or sizes fail in its first forward, and `layout_of`'s estimate of
    them from the config is not what every model's cache holds)."""
    have = store.layout
    layers = getattr(_text_config(model), "num_hidden_layers", have.num_layers)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    want_dtype = dtype_name(dtype) if dtype is not None else have.dtype
    if (layers, want_dtype) != (have.num_layers, have.dtype):
        raise InvalidInput(
            f"store: its layout {have} holds KV of {have.num_layers} layers in {have.dtype}, "
            f"the model has {layers} layers in {want_dtype}; open the store with "
            "hf.open(path, model)"
        )


# A config attribute that names a placeholder token whose KV depends on media fed
# beside the token ids (an image's pixels, a clip's frames, a recording's features),
# or that opens or closes such media: image_token_id, video_token_index,
# vision_start_token_id, boi_token_index, audio_token_id, ...
_MEDIA_TOKEN = re.compile(r"(image|video|audio|vision|speech|boi|eoi|boa|eoa)\w*_token_(id|index)")
# A sub-config that says the model takes media at all.
_MEDIA_CONFIG = re.compile(r"(vision|visual|image|video|audio|speech)\w*")


def _media_tokens(config: Any) -> set[int] | None:
    """The media placeholder token ids of `config` and its sub-configs (a composite
    model keeps them in `vision_config`, `thinker_config`, ...); None for a model that
    takes media (a vision or audio sub-config) but names no placeholder: then every
    token's KV may depend on the media."""
    found: set[int] = set()
    takes_media = False
    stack, seen = [config], set()
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        for name, value in vars(c).items():
            if (
                "_token_" in name
                and _MEDIA_TOKEN.fullmatch(name)
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                found.add(value)
        for name in getattr(c, "sub_configs", None) or {}:
            sub = getattr(c, name, None)
            if sub is not None and hasattr(sub, "sub_configs"):
                stack.append(sub)
                takes_media |= bool(_MEDIA_CONFIG.match(name))
    return None if takes_media and not found else found


def _before_media(config: Any, ids: Any) -> int:
    """The tokens of `ids` before the first media placeholder of `config`'s model (all
    of them for a text model, none for a model that takes media without naming a
    placeholder): block ids name tokens only, so past that point two prompts with the
    same ids but other images have other KV."""
    import torch

    media = _media_tokens(config)
    if media is None:
        return 0
    if not media:
        return len(ids)
    hits = torch.isin(ids, torch.tensor(sorted(media), dtype=ids.dtype)).nonzero()
    return int(hits[0, 0]) if len(hits) else len(ids)


def save_session(store: Store, name: str, input_ids: Any, past_key_values: Any) -> int:
    """Binds `name` to all of `input_ids` and stores the full blocks of its KV (shared
    with every other session or save of the same prefix). Returns the tokens covered.

    The cache must hold the KV of every full block of `input_ids`. After `generate`
    it lacks the last generated token: feed that token first (the next turn's
    prefill would compute it anyway), or name fewer tokens.
    """
    import torch

    ids = _token_ids(input_ids)
    n = _storable(store, ids, past_key_values)
    full = len(ids) // store.layout.block_size * store.layout.block_size
    if n < full:
        have = min((t for _, _, t in _layer_kv(past_key_values)), default=0)
        raise InvalidInput(
            f"past_key_values: a session of {len(ids)} tokens needs the KV of its first "
            f"{full} (every full block), the cache holds {have}; run the model on "
            f"input_ids[:, {have}:] with this cache first, or save input_ids[:, :{have}]"
        )
    if n:
        kv = cache_to_kv(past_key_values, n)
    else:  # a session shorter than a block: its name and tokens are still worth keeping
        kv = torch.empty(store.layout.kv_shape(0), dtype=getattr(torch, store.layout.dtype))
    return store.save_session(name, ids, kv)


def load_session(
    store: Store,
    name: str,
    *,
    config: Any = None,
    device: Any = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DynamicCache, int]:
    """`(input_ids, cache, n)`: the session's token ids as a [1, N] int64 tensor, and a
    DynamicCache of the KV of their longest stored prefix (n tokens), restored as by
    `load` (same `config`, `device`, `out`). Raises SessionNotFound (a KeyError) for
    an unknown name."""
    import torch

    if not isinstance(name, str):
        raise InvalidInput(f"name: expected str, got {type(name).__name__}")
    # The tokens only (Store.load_session would also read the KV, into a new buffer
    # that load() then could not reuse).
    tokens = torch.from_numpy(store.session_tokens(name))
    cache, n = load(store, tokens, config=config, device=device, out=out)
    return tokens[None], cache, n


def cache_kwarg(cache: Any) -> dict[str, Any]:
    """The keyword a model's forward and `generate` take `cache` by: `cache` where
    transformers has that name (it deprecates `past_key_values`, removed in 5.40),
    else `past_key_values`."""
    from transformers.generation import utils as generation

    name = "cache" if "cache" in getattr(generation, "ALL_CACHE_NAMES", ()) else "past_key_values"
    return {name: cache}


def generate(
    model: Any,
    store: Store,
    input_ids: Any,
    *,
    save: bool = True,
    stats: dict[str, int] | None = None,
    extra: bytes | str | None = None,
    **generate_kwargs: Any,
) -> Any:
    """`model.generate(input_ids, **generate_kwargs)` that starts from the store.

    Restores the longest stored prefix of `input_ids` (leaving at least one token to
    prefill, so the first step has logits), prefills only the rest, generates, then
    (with `save`) stores the new full blocks of prompt + generated tokens. Returns what
    `model.generate` returns. If `stats` is a dict, it receives `restored_tokens`,
    `prefilled_tokens` and `stored_tokens`.

    Batch size 1. With beam search or several return sequences, only the prompt's
    blocks are stored (every beam shares them). `extra`: as for `save`. A model that
    takes images, video or audio restores nothing from the prompt's first such
    placeholder token on (transformers then feeds the media to the tokens it
    prefills), and stores blocks past it only under an `extra` naming the media.
    """
    import torch

    for k in ("past_key_values", "cache", "position_ids", "cache_position", "cache_implementation"):
        if k in generate_kwargs:
            raise InvalidInput(f"{k}: hf.generate builds the cache and positions from the store")
    ids = _token_ids(input_ids)
    if len(ids) == 0:
        raise InvalidInput("input_ids: expected at least one token, got none")
    mask = generate_kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).eq(1).all()):
        # Padding shifts the positions: that KV is not the plain tokens' KV.
        raise InvalidInput("attention_mask: expected all ones (batch size 1, no padding)")
    _check_rope(_text_config(model))
    _check_layout(store, model)
    if save and _full_attention_layers(model.config) is None:
        raise InvalidInput(
            "model: its cache has layers other than full attention (sliding window, "
            "linear attention, ...), which keep no prefix to store; pass save=False"
        )
    b = store.layout.block_size
    device = getattr(model, "device", None)
    media = _before_media(model.config, ids)
    cache, n = load(
        store,
        ids,
        config=model.config,
        device=device,
        # The media's features go to the placeholder tokens generate prefills: never
        # restore those, whatever `extra` says.
        max_tokens=min(len(ids) - 1, media) // b * b,
        extra=extra,
    )
    row = ids[None].to(device) if device is not None else ids[None]
    # With a non-empty cache, generate slices input_ids to the uncached part only when
    # the attention mask spans the whole sequence. A generation config that asks for a
    # cache of its own (cache_implementation) would refuse the one given here.
    mask = torch.ones_like(row)
    out = model.generate(
        row,
        attention_mask=mask,
        cache_implementation=None,
        **cache_kwarg(cache),
        **generate_kwargs,
    )
    stored = 0
    if save:
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        cached = cache.get_seq_length()
        if extra is None:  # KV past a media token is keyed by that media only via extra
            cached = _before_media(model.config, sequences[0, :cached].cpu())
        rows = _layer_kv(cache)[0][0].shape[0]
        if sequences.shape[0] == 1 and rows == 1:
            stored = _save(store, sequences[0, :cached], cache, extra=extra)
        else:
            stored = _save_prompt_of_row0(store, ids[: min(len(ids), cached)], cache, extra)
    if stats is not None:
        stats.update(restored_tokens=n, prefilled_tokens=len(ids) - n, stored_tokens=stored)
    return out


def _save_prompt_of_row0(store: Store, ids: Any, cache: Any, extra: bytes | str | None) -> int:
    """Saves the prompt's blocks from row 0 of a batch-expanded (beam) cache: the
    prompt's KV is the same in every row."""
    rows = [(k[:1], v[:1]) for k, v, _ in _layer_kv(cache)]
    return _save(store, ids, tuple(rows), extra=extra)
