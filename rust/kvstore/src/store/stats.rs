//! What a handle counts (hits, misses, bytes) and what `stats` and
//! `kvstore stats` report; the store-wide hit/miss totals in the index.

use super::Inner;
use crate::arena::ArenaStats;
use crate::clock::now_ms;
use crate::error::Result;
use crate::format;
use crate::index::SegmentState;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Meta-name prefix of the clients' named counters (`Store::add_counters`).
const COUNTER_PREFIX: &str = "counter.";
/// Longest name of a named counter.
const COUNTER_NAME_MAX: usize = 64;
/// Distinct named counters a handle holds unsaved (bounded memory).
const COUNTERS_MAX: usize = 256;

#[derive(Default)]
pub(super) struct Counters {
    pub(super) hit_blocks: AtomicU64,
    pub(super) miss_blocks: AtomicU64,
    /// Hits and misses already added to the store-wide totals in `meta`.
    pub(super) saved_hits: AtomicU64,
    pub(super) saved_misses: AtomicU64,
    pub(super) blocks_written: AtomicU64,
    pub(super) blocks_deduped: AtomicU64,
    pub(super) bytes_written: AtomicU64,
    pub(super) bytes_read: AtomicU64,
    pub(super) damaged_found: AtomicU64,
    pub(super) read_errors: AtomicU64,
    pub(super) hot_hit_blocks: AtomicU64,
    pub(super) disk_hit_blocks: AtomicU64,
    /// Clients' named counters (`Store::add_counters`) not yet added to the
    /// store-wide totals.
    pub(super) named: Mutex<BTreeMap<String, u64>>,
}

/// Figures of `Store::stats`.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Blocks in the index (every tenant's).
    pub blocks: u64,
    /// Sessions of this handle's tenant.
    pub sessions: u64,
    /// Segment files in the index.
    pub segments: u64,
    /// Of those, segments of format version 1 (records not aligned for
    /// direct reads; `compact` rewrites them as version 2).
    pub segments_v1: u64,
    /// Bytes of segment files on disk.
    pub disk_bytes: u64,
    /// Record bytes of the blocks in the index.
    pub live_bytes: u64,
    /// Committed bytes no block points at (freed by compaction).
    pub dead_bytes: u64,
    /// Raw (decoded) bytes of the live blocks; `/ live_bytes` is the compression ratio.
    pub raw_live_bytes: u64,
    /// Records found damaged and not yet stored again.
    pub damaged_blocks: u64,
    /// Blocks this handle wrote that are not yet committed.
    pub pending_blocks: u64,
    /// Reads of records by this handle that failed with an I/O error (out
    /// of file descriptors or memory, EIO): misses that left the block
    /// where it is, unlike damage.
    pub read_errors: u64,
    /// Blocks this handle found (lookup, get).
    pub hit_blocks: u64,
    /// Blocks this handle asked for and did not find.
    pub miss_blocks: u64,
    /// Hits and misses of every handle since the store was created, as of each
    /// handle's last flush or close.
    pub total_hit_blocks: u64,
    /// See `total_hit_blocks`.
    pub total_miss_blocks: u64,
    /// Blocks this handle wrote.
    pub blocks_written: u64,
    /// Blocks this handle was asked to put that were stored already.
    pub blocks_deduped: u64,
    /// Record bytes this handle wrote.
    pub bytes_written: u64,
    /// Record bytes this handle read from segments.
    pub bytes_read: u64,
    /// Raw bytes of one block in this layout.
    pub block_bytes: u64,
    /// Blocks this handle served from the hot tier, and from the segments.
    /// A get split among reader threads may also count a few blocks another
    /// thread read past the miss that ended its prefix (`hit_blocks` does not).
    pub hot_hit_blocks: u64,
    /// See `hot_hit_blocks`.
    pub disk_hit_blocks: u64,
    /// The hot tier, if this handle has one.
    pub arena: Option<ArenaStats>,
    /// The remote tier, if this handle has one.
    pub remote: Option<crate::remote::RemoteStats>,
    /// Clients' named counters (`Store::add_counters`): every handle's
    /// additions since the store was created, as of each handle's last flush
    /// or close, plus this handle's since.
    pub counters: BTreeMap<String, u64>,
}

/// One segment, as `kvstore stats` lists it.
#[derive(Clone, Debug)]
pub struct SegmentReport {
    /// Segment number.
    pub segment: u64,
    /// Whether no writer appends to it any more.
    pub sealed: bool,
    /// Length of the file, if it exists.
    pub file_bytes: Option<u64>,
    /// Bytes covered by committed index entries (header included).
    pub committed_bytes: u64,
    /// Record bytes of live blocks in it.
    pub live_bytes: u64,
    /// Live blocks in it.
    pub live_records: u64,
    /// Committed bytes no block points at.
    pub dead_bytes: u64,
}

impl Inner {
    pub(super) fn stats(&self) -> Result<Stats> {
        // This handle's commits happen under the writer lock: holding it while
        // the snapshot is taken makes `blocks` and `pending_blocks` agree.
        let (txn, pending) = {
            let w = self.writer.lock().expect("writer lock");
            (self.index.read()?, w.pending.len() as u64)
        };
        let segs = self.index.all_segments(&txn)?;
        let blocks = self.index.block_count(&txn)?;
        let live_bytes: u64 = segs.iter().map(|(_, i)| i.live_bytes).sum();
        let committed: u64 = segs.iter().map(|(_, i)| i.committed_len).sum();
        let disk_bytes: u64 = segs
            .iter()
            .filter_map(|(s, _)| std::fs::symlink_metadata(self.dir.segment_path(*s)).ok())
            .map(|m| m.len())
            .sum();
        let headers = segs.len() as u64 * format::SEGMENT_HEADER_LEN as u64;
        let c = &self.counters;
        let mut counters: BTreeMap<String, u64> = self
            .index
            .meta_u64_prefixed(&txn, COUNTER_PREFIX)?
            .into_iter()
            .collect();
        for (name, n) in c.named.lock().expect("counters lock").iter() {
            let v = counters.entry(name.clone()).or_default();
            *v = v.saturating_add(*n);
        }
        Ok(Stats {
            blocks,
            sessions: self.index.sessions(&txn, &self.tag)?.len() as u64,
            segments: segs.len() as u64,
            segments_v1: segs
                .iter()
                .filter(|(s, _)| self.reader(*s).is_ok_and(|f| f.version == Some(1)))
                .count() as u64,
            disk_bytes,
            live_bytes,
            dead_bytes: committed.saturating_sub(live_bytes + headers),
            raw_live_bytes: blocks * self.layout.block_bytes() as u64,
            damaged_blocks: self.index.all_damaged(&txn)?.len() as u64,
            pending_blocks: pending,
            read_errors: c.read_errors.load(Ordering::Relaxed),
            hit_blocks: c.hit_blocks.load(Ordering::Relaxed),
            miss_blocks: c.miss_blocks.load(Ordering::Relaxed),
            total_hit_blocks: self.index.meta_u64(&txn, "hit_blocks")?,
            total_miss_blocks: self.index.meta_u64(&txn, "miss_blocks")?,
            blocks_written: c.blocks_written.load(Ordering::Relaxed),
            blocks_deduped: c.blocks_deduped.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            block_bytes: self.layout.block_bytes() as u64,
            hot_hit_blocks: c.hot_hit_blocks.load(Ordering::Relaxed),
            disk_hit_blocks: c.disk_hit_blocks.load(Ordering::Relaxed),
            arena: match &self.arena {
                Some(a) => Some(a.stats(now_ms())),
                // Without a hot tier: the store's arena as its file says,
                // wherever a process opening it with one would look.
                None => crate::arenas::peek_arena(
                    &crate::arenas::arena_dirs(self.opts.hot_dir.as_deref()),
                    &self.manifest.store_id,
                    now_ms(),
                ),
            },
            remote: self.remote.as_ref().map(crate::remote::Remote::stats),
            counters,
        })
    }

    pub(super) fn segment_reports(&self) -> Result<Vec<SegmentReport>> {
        let txn = self.index.read()?;
        Ok(self
            .index
            .all_segments(&txn)?
            .into_iter()
            .map(|(s, i)| SegmentReport {
                segment: s,
                sealed: i.state == SegmentState::Sealed,
                file_bytes: std::fs::symlink_metadata(self.dir.segment_path(s))
                    .ok()
                    .map(|m| m.len()),
                committed_bytes: i.committed_len,
                live_bytes: i.live_bytes,
                live_records: i.live_records,
                dead_bytes: i
                    .committed_len
                    .saturating_sub(i.live_bytes + format::SEGMENT_HEADER_LEN as u64),
            })
            .collect())
    }

    /// Saves last-use times and hit counters, if it can: they only inform
    /// eviction and statistics, so a full device or index map must not fail
    /// a read, a flush or a close over them.
    pub(super) fn save_advisory(&self) {
        let _ = self.save_touches();
        let _ = self.save_counters();
    }

    /// Adds this handle's hits and misses since the last call to the store-wide
    /// totals (one small index write, at flush and close only).
    pub(super) fn save_counters(&self) -> Result<()> {
        let c = &self.counters;
        let hits = c.hit_blocks.load(Ordering::Relaxed);
        let misses = c.miss_blocks.load(Ordering::Relaxed);
        let (dh, dm) = (
            hits - c.saved_hits.swap(hits, Ordering::Relaxed),
            misses - c.saved_misses.swap(misses, Ordering::Relaxed),
        );
        let named = std::mem::take(&mut *c.named.lock().expect("counters lock"));
        if dh == 0 && dm == 0 && named.is_empty() {
            return Ok(());
        }
        let mut txn = self.index.write()?;
        for (name, d) in [("hit_blocks", dh), ("miss_blocks", dm)] {
            let v = self.index.meta_u64(&txn, name)?;
            self.index.set_meta_u64(&mut txn, name, v + d)?;
        }
        for (name, d) in &named {
            let key = format!("{COUNTER_PREFIX}{name}");
            let v = self.index.meta_u64(&txn, &key)?;
            self.index
                .set_meta_u64(&mut txn, &key, v.saturating_add(*d))?;
        }
        self.index.commit(txn, false)
    }

    /// Adds to clients' named counters (a connector's hit tokens, bytes
    /// moved, errors): kept by the handle, added to the store-wide totals
    /// with the hit and miss counts, shown by `stats`. A name is 1 to 64
    /// characters of `a-z 0-9 _ . -`; a handle holds at most 256 names
    /// unsaved (then it saves them first).
    pub(super) fn add_counters(&self, counts: &[(&str, u64)]) -> Result<()> {
        for (name, _) in counts {
            let ok = (1..=COUNTER_NAME_MAX).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b));
            if !ok {
                return Err(crate::error::Error::InvalidInput(format!(
                    "counter name: expected 1 to {COUNTER_NAME_MAX} characters of a-z 0-9 _ . -, \
                     got {name:?}"
                )));
            }
        }
        let full = {
            let mut named = self.counters.named.lock().expect("counters lock");
            for (name, n) in counts {
                let v = named.entry((*name).to_owned()).or_default();
                *v = v.saturating_add(*n);
            }
            named.len() >= COUNTERS_MAX
        };
        if full {
            self.save_counters()?;
        }
        Ok(())
    }

    pub(super) fn count_hits(&self, hit: usize, asked: usize) {
        self.counters
            .hit_blocks
            .fetch_add(hit as u64, Ordering::Relaxed);
        self.counters
            .miss_blocks
            .fetch_add((asked - hit) as u64, Ordering::Relaxed);
    }
}
