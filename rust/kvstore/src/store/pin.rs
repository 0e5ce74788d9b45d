//! Pins: blocks kept warm in the hot tier ahead of others and kept by `gc`,
//! by priority and until an expiry.

use super::read::Cold;
use super::Inner;
use crate::arena::{Arena, Inserted};
use crate::clock::now_ms;
use crate::error::{Error, Result};
use crate::id::BlockId;
use crate::index::Location;
use std::time::Duration;

impl Inner {
    pub(super) fn pin(
        &self,
        tokens: &[u32],
        extra: &[u8],
        priority: u64,
        ttl: Option<Duration>,
    ) -> Result<usize> {
        if priority == 0 {
            return Err(Error::InvalidInput(
                "priority: expected a positive integer (0 means unpinned), got 0".into(),
            ));
        }
        let b = self.layout.block_size as usize;
        let expires = match ttl {
            Some(t) => now_ms()
                .saturating_add(t.as_millis().try_into().unwrap_or(u64::MAX))
                .max(1),
            None => 0,
        };
        let ids = self.keyer.chain(tokens, b, extra);
        let mut snap = Some(self.snapshot()?);
        let mut locs = Vec::new();
        for id in &ids {
            match self.find(&mut snap, id)? {
                Some(loc) => locs.push(loc),
                None => break,
            }
        }
        drop(snap);
        // Into the hot tier first; only what made it there is pinned in the
        // index (what keeps blocks out of gc): a refused pin pins nothing.
        let (pinned, refused) = match &self.arena {
            Some(arena) => self.pin_hot(arena, tokens, &ids, &locs, priority, expires)?,
            None => (locs.len(), None),
        };
        // Only blocks this transaction still finds indexed (or this handle
        // has pending): one evicted since it was found ends the pinned prefix
        // (eviction checks the pins in its own transactions, so a pin
        // committed first keeps its block). The writer lock first, then the
        // index's, in the order a commit takes them.
        let w = self.writer.lock().expect("writer lock");
        let mut txn = self.index.write()?;
        let mut kept = 0;
        for id in &ids[..pinned] {
            if self.index.get_block_rw(&txn, id)?.is_none() && !w.pending_ids.contains_key(id) {
                break;
            }
            self.index.put_pin(&mut txn, id, priority, expires)?;
            kept += 1;
        }
        self.index.commit(txn, self.durable())?;
        drop(w);
        if let Some(arena) = &self.arena {
            // Evicted from the segments since the hot tier pinned them: not
            // kept there ahead of other blocks either.
            for id in &ids[kept..pinned] {
                arena.unpin(id)?;
            }
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(kept * b),
        }
    }

    /// Pins the blocks at `locs` in the hot tier, loading those not there.
    /// Returns how many of them are pinned (a prefix) and, if the hot tier
    /// refused one, the error to report: `StoreFull`, or `StoreLocked` where
    /// its writers' lock stayed held (`arena::WRITE_WAIT`).
    pub(super) fn pin_hot(
        &self,
        arena: &Arena,
        tokens: &[u32],
        ids: &[BlockId],
        locs: &[Location],
        priority: u64,
        expires: u64,
    ) -> Result<(usize, Option<Error>)> {
        let b = self.layout.block_size as usize;
        let mut buf = vec![0u8; self.layout.block_bytes()];
        let mut scratch = Vec::new();
        for (i, (id, loc)) in ids.iter().zip(locs).enumerate() {
            match arena.pin(id, priority, expires) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e @ Error::StoreLocked(_)) => return Ok((i, Some(e))),
                Err(e) => return Err(e),
            }
            let block_tokens = &tokens[i * b..(i + 1) * b];
            let mut chunks: Vec<&mut [u8]> = buf.chunks_mut(self.layout.chunk_bytes()).collect();
            if self
                .read_record(
                    loc,
                    id,
                    Some(block_tokens),
                    &mut chunks,
                    &mut scratch,
                    Cold::plain(self.direct(true)),
                )
                .is_err()
            {
                return Ok((i, None)); // damaged or compacted away: the pinned prefix ends here
            }
            let chunks: Vec<&[u8]> = buf.chunks(self.layout.chunk_bytes()).collect();
            match arena.insert(id, block_tokens, &chunks, priority, expires, now_ms())? {
                Inserted::Stored | Inserted::Present => {}
                Inserted::Full => {
                    return Ok((
                        i,
                        Some(Error::StoreFull(format!(
                            "the hot tier has no room for block {i} of this sequence: its slots \
                             hold blocks pinned at priority {priority} or higher"
                        ))),
                    ));
                }
                Inserted::Busy => return Ok((i, Some(arena.writers_locked_error()))),
            }
        }
        Ok((locs.len(), None))
    }

    pub(super) fn unpin(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let ids = self
            .keyer
            .chain(tokens, self.layout.block_size as usize, extra);
        // The hot tier first: an unpin that fails there (StoreLocked) leaves
        // its blocks pinned in the index too, so gc keeps them until a retry.
        if let Some(arena) = &self.arena {
            for id in &ids {
                arena.unpin(id)?;
            }
        }
        let mut txn = self.index.write()?;
        for id in &ids {
            self.index.delete_pin(&mut txn, id)?;
        }
        self.index.commit(txn, self.durable())?;
        Ok(ids.len() * self.layout.block_size as usize)
    }
}
