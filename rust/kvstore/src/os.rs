//! The engine's only `unsafe` code: calls whose soundness rests on a promise
//! the type system cannot check.

#![allow(unsafe_code)]

use heed::{Env, EnvFlags, EnvOpenOptions, WithoutTls};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Opens the LMDB environment of a store's `index/` directory.
///
/// `heed` marks this unsafe because LMDB maps the data file: modifying it
/// outside LMDB while mapped is undefined behaviour.
pub(crate) fn open_lmdb(
    path: &Path,
    map_size: usize,
    nosync: bool,
) -> heed::Result<Env<WithoutTls>> {
    let mut opts = EnvOpenOptions::new().read_txn_without_tls();
    opts.map_size(map_size).max_dbs(8).max_readers(1022);
    let flags = if nosync {
        EnvFlags::NO_SYNC
    } else {
        EnvFlags::empty()
    };
    // SAFETY: the index directory belongs to the store and is only ever
    // written through LMDB (ours or another LMDB client honouring its lock
    // file). `Index::open` keeps one Env per path per process, so the same
    // environment is never opened twice in a process, which LMDB forbids.
    unsafe {
        opts.flags(flags);
        opts.open(path)
    }
}

/// A shared, writable mapping of a file (the hot-tier arena), addressed by
/// byte offsets. Every access is bounds- and alignment-checked here, so the
/// rest of the engine uses it without `unsafe`.
pub(crate) struct SharedMap {
    map: memmap2::MmapRaw,
}

impl SharedMap {
    /// Maps `len` bytes of `file`, pre-faulting every page (`MAP_POPULATE`).
    pub fn new(file: &std::fs::File, len: usize) -> std::io::Result<SharedMap> {
        let map = memmap2::MmapOptions::new()
            .len(len)
            .populate()
            .map_raw(file)?;
        Ok(SharedMap { map })
    }

    pub fn advise_huge_pages(&self) {
        // Best effort: without `shmem_enabled=advise` the kernel ignores it.
        let _ = self.map.advise(memmap2::Advice::HugePage);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Start address, to find the mapping in `/proc/self/smaps` and to let
    /// CUDA register it.
    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    fn check(&self, off: usize, len: usize, align: usize) {
        assert!(
            off.is_multiple_of(align)
                && off
                    .checked_add(len)
                    .is_some_and(|end| end <= self.map.len()),
            "arena access out of bounds or misaligned: offset {off}, length {len}"
        );
    }

    pub fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked above; the mapping is
        // page-aligned); the mapping lives as long as `self`. Shared memory may
        // be changed by other processes at any time, which is what atomics are
        // for.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    pub fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: as in `u64_at`, with 4-byte alignment.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    /// Copies bytes out of the mapping. Another process may be writing them
    /// concurrently: callers read under the arena's seqlock and discard the
    /// bytes when a slot version changed during the copy.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check(off, dst.len(), 1);
        // SAFETY: the source range is in bounds (checked) and cannot overlap
        // `dst`, a Rust slice outside the mapping. The bytes are plain data:
        // any value is valid, and a torn copy is detected and dropped by the
        // seqlock protocol in `arena.rs`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copies bytes into the mapping (the caller holds the arena's write lock
    /// and has marked the slot as being written).
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len(), 1);
        // SAFETY: in bounds (checked); `src` is outside the mapping. Readers
        // of this range check the slot version around their copy.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len())
        }
    }
}
