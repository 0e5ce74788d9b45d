//! A segment file open for reads: its buffered descriptor, an `O_DIRECT` one
//! beside it where the file system has them, and the version its header
//! names. Where the caller asks for direct reads, a record's read picks the
//! way per payload: one the page cache holds is copied from there (buffered,
//! as fast as memory); one it does not is read with `O_DIRECT`, straight into
//! the destination when that is aligned as the device requires, else through
//! a bounded per-thread bounce buffer. Direct reads keep the device busy with
//! the whole request (no readahead guessing, no page-cache copy to fill and
//! later evict); the kernel writes back dirty cached pages of the range
//! before a direct read, so it sees what was just written. A get's reader
//! threads may instead queue a record's whole direct read ahead of time
//! (`direct_request`, read by `readq`), several in flight.

use crate::format;
use crate::fs;
use crate::os::Residency;
use std::cell::RefCell;
use std::fs::File;
use std::io::{self, IoSliceMut};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// How a record would be read (see [`SegmentFile::direct_request`]).
pub(crate) enum Plan<'a> {
    /// With this one direct request.
    Direct(DirectRequest<'a>),
    /// Buffered: the page cache holds its payload.
    Cached,
    /// Buffered or otherwise, as [`SegmentFile::read`] decides.
    Other,
}

/// One aligned `O_DIRECT` request that reads a record whole (see
/// [`SegmentFile::direct_request`]).
pub(crate) struct DirectRequest<'a> {
    pub(crate) file: &'a Arc<File>,
    /// File offset of the request (aligned).
    pub(crate) start: u64,
    /// Bytes of the request before the payload (the head at their end).
    pub(crate) lead: usize,
    /// Bytes asked for (aligned; may run past the end of the file).
    pub(crate) len: usize,
}

/// Bytes of a reader thread's bounce buffer: unaligned destinations are
/// read in pieces of this size (a few requests' worth, so pieces are large).
const BOUNCE_BYTES: usize = 2 << 20;

thread_local! {
    /// One bounce buffer per reader thread, reused; page-aligned (an
    /// anonymous mapping), so it meets any device's alignment.
    static BOUNCE: RefCell<Option<memmap2::MmapMut>> = const { RefCell::new(None) };
}

/// An open segment file.
pub(crate) struct SegmentFile {
    file: File,
    /// How to ask the page cache about it (`fs::residency`).
    residency: Residency,
    direct: Option<Direct>,
    /// The version its header names; `None` when the header does not decode
    /// (its records still read: each is checked on its own).
    pub(crate) version: Option<u32>,
}

/// The `O_DIRECT` descriptor and what its reads must respect.
struct Direct {
    /// Shared with reads in flight in a ring (`os::ReadRing`).
    file: Arc<File>,
    /// Alignment of memory addresses for direct reads.
    mem_align: usize,
    /// Alignment of file offsets and lengths for direct reads.
    offset_align: u64,
    /// Cleared when a direct read was refused (`EINVAL`): a file system
    /// that opens with the flag but does not read with it.
    ok: AtomicBool,
}

impl SegmentFile {
    /// Opens segment file `path`; `direct` asks for the `O_DIRECT`
    /// descriptor too (left out quietly where the file system refuses it,
    /// e.g. tmpfs, and for version-1 segments, whose payloads are not
    /// aligned).
    pub(crate) fn open(path: &Path, direct: bool) -> io::Result<SegmentFile> {
        let file = fs::open_existing(path, false)?;
        let mut h = [0u8; format::SEGMENT_HEADER_LEN];
        let version = fs::read_exact_at(&file, &mut [IoSliceMut::new(&mut h)], 0)
            .ok()
            .and_then(|()| format::decode_segment_header(&h).ok())
            .map(|(_, v)| v);
        let direct = if direct && version != Some(format::SEGMENT_VERSION_V1) {
            Direct::open(path)
        } else {
            None
        };
        Ok(SegmentFile {
            residency: fs::residency(&file),
            file,
            direct,
            version,
        })
    }

    /// The `O_DIRECT` request that reads a record whole, its head (`head_len`
    /// bytes from `offset`) and its payload (`len` bytes after it) in one,
    /// when its payload would be read directly: there is a direct
    /// descriptor that works, the payload is aligned for it, and the page
    /// cache does not hold it all. Else whether the page cache holds it
    /// (read it with [`SegmentFile::read_buffered`]) or not.
    pub(crate) fn direct_request(&self, head_len: usize, offset: u64, len: usize) -> Plan<'_> {
        let Some(d) = self
            .direct
            .as_ref()
            .filter(|d| d.ok.load(Ordering::Relaxed))
        else {
            return Plan::Other;
        };
        let at = offset + head_len as u64;
        if !at.is_multiple_of(d.offset_align) || d.mem_align as u64 > format::PAYLOAD_ALIGN {
            return Plan::Other;
        }
        if self.cached(at, len as u64) {
            return Plan::Cached;
        }
        let start = offset / d.offset_align * d.offset_align;
        let end = (at + len as u64).next_multiple_of(d.offset_align);
        match (usize::try_from(at - start), usize::try_from(end - start)) {
            (Ok(lead), Ok(len)) => Plan::Direct(DirectRequest {
                file: &d.file,
                start,
                lead,
                len,
            }),
            _ => Plan::Other,
        }
    }

    /// Fills `head`, then the `payload` buffers in order, from `offset`:
    /// a record's padding and meta, then its payload, which starts at
    /// `offset + head.len()`; with `O_DIRECT` if `direct` asks for it and the
    /// page cache does not hold the payload. End of file is an error.
    pub(crate) fn read(
        &self,
        head: &mut [u8],
        payload: &mut [&mut [u8]],
        offset: u64,
        direct: bool,
    ) -> io::Result<()> {
        let at = offset + head.len() as u64;
        let len: usize = payload.iter().map(|p| p.len()).sum();
        if let Some(d) = self
            .direct
            .as_ref()
            .filter(|d| direct && d.ok.load(Ordering::Relaxed))
        {
            if at.is_multiple_of(d.offset_align) && !self.cached(at, len as u64) {
                match d.read(head, payload, offset, at, len) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        d.ok.store(false, Ordering::Relaxed);
                    }
                    other => return other,
                }
            }
        }
        self.read_buffered(head, payload, offset)
    }

    /// Whether the page cache holds all of bytes `offset..offset + len`.
    pub(crate) fn cached(&self, offset: u64, len: u64) -> bool {
        fs::cached(&self.file, offset, len, self.residency)
    }

    /// [`SegmentFile::read`] through the page cache, whatever it holds.
    pub(crate) fn read_buffered(
        &self,
        head: &mut [u8],
        payload: &mut [&mut [u8]],
        offset: u64,
    ) -> io::Result<()> {
        let mut bufs: Vec<IoSliceMut<'_>> = Vec::with_capacity(payload.len() + 1);
        bufs.push(IoSliceMut::new(head));
        bufs.extend(payload.iter_mut().map(|p| IoSliceMut::new(p)));
        fs::read_exact_at(&self.file, &mut bufs, offset)
    }
}

impl Direct {
    fn open(path: &Path) -> Option<Direct> {
        let file = fs::open_direct(path).ok()??;
        let (mem_align, offset_align) = fs::direct_alignment(&file)?;
        Some(Direct {
            file: Arc::new(file),
            mem_align,
            offset_align,
            ok: AtomicBool::new(true),
        })
    }

    /// [`SegmentFile::read`] with `O_DIRECT`, from the aligned offset at or
    /// before `offset`; `at` (the payload's offset, `len` bytes) is aligned.
    fn read(
        &self,
        head: &mut [u8],
        payload: &mut [&mut [u8]],
        offset: u64,
        at: u64,
        len: usize,
    ) -> io::Result<()> {
        let a = self.offset_align;
        let start = offset / a * a;
        // Bytes before the payload: whole blocks, the head at their end.
        let lead = usize::try_from(at - start).map_err(io::Error::other)?;
        if lead > BOUNCE_BYTES {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let aligned = (len as u64).is_multiple_of(a)
            && payload.iter().all(|p| {
                (p.as_ptr() as usize).is_multiple_of(self.mem_align)
                    && (p.len() as u64).is_multiple_of(a)
            });
        BOUNCE.with(|cell| {
            let mut cell = cell.borrow_mut();
            let bounce = match &mut *cell {
                Some(b) => b,
                None => cell.insert(memmap2::MmapMut::map_anon(BOUNCE_BYTES)?),
            };
            if aligned {
                // One request: the head's blocks into the bounce buffer,
                // the payload straight into its destination.
                let mut bufs: Vec<IoSliceMut<'_>> = Vec::with_capacity(payload.len() + 1);
                bufs.push(IoSliceMut::new(&mut bounce[..lead]));
                bufs.extend(payload.iter_mut().map(|p| IoSliceMut::new(p)));
                fs::read_exact_at(&self.file, &mut bufs, start)?;
                head.copy_from_slice(&bounce[lead - head.len()..lead]);
                return Ok(());
            }
            // Through the bounce buffer, in pieces, each copied out to the
            // parts of the destination it covers.
            let end = at + len as u64;
            let mut pos = start;
            while pos < end {
                let want = usize::try_from((end - pos).next_multiple_of(a))
                    .map_or(BOUNCE_BYTES, |n| n.min(BOUNCE_BYTES));
                let need = usize::try_from(end - pos).map_or(want, |n| n.min(want));
                let got = read_at_least(&self.file, &mut bounce[..want], pos, need)?;
                let piece = &bounce[..got.min(need)];
                scatter(piece, pos, at - head.len() as u64, head);
                let mut dst_at = at;
                for p in payload.iter_mut() {
                    scatter(piece, pos, dst_at, p);
                    dst_at += p.len() as u64;
                }
                pos += piece.len() as u64;
            }
            Ok(())
        })
    }
}

/// Reads into `buf` from `offset` until at least `need` bytes are in (or
/// `buf` is full); end of file before `need` is an error.
fn read_at_least(file: &File, buf: &mut [u8], offset: u64, need: usize) -> io::Result<usize> {
    let mut got = 0;
    while got < need {
        let n = rustix::io::pread(file, &mut buf[got..], offset + got as u64)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "record extends past end of file",
            ));
        }
        got += n;
    }
    Ok(got)
}

/// Copies the part of `piece` (the file's bytes from `piece_at`) that
/// overlaps `dst` (the file's bytes from `dst_at`) into `dst`.
fn scatter(piece: &[u8], piece_at: u64, dst_at: u64, dst: &mut [u8]) {
    let from = piece_at.max(dst_at);
    let to = (piece_at + piece.len() as u64).min(dst_at + dst.len() as u64);
    if from < to {
        let n = (to - from) as usize;
        let (p, d) = ((from - piece_at) as usize, (from - dst_at) as usize);
        dst[d..d + n].copy_from_slice(&piece[p..p + n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_copies_the_overlap_only() {
        let piece: Vec<u8> = (0..10).collect();
        let mut dst = [0xffu8; 4];
        scatter(&piece, 100, 108, &mut dst);
        assert_eq!(dst, [8, 9, 0xff, 0xff]);
        let mut dst = [0xffu8; 4];
        scatter(&piece, 100, 98, &mut dst);
        assert_eq!(dst, [0xff, 0xff, 0, 1]);
        let mut dst = [0xffu8; 4];
        scatter(&piece, 100, 110, &mut dst);
        assert_eq!(dst, [0xff; 4]);
    }
}
