"""The KV layout a store is bound to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput

DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
STORAGES = ("exact", "fp8")
KINDS = ("kv", "latent")
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as a string, a torch dtype or a numpy dtype."""
    name = str(dtype)
    name = name.removeprefix("torch.")
    aliases = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise InvalidInput(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class Layout:
    """`num_layers L`, `num_kv_heads H`, `head_dim D`, `dtype`, `block_size B`.

    A block holds the KV of B tokens for every layer, logically `[L, 2, B, H, D]`
    (index 0 of the second axis is K, 1 is V).

    `storage`: "exact" (the dtype's bits) or "fp8" (lossy: float8_e4m3fn with one
    float32 scale per block, layer, K/V and kv head; `put` and `get` still take and
    return `dtype`; see `kvstore.fp8`). Part of the block ids: stores of the two
    never share blocks.

    `kind`: "kv" (K and V, as above) or "latent": an MLA cache (DeepSeek-V2/V3, Kimi
    K2) of one vector per token and layer, `head_dim` wide (`kv_lora_rank +
    qk_rope_head_dim`, even) with `num_kv_heads` 1: a block is `[L, B, head_dim]`,
    the latent once, and `put`/`get` take and return `[L, T, head_dim]`. Part of the
    block ids too.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16
    storage: str = "exact"
    kind: str = "kv"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidInput(f"{field}: expected a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.storage not in STORAGES:
            raise InvalidInput(f"storage: expected 'exact' or 'fp8', got {self.storage!r}")
        if self.storage == "fp8" and self.dtype == "float8_e4m3fn":
            raise InvalidInput(
                "storage: 'fp8' stores float16, bfloat16 or float32 KV as fp8; "
                "this layout's dtype is float8_e4m3fn already"
            )
        if self.kind not in KINDS:
            raise InvalidInput(f"kind: expected 'kv' or 'latent', got {self.kind!r}")
        if self.kind == "latent":
            if self.num_kv_heads != 1 or self.head_dim % 2:
                raise InvalidInput(
                    "kind 'latent': expected num_kv_heads 1 and an even head_dim (the latent "
                    f"width), got num_kv_heads {self.num_kv_heads}, head_dim {self.head_dim}"
                )
            if self.storage != "exact":
                raise InvalidInput("kind 'latent': storage 'fp8' is for K/V layouts")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block as stored: `L * 2 * B * H * D * itemsize`; with fp8
        storage `L * 2 * (B * H * D + 4 * H)`; a latent's `L * B * W * itemsize`."""
        if self.storage == "fp8":
            n, h = self.block_size * self.head_dim, self.num_kv_heads
            return self.num_layers * 2 * (n * h + 4 * h)
        if self.latent:  # the latent once: `L * B * W * itemsize`
            return self.num_layers * self.block_size * self.head_dim * self.itemsize
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.itemsize
        )

    @property
    def latent(self) -> bool:
        return self.kind == "latent"

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the KV of `tokens` tokens: `[L, 2, tokens, H, D]`; a latent's
        `[L, tokens, W]`."""
        if self.latent:
            return (self.num_layers, tokens, self.head_dim)
        return (self.num_layers, 2, tokens, self.num_kv_heads, self.head_dim)

    def runs_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the buffers the engine reads and writes: `[L, 2, tokens, H, D]`;
        a latent's two halves as K and V, `[L, 2, tokens, 1, W / 2]`."""
        if self.latent:
            return (self.num_layers, 2, tokens, 1, self.head_dim // 2)
        return (self.num_layers, 2, tokens, self.num_kv_heads, self.head_dim)
