"""A vLLM KV connector: vLLM's prefixes survive restarts and are shared by every
vLLM process on the machine, through a kvstore store.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"path": "/data/kv", "hot_bytes": 1 << 30}))

vLLM (0.32 API) builds two halves, each in its own process with its own store
handle: the scheduler half answers "how much of this prompt is stored beyond
vLLM's own prefix cache" and plans which blocks to load and save each step; the
worker half moves KV between vLLM's paged cache and the store. Blocks are stored
in kvstore's canonical `[L, 2, T, H, D]` under the same keys `kvstore.hf` uses,
so a prefix vLLM stored is a hit for transformers on the same model and the
reverse. Where a paged block keeps each value is learnt at start-up by running
the attention backend's own cache writer on a probe block, never assumed.

Extra config keys: `path` (required), `hot_bytes`, `disk_bytes`, `durability`
("sync", "batch", "none"), `salt` (tenant secret), `remote` (a dict of
`kvstore.Remote` fields), `fingerprint` (the model identity; default: that of
the checkpoint files vLLM serves, `kvstore.fingerprint`, as `kvstore.hf.fingerprint`
gives a model loaded from them, bound to vLLM's `hf_overrides` and quantization
when set; never loads the model, and the files' hashes are remembered beside the
store), `save_queue` (save jobs in flight before a step waits, default 64).

Multimodal and `prompt_embeds` requests are neither served nor stored (their token
ids do not identify their KV).

Modules: `keys` (identity), `paged` (the backend's block layout), `connector` (the
connector, which imports vLLM: `import kvstore` and `import kvstore.vllm` do not;
vLLM's `getattr(kvstore.vllm, "KVStoreConnector")` does).
"""

from __future__ import annotations

from typing import Any

from .keys import key_extra, request_extra
from .paged import affine_strides, paged_block_map

__all__ = [
    "KVStoreConnector",
    "KVStoreConnectorStats",
    "affine_strides",
    "key_extra",
    "paged_block_map",
    "request_extra",
]


def __getattr__(name: str) -> Any:
    if name in ("KVStoreConnector", "KVStoreConnectorStats", "KVStoreConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
