"""What one tensor-parallel worker holds of a block, and what it stores. Imports no
vLLM (tested without it).

vLLM splits a K/V layer's heads over the tensor-parallel ranks: with TP size `t`
and `H` KV heads, rank `r` holds heads `[r*H/t, (r+1)*H/t)` where `t <= H`, and
head `r // (t/H)` (replicated on `t/H` ranks) where `t > H`. An MLA layer's latent
is whole on every rank. Blocks keep the model's canonical head order whatever the
TP size: a K/V rank at TP > 1 stores its heads one record per (block, head) in the
heads store (`kvstore.heads`), one rank per head writing; a TP=1 worker stores
whole blocks; a latent, and the one head of an MQA model, is stored whole, by
rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInput
from ..layout import Layout


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the model's heads it holds, in order, and whether it
    stores them (`writes`) one per record in the heads store (`per_head`)."""

    rank: int
    size: int
    heads: range
    writes: bool
    per_head: bool

    @property
    def local_heads(self) -> int:
        return len(self.heads)


def shard(layout: Layout, rank: int, size: int) -> Shard:
    """The shard of rank `rank` of a tensor-parallel group of `size` over blocks of
    `layout` (the whole model's)."""
    if not 0 <= rank < size:
        raise InvalidInput(f"tensor-parallel rank: expected 0 <= rank < {size}, got {rank}")
    if layout.latent:
        return Shard(rank, size, range(1), writes=rank == 0, per_head=False)
    h = layout.num_kv_heads
    if size == 1:
        return Shard(rank, size, range(h), writes=True, per_head=False)
    if size <= h:
        if h % size:
            raise InvalidInput(f"tensor parallelism: {h} KV heads do not split over {size} ranks")
        per = h // size
        return Shard(rank, size, range(rank * per, (rank + 1) * per), True, per_head=True)
    if size % h:
        raise InvalidInput(f"tensor parallelism: {size} ranks do not replicate {h} KV heads")
    replicas = size // h
    head = rank // replicas
    # One KV head (MQA): every rank holds the whole block; the first stores it whole.
    return Shard(rank, size, range(head, head + 1), rank % replicas == 0, per_head=h > 1)
