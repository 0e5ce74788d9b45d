//! `lookup`: how many leading blocks of a chain are stored. A short chain
//! goes one block at a time through the read path's `find`. A long chain
//! first gallops over the index's closed marks (see "Prefix-closed chains"
//! in `index.rs`): a closed block's whole ancestry is indexed, so a few
//! probes find how far the chain is known stored, and only hashing is paid
//! for that part. From there (blocks stored without a mark: older stores, a
//! rebuilt index, the hot tier, a hole filled again) the chain is hashed a
//! chunk at a time and each chunk's ids are probed in key order
//! (neighbouring keys share B-tree pages and branch decisions: a third
//! cheaper than probing in chain order), their locations cached under one
//! lock. The walk stays exact: a chunk's results are read back in chain
//! order, and the first block found nowhere ends it; hashing stops there.
//!
//! Hashing on a helper thread while this one probes was tried: on an idle
//! second core it saved ~40%, but on a busy machine waiting for the helper
//! to be scheduled cost milliseconds, more than it saved.

use super::{Inner, Snap};
use crate::error::Result;
use crate::id::{BlockId, ROOT};
use crate::index::Location;

/// Chains of at least this many blocks are walked by chunks.
pub(super) const CHUNKED_MIN_BLOCKS: usize = 64;

/// Blocks hashed, then probed, per step: large enough to sort usefully,
/// small enough that a miss early in a long chain stops hashing soon. The
/// first step is smaller and each one doubles up to `CHUNK`: a new prompt,
/// stored nowhere, is told apart after hashing `FIRST_CHUNK` blocks.
const CHUNK: usize = 1024;
const FIRST_CHUNK: usize = 64;

impl Inner {
    /// Number of leading full blocks of `tokens` that are stored.
    pub(super) fn stored_blocks(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let b = self.layout.block_size as usize;
        let blocks = tokens.len() / b;
        // One snapshot per call, so the cache notices a newer generation.
        let snap = self.snapshot()?;
        let (mut ids, mut n) = if blocks >= CHUNKED_MIN_BLOCKS {
            self.walk_stored(&snap, tokens, extra)?
        } else {
            (Vec::with_capacity(blocks), 0)
        };
        // From the first block not found (or from the start): one block at
        // a time, with this handle's pending writes and a fresh snapshot on
        // a miss (`find`).
        let mut snap = Some(snap);
        while n < blocks {
            // Ahead of the probe by doubling steps: a miss (a new prompt,
            // most often at its first block) does not pay for hashing the
            // whole chain, and a hit hashes in a few calls, not one a block.
            self.hash_to(&mut ids, tokens, (2 * n).clamp(n + 1, blocks), extra);
            let id = &ids[n];
            if !self.holds(&mut snap, id)? {
                break;
            }
            n += 1;
        }
        drop(snap);
        if self.remote.is_none() {
            return Ok(n);
        }
        self.hash_to(&mut ids, tokens, blocks, extra);
        Ok(n + self.remote_extend(&ids, tokens, n, None))
    }

    /// Walks the chain of `tokens` while it is stored (hot tier, location
    /// cache, or the index as `snap` sees it). Returns the ids hashed, in
    /// chain order, and how many leading blocks are stored: the ids run at
    /// least one past that count unless every block is stored.
    pub(super) fn walk_stored(
        &self,
        snap: &Snap<'_>,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<(Vec<BlockId>, usize)> {
        let b = self.layout.block_size as usize;
        let blocks = tokens.len() / b;
        let mut ids = Vec::with_capacity(blocks);
        let mut n = self.closed_prefix(snap, tokens, extra, &mut ids)?;
        let mut scratch = Probe::default();
        let mut chunk = FIRST_CHUNK;
        while n < blocks {
            let end = (n + chunk).min(blocks);
            chunk = (2 * chunk).min(CHUNK);
            self.hash_to(&mut ids, tokens, end, extra);
            let run = self.stored_run(snap, &ids[n..end], &mut scratch)?;
            n += run;
            if n < end {
                break;
            }
        }
        Ok((ids, n))
    }

    /// How many leading blocks of the chain are closed in the index (see
    /// "Prefix-closed chains" in `index.rs`): every one of them is indexed.
    /// Closed blocks form a prefix of the chain, so a galloping search finds
    /// its end with about 2·log2(n) probes; the ids are hashed into `ids` as
    /// far as the probes needed (at most about twice the prefix).
    fn closed_prefix(
        &self,
        snap: &Snap<'_>,
        tokens: &[u32],
        extra: &[u8],
        ids: &mut Vec<BlockId>,
    ) -> Result<usize> {
        // With 16-bit ids (test builds) a probe matches blocks of other
        // chains, and the gallop skips the blocks between its probes: walk
        // block by block instead.
        if cfg!(feature = "test-short-ids") || !self.index.chains_trusted(&snap.txn)? {
            return Ok(0);
        }
        let b = self.layout.block_size as usize;
        let blocks = tokens.len() / b;
        let closed = |ids: &mut Vec<BlockId>, k: usize| -> Result<bool> {
            self.hash_to(ids, tokens, k + 1, extra);
            let parent = if k == 0 { &ROOT } else { &ids[k - 1] };
            self.index.is_closed(&snap.txn, &ids[k], parent)
        };
        // Gallop: blocks 1, 2, 4, ... (indices 0, 1, 3, 7, ...), then the last.
        let (mut lo, mut hi, mut step) = (0, blocks, 1);
        while lo < blocks {
            let k = step.min(blocks) - 1;
            if !closed(ids, k)? {
                hi = k;
                break;
            }
            lo = k + 1;
            step *= 2;
        }
        // Blocks before `lo` are closed, the one at `hi` (if any) is not.
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if closed(ids, mid)? {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }

    /// Extends `ids`, the chain of `tokens` hashed so far, to its first `end`
    /// blocks.
    fn hash_to(&self, ids: &mut Vec<BlockId>, tokens: &[u32], end: usize, extra: &[u8]) {
        if ids.len() < end {
            let b = self.layout.block_size as usize;
            let parent = ids.last().copied().unwrap_or(ROOT);
            let rest = &tokens[ids.len() * b..end * b];
            ids.extend(self.keyer.chain_from(&parent, rest, b, extra));
        }
    }

    /// How many leading ids of `chunk` are stored; probes the index in key
    /// order and remembers what it found in the location cache.
    fn stored_run(&self, snap: &Snap<'_>, chunk: &[BlockId], p: &mut Probe) -> Result<usize> {
        p.locs.clear();
        p.locs.resize(chunk.len(), None);
        self.known.get_many(chunk, &mut p.locs);
        p.order.clear();
        p.order.extend((0..chunk.len() as u32).filter(|&i| {
            p.locs[i as usize].is_none()
                && !self
                    .arena
                    .as_ref()
                    .is_some_and(|a| a.contains(&chunk[i as usize]))
        }));
        p.order.sort_unstable_by_key(|&i| {
            u64::from_be_bytes(chunk[i as usize][..8].try_into().expect("8 bytes"))
        });
        p.found.clear();
        let mut hit = vec![true; chunk.len()];
        for &i in &p.order {
            let id = &chunk[i as usize];
            match self.index.get_block(&snap.txn, id)? {
                Some(loc) => p.found.push((*id, loc)),
                None => hit[i as usize] = false,
            }
        }
        self.known.insert_many(snap.generation, &p.found);
        Ok(hit.iter().position(|h| !h).unwrap_or(chunk.len()))
    }
}

/// Scratch of `stored_run`, kept across chunks.
#[derive(Default)]
struct Probe {
    locs: Vec<Option<Location>>,
    order: Vec<u32>,
    found: Vec<(BlockId, Location)>,
}
