//! Rebuilding the index from the segment files (`kvstore rebuild-index`,
//! `kvstore verify --repair` on a store whose index cannot be opened).
//!
//! Segments are self-describing: every record carries its block id, token ids,
//! lengths and checksums, so the block table can be recovered by scanning them
//! ([`crate::scan`]). What lives only in the index is lost: sessions, pins,
//! last-use times (set to the segment's modification time) and hit counters.
//! The old index directory is kept beside the new one, renamed, never deleted.

use crate::dir::{segment_number, StoreDir};
use crate::error::{Error, IoContext, Result};
use crate::format;
use crate::fs;
use crate::index::{Index, Location, SegmentInfo, SegmentState};
use crate::scan::{self, DamagedRange};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// What a rebuild found and did.
#[derive(Clone, Debug, Default)]
pub struct RebuildReport {
    /// Segment files scanned into the new index.
    pub segments: u64,
    /// Valid records found, and how many of them became index entries (a
    /// block stored twice, by a dedupe race or a compaction, counts once).
    pub records: u64,
    /// Blocks in the new index.
    pub blocks: u64,
    /// Damaged ranges found (their blocks are misses; `verify` lists them).
    pub damaged: Vec<(u64, DamagedRange)>,
    /// Files in `segments/` that are not segments (left alone).
    pub skipped: Vec<String>,
    /// Where the previous index directory was moved, if there was one.
    pub old_index: Option<String>,
}

/// Lists the segment files (anything else goes to `report.skipped`) and
/// takes each one's lock: a writer still alive somewhere would append
/// records the new index never hears of. Returns them in segment order, and
/// the next segment number to hand out (past every file, opened or not).
fn lock_segments(sd: &StoreDir, report: &mut RebuildReport) -> Result<(Vec<(u64, File)>, u64)> {
    let seg_dir = sd.segments_dir();
    fs::ensure_dir(&seg_dir).ctx(|| format!("{}", seg_dir.display()))?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&seg_dir).ctx(|| format!("listing {}", seg_dir.display()))? {
        let entry = entry.ctx(|| format!("listing {}", seg_dir.display()))?;
        match segment_number(&entry.file_name()) {
            Some(n) if sd.segment_path(n) == entry.path() => files.push(n),
            _ => report
                .skipped
                .push(entry.file_name().to_string_lossy().into_owned()),
        }
    }
    files.sort_unstable();

    let mut held = Vec::new();
    for &n in &files {
        let path = sd.segment_path(n);
        let f = match fs::open_existing(&path, false) {
            Ok(f) => f,
            Err(e) => {
                report.skipped.push(format!("{} ({e})", path.display()));
                continue;
            }
        };
        match f.try_lock() {
            Ok(()) => held.push((n, f)),
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::StoreLocked(format!(
                "segment {n:016x} is held by a live writer; close every handle on the store first"
            )))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::from_io(format!("locking {}", path.display()), e))
            }
        }
    }

    let next = files.last().map_or(1, |n| n + 1);
    Ok((held, next))
}

/// Rebuilds `<dir>/index` from `<dir>/segments`. Every handle on the store, in
/// every process, must be closed: a live writer (its segment locked) makes
/// this `StoreLocked`.
pub fn rebuild_index(dir: &Path, progress: crate::progress::Progress<'_>) -> Result<RebuildReport> {
    let sd = StoreDir::new(dir);
    let manifest_path = sd.manifest_path();
    let manifest = sd.read_manifest()?.ok_or_else(|| {
        Error::corrupt(
            &manifest_path,
            "missing: the layout lives only there, so the index cannot be rebuilt",
        )
    })?;
    let layout = manifest
        .layout()
        .map_err(|e| Error::corrupt(&manifest_path, e.to_string()))?;
    let lock = sd.lock()?;

    let mut report = RebuildReport::default();
    let (held, next) = lock_segments(&sd, &mut report)?;

    // Move the old index aside (kept for inspection), then start a new one.
    let index_dir = sd.index_dir();
    if Index::is_open_here(&index_dir) {
        return Err(Error::StoreLocked(
            "this process has the store open; close it before rebuilding its index".into(),
        ));
    }
    // A handle open elsewhere, even one that writes nothing yet, would go on
    // with the index moved aside: its next puts would be acknowledged there
    // and lost to the new one.
    if !sd.none_open(&lock)? {
        return Err(Error::StoreLocked(
            "the store is open in another process; close every handle on it first".into(),
        ));
    }
    if std::fs::symlink_metadata(&index_dir).is_ok() {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = dir.join(format!("index.old-{secs}"));
        std::fs::rename(&index_dir, &aside).ctx(|| format!("moving {}", index_dir.display()))?;
        report.old_index = Some(aside.display().to_string());
    }
    fs::ensure_dir(&index_dir).ctx(|| format!("{}", index_dir.display()))?;
    let index = Index::open(&index_dir, false, crate::index::DEFAULT_MAP_SIZE)?;

    let mut blocks: HashMap<[u8; 32], Location> = HashMap::new();
    let mut infos: BTreeMap<u64, SegmentInfo> = BTreeMap::new();
    let total = held.len() as u64;
    for (i, (n, file)) in held.iter().enumerate() {
        let used_us = file
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_micros() as u64);
        let scanned = scan::scan_segment(file, &layout, |r| {
            report.records += 1;
            // A block stored twice keeps its last copy: later segments hold
            // the newer one (compaction writes forward).
            blocks.insert(
                r.header.block_id,
                Location {
                    segment: *n,
                    offset: r.offset,
                    record_len: r.record_len,
                    stored_len: r.header.stored_len,
                    used_us,
                },
            );
        })
        .ctx(|| format!("scanning segment {n:016x}"))?;
        // Every byte of the file counts against the disk bound until
        // compaction drops the dead and damaged ones.
        let info = SegmentInfo {
            state: SegmentState::Sealed,
            committed_len: scanned.file_len.max(format::SEGMENT_HEADER_LEN as u64),
            live_bytes: 0,
            live_records: 0,
        };
        report
            .damaged
            .extend(scanned.damaged.into_iter().map(|d| (*n, d)));
        infos.insert(*n, info);
        progress(i as u64 + 1, total);
    }
    // Segments first: the index counts each block it takes in as live in
    // its segment, so live figures follow from which copy it keeps.
    let mut txn = index.write()?;
    for (n, info) in &infos {
        index.put_segment(&mut txn, *n, info)?;
    }
    for (id, loc) in &blocks {
        index.insert_block(&mut txn, id, loc)?;
    }
    for (n, d) in &report.damaged {
        if let Some(id) = d.block_id.filter(|id| !blocks.contains_key(id)) {
            let loc = Location {
                segment: *n,
                offset: d.start,
                record_len: d.end - d.start,
                stored_len: 0,
                used_us: 0,
            };
            index.put_damaged(&mut txn, &id, &loc, &d.reason)?;
        }
    }
    index.set_meta_u64(&mut txn, "next_segment", next)?;
    index.bump_generation(&mut txn)?;
    index.commit(txn, true)?;
    report.segments = infos.len() as u64;
    report.blocks = blocks.len() as u64;
    drop(held);
    drop(lock);
    Ok(report)
}
