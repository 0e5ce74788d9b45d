//! Direct reads queued ahead of a reader thread: the records it will read
//! next, each read whole (head and payload in one aligned `O_DIRECT`
//! request) into a buffer of an `io_uring` ring, several in flight, so the
//! device has work queued while the thread checks and copies out the record
//! before them, and while it waits for a core. Rings are pooled across gets
//! (a bounded few), so a get pays neither their setup nor their buffers'
//! first page faults.

use crate::os::ReadRing;
use crate::segfile::DirectRequest;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Rings kept for reuse: one per reader thread of a get.
const POOL_MAX: usize = 4;

static POOL: Mutex<Vec<ReadRing>> = Mutex::new(Vec::new());

/// Where a record is: (segment, offset).
pub(crate) type Key = (u64, u64);

/// A reader thread's reads in flight, in the order it will take them.
pub(crate) struct ReadQueue {
    ring: Option<ReadRing>,
    queued: VecDeque<Queued>,
    /// Records found in the page cache when they were looked at, in order:
    /// read buffered without asking again.
    cached: VecDeque<Key>,
    /// The first block of the thread's range not yet considered.
    pub(crate) next: usize,
}

struct Queued {
    key: Key,
    slot: usize,
    /// Bytes of the request before the payload.
    lead: usize,
}

impl ReadQueue {
    /// A queue `depth` reads deep of records whose payload, as read (up to
    /// the device's alignment), is at most `len` bytes (a pooled ring if one
    /// fits); `None` where the kernel has no `io_uring`.
    pub(crate) fn new(depth: usize, len: usize) -> Option<ReadQueue> {
        let pooled = {
            let mut pool = POOL.lock().ok()?;
            let at = pool
                .iter()
                .position(|r| r.depth() == depth && r.fits(len, 0));
            at.map(|i| pool.swap_remove(i))
        };
        let ring = match pooled {
            Some(r) => r,
            None => ReadRing::new(depth, len).ok()?,
        };
        Some(ReadQueue {
            ring: Some(ring),
            queued: VecDeque::new(),
            cached: VecDeque::new(),
            next: 0,
        })
    }

    fn ring(&mut self) -> &mut ReadRing {
        self.ring.as_mut().expect("ring")
    }

    /// Whether another read can be queued.
    pub(crate) fn has_room(&self) -> bool {
        self.ring
            .as_ref()
            .is_some_and(|r| (0..r.depth()).any(|s| r.is_free(s)))
    }

    /// Queues `req`, the read of the record at `key` (when there is room
    /// and the request fits a buffer: else the record is read without the
    /// queue).
    pub(crate) fn push(&mut self, key: Key, req: &DirectRequest<'_>) {
        let ring = self.ring();
        if !ring.fits(req.len, req.lead) {
            return;
        }
        let Some(slot) = (0..ring.depth()).find(|&s| ring.is_free(s)) else {
            return;
        };
        if ring
            .submit(slot, req.file, (req.start, req.len, req.lead))
            .is_ok()
        {
            self.queued.push_back(Queued {
                key,
                slot,
                lead: req.lead,
            });
        }
    }

    /// Notes that the record at `key` was in the page cache.
    pub(crate) fn note_cached(&mut self, key: Key) {
        self.cached.push_back(key);
    }

    /// Whether the record at `key` was noted in the page cache (forgetting
    /// it, and the records noted before it: no longer wanted).
    pub(crate) fn was_cached(&mut self, key: Key) -> bool {
        match self.cached.iter().position(|k| *k == key) {
            Some(at) => {
                self.cached.drain(..=at);
                true
            }
            None => false,
        }
    }

    /// Runs `f` on the queued read of the record at `key` once it is done
    /// (its bytes from the request's start, or its error, and the bytes
    /// before the payload); `None` when it was not queued. Reads queued
    /// before it are for records no longer wanted (served from memory):
    /// dropped.
    pub(crate) fn with_record<R>(
        &mut self,
        key: Key,
        f: impl FnOnce(std::io::Result<&[u8]>, usize) -> R,
    ) -> Option<R> {
        let at = self.queued.iter().position(|q| q.key == key)?;
        for q in self.queued.drain(..at).collect::<Vec<_>>() {
            self.ring().release(q.slot);
        }
        let q = self.queued.pop_front()?;
        let ring = self.ring();
        let out = f(ring.wait(q.slot), q.lead);
        ring.release(q.slot);
        Some(out)
    }
}

impl Drop for ReadQueue {
    fn drop(&mut self) {
        let Some(mut ring) = self.ring.take() else {
            return;
        };
        for q in self.queued.drain(..) {
            ring.release(q.slot);
        }
        if let Ok(mut pool) = POOL.lock() {
            if pool.len() < POOL_MAX {
                pool.push(ring);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::os::ReadRing;
    use std::io::Write;
    use std::sync::Arc;

    #[test]
    fn a_ring_reads_what_the_file_holds_and_stops_at_its_end() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i * 7 + i / 4099) as u8).collect();
        f.write_all(&data).unwrap();
        let f = Arc::new(f);
        let mut ring = ReadRing::new(2, (2 << 20) + 4096).unwrap();
        assert!(ring.fits((2 << 20) + 8192, 4096));
        assert!(!ring.fits((8 << 20) + 8192, 4096));
        // Two in flight at once, then one running past the end of the file.
        ring.submit(0, &f, (4096, (2 << 20) + 8192, 4096)).unwrap();
        ring.submit(1, &f, (100, 1000, 17)).unwrap();
        assert!(!ring.is_free(0) && !ring.is_free(1));
        assert_eq!(ring.wait(1).unwrap(), &data[100..1100]);
        assert_eq!(ring.wait(0).unwrap(), &data[4096..4096 + (2 << 20) + 8192]);
        ring.release(0);
        ring.release(1);
        ring.submit(0, &f, ((3 << 20) - 10, 4096, 0)).unwrap();
        assert_eq!(ring.wait(0).unwrap(), &data[(3 << 20) - 10..]);
        ring.release(0);
        // Dropped with a read in flight: waits for it, no crash.
        ring.submit(1, &f, (0, 1 << 20, 0)).unwrap();
        drop(ring);
    }
}
