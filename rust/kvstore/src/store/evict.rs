//! Eviction: dropping the index entries of the least recently used unpinned
//! blocks (`gc`, and `put` under a `disk_bytes` bound); their records
//! become dead bytes that compaction then frees.

use super::compact::CompactReport;
use super::{Inner, Progress};
use crate::clock::{now_ms, now_us};
use crate::error::{Error, Result};
use crate::id::BlockId;
use std::collections::HashSet;
use std::time::Duration;

#[derive(Clone, Debug, Default)]
/// What `gc` did.
pub struct GcReport {
    /// Blocks whose index entries were dropped.
    pub blocks_evicted: u64,
    /// Record bytes those blocks held.
    pub bytes_evicted: u64,
    /// The compaction that followed, freeing those bytes on disk.
    pub compact: CompactReport,
}

impl Inner {
    pub(super) fn gc(
        &self,
        max_bytes: Option<u64>,
        older_than: Option<Duration>,
        progress: Progress<'_>,
    ) -> Result<GcReport> {
        let _lock = self.dir.compaction_lock()?;
        // A full index is what gc is for: if what is pending cannot be
        // committed for that, evict first (freeing the pages the commit
        // needs), then commit.
        let full = match self.commit_pending(&mut self.writer.lock().expect("writer lock")) {
            Ok(()) => false,
            Err(Error::StoreFull(_)) => true,
            Err(e) => return Err(e),
        };
        let (blocks_evicted, bytes_evicted) =
            self.evict(max_bytes, older_than, &HashSet::default())?;
        if full {
            self.commit_pending(&mut self.writer.lock().expect("writer lock"))?;
        }
        Ok(GcReport {
            blocks_evicted,
            bytes_evicted,
            compact: self.compact_locked(progress, false, false)?,
        })
    }

    /// Drops the index entries of unpinned blocks, oldest first: those created
    /// more than `older_than` ago, then more until the live bytes fit
    /// `max_live`. Their records become dead bytes for compaction. Returns
    /// (blocks, bytes) evicted.
    pub(super) fn evict(
        &self,
        max_live: Option<u64>,
        older_than: Option<Duration>,
        keep: &HashSet<BlockId>,
    ) -> Result<(u64, u64)> {
        // Best effort: fresher last-use times make a better choice.
        let _ = self.save_touches();
        let (mut blocks, pinned) = {
            let txn = self.index.read()?;
            (
                self.index.all_blocks(&txn)?,
                self.index.live_pins(&txn, now_ms())?,
            )
        };
        let mut live: u64 = blocks.iter().map(|(_, l)| l.record_len).sum();
        blocks.retain(|(id, _)| !pinned.contains(id) && !keep.contains(id));
        blocks.sort_by_key(|(_, l)| l.used_us);
        let cutoff = older_than.map(|d| now_us().saturating_sub(d.as_micros() as u64));
        let mut evict = Vec::new();
        for (id, loc) in &blocks {
            let too_old = cutoff.is_some_and(|c| loc.used_us < c);
            let too_big = max_live.is_some_and(|m| live > m);
            if !(too_old || too_big) {
                break;
            }
            live -= loc.record_len;
            evict.push((*id, *loc));
        }
        self.in_batches(&evict, |txn, batch| {
            let (mut n, mut bytes) = (0, 0);
            let now = now_ms();
            for (id, loc) in batch {
                // Pinned since the pins were read: kept. `pin` pins only
                // what its own transaction still finds indexed, so the two
                // never cross.
                if self.index.is_pinned(txn, id, now)? {
                    continue;
                }
                if self.index.delete_block_if_at(txn, id, loc)? {
                    n += 1;
                    bytes += loc.record_len;
                }
            }
            Ok((n, bytes))
        })
    }

    /// Applies `apply` to `items` in index transactions of up to 4096 items,
    /// halving the batch whenever the index map is full: LMDB copies every
    /// page a transaction touches, so a big delete or move can need more free
    /// pages than a full map has, while small ones free pages the next reuses.
    /// Returns the sums of what `apply` returned for the committed batches.
    pub(super) fn in_batches<T>(
        &self,
        items: &[T],
        mut apply: impl FnMut(&mut heed::RwTxn<'_>, &[T]) -> Result<(u64, u64)>,
    ) -> Result<(u64, u64)> {
        let (mut sum, mut size, mut rest) = ((0, 0), 4096, items);
        while !rest.is_empty() {
            let batch = &rest[..size.min(rest.len())];
            let res = self.index.write().and_then(|mut txn| {
                let r = apply(&mut txn, batch)?;
                self.index.commit(txn, self.durable()).map(|()| r)
            });
            match res {
                Ok((a, b)) => {
                    sum = (sum.0 + a, sum.1 + b);
                    rest = &rest[batch.len()..];
                }
                Err(Error::StoreFull(_)) if batch.len() > 1 => size = batch.len() / 2,
                Err(e) => return Err(e),
            }
        }
        Ok(sum)
    }
}
