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
    opts.map_size(map_size).max_dbs(16).max_readers(1022);
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

/// Bytes `SharedMap::read_crc32c` copies before it checksums them, in the
/// L1 data cache then (half of it on the CPUs measured): the reads into a
/// buffer of the caller's (`get(out=)`, a slot's check). A paged load
/// instead lands each row in the engine's cache as it checksums it
/// (`SharedMap::read_rows_crc32c`; through a run-long piece on a CPU
/// without AVX2).
const CRC_PIECE: usize = 16 << 10;

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

    #[allow(clippy::cast_ptr_alignment)] // checked by `check`
    pub fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked above; the mapping is
        // page-aligned); the mapping lives as long as `self`. Shared memory may
        // be changed by other processes at any time, which is what atomics are
        // for.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    #[allow(clippy::cast_ptr_alignment)] // checked by `check`
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
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len());
        }
    }

    /// Copies `dst.len()` bytes out of the mapping at `off` into `dst` and
    /// returns `crc32c_append(crc, dst)`: the checksum of the bytes copied,
    /// which a concurrent writer cannot make differ from them, taken a
    /// piece at a time while the piece is in the CPU's L1 cache. Same
    /// concurrency caveat as `read`.
    pub fn read_crc32c(&self, off: usize, dst: &mut [u8], mut crc: u32) -> u32 {
        self.check(off, dst.len(), 1);
        for (i, piece) in dst.chunks_mut(CRC_PIECE).enumerate() {
            self.read(off + i * CRC_PIECE, piece);
            crc = crate::crc::append(crc, piece);
        }
        crc
    }

    /// Copies up to four runs out of the mapping, each checksummed as it
    /// goes, in one pass: run `s` is the `shape[0] * shape[1]` rows of
    /// `row` bytes that lie end to end at `src[s]`, its row `(t, h)` lands
    /// as `outs[s]` says, and the return is `crc32c_append(crcs[s], run s)`
    /// for each. Every 32 bytes is loaded once and both fed to a `crc32`
    /// chain of its own run (up to four chains interleaved, so the
    /// instruction's latency is hidden) and stored from the same register:
    /// what lands is what was checksummed, whatever another process does to
    /// the slot meanwhile. Rows of an `outs` entry with `stream` go out with
    /// streaming stores where they are 32-byte aligned (call `stream_fence`
    /// before the bytes are handed on): the reads of the slot and the
    /// writes to a paged cache then share one pass, as in memcpy. Needs
    /// `has_fused_rows()` and `row` a multiple of 32; panics otherwise, or
    /// where a row lies outside its slice or the mapping. Same concurrency
    /// caveat as `read`.
    pub fn read_rows_crc32c(
        &self,
        src: &[usize],
        outs: &mut [Rows<'_>],
        shape: [usize; 2],
        row: usize,
        crcs: &mut [u32],
    ) {
        let n = src.len();
        assert!(
            (1..=4).contains(&n) && outs.len() == n && crcs.len() == n,
            "read_rows_crc32c: one to four runs, each with its rows and crc"
        );
        assert!(has_fused_rows(), "read_rows_crc32c needs AVX2 and SSE4.2");
        assert!(
            row > 0 && row.is_multiple_of(32),
            "rows must be a multiple of 32 bytes"
        );
        let rows = shape[0].checked_mul(shape[1]).expect("rows");
        let bytes = rows.checked_mul(row).expect("run bytes");
        let mut dst = [std::ptr::null_mut::<u8>(); 4];
        let mut strides = [[0usize; 2]; 4];
        let mut stream = [false; 4];
        let mut from = [std::ptr::null::<u8>(); 4];
        for s in 0..n {
            self.check(src[s], bytes, 1);
            let o = &mut outs[s];
            let end = (0..2)
                .try_fold(o.at, |end, a| {
                    shape[a]
                        .saturating_sub(1)
                        .checked_mul(o.strides[a])?
                        .checked_add(end)
                })
                .and_then(|e| e.checked_add(row));
            assert!(
                rows == 0 || end.is_some_and(|e| e <= o.dst.len()),
                "read_rows_crc32c: a row lies outside its destination"
            );
            dst[s] = o.dst.as_mut_ptr().wrapping_add(o.at);
            strides[s] = o.strides;
            stream[s] = o.stream
                && (dst[s] as usize).is_multiple_of(32)
                && o.strides.iter().all(|st| st.is_multiple_of(32));
            from[s] = self.map.as_ptr().wrapping_add(src[s]);
        }
        if rows == 0 {
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("has_fused_rows is false off x86-64: {from:?} {dst:?} {strides:?} {stream:?}");
        #[cfg(target_arch = "x86_64")]
        {
            let mut c = [0u32; 4];
            c[..n].copy_from_slice(crcs);
            let job = FusedRows {
                from,
                dst,
                strides,
                stream,
                shape,
                row,
            };
            // SAFETY: the CPU has AVX2 and SSE4.2 (asserted). Run `s < n` is
            // `bytes` readable bytes of the mapping at `from[s]`; each of its
            // rows `(t, h)` is `row` writable bytes at `dst[s] + t * strides[s][0]
            // + h * strides[s][1]`, inside `outs[s].dst` (asserted above, without
            // overflow), which is a Rust slice and so neither overlaps the
            // mapping nor another run's destination; streamed rows are 32-byte
            // aligned (checked: `dst[s]` and both strides are, and `row` is a
            // multiple of 32).
            let c = unsafe {
                match n {
                    1 => fused_rows_avx2::<1>(&job, c),
                    2 => fused_rows_avx2::<2>(&job, c),
                    3 => fused_rows_avx2::<3>(&job, c),
                    _ => fused_rows_avx2::<4>(&job, c),
                }
            };
            crcs.copy_from_slice(&c[..n]);
        }
    }

    /// Copies bytes into the mapping (the caller holds the arena's write lock
    /// and has marked the slot as being written).
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check(off, src.len(), 1);
        // SAFETY: in bounds (checked); `src` is outside the mapping. Readers
        // of this range check the slot version around their copy.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len());
        }
    }
}

/// How to ask which of a file's pages the page cache holds (`all_cached`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Residency {
    /// `cachestat(2)` (Linux 6.5), falling back to `mincore` where it is
    /// missing or refused.
    Cachestat,
    /// `mincore(2)` only: on overlayfs, whose `cachestat` counts the
    /// overlay's own page cache, always empty, not the real file's.
    Mincore,
}

/// Whether the page cache holds every page of `file`'s bytes
/// `offset..offset + len` (a partial page at either end included): yes
/// where it cannot be told. Only a hint, deciding between a direct and a
/// buffered read, which read the same bytes.
///
/// `cachestat(2)` counts the pages exactly. Where the kernel lacks it
/// (before 6.5), refuses it (since 6.14, for a file this process neither
/// owns nor may write; or a seccomp filter), or `how` says so, `mincore(2)`
/// over a mapping of the range is asked about its first and last
/// [`MINCORE_SAMPLE`] pages only, for a bounded cost: a range cached at both
/// ends and not between counts as cached. Neither touches the cache, unlike
/// a read with `RWF_NOWAIT`, which starts readahead.
///
/// `mincore` costs more per page: 6 µs over 16 KiB, 47 µs over all of
/// 2 MiB cached (a fifth of its copy from the page cache; the mapping made
/// for each call included). Over the two ends of a longer range it takes
/// 20 µs at most, 8 µs where the first pages are missing; `cachestat` took
/// 0.4 µs over 16 KiB, 3-17 µs over 2 MiB and 54 µs over 32 MiB (the AMD
/// EPYC guest of 2026-11-29).
pub(crate) fn all_cached(file: &std::fs::File, offset: u64, len: u64, how: Residency) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Set once `cachestat` is found missing (`ENOSYS`): each later call
    /// goes straight to `mincore`. A refusal (`EPERM`) is per file.
    static NO_CACHESTAT: AtomicBool = AtomicBool::new(false);
    let Some(end) = offset.checked_add(len).filter(|_| len > 0) else {
        return true;
    };
    let page = rustix::param::page_size() as u64;
    let pages = end.div_ceil(page) - offset / page;
    if how == Residency::Cachestat && !NO_CACHESTAT.load(Ordering::Relaxed) {
        match cachestat_pages(file, offset, len) {
            Ok(n) => return n >= pages,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                NO_CACHESTAT.store(true, Ordering::Relaxed);
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            Err(_) => return true,
        }
    }
    sampled_cached(file, offset, len).unwrap_or(true)
}

/// `all_cached` by `mincore`: the first and last [`MINCORE_SAMPLE`] pages of
/// the range (not empty; all of it if that is as many), over one mapping.
fn sampled_cached(file: &std::fs::File, offset: u64, len: u64) -> Option<bool> {
    let (map, pages) = map_pages(file, offset, len)?;
    let all = |from: usize, to: usize| Some(resident_in(&map, from, to, true)? == to - from);
    let sample = MINCORE_SAMPLE;
    if pages <= 2 * sample {
        return all(0, pages);
    }
    Some(all(0, sample)? && all(pages - sample, pages)?)
}

/// Pages at each end of a range that `all_cached` asks `mincore` about.
const MINCORE_SAMPLE: usize = 64;

/// `cachestat(2)` over bytes `offset..offset + len` (not empty): the pages
/// the page cache holds.
fn cachestat_pages(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    /// `struct cachestat_range` of the kernel's uapi.
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    /// `struct cachestat` of the kernel's uapi (its field names).
    #[repr(C)]
    #[derive(Default)]
    #[allow(clippy::struct_field_names)]
    struct CacheStat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// The same number on every architecture (the unified syscall table).
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off: offset, len };
    let mut st = CacheStat::default();
    // SAFETY: `file` is an open descriptor for the duration of the call;
    // `range` and `st` are valid, initialised `#[repr(C)]` structs of the
    // kernel's layout that outlive the call (the kernel reads one, writes
    // the other); flags must be 0.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &raw const range,
            &raw mut st,
            0 as libc::c_uint,
        )
    };
    if rc == 0 {
        Ok(st.nr_cache)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A read-only shared mapping of the pages of `file` that hold bytes
/// `offset..offset + len` (not empty), made to ask `mincore` about and
/// never read, so a file changed or truncated under it is no hazard; and
/// how many pages it spans. `None` where the range cannot be mapped.
fn map_pages(file: &std::fs::File, offset: u64, len: u64) -> Option<(memmap2::Mmap, usize)> {
    let page = rustix::param::page_size() as u64;
    let start = offset / page * page;
    let map_len = usize::try_from(offset.checked_add(len)?.div_ceil(page) * page - start).ok()?;
    // SAFETY: never read (above): only its pages' residency is asked.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(start)
            .len(map_len)
            .map(file)
            .ok()?
    };
    Some((map, map_len / page as usize))
}

/// Of pages `from..to` of `map` (from `map_pages`), how many the page cache
/// holds, as `mincore(2)` reports them, 64 at a time; with `stop`, counting
/// ends at the first page missing. For a shared file mapping the kernel
/// answers from the page cache whether or not this process mapped the page
/// in (since Linux 5.2; 5.0 and 5.1 counted only pages mapped in, so every
/// read there would be direct). Where it will not tell (a file this process
/// neither owns nor may write) it reports every page resident: then reads
/// are buffered, as before direct reads. Pages past the end of the file are
/// not resident, except within a huge page of a tmpfs mounted `huge=`.
fn resident_in(map: &memmap2::Mmap, from: usize, to: usize, stop: bool) -> Option<usize> {
    const STEP: usize = 64;
    let page = rustix::param::page_size();
    let mut vec = [0u8; STEP];
    let mut resident = 0;
    for at in (from..to).step_by(STEP) {
        let n = (to - at).min(STEP);
        if (at + n) * page > map.len() {
            return None;
        }
        // SAFETY: `map` starts at a page boundary (`map_pages` maps from
        // one, so memmap2 adds no offset) and lives for the call; pages
        // `at..at + n` lie within it (checked above); `vec` has a byte for
        // each of them (`n` is at most `STEP`).
        let rc = unsafe {
            libc::mincore(
                map.as_ptr().add(at * page) as *mut libc::c_void,
                n * page,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return None;
        }
        let here = vec[..n].iter().filter(|&&b| b & 1 != 0).count();
        resident += here;
        if stop && here < n {
            break;
        }
    }
    Some(resident)
}

/// Starts writing back `file`'s dirty pages in `[offset, offset + len)`
/// (`sync_file_range` with `SYNC_FILE_RANGE_WRITE` alone): it returns once
/// the writes are queued, waits for none of them and promises nothing about
/// durability, so a later `fdatasync` finds most of the range on the disk
/// already instead of writing all of it then.
pub(crate) fn start_writeback(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is an open descriptor for the duration of the call; the
    // other arguments are plain integers (the kernel checks the range).
    let rc = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A new open file description of `file`, through `/proc/self/fd`: it names
/// `file` itself even if its path was removed or reused (checked: the same
/// device and inode).
pub(crate) fn reopen(file: &std::fs::File) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let name = format!("/proc/self/fd/{}", file.as_raw_fd());
    let own = std::fs::File::open(&name)?;
    let (a, b) = (own.metadata()?, file.metadata()?);
    if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
        return Err(std::io::Error::other(format!("{name} names another file")));
    }
    Ok(own)
}

/// Descriptors that a child forked from this process closes as it starts
/// (`pthread_atfork`); -1 is a free slot.
static FORK_CLOSED: [std::sync::atomic::AtomicI32; 256] =
    [const { std::sync::atomic::AtomicI32::new(-1) }; 256];

/// The handler `pthread_atfork` runs in a forked child, before `fork`
/// returns there: the child is one thread, and `close` is async-signal-safe.
extern "C" fn close_in_child() {
    for slot in &FORK_CLOSED {
        let fd = slot.swap(-1, std::sync::atomic::Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: `fd` was registered by a live `ParentOnly`, whose
            // descriptor the child inherited and never uses (`get`).
            unsafe { libc::close(fd) };
        }
    }
}

/// A new open file description of `file`, which forked children do not
/// keep: they close it as they start. A lock (`flock`) taken through it is
/// then this process's alone, and dies with it, where one taken through a
/// description a child shares outlives its taker for as long as the child
/// lives (even an idle one, forked long before).
pub(crate) struct ParentOnly {
    file: std::mem::ManuallyDrop<std::fs::File>,
    pid: u32,
}

impl ParentOnly {
    /// Opens it through `/proc/self/fd`, which names `file` itself even if
    /// its path was removed or reused; `None` where that cannot be done
    /// (no `/proc`, or 256 of them open at once).
    pub(crate) fn open(file: &std::fs::File) -> Option<ParentOnly> {
        use std::os::fd::AsRawFd;
        static HANDLER: std::sync::Once = std::sync::Once::new();
        HANDLER.call_once(|| {
            // SAFETY: registers a handler that only swaps atomics and closes
            // descriptors; none for before the fork or in the parent.
            unsafe { libc::pthread_atfork(None, None, Some(close_in_child)) };
        });
        let own = reopen(file).ok()?;
        let fd = own.as_raw_fd();
        FORK_CLOSED.iter().find(|slot| {
            slot.compare_exchange(
                -1,
                fd,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
        })?;
        Some(ParentOnly {
            file: std::mem::ManuallyDrop::new(own),
            pid: std::process::id(),
        })
    }

    /// The description, in the process that opened it (a forked child has
    /// closed its copy: `None` there).
    pub(crate) fn get(&self) -> Option<&std::fs::File> {
        (std::process::id() == self.pid).then_some(&*self.file)
    }
}

impl Drop for ParentOnly {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        if std::process::id() != self.pid {
            return; // closed as the child started; the number may be another file's now
        }
        let fd = self.file.as_raw_fd();
        for slot in &FORK_CLOSED {
            if slot
                .compare_exchange(
                    fd,
                    -1,
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_ok()
            {
                break;
            }
        }
        // SAFETY: dropped once, here, in the process that opened it.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.file) };
    }
}

/// What `ofd_lock` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OfdLock {
    /// A shared (read) lock, failing at once if someone holds an exclusive one.
    SharedTry,
    /// An exclusive (write) lock, failing at once if someone holds any.
    ExclusiveTry,
}

/// Takes an open-file-description lock (`F_OFD_SETLK`) on the whole of
/// `file`. Unlike `flock` (the arena's writer lock) it never interacts with
/// `flock` locks, and unlike POSIX record locks it belongs to the open file
/// description, not to the process: another description of the same file,
/// in this process or another, conflicts; closing an unrelated descriptor
/// does not release it; the kernel releases it when the last descriptor of
/// the description closes (a dead process's included). Returns false, at
/// once, if another description holds a conflicting lock.
pub(crate) fn ofd_lock(file: &std::fs::File, how: OfdLock) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: `flock` is a plain C struct; all zeroes is a valid value
    // (whence SEEK_SET, start 0, len 0 = the whole file, pid 0 as OFD
    // locks require).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    let kind = match how {
        OfdLock::SharedTry => libc::F_RDLCK,
        OfdLock::ExclusiveTry => libc::F_WRLCK,
    };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    loop {
        // SAFETY: `file` is an open descriptor for the duration of the call
        // and `fl` a valid, initialised `flock` the kernel reads.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &raw mut fl) };
        if rc == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN | libc::EACCES) => return Ok(false),
            _ => return Err(err),
        }
    }
}

/// The 8x8 transpose of two-byte elements as 24 unpacks, on 128-bit vectors
/// or on each 128-bit lane of wider ones (the unpack intrinsics are named
/// by the caller): `$a` holds 8 rows, the result the 8 columns.
#[cfg(target_arch = "x86_64")]
macro_rules! unpack_8x8_u16 {
    ($a:expr, $lo16:ident, $hi16:ident, $lo32:ident, $hi32:ident, $lo64:ident, $hi64:ident) => {{
        let a = $a;
        let t = [
            $lo16(a[0], a[1]),
            $hi16(a[0], a[1]),
            $lo16(a[2], a[3]),
            $hi16(a[2], a[3]),
            $lo16(a[4], a[5]),
            $hi16(a[4], a[5]),
            $lo16(a[6], a[7]),
            $hi16(a[6], a[7]),
        ];
        let u = [
            $lo32(t[0], t[2]),
            $hi32(t[0], t[2]),
            $lo32(t[1], t[3]),
            $hi32(t[1], t[3]),
            $lo32(t[4], t[6]),
            $hi32(t[4], t[6]),
            $lo32(t[5], t[7]),
            $hi32(t[5], t[7]),
        ];
        [
            $lo64(u[0], u[4]),
            $hi64(u[0], u[4]),
            $lo64(u[1], u[5]),
            $hi64(u[1], u[5]),
            $lo64(u[2], u[6]),
            $hi64(u[2], u[6]),
            $lo64(u[3], u[7]),
            $hi64(u[3], u[7]),
        ]
    }};
}

/// One past the last byte of `rows` rows of `len` bytes, the first at `at`
/// and each `stride` after the one before; `None` where that overflows.
#[cfg(target_arch = "x86_64")]
fn rows_end(at: usize, stride: usize, rows: usize, len: usize) -> Option<usize> {
    stride
        .checked_mul(rows - 1)?
        .checked_add(at)?
        .checked_add(len)
}

/// Transposes an 8x8 tile of 2-byte elements: the 16 bytes at
/// `src[s + i * ss..]` (row `i`) hold elements `(i, 0..8)`, which land at
/// element `i` of the 16 bytes at `dst[d + j * ds..]` (row `j`), each
/// `(i, j)`. Offsets and strides in bytes; panics where a row is out of
/// bounds. SSE2: 8 loads, 24 unpacks and 8 stores where the element by
/// element copy takes 64 loads and 64 stores.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn transpose_8x8_u16(
    (dst, d, ds): (&mut [u8], usize, usize),
    (src, s, ss): (&[u8], usize, usize),
) {
    use std::arch::x86_64::{
        _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi16, _mm_unpackhi_epi32,
        _mm_unpackhi_epi64, _mm_unpacklo_epi16, _mm_unpacklo_epi32, _mm_unpacklo_epi64,
    };
    assert!(
        rows_end(s, ss, 8, 16).is_some_and(|e| e <= src.len()),
        "tile rows out of bounds"
    );
    assert!(
        rows_end(d, ds, 8, 16).is_some_and(|e| e <= dst.len()),
        "tile rows out of bounds"
    );
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    // SAFETY: SSE2 is part of the x86-64 baseline, so every CPU that runs
    // this code has it. Row `i` of either side is the 16 bytes at `at + i *
    // stride`, `i < 8`, inside its slice (asserted above, without
    // overflow); `src` and `dst` are distinct slices, so loads and stores
    // do not overlap; `loadu`/`storeu` take any alignment.
    unsafe {
        let a: [_; 8] = std::array::from_fn(|i| _mm_loadu_si128(sp.add(s + i * ss).cast()));
        let r = unpack_8x8_u16!(
            a,
            _mm_unpacklo_epi16,
            _mm_unpackhi_epi16,
            _mm_unpacklo_epi32,
            _mm_unpackhi_epi32,
            _mm_unpacklo_epi64,
            _mm_unpackhi_epi64
        );
        for (j, v) in r.into_iter().enumerate() {
            _mm_storeu_si128(dp.add(d + j * ds).cast(), v);
        }
    }
}

/// Whether `transpose_16x8_u16_stream` runs on this CPU (AVX2).
pub(crate) fn has_wide_transpose() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `transpose_8x8_u16` of two tiles side by side, streamed from registers:
/// the 16 bytes at `src[s + j * ss..]` (row `j < 16`) hold elements `(j,
/// 0..8)`, which land at element `j` of the 32 bytes at `dst[d + i * ds..]`
/// (row `i < 8`), written with non-temporal stores (`stream_fence` before
/// the bytes are handed on). Offsets and strides in bytes; each `dst` row
/// must start on a 32-byte boundary. Panics where a row is out of bounds or
/// misaligned, or without AVX2 (`has_wide_transpose`). The two tiles go
/// through the 8x8 network at once, one in each 128-bit lane, and each row
/// leaves in one 32-byte store: a quarter of the stores of the tiles staged
/// in the CPU's cache and then streamed (K's transpose into vLLM's CPU
/// layout was bound by its stores).
#[cfg(target_arch = "x86_64")]
pub(crate) fn transpose_16x8_u16_stream(
    (dst, d, ds): (&mut [u8], usize, usize),
    (src, s, ss): (&[u8], usize, usize),
) {
    assert!(has_wide_transpose(), "transpose_16x8_u16_stream needs AVX2");
    assert!(
        rows_end(s, ss, 16, 16).is_some_and(|e| e <= src.len()),
        "tile rows out of bounds"
    );
    assert!(
        rows_end(d, ds, 8, 32).is_some_and(|e| e <= dst.len()),
        "tile rows out of bounds"
    );
    let dp = dst.as_mut_ptr().wrapping_add(d);
    assert!(
        (dp as usize).is_multiple_of(32) && ds.is_multiple_of(32),
        "tile rows not on 32-byte boundaries"
    );
    // SAFETY: the CPU has AVX2 (asserted). Source rows `j < 16` are the 16
    // bytes at `s + j * ss` and destination rows `i < 8` the 32 bytes at `d
    // + i * ds`, inside their slices (asserted, without overflow); the
    // destination rows are 32-byte aligned (asserted), as the streaming
    // store needs; `src` and `dst` are distinct slices.
    unsafe { transpose_16x8_u16_avx2(dp, ds, src.as_ptr().add(s), ss) }
}

/// The body of `transpose_16x8_u16_stream`.
///
/// # Safety
///
/// The CPU must have AVX2; `src + j * ss` must be readable for 16 bytes
/// (`j < 16`) and `dst + i * ds` writable for 32 bytes and 32-byte aligned
/// (`i < 8`), the two not overlapping.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::cast_ptr_alignment)] // `loadu` takes any alignment; `dst` rows are checked
unsafe fn transpose_16x8_u16_avx2(dst: *mut u8, ds: usize, src: *const u8, ss: usize) {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_castsi128_si256, _mm256_inserti128_si256, _mm256_stream_si256,
        _mm256_unpackhi_epi16, _mm256_unpackhi_epi32, _mm256_unpackhi_epi64, _mm256_unpacklo_epi16,
        _mm256_unpacklo_epi32, _mm256_unpacklo_epi64, _mm_loadu_si128,
    };
    // Row `i` in the low lane, row `i + 8` in the high one.
    let a: [__m256i; 8] = std::array::from_fn(|i| {
        // SAFETY: rows `i` and `i + 8` are readable for 16 bytes (caller);
        // `loadu` takes any alignment.
        unsafe {
            let lo = _mm_loadu_si128(src.add(i * ss).cast::<__m128i>());
            let hi = _mm_loadu_si128(src.add((i + 8) * ss).cast::<__m128i>());
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
        }
    });
    let r = unpack_8x8_u16!(
        a,
        _mm256_unpacklo_epi16,
        _mm256_unpackhi_epi16,
        _mm256_unpacklo_epi32,
        _mm256_unpackhi_epi32,
        _mm256_unpacklo_epi64,
        _mm256_unpackhi_epi64
    );
    for (i, v) in r.into_iter().enumerate() {
        // SAFETY: row `i < 8` is writable for 32 bytes and 32-byte aligned
        // (caller).
        unsafe { _mm256_stream_si256(dst.add(i * ds).cast::<__m256i>(), v) };
    }
}

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where
/// `dst` is 16-byte aligned and a multiple of 16 bytes long, else with a
/// plain copy. A paged load's destination is a serving engine's cache, far
/// larger than the CPU's: a plain store first reads each line it writes
/// (a second pass over that memory), a streaming store does not. The
/// stores are weakly ordered: call `stream_fence` before the bytes are
/// handed on.
#[inline]
#[allow(clippy::cast_ptr_alignment)] // `loadu` takes any alignment; `dst` is checked
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if (dst.as_ptr() as usize).is_multiple_of(16) && dst.len().is_multiple_of(16) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..dst.len()).step_by(16) {
            // SAFETY: SSE2 is part of the x86-64 baseline. `i + 16 <=
            // len` for both slices (equal lengths, a multiple of 16);
            // `dp + i` is 16-byte aligned (checked above), as
            // `_mm_stream_si128` needs; `loadu` takes any alignment; the
            // slices are distinct borrows, so they do not overlap.
            unsafe {
                let v = _mm_loadu_si128(sp.add(i).cast::<__m128i>());
                _mm_stream_si128(dp.add(i).cast::<__m128i>(), v);
            }
        }
        return;
    }
    dst.copy_from_slice(src);
}

/// Where `SharedMap::read_rows_crc32c` lands one run: its row `(t, h)` at
/// `dst[at + t * strides[0] + h * strides[1]..]`, with streaming stores if
/// `stream` (a destination in main memory, not read again soon).
pub(crate) struct Rows<'a> {
    pub dst: &'a mut [u8],
    pub at: usize,
    pub strides: [usize; 2],
    pub stream: bool,
}

/// Whether `SharedMap::read_rows_crc32c` runs on this CPU (AVX2, SSE4.2).
pub(crate) fn has_fused_rows() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `read_rows_crc32c`'s checked arguments, as pointers.
#[cfg(target_arch = "x86_64")]
struct FusedRows {
    from: [*const u8; 4],
    dst: [*mut u8; 4],
    strides: [[usize; 2]; 4],
    stream: [bool; 4],
    shape: [usize; 2],
    row: usize,
}

/// 32 bytes loaded from `p` by exactly one instruction. A plain load's
/// value may be loaded again where the compiler finds it cheaper (it
/// turned the words fed to `crc32` into `crc32` instructions reading
/// memory): a second read of a slot that another process may be writing,
/// whose value need not be the one stored.
///
/// # Safety
///
/// The CPU must have AVX2; `p` must be readable for 32 bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_once(p: *const u8) -> std::arch::x86_64::__m256i {
    let v;
    // SAFETY: `p` is readable for 32 bytes (caller); `vmovdqu` takes any
    // alignment and touches neither the stack nor the flags.
    unsafe {
        std::arch::asm!(
            "vmovdqu {v}, ymmword ptr [{p}]",
            p = in(reg) p,
            v = out(ymm_reg) v,
            options(nostack, readonly, preserves_flags),
        );
    }
    v
}

/// The loop of `read_rows_crc32c` over its first `N` runs: row by row, 32
/// bytes of each run in turn, so that the `N` crc32 chains interleave.
///
/// # Safety
///
/// The CPU must have AVX2 and SSE4.2; for `s < N`, `job.from[s]` must be
/// readable for `shape[0] * shape[1] * row` bytes and each row `(t, h)` at
/// `job.dst[s] + t * strides[s][0] + h * strides[s][1]` writable for `row`
/// bytes (32-byte aligned where `stream[s]`), no destination overlapping a
/// source or another run's rows; `row` a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,sse4.2")]
#[allow(clippy::cast_ptr_alignment)] // `loadu`/`storeu` take any alignment; streamed rows are checked
unsafe fn fused_rows_avx2<const N: usize>(job: &FusedRows, mut crc: [u32; 4]) -> [u32; 4] {
    use std::arch::x86_64::{
        __m256i, _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_storeu_si256,
        _mm256_stream_si256, _mm_crc32_u64, _mm_cvtsi128_si64, _mm_extract_epi64, _mm_prefetch,
        _MM_HINT_T0,
    };
    // Bytes ahead of each load that its run is prefetched: loads that
    // miss one after another leave DRAM idle (one thread, 16 MiB paged
    // load: 1.64-1.73 ms without, 1.23-1.40 at 2 KiB, worse at 0.5, 1, 4
    // and 8 KiB). Past a run's end it is a hint into another run or slot.
    const PREFETCH: usize = 2048;
    let [tokens, heads] = job.shape;
    // The instruction updates the register form (inverted, both ways).
    let mut c: [u64; 4] = crc.map(|x| u64::from(!x));
    let mut src = job.from;
    for t in 0..tokens {
        for h in 0..heads {
            let to: [*mut u8; 4] = std::array::from_fn(|s| {
                job.dst[s]
                    .wrapping_add(t * job.strides[s][0])
                    .wrapping_add(h * job.strides[s][1])
            });
            for k in (0..job.row).step_by(32) {
                for s in 0..N {
                    // SAFETY: 32 bytes of run `s`'s row `(t, h)` at `k <
                    // row`: readable at `src[s]`, writable at `to[s] + k`
                    // (caller), aligned where streamed.
                    unsafe {
                        if k % 64 == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(
                                src[s].wrapping_add(k + PREFETCH).cast::<i8>(),
                            );
                        }
                        let v = load_once(src[s].add(k));
                        let (lo, hi) =
                            (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                        c[s] = _mm_crc32_u64(c[s], _mm_cvtsi128_si64(lo) as u64);
                        c[s] = _mm_crc32_u64(c[s], _mm_extract_epi64::<1>(lo) as u64);
                        c[s] = _mm_crc32_u64(c[s], _mm_cvtsi128_si64(hi) as u64);
                        c[s] = _mm_crc32_u64(c[s], _mm_extract_epi64::<1>(hi) as u64);
                        let d = to[s].add(k).cast::<__m256i>();
                        if job.stream[s] {
                            _mm256_stream_si256(d, v);
                        } else {
                            _mm256_storeu_si256(d, v);
                        }
                    }
                }
            }
            for p in src.iter_mut().take(N) {
                *p = p.wrapping_add(job.row);
            }
        }
    }
    for s in 0..N {
        crc[s] = !(c[s] as u32);
    }
    crc
}

/// Orders the streaming stores (`stream_copy`, `transpose_16x8_u16_stream`)
/// before every later store (and so before whatever tells another thread
/// the bytes are there).
#[inline]
pub(crate) fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86-64 baseline; `sfence` has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Reads in flight through one `io_uring`, each into a buffer the ring
/// owns: a buffer is handed out (`wait`) only once the kernel is done with
/// it, and the ring waits for every read still in flight before its
/// buffers are freed (`Drop`), so no read ever lands in freed or borrowed
/// memory. A read's payload lands on a huge-page boundary of its buffer
/// (an anonymous mapping; huge pages where the kernel gives them), its
/// head in the small pages before it: a request is then two or three
/// physically contiguous pieces, which the device serves far faster than
/// the 64 scattered runs of a `[L, 2, T, H, D]` destination.
pub(crate) struct ReadRing {
    ring: io_uring::IoUring,
    slots: Vec<RingSlot>,
}

/// Huge-page size of the ring's buffers.
const HUGE: usize = 2 << 20;

struct RingSlot {
    buf: memmap2::MmapMut,
    /// Offset of the huge-page boundary a payload starts on.
    pay: usize,
    /// Bytes of the read in flight before its payload.
    lead: usize,
    /// The file read from, kept open while its read is in flight.
    file: Option<std::sync::Arc<std::fs::File>>,
    state: SlotState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    InFlight,
    /// Completed: bytes read, or a negated errno.
    Done(i32),
}

impl ReadRing {
    /// A ring of `depth` reads of payloads of at most `payload` bytes, each
    /// after at most [`HUGE`] bytes of head.
    pub(crate) fn new(depth: usize, payload: usize) -> std::io::Result<ReadRing> {
        let entries = u32::try_from(depth.next_power_of_two()).map_err(std::io::Error::other)?;
        let ring = io_uring::IoUring::new(entries)?;
        let room = payload.next_multiple_of(HUGE);
        let slots = (0..depth)
            .map(|_| {
                // Room for the head before the first huge-page boundary
                // past `HUGE`, and for the payload after it.
                let buf = memmap2::MmapMut::map_anon(2 * HUGE + room)?;
                let pay = HUGE + (HUGE - buf.as_ptr() as usize % HUGE) % HUGE;
                // Best effort: without huge pages a request is more pieces.
                let _ = buf.advise_range(memmap2::Advice::HugePage, pay, room);
                Ok(RingSlot {
                    buf,
                    pay,
                    lead: 0,
                    file: None,
                    state: SlotState::Free,
                })
            })
            .collect::<std::io::Result<_>>()?;
        Ok(ReadRing { ring, slots })
    }

    /// Whether a read of `len` bytes, `lead` of them before the payload,
    /// fits a buffer.
    pub(crate) fn fits(&self, len: usize, lead: usize) -> bool {
        self.slots
            .first()
            .is_some_and(|s| lead <= HUGE && s.pay - lead + len <= s.buf.len())
    }

    pub(crate) fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Whether slot `slot` can take a read.
    pub(crate) fn is_free(&self, slot: usize) -> bool {
        self.slots[slot].state == SlotState::Free
    }

    /// Starts reading `len` bytes of `file` from `offset` into slot `slot`
    /// (free), the payload `lead` bytes in (the read `fits`); the kernel
    /// has it when this returns.
    pub(crate) fn submit(
        &mut self,
        slot: usize,
        file: &std::sync::Arc<std::fs::File>,
        (offset, len, lead): (u64, usize, usize),
    ) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        assert!(self.fits(len, lead), "read does not fit a ring buffer");
        let s = &mut self.slots[slot];
        assert!(s.state == SlotState::Free, "ring slot busy");
        let len32 = u32::try_from(len).map_err(std::io::Error::other)?;
        let at = s.pay - lead;
        let entry = io_uring::opcode::Read::new(
            io_uring::types::Fd(file.as_raw_fd()),
            s.buf[at..at + len].as_mut_ptr(),
            len32,
        )
        .offset(offset)
        .build()
        .user_data(slot as u64);
        // SAFETY: the entry's buffer is `len` bytes of slot `slot`'s
        // mapping (in bounds: sliced above), owned by this ring and not lent out while the
        // slot is in flight (`wait` hands it out only once the kernel
        // reported the read done; `Drop` waits for every read in flight
        // before the mappings go). The descriptor stays open as long: the
        // slot keeps its `Arc`.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        pushed.map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
        s.file = Some(file.clone());
        s.lead = lead;
        s.state = SlotState::InFlight;
        self.ring.submit()?;
        Ok(())
    }

    /// Waits for slot `slot`'s read (submitted, not yet taken); its bytes
    /// from the request's start, as many as were read (fewer at end of
    /// file), or its error. The slot stays taken until `release`.
    pub(crate) fn wait(&mut self, slot: usize) -> std::io::Result<&[u8]> {
        loop {
            match self.slots[slot].state {
                SlotState::Done(res) => {
                    let s = &self.slots[slot];
                    let at = s.pay - s.lead;
                    return match usize::try_from(res) {
                        Ok(n) => Ok(&s.buf[at..at + n]),
                        Err(_) => Err(std::io::Error::from_raw_os_error(-res)),
                    };
                }
                SlotState::InFlight => self.reap(true)?,
                SlotState::Free => panic!("ring slot {slot} waited on with no read"),
            }
        }
    }

    /// Makes slot `slot` free again, waiting for its read if still in
    /// flight.
    pub(crate) fn release(&mut self, slot: usize) {
        while self.slots[slot].state == SlotState::InFlight {
            if self.reap(true).is_err() {
                // The kernel cannot be waited on: keep the slot (and its
                // buffer) out of use for good rather than risk a late write.
                return;
            }
        }
        self.slots[slot].state = SlotState::Free;
        self.slots[slot].file = None;
    }

    /// Moves completed reads to their slots; with `block`, waits for one.
    fn reap(&mut self, block: bool) -> std::io::Result<()> {
        if block {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            if let Some(s) = usize::try_from(cqe.user_data())
                .ok()
                .and_then(|i| self.slots.get_mut(i))
            {
                s.state = SlotState::Done(cqe.result());
                s.file = None;
            }
        }
        Ok(())
    }
}

impl Drop for ReadRing {
    fn drop(&mut self) {
        while self.slots.iter().any(|s| s.state == SlotState::InFlight) {
            if self.reap(true).is_err() {
                // Never free a buffer the kernel may still write: leak them.
                for s in self.slots.drain(..) {
                    std::mem::forget(s.buf);
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        all_cached, cachestat_pages, map_pages, resident_in, sampled_cached, Residency,
        MINCORE_SAMPLE,
    };
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// Pages of the range the page cache holds, every one asked.
    fn resident(f: &std::fs::File, off: u64, len: u64) -> usize {
        let (map, pages) = map_pages(f, off, len).unwrap();
        resident_in(&map, 0, pages, false).unwrap()
    }

    /// `mincore` and `cachestat` agree with a model of which pages were
    /// read back after the file was dropped from the page cache, over
    /// aligned, unaligned, long and past-the-end ranges; `all_cached` is
    /// exact by `cachestat` and looks at a long range's ends by `mincore`.
    #[test]
    fn mincore_counts_what_cachestat_counts() {
        let page = rustix::param::page_size() as u64;
        // Beside the test binary, under Cargo's target directory, not in
        // TMPDIR (often a tmpfs, whose pages cannot be dropped).
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        // Bytes that do not compress: a compressing file system reads
        // neighbours of a compressed page along with it.
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        let bytes: Vec<u8> = (0..256 * page)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        f.write_all(&bytes).unwrap();
        f.sync_all().unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let how = crate::fs::residency(&f);
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        // A file system that keeps every page (tmpfs) drops none: then the
        // model is "all resident".
        let evicts = resident(&f, 0, 256 * page) == 0;
        if !evicts {
            eprintln!("{}: pages not dropped, all resident", dir.path().display());
        }
        // No readahead: only the pages read come back.
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Random).unwrap();
        let read: Vec<u64> = (8..24).chain([40]).chain(48..120).chain(176..240).collect();
        let mut buf = vec![0u8; page as usize];
        for &p in &read {
            f.read_exact_at(&mut buf, p * page).unwrap();
        }
        // Resident pages of pages `first..end` (none past the file's 256).
        let model = |first: u64, end: u64| -> u64 {
            (first..end.min(256))
                .filter(|p| !evicts || read.contains(p))
                .count() as u64
        };
        let full = |first: u64, end: u64| model(first, end) == end - first;
        let half = page / 2;
        let ranges = [
            (0, 256 * page),
            (0, 8 * page),
            (8 * page, 16 * page),
            (7 * page + half, 2 * page),
            (23 * page + half, page),
            (40 * page + 1, 1),
            // More than one `mincore` call (64 pages each): all cached,
            // and pages missing in the first.
            (48 * page, 72 * page),
            (44 * page, 200 * page),
            // Cached at both ends (64 pages each), not between; at the
            // first end only.
            (48 * page, 192 * page),
            (48 * page, 200 * page),
            (250 * page, 10 * page),
            (300 * page, page),
        ];
        for (off, len) in ranges {
            let (first, end) = (off / page, (off + len).div_ceil(page));
            let want = model(first, end);
            let pages = end - first;
            assert_eq!(
                resident(&f, off, len) as u64,
                want,
                "mincore at {off}+{len}"
            );
            let s = MINCORE_SAMPLE as u64;
            let ends = if pages <= 2 * s {
                want == pages
            } else {
                full(first, first + s) && full(end - s, end)
            };
            assert_eq!(
                sampled_cached(&f, off, len),
                Some(ends),
                "sampled {off}+{len}"
            );
            assert_eq!(
                all_cached(&f, off, len, Residency::Mincore),
                ends,
                "{off}+{len}"
            );
            // Exact where the kernel counts, by the ends where it does not.
            let exact = match cachestat_pages(&f, off, len) {
                Ok(n) if how == Residency::Cachestat => {
                    assert_eq!(n, want, "cachestat at {off}+{len}");
                    want == pages
                }
                Ok(_) => ends,
                Err(e) => {
                    let code = e.raw_os_error();
                    assert!(matches!(code, Some(libc::ENOSYS | libc::EPERM)), "{e}");
                    ends
                }
            };
            assert_eq!(all_cached(&f, off, len, how), exact, "{off}+{len}");
        }
        // The model has a range whose ends alone are cached.
        assert!(!evicts || (!full(48, 240) && full(48, 112) && full(176, 240)));
    }
}
