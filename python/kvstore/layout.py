"""The KV layout a store is bound to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput

DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
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
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidInput(f"{field}: expected a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, `L * 2 * B * H * D * itemsize`."""
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.itemsize
        )

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of `tokens` tokens: `[L, 2, tokens, H, D]`."""
        return (self.num_layers, 2, tokens, self.num_kv_heads, self.head_dim)
