"""What identifies a vLLM request's blocks besides its tokens: the extra config, the
model's fingerprint as vLLM changes it, a request's cache_salt and LoRA adapter,
and which requests the store must not serve at all. Imports no vLLM (tested
without it)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidInput

EXTRA_KEYS = frozenset(
    {"path", "hot_bytes", "disk_bytes", "durability", "salt", "remote", "fingerprint", "save_queue"}
)


def parse_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`kv_connector_extra_config`, checked: unknown keys and a missing path are errors."""
    extra = dict(extra or {})
    unknown = set(extra) - EXTRA_KEYS
    if unknown:
        raise InvalidInput(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
    if "path" not in extra:
        raise InvalidInput("kv_connector_extra_config: 'path' (the store directory) is required")
    return extra


def vllm_fingerprint(hf_fingerprint: str, hf_config: dict[str, Any], **settings: Any) -> str:
    """`hf_fingerprint` (the weights as transformers loads them) bound to what vLLM
    changes besides: its `hf_config` (with `hf_overrides` applied; e.g. rope_scaling
    changes K) and `settings` (quantization, dtype). Two vLLMs differing in any of
    these get different fingerprints, hence never share blocks."""
    h = hashlib.sha256(b"kvstore.vllm.fingerprint/1\0")
    h.update(hf_fingerprint.encode() + b"\0")
    h.update(json.dumps(hf_config, sort_keys=True, default=str).encode() + b"\0")
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return f"{hf_fingerprint}+vllm@sha256:{h.hexdigest()}"


_adapter_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def adapter_digest(path: str) -> str:
    """SHA-256 of a LoRA adapter's files (names and contents) under `path`, cached per
    path and the files' sizes and mtimes. A path that is not on this machine (a hub
    id vLLM resolves itself) is identified by its string."""
    p = Path(path)
    if not p.exists():
        return "path:" + path
    files = sorted(f for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    stats = tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    key = (path, stats)
    digest = _adapter_digests.get(key)
    if digest is None:
        h = hashlib.sha256(b"kvstore.vllm.adapter/1\0")
        for f in files:
            h.update(_part(str(f.relative_to(p)) if f != p else f.name))
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            h.update(b"\0")
        digest = _adapter_digests[key] = "sha256:" + h.hexdigest()
    return digest


def _part(s: str | bytes) -> bytes:
    """A key part, length-prefixed so no part's content can pose as a boundary."""
    b = s.encode() if isinstance(s, str) else s
    return len(b).to_bytes(8, "little") + b


def key_extra(cache_salt: str | None, adapter: str | None) -> bytes | None:
    """What goes into a request's block keys besides its tokens: its `cache_salt` and
    its adapter's identity (`adapter_digest`), so tenants and adapters never share
    blocks. None for neither, so a plain request's blocks are those `kvstore.hf`
    stores for the same tokens."""
    if cache_salt is None and adapter is None:
        return None
    parts = [b"kvstore.vllm/2"]
    for name, value in (("cache_salt", cache_salt), ("lora", adapter)):
        parts.append(_part(name) + (b"\1" + _part(value) if value is not None else b"\0"))
    return b"".join(parts)


def request_extra(request: Any) -> bytes | None:
    """`key_extra` of a vLLM request."""
    lora = getattr(request, "lora_request", None)
    adapter = adapter_digest(lora.lora_path) if lora is not None else None
    return key_extra(getattr(request, "cache_salt", None), adapter)


def tagged(extra: bytes | None, tag: bytes | None) -> bytes | None:
    """`extra` after `tag` (see `latent_tag`), where there is one."""
    return extra if tag is None else tag + (extra or b"")


def latent_tag(tensor_parallel_size: int) -> bytes:
    """The key bytes that keep an MLA latent to the tensor-parallel size that computed
    it (fixed length, ahead of the request's extra). vLLM 0.32's CPU build computes
    another latent at TP=2 than at TP=1 from layer 1 on, O(1) apart, not rounding
    (measured on a tiny DeepSeek-V3, float32): a latent of one TP size restored into
    another would not be that vLLM's KV. K/V heads carry no such tag: each TP size's
    KV agrees with the others' to rounding, and one store serves them all."""
    return b"kvstore.vllm.latent-tp/1\0" + tensor_parallel_size.to_bytes(4, "little")


# Speculative methods that keep no KV of a model of their own: a store's blocks are
# the target model's alone either way.
_NO_DRAFT_KV = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})


def check_speculative(speculative_config: Any) -> None:
    """Refuses speculative decoding that keeps a draft model's KV in vLLM's cache
    (EAGLE, MTP, a draft model, ...): its layers would be stored with the target's,
    and a draft layer's KV at a token depends on the token after it (EAGLE feeds the
    next token with the target's hidden state), so a block's last position depends on
    the next block's first token: stored KV would not be a function of its prefix.
    Methods without a draft cache (n-gram, suffix, Medusa, MLP speculators) pass."""
    if speculative_config is None:
        return
    method = getattr(speculative_config, "method", None)
    if method not in _NO_DRAFT_KV:
        raise InvalidInput(
            f"KVStoreConnector: speculative decoding with method {method!r} keeps a draft "
            "model's KV, which depends on the token after each block; supported: "
            f"{sorted(_NO_DRAFT_KV)} or none"
        )


def keyed_by_tokens(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids (and extra) alone. Not so
    for multimodal requests (every image's placeholder ids are the same) nor for
    `prompt_embeds` requests (their token ids are placeholders): the store neither
    serves nor stores theirs."""
    if getattr(request, "mm_features", None) or getattr(request, "mm_hashes", None):
        return False
    return getattr(request, "prompt_embeds", None) is None
