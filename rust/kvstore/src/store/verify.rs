//! `verify`: re-reads every indexed record and lists what is damaged;
//! with `repair`, damaged records are taken out of the index. It also
//! checks the index's closed marks (see "Prefix-closed chains" in
//! `index.rs`) and, on any mismatch, stops trusting them, repair or not:
//! a wrong mark could make `lookup` count past a hole.

use super::read::{Cold, ReadFail};
use super::{Inner, Progress};
use crate::error::Result;
use crate::format;
use crate::fs;
use crate::id::{self, BlockId};
use crate::index::Location;
use std::io::IoSliceMut;

/// Findings about the closed marks listed at most (one is enough to stop
/// trusting them).
const CHAIN_FINDINGS: usize = 10;

/// One damaged record found by `verify` (or by a read before it).
#[derive(Clone, Debug)]
pub struct Damage {
    /// The block id, hex.
    pub block_id: String,
    /// Segment of the damaged record.
    pub segment: u64,
    /// Offset of the damaged record in its segment.
    pub offset: u64,
    /// What is wrong with it.
    pub reason: String,
}

#[derive(Clone, Debug, Default)]
/// What `verify` (or `repair`) found.
pub struct VerifyReport {
    /// Records read and checked.
    pub records_checked: u64,
    /// Bytes of the records checked.
    pub bytes_checked: u64,
    /// Damaged records (found now, or on an earlier read).
    pub damaged: Vec<Damage>,
    /// Problems that are not one block: missing or short segment files, orphans.
    pub problems: Vec<String>,
}

impl Inner {
    /// Re-reads every indexed record and checks it; lists what is damaged.
    /// Read-only unless `repair`: then damaged records are quarantined.
    pub(super) fn verify(&self, progress: Progress<'_>, repair: bool) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let (blocks, segments, damaged, chains) = {
            let txn = self.index.read()?;
            (
                self.index.all_blocks(&txn)?,
                self.index.all_segments(&txn)?,
                self.index.all_damaged(&txn)?,
                self.index.check_chains(&txn, CHAIN_FINDINGS)?,
            )
        };
        if !chains.is_empty() {
            let mut txn = self.index.write()?;
            self.index.distrust_chains(&mut txn)?;
            self.index.commit(txn, self.durable())?;
            report.problems.extend(chains);
            report.problems.push(
                "the index's closed marks are inconsistent: lookups no longer rely on them \
                 (the next open of the store empties them; puts mark chains again)"
                    .into(),
            );
        }
        for (id, loc, reason) in damaged {
            report.damaged.push(Damage {
                block_id: id::hex(&id),
                segment: loc.segment,
                offset: loc.offset,
                reason: format!("{reason} (found on an earlier read)"),
            });
        }
        for (seg, info) in &segments {
            let path = self.dir.segment_path(*seg);
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_symlink() => report
                    .problems
                    .push(format!("segment {seg:016x} is a symlink; not followed")),
                Ok(m) if m.len() < info.committed_len => report.problems.push(format!(
                    "segment {seg:016x} is {} bytes, shorter than its committed {} bytes",
                    m.len(),
                    info.committed_len
                )),
                Ok(_) => {
                    let header = fs::open_existing(&path, false).and_then(|f| {
                        let mut h = [0u8; format::SEGMENT_HEADER_LEN];
                        fs::read_exact_at(&f, &mut [IoSliceMut::new(&mut h)], 0).map(|()| h)
                    });
                    match header.map(|h| format::decode_segment_header(&h)) {
                        Ok(Ok((n, _))) if n == *seg => {}
                        Ok(Ok((n, _))) => report
                            .problems
                            .push(format!("segment {seg:016x} says it is segment {n:016x}")),
                        Ok(Err(r)) => report.problems.push(format!("segment {seg:016x}: {r}")),
                        Err(e) => report.problems.push(format!("segment {seg:016x}: {e}")),
                    }
                }
                Err(_) if info.live_records > 0 => report
                    .problems
                    .push(format!("segment {seg:016x} is missing")),
                Err(_) => {}
            }
        }
        // Files not in the index are left alone here: one may be a live
        // writer's new segment about to be registered. Recovery and
        // compaction remove the orphans.
        self.check_records(&blocks, progress, repair, &mut report)?;
        Ok(report)
    }

    /// Re-reads each of `blocks` whole and checks it: damage is listed (and
    /// quarantined with `repair`), a read that failed is a problem.
    fn check_records(
        &self,
        blocks: &[(BlockId, Location)],
        progress: Progress<'_>,
        repair: bool,
        report: &mut VerifyReport,
    ) -> Result<()> {
        let total = blocks.len() as u64;
        let mut buf = vec![0u8; self.layout.block_bytes()];
        let mut scratch = Vec::new();
        for (n, (id, loc)) in blocks.iter().enumerate() {
            let mut chunks: Vec<&mut [u8]> = buf.chunks_mut(self.layout.chunk_bytes()).collect();
            match self.read_record(
                loc,
                id,
                None,
                &mut chunks,
                &mut scratch,
                Cold::plain(self.direct(false)),
            ) {
                Ok(()) => {}
                Err(ReadFail::Unreadable(reason)) => {
                    // Said, and left in the index even with `repair`: an I/O
                    // error shows nothing wrong with the record's bytes.
                    report.problems.push(format!(
                        "block {} (segment {:016x}, offset {}) could not be read, not \
                         repaired: {reason}",
                        id::hex(id),
                        loc.segment,
                        loc.offset
                    ));
                }
                Err(fail) => {
                    let reason = fail.damage().expect("verify passes no tokens");
                    if repair {
                        self.quarantine(id, loc, &reason)?;
                        self.known.forget(id);
                    }
                    report.damaged.push(Damage {
                        block_id: id::hex(id),
                        segment: loc.segment,
                        offset: loc.offset,
                        reason,
                    });
                }
            }
            report.records_checked += 1;
            report.bytes_checked += loc.record_len;
            progress(n as u64 + 1, total);
        }
        Ok(())
    }
}
