//! Compaction: rewrites the live records of sealed segments that hold dead
//! bytes into a new segment, repoints their entries, and deletes the old
//! files once nothing points into them.

use super::read::{Cold, ReadFail};
use super::writer::Writer;
use super::{Inner, Progress};
use crate::error::{Error, IoContext, Result};
use crate::format;
use crate::fs;
use crate::id::BlockId;
use crate::index::{Location, SegmentState};
use crate::record;
use std::collections::HashMap;

#[derive(Clone, Debug, Default)]
/// What `compact` (or the compaction of `gc`) did.
pub struct CompactReport {
    /// Segments whose live records were rewritten and whose files were deleted.
    pub segments_rewritten: u64,
    /// Live records copied to a new segment.
    pub records_moved: u64,
    /// Records dropped as damaged (listed by `verify` from then on).
    pub records_dropped: u64,
    /// Committed segment bytes before.
    pub bytes_before: u64,
    /// Committed segment bytes after.
    pub bytes_after: u64,
}

/// A damaged record compaction drops, with why.
type Dropped = (BlockId, Location, String);

/// The compaction output and the buffers its copies reuse.
struct Copier {
    out: Writer,
    buf: Vec<u8>,
    scratch: Vec<u8>,
    done: u64,
    total: u64,
}

impl Inner {
    /// Rewrites the live records of sealed segments that hold dead bytes, or
    /// are of format version 1, into new (version-2) segments, then deletes
    /// the old files. Deleting is safe while others
    /// read: a reader that has a segment open keeps reading it (POSIX unlink),
    /// and one that has not finds it gone and looks the block up again.
    pub(super) fn compact(&self, progress: Progress<'_>, all: bool) -> Result<CompactReport> {
        let _lock = self.dir.compaction_lock()?;
        {
            let mut w = self.writer.lock().expect("writer lock");
            self.commit_pending(&mut w)?;
        }
        self.compact_locked(progress, all, true)
    }

    /// Compaction proper: the caller holds the compaction lock and has
    /// committed its own pending blocks. Victims are rewritten one at a time,
    /// each deleted as soon as nothing points into it, so the disk holds at
    /// most one victim's live bytes twice. `upgrade` rewrites version-1
    /// segments too (`kvstore compact`; the compaction of gc and of a put
    /// making room leaves them, their records read as they are).
    pub(super) fn compact_locked(
        &self,
        progress: Progress<'_>,
        all: bool,
        upgrade: bool,
    ) -> Result<CompactReport> {
        let mut report = CompactReport::default();
        let (blocks, segments) = {
            let txn = self.index.read()?;
            (self.index.all_blocks(&txn)?, self.index.all_segments(&txn)?)
        };
        let victims: Vec<u64> = segments
            .iter()
            .filter(|(_, i)| i.state == SegmentState::Sealed)
            .filter(|(s, i)| {
                all || i.committed_len > i.live_bytes + format::SEGMENT_HEADER_LEN as u64
                    || (upgrade && i.live_records > 0 && self.segment_version(*s) == Some(1))
            })
            .map(|(s, _)| *s)
            .collect();
        report.bytes_before = segments.iter().map(|(_, i)| i.committed_len).sum();
        let mut by_segment: HashMap<u64, Vec<(BlockId, Location)>> =
            victims.iter().map(|s| (*s, Vec::new())).collect();
        for (id, loc) in blocks {
            if let Some(v) = by_segment.get_mut(&loc.segment) {
                v.push((id, loc));
            }
        }
        let total: u64 = by_segment.values().map(|v| v.len() as u64).sum();
        let mut copier = Copier {
            out: Writer::new(),
            buf: vec![0u8; self.layout.block_bytes()],
            scratch: Vec::new(),
            done: 0,
            total,
        };
        let rewritten = victims.iter().try_for_each(|seg| -> Result<()> {
            let entries = &by_segment[seg];
            let (dropped, kept) = self.rewrite(&mut copier, entries, progress)?;
            report.records_moved += (entries.len() - dropped.len() - kept) as u64;
            report.records_dropped += dropped.len() as u64;
            if self.retire(*seg, &dropped)? {
                report.segments_rewritten += 1;
            }
            Ok(())
        });
        // Sealed whether or not every victim was rewritten: what was moved
        // is published, the rest stays where it was.
        self.seal_active(&mut copier.out)?;
        rewritten?;
        self.remove_orphans()?;
        fs::sync_dir(&self.dir.segments_dir()).ctx(|| "fsync segments directory".to_string())?;
        let txn = self.index.read()?;
        report.bytes_after = self
            .index
            .all_segments(&txn)?
            .iter()
            .map(|(_, i)| i.committed_len)
            .sum();
        Ok(report)
    }

    /// Copies the sound records among `entries` (one victim's) into the
    /// compaction output and repoints them; returns the damaged ones, and
    /// how many it left where they were (their reads failed).
    fn rewrite(
        &self,
        copier: &mut Copier,
        entries: &[(BlockId, Location)],
        progress: Progress<'_>,
    ) -> Result<(Vec<Dropped>, usize)> {
        let mut moved: Vec<(BlockId, Location, Location)> = Vec::new();
        let mut dropped = Vec::new();
        let mut kept = 0;
        for (id, loc) in entries {
            let mut chunks: Vec<&mut [u8]> =
                copier.buf.chunks_mut(self.layout.chunk_bytes()).collect();
            match self.read_record(
                loc,
                id,
                None,
                &mut chunks,
                &mut copier.scratch,
                Cold::plain(self.direct(false)),
            ) {
                Ok(()) => {
                    let tokens = self.record_tokens_at(loc)?;
                    let chunks: Vec<&[u8]> = copier.buf.chunks(self.layout.chunk_bytes()).collect();
                    let rec = record::encode(&self.layout, self.opts.codec, id, &tokens, &chunks)?;
                    let new = self.append(&mut copier.out, &rec)?;
                    copier.out.pending_bytes += new.record_len;
                    moved.push((*id, *loc, new));
                }
                Err(ReadFail::Unreadable(_)) => {
                    // Not damage: the record stays where it is, and so does
                    // its segment (still live); the other victims go on.
                    kept += 1;
                }
                Err(fail) => dropped.push((
                    *id,
                    *loc,
                    fail.damage().expect("compaction passes no tokens"),
                )),
            }
            // Bounded transactions, as in `evict`.
            if copier.out.pending_bytes >= 64 << 20 || moved.len() >= 1024 {
                self.publish_moves(&mut copier.out, &mut moved)?;
            }
            copier.done += 1;
            progress(copier.done, copier.total);
        }
        self.publish_moves(&mut copier.out, &mut moved)?;
        Ok((dropped, kept))
    }

    /// Quarantines a victim's damaged records, then deletes the victim if
    /// nothing points into it any more. Returns whether it was deleted.
    fn retire(&self, seg: u64, dropped: &[Dropped]) -> Result<bool> {
        let mut txn = self.index.write()?;
        for (id, loc, reason) in dropped {
            self.index.quarantine_if_at(&mut txn, id, loc, reason)?;
        }
        // Every entry of our snapshot moved or went, and dedupe never adds
        // entries into a sealed segment: the live count says so without a scan.
        let retire = self
            .index
            .get_segment(&txn, seg)?
            .is_some_and(|i| i.live_records == 0);
        if retire {
            self.index.delete_segment(&mut txn, seg)?;
            self.index.clear_damaged_in(&mut txn, seg)?;
            // Readers must drop their open files of the retired segment.
            self.index.bump_generation(&mut txn)?;
        }
        self.index.commit(txn, self.durable())?;
        if retire {
            let path = self.dir.segment_path(seg);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::Io {
                        context: format!("removing {}", path.display()),
                        source: e,
                    })
                }
            }
        }
        Ok(retire)
    }

    /// The version segment `seg`'s header names (`None`: unreadable).
    fn segment_version(&self, seg: u64) -> Option<u32> {
        self.reader(seg).ok()?.version
    }

    pub(super) fn record_tokens_at(&self, loc: &Location) -> Result<Vec<u32>> {
        let meta = self.record_meta(loc).map_err(|fail| Error::Io {
            context: format!(
                "reading the record at {} in segment {}",
                loc.offset, loc.segment
            ),
            source: std::io::Error::other(fail.damage().unwrap_or_default()),
        })?;
        Ok(record::tokens(&meta).collect())
    }

    /// Syncs the compaction output and repoints each moved block whose entry
    /// still points at the old copy; a block evicted or rewritten meanwhile
    /// leaves its new copy dead.
    pub(super) fn publish_moves(
        &self,
        out: &mut Writer,
        moved: &mut Vec<(BlockId, Location, Location)>,
    ) -> Result<()> {
        if moved.is_empty() {
            return Ok(());
        }
        let active = out.active.as_ref().expect("compaction segment");
        if self.durable() {
            fs::sync_data(&active.file).ctx(|| format!("fdatasync segment {}", active.segment))?;
        }
        // Each move stands alone (its record is synced), so they may commit
        // in several transactions.
        self.in_batches(moved, |txn, batch| {
            for (id, old, new) in batch {
                self.index.move_block_if_at(txn, id, old, new)?;
            }
            self.index
                .set_committed_len(txn, active.segment, active.len)?;
            Ok((0, 0))
        })?;
        moved.clear();
        out.pending_bytes = 0;
        Ok(())
    }
}
