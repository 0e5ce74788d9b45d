//! The read path: where a block is (location cache, index snapshot, this
//! handle's pending writes), a get's blocks read on reader threads
//! (`readers`), reading and checking each record, and quarantining damage.

use super::readers::{in_ranges, range_bounds, reader_threads};
use super::{Durability, Inner, Snap};
use crate::clock::now_ms;
use crate::error::{Error, Result};
use crate::format;
use crate::id::BlockId;
use crate::index::Location;
use crate::readq::ReadQueue;
use crate::record::{self, Mismatch};
use crate::segfile::{Plan, SegmentFile};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A buffered get of at most this many bytes that reads from the disk
/// stays on one reader thread (`one_cold_stream`): a cold 8 MiB restore
/// (512 tokens of 16 KiB) took 6.2-6.6 ms on one thread against 7.6-9.8 on
/// two; cold 16 and 32 MiB restores (1K and 2K tokens) took a median
/// 10.3-13.3 and 20.1-21.1 ms on one thread against 12.5-16.2 and
/// 24.2-25.9 on two, with a third less CPU time (3.5-4.0 against 5.2-5.6
/// ms at 16 MiB): two threads are two streams, and the device moves
/// between them (benches/README.md, the cold restores of 2026-11-24).
const COLD_ONE_READER_BYTES: usize = 32 << 20;

/// Segment files a handle keeps open for reads.
const MAX_OPEN_SEGMENTS: usize = 256;

/// One reader's share of a get: blocks `at..` of it.
struct Range<'a> {
    at: usize,
    ids: &'a [BlockId],
    found: &'a [Found],
    tokens: &'a [u32],
}

/// Why a record could not be served.
pub(super) enum ReadFail {
    /// The segment file is gone (compacted away): look the block up again.
    Gone,
    Damaged(String),
    /// A sound record of another token sequence under the same id (a hash
    /// collision, or a misplaced record): a miss, and not damage, since the
    /// record is right for its own tokens.
    OtherTokens,
    /// The read itself failed (out of file descriptors or memory, an I/O
    /// error): a miss, and not damage, since nothing was seen of the
    /// record's bytes. The entry stays: quarantining it would take a sound
    /// block from every process for one process's passing trouble.
    Unreadable(String),
}

/// Where a get's block was when the calling thread looked, with its one
/// snapshot, so that reader threads need none of their own.
#[derive(Clone, Copy)]
enum Found {
    /// In the hot tier (no location looked up: a hot hit needs none).
    Hot,
    /// In a record.
    At(Location),
}

/// How a block was landed, if it was.
enum Fetched {
    Hot,
    /// From its record: the caller decides whether to promote it.
    Disk,
    Miss,
}

/// How a read takes a record's payload that the page cache does not hold
/// ([`Inner::direct`] decides which).
pub(super) enum Cold<'q> {
    /// Through the page cache, which then keeps it for the next read.
    Buffered,
    /// With `O_DIRECT` where the record allows it; from `queue` where its
    /// read was queued there.
    Direct(Option<&'q mut ReadQueue>),
}

impl Cold<'_> {
    /// Direct or buffered, no queue.
    pub(super) fn plain(direct: bool) -> Cold<'static> {
        if direct {
            Cold::Direct(None)
        } else {
            Cold::Buffered
        }
    }
}

/// A record's padding must be zeros: anything else is damage (the bytes of
/// a record are one range, and every one of them is checked).
fn check_padding(pad: &[u8]) -> Result<(), ReadFail> {
    record::check_padding(pad).map_err(ReadFail::Damaged)
}

impl ReadFail {
    /// Why the record is unusable for its block (the reason `verify` lists
    /// and the index keeps); `None` when it is sound but for other tokens,
    /// or could not be read.
    pub(super) fn damage(self) -> Option<String> {
        match self {
            ReadFail::Gone => Some("segment file is missing".into()),
            ReadFail::Damaged(r) => Some(r),
            ReadFail::OtherTokens | ReadFail::Unreadable(_) => None,
        }
    }

    /// A failed read: a record cut short by the end of its file is damage
    /// (torn or truncated), any other error says nothing of its bytes.
    fn of_read(e: &std::io::Error) -> ReadFail {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ReadFail::Damaged(format!("read failed: {e}"))
        } else {
            ReadFail::Unreadable(format!("read failed: {e}"))
        }
    }
}

impl Inner {
    /// Whether a read that does (`promotes`) or does not put what it reads
    /// into the hot tier reads payloads the page cache does not hold with
    /// `O_DIRECT`: as the `direct_reads` option says, else exactly when it
    /// promotes into a hot tier (see the option).
    pub(super) fn direct(&self, promotes: bool) -> bool {
        self.opts
            .direct_reads
            .unwrap_or(promotes && self.arena.is_some())
    }

    /// A fresh index snapshot; advances the location cache (and drops open
    /// segment files) when the index generation moved on.
    pub(super) fn snapshot(&self) -> Result<Snap<'_>> {
        let txn = self.index.read()?;
        let generation = self.index.generation(&txn)?;
        if self.known.advance(generation) {
            self.readers.write().expect("reader cache").clear();
        }
        Ok(Snap { txn, generation })
    }

    /// Where block `id`'s committed record is (cache, then index).
    pub(super) fn committed<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        id: &BlockId,
    ) -> Result<Option<Location>> {
        if let Some(loc) = self.known.get(id) {
            return Ok(Some(loc));
        }
        if snap.is_none() {
            *snap = Some(self.snapshot()?);
        }
        let s = snap.as_ref().expect("snapshot");
        let loc = self.index.get_block(&s.txn, id)?;
        if let Some(loc) = loc {
            self.known.insert(s.generation, id, loc);
        }
        Ok(loc)
    }

    /// Where block `id` is: committed, or pending in this handle. A group
    /// commit may move a block from pending to the index after `snap` was
    /// taken; so on a miss in both, look again in a snapshot taken after the
    /// pending check (kept in `snap` for the next blocks).
    pub(super) fn find<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        id: &BlockId,
    ) -> Result<Option<Location>> {
        if let Some(loc) = self.committed(snap, id)? {
            return Ok(Some(loc));
        }
        if let Some(loc) = self.pending_loc(id) {
            return Ok(Some(loc));
        }
        if self.opts.durability != Durability::Batch {
            return Ok(None);
        }
        *snap = None;
        self.committed(snap, id)
    }

    /// Whether block `id` is stored: in the hot tier, committed, or pending
    /// in this handle (`find`).
    pub(super) fn holds<'s>(&'s self, snap: &mut Option<Snap<'s>>, id: &BlockId) -> Result<bool> {
        Ok(self.arena.as_ref().is_some_and(|a| a.contains(id)) || self.find(snap, id)?.is_some())
    }

    /// How many leading blocks of `ids` are stored (`holds`): for a get from
    /// `start`, the blocks before it, whose KV the caller has, must be.
    pub(super) fn held_prefix<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        ids: &[BlockId],
    ) -> Result<usize> {
        let mut n = 0;
        while n < ids.len() && self.holds(snap, &ids[n])? {
            n += 1;
        }
        Ok(n)
    }

    pub(super) fn get_from(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        let b = self.layout.block_size as usize;
        super::put::check_start(start, b, tokens.len())?;
        let want = self
            .layout
            .kv_bytes(out_tokens)
            .ok_or_else(|| Error::InvalidInput(format!("out: {out_tokens} tokens overflow")))?;
        if out.len() != want {
            return Err(Error::InvalidInput(format!(
                "out: expected {want} bytes for {out_tokens} tokens, got {}",
                out.len()
            )));
        }
        let (first, usable) = (start / b, tokens.len().min(start + out_tokens) / b);
        let ids = self.keyer.chain(&tokens[..usable * b], b, extra);
        // One snapshot per call, so the cache notices a newer generation.
        let mut snap = Some(self.snapshot()?);
        let mut served = self.held_prefix(&mut snap, &ids[..first])?;
        if served < first && self.remote.is_some() {
            // The prefix ends before `start` here: the server may hold the
            // rest of it (promoted locally; the caller has its KV). Then the
            // blocks from `start` are read here first, where they may be
            // stored though the ones before were not; a fresh snapshot, for
            // the generation the promotion may have advanced.
            drop(snap);
            served += self.remote_extend(&ids[..first], tokens, served, None);
            snap = Some(self.snapshot()?);
        }
        if served == first {
            served += self.read_blocks(
                &mut snap,
                &ids[first..],
                &tokens[first * b..usable * b],
                out,
                out_tokens,
            )?;
        }
        drop(snap);
        if served >= first {
            served += self.remote_extend(&ids, tokens, served, Some((out, out_tokens, first)));
        }
        self.count_hits(served, tokens.len() / b);
        self.touch(&ids[..served]);
        Ok(served * b)
    }

    /// Lands the KV of `ids` (the blocks from `start`; `tokens` theirs) in
    /// `out`, a `[L, 2, out_tokens, H, D]` buffer; how many of them, from the
    /// first, were served. Where each block is comes first, from `snap` on
    /// this thread: the first block found nowhere ends the prefix and nothing
    /// past it is read. The found blocks are split into contiguous ranges,
    /// one per reader thread (this one included), each walked in order with
    /// its own scratch and no snapshot but for a rare retry: copies and
    /// checks use every core, and each range is a sequential stream for the
    /// kernel's readahead, so several reads are in flight. The result is the
    /// one-thread walk's: the first block not served ends the prefix,
    /// whichever range it is in.
    fn read_blocks<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        ids: &[BlockId],
        tokens: &[u32],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        let mut found = Vec::with_capacity(ids.len());
        // An error looking up block i matters only if the blocks before it
        // are all served (the one-thread walk would not have reached it).
        let mut lookup_err = None;
        for id in ids {
            let f = if self.arena.as_ref().is_some_and(|a| a.contains(id)) {
                Ok(Some(Found::Hot))
            } else {
                self.find(snap, id).map(|loc| loc.map(Found::At))
            };
            match f {
                Ok(Some(f)) => found.push(f),
                Ok(None) => break,
                Err(e) => {
                    lookup_err = Some(e);
                    break;
                }
            }
        }
        let n = found.len();
        let served = if n == 0 {
            0
        } else {
            self.read_found(snap, &ids[..n], &found, tokens, out, out_tokens)?
        };
        match lookup_err {
            Some(e) if served == n => Err(e),
            _ => Ok(served),
        }
    }

    /// [`Inner::read_blocks`] once the blocks are found: `ids` (all found,
    /// `found` where) split among reader threads.
    fn read_found<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        ids: &[BlockId],
        found: &[Found],
        tokens: &[u32],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        let n = ids.len();
        let mut readers = reader_threads(
            n,
            self.layout.block_bytes(),
            self.opts.get_readers,
            self.direct(true),
        );
        if readers > 1 && self.one_cold_stream(found) {
            readers = 1;
        }
        let b = self.layout.block_size as usize;
        let bounds = range_bounds(n, readers);
        let runs = self.layout.split_runs_mut(out, out_tokens, &bounds);
        // The first block found missing so far: no range reads past it.
        let stop = AtomicUsize::new(n);
        let stop = &stop;
        let ranges = bounds.windows(2).zip(runs).map(|(w, runs)| {
            let (at, end) = (w[0], w[1]);
            let range = Range {
                at,
                ids: &ids[at..end],
                found: &found[at..end],
                tokens: &tokens[at * b..end * b],
            };
            (end - at, (range, runs))
        });
        let work = |snap: &mut Option<Snap<'s>>, (range, runs): (Range<'_>, _)| {
            self.read_range(snap, &range, runs, stop)
        };
        in_ranges(snap, "kvstore-read", ranges, &work)
    }

    /// Whether a small buffered get (at most [`COLD_ONE_READER_BYTES`]) of
    /// the records `found` reads from the disk: then one reader thread
    /// reads it, as one sequential stream that the kernel's readahead keeps
    /// ahead (two threads are two cold streams, each ramping up on its own).
    /// Not with direct reads or `get_readers` set.
    fn one_cold_stream(&self, found: &[Found]) -> bool {
        if self.direct(true)
            || self.opts.get_readers.is_some()
            || found.len().saturating_mul(self.layout.block_bytes()) > COLD_ONE_READER_BYTES
        {
            return false;
        }
        // Each run of adjacent records of a segment asked once.
        let cold = |(first, end): (Location, u64)| {
            self.segment_file(&first)
                .is_ok_and(|f| !f.cached(first.offset, end - first.offset))
        };
        let mut run: Option<(Location, u64)> = None;
        for f in found {
            let Found::At(loc) = *f else { continue };
            match &mut run {
                Some((first, end)) if first.segment == loc.segment && *end == loc.offset => {
                    *end += loc.record_len;
                }
                _ => {
                    if run
                        .replace((loc, loc.offset + loc.record_len))
                        .is_some_and(cold)
                    {
                        return true;
                    }
                }
            }
        }
        run.is_some_and(cold)
    }

    /// One reader's range of [`Inner::read_found`], in order, into `runs`
    /// (its part of every run of the output); how many were served before
    /// the first that was not. `snap` is `None` on a spawned thread, taken
    /// only if a block moved since it was found.
    fn read_range<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        range: &Range<'_>,
        mut runs: Vec<&mut [u8]>,
        stop: &AtomicUsize,
    ) -> Result<usize> {
        let (b, chunk) = (self.layout.block_size as usize, self.layout.chunk_bytes());
        let mut scratch = Vec::new();
        let (direct, mut queue) = (self.direct(true), self.read_queue());
        for (j, id) in range.ids.iter().enumerate() {
            let at = range.at + j;
            if stop.load(Ordering::Relaxed) < at {
                return Ok(j);
            }
            if let Some(q) = &mut queue {
                self.queue_ahead(q, range.found, j);
            }
            let mut chunks: Vec<&mut [u8]> = runs
                .iter_mut()
                .map(|r| &mut r[j * chunk..(j + 1) * chunk])
                .collect();
            let block_tokens = &range.tokens[j * b..(j + 1) * b];
            let cold = if direct {
                Cold::Direct(queue.as_mut())
            } else {
                Cold::Buffered
            };
            let fetched = self.fetch(
                snap,
                id,
                Some(range.found[j]),
                block_tokens,
                &mut chunks,
                &mut scratch,
                cold,
            );
            let served = fetched.and_then(|f| match f {
                // Past a block another range found missing it is read (the
                // miss came too late) but not promoted: no reader wants it.
                Fetched::Disk if stop.load(Ordering::Relaxed) > at => {
                    self.promote_block(id, block_tokens, &chunks).map(|()| true)
                }
                Fetched::Miss => Ok(false),
                Fetched::Hot | Fetched::Disk => Ok(true),
            });
            if !matches!(served, Ok(true)) {
                stop.fetch_min(at, Ordering::Relaxed);
                return served.map(|_| j);
            }
        }
        Ok(range.ids.len())
    }

    /// A reader thread's queue of direct reads in flight, when direct reads
    /// are on and `read_depth` asks for one (and the kernel has `io_uring`).
    fn read_queue(&self) -> Option<ReadQueue> {
        if !self.direct(true) || self.opts.read_depth == 0 {
            return None;
        }
        // A request reads the payload rounded up to the device's alignment.
        let payload = self.layout.block_bytes() + format::PAYLOAD_ALIGN as usize;
        ReadQueue::new(self.opts.read_depth, payload)
    }

    /// Queues direct reads of the records of `found` from block `j` on
    /// while the queue has room: raw payloads that would be read with
    /// `O_DIRECT` (aligned, not in the page cache); the others are read
    /// when their turn comes, without the queue (those found in the page
    /// cache noted, so that it is not asked again). No further ahead than
    /// the depth: a warm range is not looked over whole at once.
    fn queue_ahead(&self, q: &mut ReadQueue, found: &[Found], j: usize) {
        let raw_len = self.layout.block_bytes() as u64;
        let meta = record::meta_len(&self.layout);
        q.next = q.next.max(j);
        let end = found.len().min(j + self.opts.read_depth);
        while q.has_room() && q.next < end {
            let k = q.next;
            q.next += 1;
            let Found::At(loc) = found[k] else { continue };
            if loc.stored_len != raw_len {
                continue;
            }
            let Ok(file) = self.segment_file(&loc) else {
                continue;
            };
            let Ok(pad) = self.placed(&loc, &file) else {
                continue;
            };
            let key = (loc.segment, loc.offset);
            match file.direct_request(pad as usize + meta, loc.offset, loc.stored_len as usize) {
                Plan::Direct(req) => q.push(key, &req),
                Plan::Cached => q.note_cached(key),
                Plan::Other => {}
            }
        }
    }

    /// Lands block `id` in `chunks`: from the hot tier, else from its record,
    /// not promoted into the hot tier. Whether it was served; a damaged
    /// record is quarantined on the way. For a paged load (`get_paged`),
    /// whose engine keeps the block in its own cache: promotion cost such a
    /// load from the page cache 1.4x its CPU time and 1.9x its wall time
    /// (a full hot tier, `bench_paged`'s layout), to spare the next load of
    /// the same block, in another engine, 0.35x of its CPU time.
    pub(super) fn read_block<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        id: &BlockId,
        block_tokens: &[u32],
        chunks: &mut [&mut [u8]],
        scratch: &mut Vec<u8>,
    ) -> Result<bool> {
        let cold = Cold::plain(self.direct(false));
        let fetched = self.fetch(snap, id, None, block_tokens, chunks, scratch, cold)?;
        Ok(!matches!(fetched, Fetched::Miss))
    }

    /// [`Inner::read_block`] without the promotion; `found`, where the block
    /// was seen, spares a lookup (looked up in `snap` when it is `None`, or
    /// the block moved since); a payload the page cache does not hold is
    /// read as `cold` says.
    #[allow(clippy::too_many_arguments)]
    fn fetch<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        id: &BlockId,
        found: Option<Found>,
        block_tokens: &[u32],
        chunks: &mut [&mut [u8]],
        scratch: &mut Vec<u8>,
        mut cold: Cold<'_>,
    ) -> Result<Fetched> {
        if let Some(arena) = &self.arena {
            if arena.get(id, block_tokens, chunks) {
                self.counters.hot_hit_blocks.fetch_add(1, Ordering::Relaxed);
                return Ok(Fetched::Hot);
            }
        }
        // Evicted from the hot tier since it was found there: looked up.
        let mut seen = match found {
            Some(Found::At(loc)) => Some(loc),
            Some(Found::Hot) | None => None,
        };
        for attempt in 0..2 {
            let loc = match seen.take() {
                Some(loc) => loc,
                None => match self.find(snap, id)? {
                    Some(loc) => loc,
                    None => return Ok(Fetched::Miss),
                },
            };
            // `cold` reborrowed for this attempt (a second one follows a move).
            let how = match &mut cold {
                Cold::Buffered => Cold::Buffered,
                Cold::Direct(queue) => Cold::Direct(queue.as_deref_mut()),
            };
            let read = self.read_record(&loc, id, Some(block_tokens), chunks, scratch, how);
            match read {
                Ok(()) => {
                    self.counters
                        .bytes_read
                        .fetch_add(loc.record_len, Ordering::Relaxed);
                    self.counters
                        .disk_hit_blocks
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(Fetched::Disk);
                }
                Err(ReadFail::Gone) if attempt == 0 => {
                    // Compacted away since it was found: look it up afresh.
                    *snap = None;
                    self.known.forget(id);
                    self.readers
                        .write()
                        .expect("reader cache")
                        .remove(&loc.segment);
                }
                Err(ReadFail::Unreadable(_)) => {
                    self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Ok(Fetched::Miss);
                }
                Err(fail) => {
                    // Damaged, or still pointing at a missing file after
                    // a fresh look (lost, not compacted): out of the
                    // index, so the next put of these tokens stores it
                    // again. Another sequence's record is just a miss.
                    if let Some(reason) = fail.damage() {
                        drop(snap.take());
                        self.known.forget(id);
                        self.quarantine(id, &loc, &reason)?;
                    }
                    return Ok(Fetched::Miss);
                }
            }
        }
        Ok(Fetched::Miss)
    }

    /// Promotes a block read from its record: the next reader, in any
    /// process, gets it from memory.
    pub(super) fn promote_block(
        &self,
        id: &BlockId,
        block_tokens: &[u32],
        chunks: &[&mut [u8]],
    ) -> Result<()> {
        if let Some(arena) = &self.arena {
            let chunks: Vec<&[u8]> = chunks.iter().map(|c| &**c).collect();
            arena.insert(id, block_tokens, &chunks, 0, 0, now_ms())?;
        }
        Ok(())
    }

    pub(super) fn reader(&self, segment: u64) -> std::io::Result<Arc<SegmentFile>> {
        if let Some(f) = self.readers.read().expect("reader cache").get(&segment) {
            return Ok(f.clone());
        }
        let f = Arc::new(SegmentFile::open(
            &self.dir.segment_path(segment),
            self.direct(true),
        )?);
        let mut readers = self.readers.write().expect("reader cache");
        if readers.len() >= MAX_OPEN_SEGMENTS {
            // Bounded: reads in flight keep their own `Arc`.
            readers.clear();
        }
        readers.insert(segment, f.clone());
        Ok(f)
    }

    /// The padding of the record at `loc`, once its lengths are checked
    /// against the layout and its placement against its segment's version
    /// (a large version-2 payload starts on a 4 KiB boundary: one that does
    /// not is misplaced, and a miss).
    fn placed(&self, loc: &Location, file: &SegmentFile) -> Result<u64, ReadFail> {
        let raw_len = self.layout.block_bytes() as u64;
        let meta_len = record::meta_len(&self.layout);
        let pad = loc
            .record_len
            .checked_sub(meta_len as u64 + loc.stored_len)
            .filter(|&p| loc.stored_len <= raw_len && p < format::PAYLOAD_ALIGN)
            .ok_or_else(|| ReadFail::Damaged("index entry has impossible lengths".into()))?;
        if !format::placement_ok(file.version, loc.offset, pad, meta_len, loc.stored_len) {
            return Err(ReadFail::Damaged(format!(
                "record at offset {} is not placed as its segment's version requires \
                 (payload not on a {}-byte boundary)",
                loc.offset,
                format::PAYLOAD_ALIGN
            )));
        }
        Ok(pad)
    }

    /// The open segment file of `loc` (`Gone` when it is not there).
    fn segment_file(&self, loc: &Location) -> Result<Arc<SegmentFile>, ReadFail> {
        match self.reader(loc.segment) {
            Ok(f) => Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ReadFail::Gone),
            // What is at its path is no segment file: a symlink (never
            // followed) or not a regular file.
            Err(e)
                if e.kind() == std::io::ErrorKind::InvalidInput
                    || e.raw_os_error() == Some(libc::ELOOP) =>
            {
                Err(ReadFail::Damaged(format!(
                    "segment {} unreadable: {e}",
                    loc.segment
                )))
            }
            Err(e) => Err(ReadFail::Unreadable(format!(
                "segment {} could not be opened: {e}",
                loc.segment
            ))),
        }
    }

    /// The meta bytes (header and token ids) of the record at `loc`, its
    /// padding checked to be zeros; the header is not checked here.
    pub(super) fn record_meta(&self, loc: &Location) -> Result<Vec<u8>, ReadFail> {
        let file = self.segment_file(loc)?;
        let pad = self.placed(loc, &file)?;
        let mut head = vec![0u8; pad as usize + record::meta_len(&self.layout)];
        file.read_buffered(&mut head, &mut [], loc.offset)
            .map_err(|e| ReadFail::of_read(&e))?;
        check_padding(&head[..pad as usize])?;
        Ok(head.split_off(pad as usize))
    }

    /// Reads the record at `loc` into `out` (the block's `2L` runs) and checks
    /// it against `id` and, when given, the requested `tokens`; a payload the
    /// page cache does not hold is read as `cold` says (from its queue where
    /// its read was queued there and came back whole: else it is read again,
    /// without the queue).
    /// Every failure, I/O included, is a reason not to serve the block.
    pub(super) fn read_record(
        &self,
        loc: &Location,
        id: &BlockId,
        tokens: Option<&[u32]>,
        out: &mut [&mut [u8]],
        scratch: &mut Vec<u8>,
        cold: Cold<'_>,
    ) -> Result<(), ReadFail> {
        let raw_len = self.layout.block_bytes() as u64;
        let file = self.segment_file(loc)?;
        let pad = self.placed(loc, &file)? as usize;
        let head_len = pad + record::meta_len(&self.layout);
        let mut known_cached = false;
        let (direct, queue) = match cold {
            Cold::Buffered => (false, None),
            Cold::Direct(queue) => (true, queue),
        };
        if let Some(q) = queue.filter(|_| loc.stored_len == raw_len) {
            let len = raw_len as usize;
            let key = (loc.segment, loc.offset);
            known_cached = q.was_cached(key);
            let landed = q.with_record(key, |bytes, lead| {
                // A request queued for another entry at this offset (only a
                // forged index has two) may carry another head: read again.
                let bytes = bytes
                    .ok()
                    .filter(|b| lead >= head_len && b.len() >= lead + len)?;
                let (head, payload) = (&bytes[lead - head_len..lead], &bytes[lead..lead + len]);
                let chunk = self.layout.chunk_bytes();
                for (dst, src) in out.iter_mut().zip(payload.chunks(chunk)) {
                    dst.copy_from_slice(src);
                }
                Some(self.check_record(head, pad, loc, id, tokens, out, scratch))
            });
            if let Some(Some(res)) = landed {
                return res;
            }
        }
        // Padding and meta in one buffer, read with the payload.
        let mut head = vec![0u8; head_len];
        // A raw payload lands straight in `out`; a compressed one is decoded
        // from `scratch`.
        let raw = loc.stored_len == raw_len;
        let read = if known_cached {
            file.read_buffered(&mut head, out, loc.offset)
        } else if raw {
            file.read(&mut head, out, loc.offset, direct)
        } else {
            scratch.resize(loc.stored_len as usize, 0);
            file.read(&mut head, &mut [&mut scratch[..]], loc.offset, direct)
        };
        read.map_err(|e| ReadFail::of_read(&e))?;
        self.check_record(&head, pad, loc, id, tokens, out, scratch)
    }

    /// Checks a record read into `head` (its padding, `pad` bytes, and its
    /// meta) and `out` (a raw payload) or `scratch` (a compressed one, then
    /// decoded into `out`) against `id` and, when given, `tokens`.
    #[allow(clippy::too_many_arguments)]
    fn check_record(
        &self,
        head: &[u8],
        pad: usize,
        loc: &Location,
        id: &BlockId,
        tokens: Option<&[u32]>,
        out: &mut [&mut [u8]],
        scratch: &mut Vec<u8>,
    ) -> Result<(), ReadFail> {
        let raw = loc.stored_len == self.layout.block_bytes() as u64;
        check_padding(&head[..pad])?;
        let meta = &head[pad..];
        let header = match record::check_read(&self.layout, meta, id, loc.stored_len, tokens) {
            Ok(h) => h,
            Err(Mismatch::Damaged(r)) => return Err(ReadFail::Damaged(r)),
            Err(Mismatch::OtherTokens) => return Err(ReadFail::OtherTokens),
        };
        let payload = if raw {
            record::check_raw(&header, out)
        } else {
            let stored = std::mem::take(scratch);
            let res = record::decode_compressed(&self.layout, &header, &stored, out, scratch);
            *scratch = stored;
            res
        };
        payload.map_err(ReadFail::Damaged)
    }

    /// Moves a damaged block's entry out of `blocks` (if it still points at the
    /// damaged record), so it is a miss and a later put stores it again.
    pub(super) fn quarantine(&self, id: &BlockId, loc: &Location, reason: &str) -> Result<()> {
        self.counters.damaged_found.fetch_add(1, Ordering::Relaxed);
        let mut txn = self.index.write()?;
        self.index.quarantine_if_at(&mut txn, id, loc, reason)?;
        self.index.commit(txn, self.durable())
    }
}
