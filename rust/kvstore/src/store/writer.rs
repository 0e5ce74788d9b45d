//! The segment writer: appends encoded records to this handle's own segment
//! file, rolls to a new one when full, seals, syncs and publishes what is
//! pending (group commit for `Batch`). It only appends: bounds on disk use
//! are the caller's (`put` makes room before it appends).

use super::Inner;
use crate::clock::now_us;
use crate::error::{Error, IoContext, Result};
use crate::format;
use crate::fs;
use crate::id::BlockId;
use crate::index::{Location, SegmentInfo, SegmentState};
use crate::os;
use crate::record::Encoded;
use std::collections::HashMap;
use std::fs::File;
use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The padding before a record's meta (always less than a page).
static ZEROS: [u8; format::PAYLOAD_ALIGN as usize] = [0; format::PAYLOAD_ALIGN as usize];

/// The segment this handle appends to.
pub(super) struct Active {
    pub(super) segment: u64,
    pub(super) file: File,
    pub(super) len: u64,
    /// Where [`Inner::start_writeback`] has asked the disk to write up to.
    pub(super) written_back: u64,
}

/// A record written but not yet committed to the index.
pub(super) struct Pending {
    pub(super) id: BlockId,
    /// The block before it in its chain (`ROOT` for the first): the index
    /// keeps chains prefix-closed with it.
    pub(super) parent: BlockId,
    pub(super) loc: Location,
}

/// A writer: one active segment and the records not yet committed.
#[derive(Default)]
pub(super) struct Writer {
    pub(super) active: Option<Active>,
    pub(super) pending: Vec<Pending>,
    pub(super) pending_ids: HashMap<BlockId, Location>,
    pub(super) pending_bytes: u64,
    pub(super) oldest_pending: Option<Instant>,
    pub(super) poisoned: Option<String>,
    /// The last commit of what is pending failed (the index full): puts try
    /// it again before adding to it, and fail while it fails, so the records
    /// kept for it stay bounded.
    pub(super) commit_failed: bool,
}

impl Writer {
    pub(super) fn new() -> Self {
        Writer::default()
    }

    /// Remembers a written record until the next commit publishes it.
    pub(super) fn add_pending(&mut self, id: &BlockId, parent: &BlockId, loc: Location) {
        self.pending_bytes += loc.record_len;
        self.oldest_pending.get_or_insert_with(Instant::now);
        self.pending_ids.insert(*id, loc);
        self.pending.push(Pending {
            id: *id,
            parent: *parent,
            loc,
        });
    }

    /// Forgets pending records of `ids` (a put that failed part way).
    pub(super) fn drop_pending(&mut self, ids: &std::collections::HashSet<&BlockId>) {
        self.pending.retain(|p| !ids.contains(&p.id));
        self.pending_ids.retain(|id, _| !ids.contains(id));
        self.pending_bytes = self.pending.iter().map(|p| p.loc.record_len).sum();
        if self.pending.is_empty() {
            self.oldest_pending = None;
        }
    }

    /// Whether `record` (and the padding before it) starts a new segment file.
    pub(super) fn rolls(&self, record: &Encoded<'_>, segment_bytes: u64) -> bool {
        match &self.active {
            Some(a) => {
                let len = pad_at(a.len, record) + record.record_len();
                a.len + len > segment_bytes && a.len > format::SEGMENT_HEADER_LEN as u64
            }
            None => true,
        }
    }

    /// At most the bytes of segment file `record` takes when appended next
    /// (its padding included, wherever it lands).
    pub(super) fn room_for(&self, record: &Encoded<'_>) -> u64 {
        let fresh = pad_at(format::SEGMENT_HEADER_LEN as u64, record);
        record.record_len()
            + self
                .active
                .as_ref()
                .map_or(fresh, |a| pad_at(a.len, record).max(fresh))
    }
}

/// The padding `record` has when it starts at `offset` of a segment this
/// build writes.
fn pad_at(offset: u64, record: &Encoded<'_>) -> u64 {
    format::pad_before(
        format::SEGMENT_VERSION,
        offset,
        record.meta_len(),
        record.stored_len(),
    )
}

impl Inner {
    /// Appends one encoded record to the active segment, first rolling to a
    /// new segment when it would grow past `segment_bytes` (committing what
    /// is pending and sealing the full one). Returns where it landed; the
    /// caller decides when it is published.
    pub(super) fn append(&self, w: &mut Writer, record: &Encoded<'_>) -> Result<Location> {
        if w.rolls(record, self.opts.segment_limit()) {
            self.commit_pending(w)?;
            self.seal_active(w)?;
            w.active = Some(self.new_segment()?);
        }
        let active = w.active.as_mut().expect("active segment");
        let offset = active.len;
        // Zeros first, so that the payload starts on a 4 KiB boundary of
        // the file (readable with O_DIRECT); they are part of the record.
        let pad = pad_at(offset, record);
        let record_len = pad + record.record_len();
        let mut slices = record.slices();
        slices.insert(0, IoSlice::new(&ZEROS[..pad as usize]));
        if let Err(e) = fs::write_all_at(&active.file, &mut slices, offset) {
            // Whatever reached the file past `len` is garbage the next record
            // overwrites, and recovery truncates: nothing was published.
            if e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) {
                return Err(Error::StoreFull(format!(
                    "no space left on the device for segment {}",
                    active.segment
                )));
            }
            return Err(Error::Io {
                context: format!("writing segment {}", active.segment),
                source: e,
            });
        }
        active.len += record_len;
        self.counters
            .bytes_written
            .fetch_add(record_len, Ordering::Relaxed);
        Ok(Location {
            segment: active.segment,
            offset,
            record_len,
            stored_len: record.stored_len(),
            used_us: now_us(),
        })
    }

    fn new_segment(&self) -> Result<Active> {
        self.before_first_segment()?;
        let mut txn = self.index.write()?;
        let segment = self.index.meta_u64(&txn, "next_segment")?.max(1);
        self.index
            .set_meta_u64(&mut txn, "next_segment", segment + 1)?;
        self.index.commit(txn, self.durable())?;
        // The file exists, locked and with its header, before the segment is
        // registered. So a registered segment whose lock is free has lost its
        // writer (recovery may seal it), and a file not registered is either
        // locked by a writer about to register it or an orphan (removable).
        let path = self.dir.segment_path(segment);
        let file = fs::create_new(&path).ctx(|| format!("creating {}", path.display()))?;
        // Blocking: an orphan scan may hold the new file's lock for an
        // instant (it leaves young files alone, see `remove_orphans`).
        file.lock().ctx(|| format!("locking {}", path.display()))?;
        let header = format::encode_segment_header(segment);
        fs::write_all_at(&file, &mut [IoSlice::new(&header)], 0)
            .ctx(|| format!("writing {}", path.display()))?;
        if self.durable() {
            fs::sync_data(&file).ctx(|| format!("fdatasync {}", path.display()))?;
            fs::sync_dir(&self.dir.segments_dir())
                .ctx(|| "fsync segments directory".to_string())?;
        }
        let mut txn = self.index.write()?;
        self.index
            .put_segment(&mut txn, segment, &SegmentInfo::new())?;
        self.index.commit(txn, self.durable())?;
        Ok(Active {
            segment,
            file,
            len: format::SEGMENT_HEADER_LEN as u64,
            written_back: 0,
        })
    }

    /// Has the disk start writing the whole pages appended to the active
    /// segment since the last call, without waiting for them (only where
    /// commits sync). A put calls it as it goes, so that the disk writes
    /// while the put encodes and appends: the commit's `fdatasync` then
    /// waits for the last pages only, not for the whole put. The page a
    /// record ends in stays out (the next record is written into it).
    pub(super) fn start_writeback(&self, w: &mut Writer) {
        let Some(active) = w.active.as_mut().filter(|_| self.durable()) else {
            return;
        };
        let page = rustix::param::page_size() as u64;
        let end = active.len / page * page;
        if end > active.written_back {
            // Only a hint: should the kernel refuse it, the commit's
            // `fdatasync` writes the range and reports what failed.
            let _ =
                os::start_writeback(&active.file, active.written_back, end - active.written_back);
            active.written_back = end;
        }
    }

    pub(super) fn seal_active(&self, w: &mut Writer) -> Result<()> {
        let Some(active) = w.active.take() else {
            return Ok(());
        };
        let mut txn = self.index.write()?;
        if let Some(mut info) = self.index.get_segment(&txn, active.segment)? {
            info.state = SegmentState::Sealed;
            self.index.put_segment(&mut txn, active.segment, &info)?;
        }
        self.index.commit(txn, self.durable())?;
        Ok(())
    }

    /// Syncs the active segment (unless durability is "none") and commits every
    /// pending entry in one index transaction.
    pub(super) fn commit_pending(&self, w: &mut Writer) -> Result<()> {
        if let Some(p) = &w.poisoned {
            return Err(Error::Poisoned(p.clone()));
        }
        if w.pending.is_empty() {
            return Ok(());
        }
        let active = w
            .active
            .as_ref()
            .expect("pending records live in the active segment");
        if self.durable() {
            if let Err(e) = fs::sync_data(&active.file) {
                let msg = format!("fdatasync of segment {} failed: {e}", active.segment);
                w.poisoned = Some(msg.clone());
                return Err(Error::Poisoned(msg));
            }
        }
        let (segment, committed_len) = (active.segment, active.len);
        // On failure (the index full, an LMDB error) the records stay
        // pending: puts of a batch have returned already, and the next
        // commit (a flush, a close, the next window) publishes them or
        // reports why it cannot. A put whose own commit fails takes its
        // records back (`store_blocks`).
        if let Err(e) = self.publish_pending(w, segment, committed_len) {
            w.commit_failed = true;
            return Err(e);
        }
        w.commit_failed = false;
        w.pending.clear();
        w.pending_ids.clear();
        w.pending_bytes = 0;
        w.oldest_pending = None;
        Ok(())
    }

    fn publish_pending(&self, w: &Writer, segment: u64, committed_len: u64) -> Result<()> {
        if self.index.nearly_full()? {
            return Err(Error::StoreFull(
                "the index map is nearly full (the rest is kept for gc); free blocks with gc, \
                 or reopen with a larger index_bytes"
                    .into(),
            ));
        }
        let mut txn = self.index.write()?;
        self.index
            .set_committed_len(&mut txn, segment, committed_len)?;
        for p in &w.pending {
            // Another process may have committed the same block meanwhile; the
            // first one wins and this copy is dead bytes. In chain order, so
            // a parent is closed before its child is published.
            self.index
                .insert_child(&mut txn, &p.id, &p.loc, &p.parent)?;
        }
        self.index.commit(txn, self.durable())
    }

    /// Group commit for `Batch`: commits whatever is older than the window.
    pub(super) fn flush_loop(&self) {
        let window = self.opts.batch_window;
        let mut w = self.writer.lock().expect("writer lock");
        while !self.closing.load(Ordering::SeqCst) {
            let wait = match w.oldest_pending {
                Some(t) => window.saturating_sub(t.elapsed()),
                None => window,
            };
            w = self.wake.wait_timeout(w, wait).expect("writer lock").0;
            if w.oldest_pending.is_some_and(|t| t.elapsed() >= window)
                && self.commit_pending(&mut w).is_err()
            {
                // The records stay pending (or the writer is poisoned): the
                // next flush, close or full batch reports the failure. Tried
                // again a window later, not at once.
                w.oldest_pending = Some(Instant::now());
            }
        }
    }

    pub(super) fn pending_loc(&self, id: &BlockId) -> Option<Location> {
        self.writer
            .lock()
            .expect("writer lock")
            .pending_ids
            .get(id)
            .copied()
    }
}
