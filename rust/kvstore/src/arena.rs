//! The hot tier: one shared-memory arena per store, mapped by every process
//! that opens the store with a hot tier.
//!
//! # Layout
//!
//! ```text
//! 0            header (4 KiB): magic, version, geometry, store tag, ready flag, counters,
//!              page kind, last use, and the store it belongs to (id, absolute path)
//! 4096         slot headers, nslots × slot_hdr bytes
//! data_off     slot data, nslots × slot_size bytes (data_off aligned to 2 MiB)
//! ```
//!
//! A slot holds one block. Slots form sets of `ways` slots; a block can only
//! live in one of the two sets its id hashes to (two choices: a set full of
//! pinned blocks rarely blocks a newcomer), so finding it needs no shared hash
//! table (nothing to rebuild, nothing a crash can leave half-updated).
//!
//! # Protocol (why a reader never sees a torn or reused slot)
//!
//! Writers (insert, evict, pin) serialise on `flock(LOCK_EX)` of the arena
//! file plus a mutex for the threads of one process. The kernel drops a dead
//! process's `flock`, so a crash at any instruction leaves nothing locked.
//! The lock is taken through a description of the file opened for it alone,
//! which forked children close as they start (`os::ParentOnly`): a child
//! shares the mapping's description (its copy of the mapping keeps it open),
//! and a lock taken through that outlived a writer killed while holding it
//! for as long as the child lived (one is opened per use where the arena
//! has none of its own, and the mapping's is the last resort). A stopped
//! process (SIGSTOP, a debugger, a frozen cgroup) keeps it, so a
//! writer gives up [`WRITE_WAIT`] after it started waiting (the mutex
//! included): a pin or unpin then fails with `StoreLocked`, and a cache fill
//! (a put's or a read's copy into the arena) is skipped (`Inserted::Busy`:
//! the block stays in the segments). After a writer gave up, the fills of
//! this process try the lock once without waiting, until one takes it or
//! [`FILL_BACKOFF`] has passed: a stopped holder costs a process about one
//! wait per `FILL_BACKOFF`, not one per block or per thread.
//!
//! Each slot has a version counter used as a seqlock. A writer makes it odd,
//! fills id, tokens, data and the data's checksum, then makes it even.
//! Readers take no lock: they read an even version, compare the id and token
//! ids, copy the data (checksumming each piece of the copy as it lands), and read the
//! version again; a change means the copy may be torn
//! or the slot reused, and the copy is thrown away (the caller falls back to
//! the segment files). A writer that died mid-write leaves an odd version:
//! readers skip the slot, and the next writer to visit the set reclaims it.
//! No slot leaks.
//!
//! # Damage
//!
//! The arena is a file anyone with the owner's uid can write, and memory can
//! flip. Nothing read from it is trusted: the geometry in the header must be
//! exactly what the layout and the file's size give (else the arena is
//! refused), and a slot whose data does not match its checksum is a miss.
//! The reader then reads the segments and re-inserts the block; the writer,
//! finding the block present but damaged, rewrites the slot with the good
//! bytes (keeping its pin).
//!
//! # Lifetime and pruning (see `arenas.rs` for the pruner)
//!
//! The arena outlives its processes; its header names its store (id and the
//! absolute path it was last opened from), so an orphan (store deleted, or
//! replaced by another store) can be found and removed. Two locks make that
//! race-free against processes opening and using arenas in the same
//! directory, without touching the writers' `flock`:
//!
//! - every process that maps an arena holds a shared open-file-description
//!   lock (`os::ofd_lock`, `F_OFD_SETLK`) on the arena file for as long as it
//!   has the file open, which is as long as it maps it. It takes it before
//!   it reads or maps anything, then checks that the path still names the
//!   file it locked (a pruner may have unlinked it meanwhile: then it
//!   retries, creating a fresh arena). Python's `kvstore.torch.arena_view`,
//!   which maps the file on its own, takes the same lock on the descriptor it
//!   maps, whose duplicate the mapping keeps: the lock lives as long as the
//!   view, even past its store's handle;
//! - a pruner takes the exclusive lock without waiting (held by anyone:
//!   keep), then reads the header, checks the store, scans `/proc/*/maps`
//!   for the file's device and inode (mappers that hold no lock: kvstore
//!   versions before arena format 3), and unlinks the path while still
//!   holding the lock. An opener waiting for its shared lock then sees the
//!   unlinked file and starts over; nobody can have it mapped. Openers wait
//!   for either lock at most `LOCK_WAIT`, then fail with `StoreLocked`
//!   naming the holder.
//!
//! OFD locks and `flock` never conflict with each other on Linux, so the
//! writers' `flock(LOCK_EX)` and the lifetime lock are independent.
//!
//! Eviction within a set: empty or torn slots first, then blocks whose pin
//! has expired or was never set, lowest priority first, least recently used
//! first. A block pinned with a priority at least the newcomer's stays.

use crate::error::{Error, IoContext, Result};
use crate::id::BlockId;
use crate::layout::Layout;
use crate::lockwait::{flock_holders, try_flock, wait_for};
use crate::os::{ofd_lock, OfdLock, ParentOnly};
use crate::os::{Rows, SharedMap};
use crate::pages::PageKind;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const MAGIC: u64 = u64::from_le_bytes(*b"KVARENA\x01");
/// 2: slot headers carry a crc32c of the slot's data (`S_CRC`).
/// 3: the header names its store (`H_STORE_ID`, `H_PATH`), its page kind and
/// last use.
pub(crate) const VERSION: u64 = 3;
pub(crate) const MAGIC_WORD: u64 = MAGIC;
pub(crate) const HEADER_LEN: usize = 4096;
const DATA_ALIGN: usize = 2 << 20;
/// Slot data starts half a page past a page boundary. Callers' buffers
/// usually start a few bytes past one (malloc's 16, torch's 64): a copy whose
/// source sits at offset 0 and destination at 16 modulo 4 KiB stalls on "4K
/// aliasing" (loads wait on stores to the same low address bits) and ran at a
/// quarter of memcpy speed here (2.6 vs 10 GiB/s); half a page away it runs
/// at full speed.
const DATA_SKEW: usize = 2048;
/// Slots per set. More ways: closer to a global LRU, more probes per lookup.
const WAYS: usize = 8;

// Header word offsets.
pub(crate) const H_MAGIC: usize = 0;
pub(crate) const H_VERSION: usize = 8;
pub(crate) const H_NSLOTS: usize = 16;
pub(crate) const H_WAYS: usize = 24;
pub(crate) const H_SLOT_HDR: usize = 32;
pub(crate) const H_SLOT_SIZE: usize = 40;
pub(crate) const H_DATA_OFF: usize = 48;
pub(crate) const H_TOTAL: usize = 56;
const H_TAG: usize = 64; // 4 words
pub(crate) const H_READY: usize = 96;
pub(crate) const H_EVICTIONS: usize = 104;
pub(crate) const H_INSERTS: usize = 112;
const H_TICK: usize = 120;
/// `PageKind::code` of what the creator got.
pub(crate) const H_PAGE_KIND: usize = 128;
/// Ms since the epoch of the last open or insert.
pub(crate) const H_LAST_USE: usize = 136;
/// The store id, 32 ASCII hex digits (the file name says it too).
pub(crate) const H_STORE_ID: usize = 160;
/// Length of the store's absolute path, then its bytes up to the header's end.
pub(crate) const H_PATH_LEN: usize = 192;
pub(crate) const H_PATH: usize = 256;
/// Longest store path the header can name (longer: named as unknown).
pub(crate) const PATH_MAX: usize = HEADER_LEN - H_PATH;

// Slot header offsets.
pub(crate) const S_VERSION: usize = 0;
const S_ID: usize = 8; // 4 words
pub(crate) const S_STATE: usize = 40; // 0 empty, 1 holds a block
pub(crate) const S_PRIORITY: usize = 48;
pub(crate) const S_EXPIRES: usize = 56; // ms since the epoch; 0 = never
const S_LAST_USED: usize = 64; // value of the arena's tick
const S_CRC: usize = 72; // `data_crc` of the slot's data, zero-extended
const S_TOKENS: usize = 80; // block_size × u32

/// The slot checksum runs this many crc32c chains, chain `k` over the block's
/// runs `k, k + LANES, k + 2 × LANES, …`: made for `crc32` instructions, four
/// chains interleaved with a copy, when one chain was slower than memory.
/// A paged load reads a block that way (`RunReader`), four runs at a time,
/// each straight into its destination; the other reads checksum a run at a
/// time with `crate::crc`'s folding.
pub(crate) const LANES: usize = 4;
// `PagedLayout::land` takes a layer's K and V in the same group of lanes.
const _: () = assert!(LANES.is_multiple_of(2));
/// Piece size of the scratch buffer for checksumming a slot in place.
const SCRATCH: usize = 64 << 10;

/// The slot checksum of a block of `runs` runs, the one place that says how
/// runs go into lanes: run `i` is appended to lane `i % LANES` by
/// `append(i, lane)` (which returns that lane's crc32c with run `i` after
/// it), in run order; then the crc32c of the lanes' values, little-endian.
fn slot_crc(runs: usize, mut append: impl FnMut(usize, u32) -> u32) -> u64 {
    let mut lanes = [0u32; LANES];
    for i in 0..runs {
        lanes[i % LANES] = append(i, lanes[i % LANES]);
    }
    fold_lanes(lanes)
}

/// The slot checksum from its lanes' values (`slot_crc`).
fn fold_lanes(lanes: [u32; LANES]) -> u64 {
    let mut bytes = [0u8; 4 * LANES];
    for (b, lane) in bytes.chunks_exact_mut(4).zip(lanes) {
        b.copy_from_slice(&lane.to_le_bytes());
    }
    u64::from(crate::crc::crc32c(&bytes))
}

/// A block's runs as `Arena::read_runs` hands them to its caller: read in
/// order, up to `LANES` at a time (`read`), each run's rows landed where
/// the caller says, each checksummed into its lane as it is copied.
pub(crate) struct RunReader<'a> {
    arena: &'a Arena,
    /// The slot's data in the mapping.
    base: usize,
    /// The next run to read.
    next: usize,
    lanes: [u32; LANES],
    /// A run's bytes, where the CPU lacks `read_rows_crc32c` (made once).
    piece: Option<Vec<u8>>,
}

impl RunReader<'_> {
    /// Rows of a run, `[B, H]`, and bytes of a row (`D` values): the shape
    /// `read`'s destinations are given in.
    pub fn shape(&self) -> ([usize; 2], usize) {
        let a = self.arena;
        let rows = [a.block_size, a.heads];
        (rows, a.chunk_bytes / (rows[0] * rows[1]))
    }

    /// Reads the block's next `outs.len()` runs (at most `LANES`; fewer only
    /// for the last ones) into `outs`, in order: run `next + j`'s row `(t,
    /// h)` lands as `outs[j]` says. Each row's bytes are loaded once, both
    /// checksummed and stored (`SharedMap::read_rows_crc32c` where the CPU
    /// has it, else each run through a piece, `SharedMap::read_crc32c`).
    pub fn read(&mut self, outs: &mut [Rows<'_>]) {
        let a = self.arena;
        let (n, run) = (outs.len(), a.chunk_bytes);
        assert!(
            n <= LANES && self.next + n <= a.block_bytes / run,
            "RunReader::read: past the block's last run"
        );
        if n == 0 {
            return;
        }
        let (shape, row) = self.shape();
        let src: [usize; LANES] = std::array::from_fn(|j| self.base + (self.next + j) * run);
        let mut crcs: [u32; LANES] = std::array::from_fn(|j| self.lanes[(self.next + j) % LANES]);
        let (src, crcs) = (&src[..n], &mut crcs[..n]);
        if crate::os::has_fused_rows() && row.is_multiple_of(32) {
            a.map.read_rows_crc32c(src, outs, shape, row, crcs);
        } else {
            // Each run whole into a piece (copied, then checksummed there),
            // then its rows from the piece: what lands is what was checked.
            let piece = self.piece.get_or_insert_with(|| vec![0u8; run]);
            for ((o, crc), &from) in outs.iter_mut().zip(crcs.iter_mut()).zip(src) {
                *crc = a.map.read_crc32c(from, piece, *crc);
                for (i, bytes) in piece.chunks_exact(row).enumerate() {
                    let (t, h) = (i / shape[1], i % shape[1]);
                    let at = o.at + t * o.strides[0] + h * o.strides[1];
                    o.dst[at..at + row].copy_from_slice(bytes);
                }
            }
        }
        for (j, &crc) in crcs.iter().enumerate() {
            self.lanes[(self.next + j) % LANES] = crc;
        }
        self.next += n;
    }
}

/// Outcome of an insert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// Stored (possibly evicting another block).
    Stored,
    /// Already there (its pin was raised if asked).
    Present,
    /// Every slot of its set holds a block pinned at least as high.
    Full,
    /// Not stored: the writers' lock was not free within [`WRITE_WAIT`] (or,
    /// for a cache fill, another writer of this process gave up on it less
    /// than [`FILL_BACKOFF`] ago and it was not free at once).
    Busy,
}

/// Figures of the hot tier.
#[derive(Clone, Debug, Default)]
pub struct ArenaStats {
    /// The arena file.
    pub path: String,
    /// Bytes mapped.
    pub bytes: u64,
    /// Block slots in the arena.
    pub slots: u64,
    /// Slots holding a block.
    pub slots_used: u64,
    /// Slots holding a block pinned and not expired.
    pub slots_pinned: u64,
    /// Blocks evicted to make room, since the arena was created.
    pub evictions: u64,
    /// Blocks stored, since the arena was created.
    pub inserts: u64,
    /// Slots a writer is filling right now, or that one left half-written
    /// when it died (reclaimed by the next open or insert in their set).
    pub slots_torn: u64,
    /// What backs the mapping: `hugetlb`, `thp` or `normal`.
    pub page_kind: String,
    /// Whether this handle maps it (false: a handle opened without a hot
    /// tier, reporting the store's arena from its file).
    pub mapped: bool,
    /// Waits for the writers' lock this handle gave up after [`WRITE_WAIT`]
    /// (a holder stopped or stuck); 0 where it does not map the arena.
    pub lock_timeouts: u64,
    /// Cache fills of this handle skipped because the writers' lock was not
    /// free (`Inserted::Busy`: the block stays in the segments).
    pub fills_skipped: u64,
}

/// The store an arena belongs to, as its header names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The store id (32 hex digits), from its MANIFEST.
    pub store_id: String,
    /// The store directory's absolute path.
    pub store_path: PathBuf,
}

impl Owner {
    /// The path bytes the header stores: empty when too long to fit.
    fn path_bytes(&self) -> &[u8] {
        use std::os::unix::ffi::OsStrExt;
        let b = self.store_path.as_os_str().as_bytes();
        if b.len() <= PATH_MAX {
            b
        } else {
            &[]
        }
    }
}

pub(crate) struct Arena {
    map: SharedMap,
    file: File,
    path: PathBuf,
    /// The mutex of this process's writers, which holds the fills' backoff:
    /// until when cache fills try the writers' `flock` once instead of
    /// waiting for it (a writer gave up waiting, and none has taken it since).
    writers: Mutex<Option<Instant>>,
    /// This handle's waits for the writers' lock that ran out (`ArenaStats`).
    lock_timeouts: AtomicU64,
    /// This handle's cache fills skipped for a busy lock (`ArenaStats`).
    fills_skipped: AtomicU64,
    /// The description the writers' lock is taken through (see "Protocol");
    /// `None` where it could not be opened: one is opened per use then.
    lock: Option<ParentOnly>,
    nslots: usize,
    ways: usize,
    slot_hdr: usize,
    slot_size: usize,
    data_off: usize,
    block_size: usize,
    /// KV heads: a run is `[B, H]` rows (`RunReader::shape`).
    heads: usize,
    block_bytes: usize,
    chunk_bytes: usize,
    page_kind: PageKind,
    /// Per slot, `version | 1` of the slot's contents whose checksum this
    /// process checked for `locate` (0: none), so a block copied out by DMA
    /// is checked once per process and version, not on every copy.
    located: OnceLock<Box<[AtomicU64]>>,
}

/// Where everything lies in an arena: a function of the layout and the size
/// alone, so an existing arena's header can be checked word for word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub nslots: usize,
    pub ways: usize,
    pub slot_hdr: usize,
    pub slot_size: usize,
    pub data_off: usize,
    pub total: usize,
}

impl Geometry {
    /// The geometry of the largest arena for `layout` that fits in
    /// `hot_bytes`, or `None` if not even one slot fits. `for_size(l,
    /// g.total) == g` for every `g` this returns (tested below), which is
    /// how an existing arena of any size is checked.
    fn for_size(layout: &Layout, hot_bytes: u64) -> Option<Geometry> {
        let slot_hdr = (S_TOKENS + 4 * layout.block_size as usize).next_multiple_of(64);
        let slot_size = layout.block_bytes().next_multiple_of(64);
        let per_slot = slot_hdr + slot_size;
        let limit = usize::try_from(hot_bytes).unwrap_or(usize::MAX);
        let mut nslots = limit.saturating_sub(HEADER_LEN) / per_slot;
        // The mapping, rounding included, must fit in `hot_bytes` (at most a
        // few thousand steps: the rounding adds at most ~4 MiB).
        while nslots > 0 && Self::total_for(nslots, slot_hdr, slot_size).is_none_or(|t| t > limit) {
            nslots -= 1;
        }
        if nslots >= WAYS {
            nslots -= nslots % WAYS;
        }
        if nslots == 0 {
            return None;
        }
        Some(Geometry {
            nslots,
            ways: WAYS.min(nslots),
            slot_hdr,
            slot_size,
            data_off: Self::data_off_for(nslots, slot_hdr)?,
            total: Self::total_for(nslots, slot_hdr, slot_size)?,
        })
    }

    pub(crate) fn data_off_for(nslots: usize, slot_hdr: usize) -> Option<usize> {
        nslots
            .checked_mul(slot_hdr)?
            .checked_add(HEADER_LEN)?
            .checked_next_multiple_of(DATA_ALIGN)?
            .checked_add(DATA_SKEW)
    }

    pub(crate) fn total_for(nslots: usize, slot_hdr: usize, slot_size: usize) -> Option<usize> {
        Self::data_off_for(nslots, slot_hdr)?
            .checked_add(nslots.checked_mul(slot_size)?)?
            .checked_next_multiple_of(DATA_ALIGN)
    }

    /// The header words that describe it, as stored.
    fn words(&self) -> [(usize, u64); 6] {
        [
            (H_NSLOTS, self.nslots as u64),
            (H_WAYS, self.ways as u64),
            (H_SLOT_HDR, self.slot_hdr as u64),
            (H_SLOT_SIZE, self.slot_size as u64),
            (H_DATA_OFF, self.data_off as u64),
            (H_TOTAL, self.total as u64),
        ]
    }
}

/// Geometry of an arena of at most `hot_bytes` for `layout`.
fn geometry(layout: &Layout, hot_bytes: u64) -> Result<Geometry> {
    Geometry::for_size(layout, hot_bytes).ok_or_else(|| {
        let slot_hdr = (S_TOKENS + 4 * layout.block_size as usize).next_multiple_of(64);
        let one = Geometry::total_for(1, slot_hdr, layout.block_bytes().next_multiple_of(64));
        Error::InvalidInput(format!(
            "hot_bytes: expected at least {} bytes (one {}-byte block, headers, 2 MiB alignment \
             for huge pages), got {hot_bytes}",
            one.unwrap_or(usize::MAX),
            layout.block_bytes()
        ))
    })
}

/// How long an opener waits for the arena's locks, all together (a
/// pruner's, another opener creating or adopting it, a writer's), before
/// `StoreLocked`. Less than the store LOCK's wait, which this opener holds
/// meanwhile: the openers queued behind it get the LOCK back before they
/// give up.
const LOCK_WAIT: Duration = Duration::from_secs(20);

/// How often an opener tries the arena's locks while it waits.
const LOCK_POLL: Duration = Duration::from_millis(1);

/// How long a writer (insert, pin, unpin) waits for the writers' `flock`
/// (and the mutex of its process's writers) before it gives up (see
/// "Protocol"). Writers hold it for one block's copy (all layers of its
/// tokens: 2 MiB for a 16-token block of Llama-3-8B, a few hundred
/// microseconds); only a stopped process holds it for seconds.
pub(crate) const WRITE_WAIT: Duration = Duration::from_secs(2);

/// After a writer gave up on the writers' `flock`, how long this process's
/// fills try it once instead of waiting (unless one takes it first): a free
/// lock is still taken at once, a held one costs nothing.
const FILL_BACKOFF: Duration = Duration::from_secs(30);

/// How often a writer tries the writers' `flock` while another process holds
/// it: a fraction of a block's copy, so a contended writer starts soon after
/// the holder is done.
const WRITE_POLL: Duration = Duration::from_micros(50);

/// How to get past an arena refused for its contents.
const REMOVE: &str = "remove it (kvstore.remove_arena) to start a fresh one: processes that \
                      have it mapped keep their mapping";

fn refuse(path: &Path, reason: impl Into<String>) -> Error {
    Error::corrupt(path, format!("hot-tier arena refused: {}", reason.into()))
}

impl Arena {
    /// Opens the arena at `path`, creating it (of at most `hot_bytes`) if it
    /// does not exist. An existing arena of this store is adopted at its own
    /// size; anything else at that path is refused, never followed.
    pub fn open(
        path: &Path,
        layout: &Layout,
        tag: &[u8; 32],
        hot_bytes: u64,
        owner: &Owner,
    ) -> Result<Arena> {
        Self::open_waiting(path, layout, tag, hot_bytes, owner, LOCK_WAIT)
    }

    /// `open`, giving up on the arena's locks once `wait` has passed, all
    /// waits and retries together.
    fn open_waiting(
        path: &Path,
        layout: &Layout,
        tag: &[u8; 32],
        hot_bytes: u64,
        owner: &Owner,
        wait: Duration,
    ) -> Result<Arena> {
        let geo = geometry(layout, hot_bytes)?;
        let deadline = Instant::now() + wait;
        let mut tries = 0;
        loop {
            let (file, created) = Self::open_locked(path, wait, deadline)?;
            match Self::init_or_adopt(file, path, layout, tag, geo, owner) {
                Ok(Some(arena)) => return Ok(arena),
                // An unfinished file, removed: create one afresh.
                Ok(None) if tries < 8 => tries += 1,
                Ok(None) => {
                    return Err(Error::StoreLocked(format!(
                        "arena {}: found unfinished again and again while this process opened it",
                        path.display()
                    )))
                }
                Err(e) => {
                    if created && !matches!(e, Error::CorruptStore { .. }) {
                        let _ = std::fs::remove_file(path);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// The arena file at `path` (created if there is none; true if so),
    /// with its lifetime lock shared and its arena lock held.
    fn open_locked(path: &Path, wait: Duration, deadline: Instant) -> Result<(File, bool)> {
        let mut tries = 0;
        let (file, created) = loop {
            let (file, created) = Self::open_file(path)?;
            // Refuse what is not ours before waiting on its lock: /dev/shm
            // is writable by everyone, and another user's file could hold
            // the lock (and this opener, and the store's LOCK) until the wait
            // gives up.
            Self::check_ours(&file, path)?;
            // The lifetime lock, before anything is read or mapped; then the
            // path must still name this file (else a pruner removed it).
            let shared = wait_for(deadline, LOCK_POLL, || ofd_lock(&file, OfdLock::SharedTry))
                .ctx(|| format!("locking arena {}", path.display()))?;
            if !shared {
                return Err(Error::StoreLocked(format!(
                    "arena {}: not free within {}s: a pruner (kvstore arenas --prune) holds \
                     its lifetime lock",
                    path.display(),
                    wait.as_secs_f64()
                )));
            }
            if same_file(&file, path) {
                break (file, created);
            }
            tries += 1;
            if tries == 8 {
                return Err(Error::StoreLocked(format!(
                    "arena {} keeps being removed while this process opens it",
                    path.display()
                )));
            }
        };
        // Creation and adoption run under the arena lock: a second process
        // waits here until the creator has filled the header.
        let locked = wait_for(deadline, LOCK_POLL, || try_flock(&file))
            .ctx(|| format!("locking arena {}", path.display()))?;
        if !locked {
            return Err(Error::StoreLocked(format!(
                "arena {}: its lock was not free within {}s; held now{}",
                path.display(),
                wait.as_secs_f64(),
                flock_holders(&file)
            )));
        }
        Ok((file, created))
    }

    /// Refuses an arena file that is not a regular file of this user with
    /// mode 600.
    fn check_ours(file: &File, path: &Path) -> Result<()> {
        let meta = file.metadata().ctx(|| format!("stat {}", path.display()))?;
        let me = rustix::process::geteuid().as_raw();
        if !meta.file_type().is_file() {
            return Err(refuse(path, "it is not a regular file"));
        }
        if meta.uid() != me {
            return Err(refuse(
                path,
                format!(
                    "it is owned by uid {}, not by this user (uid {me})",
                    meta.uid()
                ),
            ));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(refuse(
                path,
                format!("its mode is {:o}; expected 600", meta.mode() & 0o777),
            ));
        }
        Ok(())
    }

    /// Creates the arena file (`O_EXCL`), or opens the existing one; never
    /// follows a symlink. True if created.
    fn open_file(path: &Path) -> Result<(File, bool)> {
        // Non-blocking, so a FIFO planted under the name cannot hang the open.
        let nofollow = (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32;
        let symlink =
            |e: &std::io::Error| e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error());
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nofollow)
            .open(path)
        {
            Ok(f) => Ok((f, true)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                match std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(nofollow)
                    .open(path)
                {
                    Ok(f) => Ok((f, false)),
                    Err(e) if symlink(&e) => Err(refuse(path, "it is a symlink")),
                    Err(e) => Err(Error::Io {
                        context: format!("opening arena {}", path.display()),
                        source: e,
                    }),
                }
            }
            Err(e) if symlink(&e) => Err(refuse(path, "it is a symlink")),
            Err(e) => Err(Error::Io {
                context: format!("creating arena {}", path.display()),
                source: e,
            }),
        }
    }

    /// Initialises the fresh file under the arena lock, or adopts the arena
    /// it holds; `None` when it was unfinished and has been removed (open
    /// again).
    fn init_or_adopt(
        file: File,
        path: &Path,
        layout: &Layout,
        tag: &[u8; 32],
        geo: Geometry,
        owner: &Owner,
    ) -> Result<Option<Arena>> {
        // Decided here, under the lock, from the file itself (not from who
        // created it): the first process to hold the lock initialises it.
        let len = file
            .metadata()
            .ctx(|| format!("stat {}", path.display()))?
            .len() as usize;
        if len >= HEADER_LEN {
            let head = read_header(&file, path)?;
            if head(H_READY) != 1 && [0, MAGIC].contains(&head(H_MAGIC)) {
                // Its creator died before marking it ready (its pages are
                // reserved before its header is written), or the ready word
                // was damaged. Removed, not reset in place: a process that
                // maps it keeps a whole mapping (truncating it under them
                // faulted every reader) and its slots' versions.
                if same_file(&file, path) {
                    std::fs::remove_file(path)
                        .ctx(|| format!("removing unfinished arena {}", path.display()))?;
                }
                return Ok(None);
            }
        }
        let fresh = len == 0;
        let geo = if fresh {
            // Reserve every page now: on a full tmpfs or an empty huge-page
            // pool this fails here, cleanly, instead of a SIGBUS on first touch.
            rustix::fs::fallocate(
                &file,
                rustix::fs::FallocateFlags::empty(),
                0,
                geo.total as u64,
            )
            .map_err(|e| {
                Error::StoreFull(format!(
                    "cannot reserve {} bytes for the hot tier at {}: {e}",
                    geo.total,
                    path.display()
                ))
            })?;
            geo
        } else {
            Self::check_existing(&file, path, layout, tag, len)?
        };
        let map = SharedMap::new(&file, geo.total).ctx(|| format!("mapping {}", path.display()))?;
        map.advise_huge_pages();
        if fresh {
            for (off, v) in [(H_MAGIC, MAGIC), (H_VERSION, VERSION)]
                .into_iter()
                .chain(geo.words())
            {
                map.u64_at(off).store(v, Ordering::Relaxed);
            }
            for i in 0..4 {
                let w = u64::from_le_bytes(tag[8 * i..8 * i + 8].try_into().expect("8 bytes"));
                map.u64_at(H_TAG + 8 * i).store(w, Ordering::Relaxed);
            }
        }
        let page_kind = crate::pages::page_kind_of(map.addr());
        if fresh {
            map.u64_at(H_PAGE_KIND)
                .store(page_kind.code(), Ordering::Relaxed);
            map.write(
                H_STORE_ID,
                owner.store_id.as_bytes().get(..32).unwrap_or(&[0; 32]),
            );
            map.u64_at(H_READY).store(1, Ordering::Release);
        }
        write_owner_path(&map, owner);
        map.u64_at(H_LAST_USE)
            .store(crate::clock::now_ms(), Ordering::Relaxed);
        let lock = ParentOnly::open(&file);
        let arena = Arena {
            map,
            file,
            path: path.to_path_buf(),
            writers: Mutex::new(None),
            lock_timeouts: AtomicU64::new(0),
            fills_skipped: AtomicU64::new(0),
            lock,
            nslots: geo.nslots,
            ways: geo.ways,
            slot_hdr: geo.slot_hdr,
            slot_size: geo.slot_size,
            data_off: geo.data_off,
            block_size: layout.block_size as usize,
            heads: layout.num_kv_heads as usize,
            block_bytes: layout.block_bytes(),
            chunk_bytes: layout.chunk_bytes(),
            page_kind,
            located: OnceLock::new(),
        };
        arena.reclaim_torn();
        arena
            .file
            .unlock()
            .ctx(|| format!("unlocking {}", path.display()))?;
        Ok(Some(arena))
    }

    /// The geometry of an existing arena of `len` bytes, if its header is that
    /// of an arena of this store and layout and every geometry word is exactly
    /// what the layout and `len` give. No header word is used in arithmetic.
    fn check_existing(
        file: &File,
        path: &Path,
        layout: &Layout,
        tag: &[u8; 32],
        len: usize,
    ) -> Result<Geometry> {
        if len < HEADER_LEN {
            return Err(refuse(
                path,
                format!("it is {len} bytes, smaller than an arena header"),
            ));
        }
        let head = read_header(file, path)?;
        if head(H_MAGIC) != MAGIC {
            return Err(refuse(path, "it is not a kvstore arena (bad magic)"));
        }
        if head(H_VERSION) != VERSION {
            return Err(refuse(
                path,
                format!(
                    "it is in arena format {}, this kvstore uses format {VERSION} (made by \
                     another kvstore version, or damaged); {REMOVE}",
                    head(H_VERSION)
                ),
            ));
        }
        let their_tag: Vec<u8> = (0..4)
            .flat_map(|i| head(H_TAG + 8 * i).to_le_bytes())
            .collect();
        if their_tag != tag {
            return Err(refuse(path, "it belongs to another store or layout"));
        }
        let Some(geo) = Geometry::for_size(layout, len as u64).filter(|g| g.total == len) else {
            return Err(refuse(
                path,
                format!("its size ({len} bytes) is not that of an arena of this layout; {REMOVE}"),
            ));
        };
        for (off, want) in geo.words() {
            if head(off) != want {
                return Err(refuse(
                    path,
                    format!(
                        "header word at byte {off} is {}; an arena of {len} bytes of this \
                         layout has {want} there (damaged header); {REMOVE}",
                        head(off)
                    ),
                ));
            }
        }
        Ok(geo)
    }

    /// Empties every slot left half-written by a writer that died. Runs under
    /// the arena lock (at open), when no write can be in progress.
    fn reclaim_torn(&self) {
        for slot in 0..self.nslots {
            let v = self.map.u64_at(self.hdr(slot) + S_VERSION);
            let version = v.load(Ordering::Relaxed);
            if version & 1 == 1 {
                self.map
                    .u64_at(self.hdr(slot) + S_STATE)
                    .store(0, Ordering::Relaxed);
                v.store(version.wrapping_add(1), Ordering::Release);
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Start address and length of the mapping (for `cudaHostRegister`).
    pub fn region(&self) -> (usize, usize) {
        (self.map.addr(), self.map.len())
    }

    fn hdr(&self, slot: usize) -> usize {
        HEADER_LEN + slot * self.slot_hdr
    }

    fn data(&self, slot: usize) -> usize {
        self.data_off + slot * self.slot_size
    }

    /// The slots a block may occupy: the ways of its two candidate sets.
    fn set_of(&self, id: &BlockId) -> impl Iterator<Item = usize> {
        let nsets = (self.nslots / self.ways) as u64;
        let pick = |at: usize| {
            (u64::from_le_bytes(id[at..at + 8].try_into().expect("8 bytes")) % nsets) as usize
        };
        let (a, b) = (pick(8), pick(16));
        let ways = self.ways;
        let second = if b == a {
            0..0
        } else {
            b * ways..(b + 1) * ways
        };
        (a * ways..(a + 1) * ways).chain(second)
    }

    fn id_matches(&self, slot: usize, id: &BlockId) -> bool {
        (0..4).all(|i| {
            let w = u64::from_le_bytes(id[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            self.map
                .u64_at(self.hdr(slot) + S_ID + 8 * i)
                .load(Ordering::Relaxed)
                == w
        })
    }

    fn tokens_match(&self, slot: usize, tokens: &[u32]) -> bool {
        tokens.len() == self.block_size
            && tokens.iter().enumerate().all(|(j, t)| {
                self.map
                    .u32_at(self.hdr(slot) + S_TOKENS + 4 * j)
                    .load(Ordering::Relaxed)
                    == *t
            })
    }

    fn tick(&self) -> u64 {
        self.map.u64_at(H_TICK).fetch_add(1, Ordering::Relaxed)
    }

    /// Copies block `id` (whose token ids must be `tokens`) into `out`, the
    /// block's `2L` runs. Lock-free; false on a miss, a concurrent change or
    /// damaged slot data (then `out` holds garbage and the caller reads the
    /// segments instead).
    pub fn get(&self, id: &BlockId, tokens: &[u32], out: &mut [&mut [u8]]) -> bool {
        let Some((slot, version)) = self.holding(id) else {
            return false;
        };
        if !self.tokens_match(slot, tokens) {
            return false; // same id, other tokens: a collision is a miss
        }
        if out.len() * self.chunk_bytes != self.block_bytes
            || out.iter().any(|c| c.len() != self.chunk_bytes)
        {
            return false; // not this layout's block: never read past the slot
        }
        let (base, run) = (self.data(slot), self.chunk_bytes);
        let crc = slot_crc(out.len(), |i, lane| {
            self.map.read_crc32c(base + i * run, out[i], lane)
        });
        crc == self.stored_crc(slot) && self.confirm(slot, version)
    }

    /// `get` for a caller that lands each run elsewhere at once (a paged
    /// load), through `land`, which reads the block's runs in order with
    /// the `RunReader` it is given, each straight into its destination:
    /// no block-sized scratch is written and read back, and what lands is
    /// what was checksummed, whatever another process does to the slot.
    /// True only if `land` read every run and each was the block's,
    /// unchanged and undamaged, checked after the last: on false, what
    /// landed may be torn or wrong and must not be used (nor counted as
    /// served).
    pub fn read_runs(
        &self,
        id: &BlockId,
        tokens: &[u32],
        land: impl FnOnce(&mut RunReader<'_>),
    ) -> bool {
        let Some((slot, version)) = self.holding(id) else {
            return false;
        };
        if !self.tokens_match(slot, tokens) {
            return false; // a collision
        }
        let mut reader = RunReader {
            arena: self,
            base: self.data(slot),
            next: 0,
            lanes: [0; LANES],
            piece: None,
        };
        land(&mut reader);
        let runs = self.block_bytes / self.chunk_bytes;
        reader.next == runs
            && fold_lanes(reader.lanes) == self.stored_crc(slot)
            && self.confirm(slot, version)
    }

    /// Where block `id` (with `tokens`) lies: `(slot, version, data offset)`,
    /// for a caller that copies it straight out of the mapping (a DMA). The
    /// copy is good only if `unchanged(slot, version)` still holds after it.
    /// The slot's checksum is checked here, once per process and version: a
    /// slot damaged later, without a write, is not noticed by this path.
    pub fn locate(&self, id: &BlockId, tokens: &[u32]) -> Option<(usize, u64, usize)> {
        let (slot, version) = self.holding(id)?;
        if !self.tokens_match(slot, tokens) {
            return None;
        }
        let located = self
            .located
            .get_or_init(|| (0..self.nslots).map(|_| AtomicU64::new(0)).collect());
        // `version` is even: `version | 1` is never 0.
        if located[slot].load(Ordering::Relaxed) != version | 1 {
            let stored = self.stored_crc(slot);
            if self.data_crc(slot) != stored || !self.unchanged(slot, version) {
                return None;
            }
            located[slot].store(version | 1, Ordering::Relaxed);
        }
        self.confirm(slot, version)
            .then(|| (slot, version, self.data(slot)))
    }

    fn stored_crc(&self, slot: usize) -> u64 {
        self.map
            .u64_at(self.hdr(slot) + S_CRC)
            .load(Ordering::Relaxed)
    }

    /// The checksum of `slot`'s data as it is now (torn if a writer is at
    /// it: readers check the version afterwards), through a small scratch.
    fn data_crc(&self, slot: usize) -> u64 {
        let (base, run) = (self.data(slot), self.chunk_bytes);
        let mut buf = vec![0u8; SCRATCH.min(run)];
        slot_crc(self.block_bytes / run, |i, mut lane| {
            for at in (0..run).step_by(buf.len()) {
                let piece = &mut buf[..SCRATCH.min(run - at)];
                lane = self.map.read_crc32c(base + i * run + at, piece, lane);
            }
            lane
        })
    }

    /// The slot holding block `id` and its (even) version, if any. Lock-free:
    /// the answer may change at once; readers confirm it after using it.
    fn holding(&self, id: &BlockId) -> Option<(usize, u64)> {
        self.set_of(id).find_map(|slot| {
            let h = self.hdr(slot);
            let version = self.map.u64_at(h + S_VERSION).load(Ordering::Acquire);
            (version & 1 == 0
                && self.map.u64_at(h + S_STATE).load(Ordering::Relaxed) == 1
                && self.id_matches(slot, id))
            .then_some((slot, version))
        })
    }

    /// After reading a slot found by `holding`: true (and the slot counts as
    /// used) if no writer touched it meanwhile.
    fn confirm(&self, slot: usize, version: u64) -> bool {
        if !self.unchanged(slot, version) {
            return false;
        }
        self.map
            .u64_at(self.hdr(slot) + S_LAST_USED)
            .store(self.tick(), Ordering::Relaxed);
        true
    }

    /// Whether `slot` still holds what it held at `version` (see `locate`).
    pub fn unchanged(&self, slot: usize, version: u64) -> bool {
        fence(Ordering::Acquire);
        slot < self.nslots
            && self
                .map
                .u64_at(self.hdr(slot) + S_VERSION)
                .load(Ordering::Acquire)
                == version
    }

    /// Device and inode of the arena file, so another mapping of it can be
    /// checked to be of the same file.
    pub fn file_id(&self) -> Result<(u64, u64)> {
        let m = self
            .file
            .metadata()
            .ctx(|| format!("stat {}", self.path.display()))?;
        Ok((m.dev(), m.ino()))
    }

    /// Whether block `id` is in the arena (a hint: it may go at any time).
    pub fn contains(&self, id: &BlockId) -> bool {
        self.holding(id).is_some()
    }

    /// Runs `f` under the writers' lock, waiting for it until `deadline`
    /// (taken before the mutex, so a thread queued behind another's wait
    /// does not wait again); `None` if it was not free by then. A cache
    /// `fill` tries once after a writer gave up (the backoff in `writers`).
    fn write_locked<T>(
        &self,
        deadline: Instant,
        fill: bool,
        f: impl FnOnce() -> T,
    ) -> Result<Option<T>> {
        let mut skip_until = self.writers.lock().expect("arena writers");
        let now = Instant::now();
        let skipping = fill && skip_until.is_some_and(|t| now < t);
        let deadline = if skipping { now } else { deadline };
        // Where neither can be had (no /proc, no descriptor left): the
        // mapping's description, as before ParentOnly, which a forked child
        // may keep locked.
        let opened;
        let lock = if let Some(lock) = self.lock.as_ref().and_then(ParentOnly::get) {
            lock
        } else {
            opened = crate::os::reopen(&self.file).ok();
            opened.as_ref().unwrap_or(&self.file)
        };
        let locked = wait_for(deadline, WRITE_POLL, || try_flock(lock))
            .ctx(|| format!("locking arena {}", self.path.display()))?;
        if !locked {
            if !skipping {
                *skip_until = Some(Instant::now() + FILL_BACKOFF);
                self.lock_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            if fill {
                self.fills_skipped.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(None);
        }
        *skip_until = None;
        let out = f();
        lock.unlock()
            .ctx(|| format!("unlocking arena {}", self.path.display()))?;
        Ok(Some(out))
    }

    /// The `StoreLocked` of a pin or unpin that gave up on the writers' lock.
    pub(crate) fn writers_locked_error(&self) -> Error {
        Error::StoreLocked(format!(
            "arena {}: its writers' lock was not free within {}s; held now{}",
            self.path.display(),
            WRITE_WAIT.as_secs_f64(),
            flock_holders(&self.file)
        ))
    }

    /// Stores a block (its `2L` runs), evicting per the policy above.
    /// `priority` 0 = unpinned (a cache fill); `expires_ms` 0 = never. A copy
    /// of the block already there whose data fails its checksum is rewritten
    /// in place. `Busy` when the writers' lock stays held (see "Protocol").
    pub fn insert(
        &self,
        id: &BlockId,
        tokens: &[u32],
        chunks: &[&[u8]],
        priority: u64,
        expires_ms: u64,
        now_ms: u64,
    ) -> Result<Inserted> {
        if tokens.len() != self.block_size
            || chunks.len() * self.chunk_bytes != self.block_bytes
            || chunks.iter().any(|c| c.len() != self.chunk_bytes)
        {
            return Err(Error::InvalidInput(
                "arena insert: block of the wrong shape".into(),
            ));
        }
        let deadline = Instant::now() + WRITE_WAIT;
        let done = self.write_locked(deadline, priority == 0, || {
            let mut victim: Option<(usize, (u8, u64, u64))> = None;
            let (mut priority, mut expires_ms) = (priority, expires_ms);
            for slot in self.set_of(id) {
                let h = self.hdr(slot);
                let version = self.map.u64_at(h + S_VERSION).load(Ordering::Relaxed);
                let used = self.map.u64_at(h + S_STATE).load(Ordering::Relaxed) == 1;
                if version & 1 == 0
                    && used
                    && self.id_matches(slot, id)
                    && self.tokens_match(slot, tokens)
                {
                    // Under the write lock the data cannot change under us.
                    if self.data_crc(slot) == self.stored_crc(slot) {
                        self.raise_pin(slot, priority, expires_ms);
                        return Inserted::Present;
                    }
                    // Damaged: rewrite it with these bytes, keeping the
                    // higher of its pin and the one asked for.
                    let p = self.map.u64_at(h + S_PRIORITY).load(Ordering::Relaxed);
                    if priority == 0 || priority < p {
                        priority = p;
                        expires_ms = self.map.u64_at(h + S_EXPIRES).load(Ordering::Relaxed);
                    }
                    victim = Some((slot, (0, 0, 0)));
                    break;
                }
                // Rank: torn or empty first, then evictable by priority, then LRU.
                let rank = if version & 1 == 1 || !used {
                    (0, 0, 0)
                } else {
                    let p = self.map.u64_at(h + S_PRIORITY).load(Ordering::Relaxed);
                    let exp = self.map.u64_at(h + S_EXPIRES).load(Ordering::Relaxed);
                    let live_pin = if exp != 0 && exp <= now_ms { 0 } else { p };
                    if live_pin > 0 && live_pin >= priority {
                        continue; // pinned at least as high: stays
                    }
                    (
                        1,
                        live_pin,
                        self.map.u64_at(h + S_LAST_USED).load(Ordering::Relaxed),
                    )
                };
                if victim.is_none_or(|(_, r)| rank < r) {
                    victim = Some((slot, rank));
                }
            }
            let Some((slot, rank)) = victim else {
                return Inserted::Full;
            };
            self.write_slot(slot, id, tokens, chunks, priority, expires_ms);
            self.map.u64_at(H_LAST_USE).store(now_ms, Ordering::Relaxed);
            if rank.0 == 1 {
                self.map.u64_at(H_EVICTIONS).fetch_add(1, Ordering::Relaxed);
            }
            self.map.u64_at(H_INSERTS).fetch_add(1, Ordering::Relaxed);
            Inserted::Stored
        })?;
        Ok(done.unwrap_or(Inserted::Busy))
    }

    /// Writes a block into `slot` under the slot's seqlock (odd version
    /// while torn, then even), each run checksummed, then copied in. The
    /// caller holds the arena's write lock.
    fn write_slot(
        &self,
        slot: usize,
        id: &BlockId,
        tokens: &[u32],
        chunks: &[&[u8]],
        priority: u64,
        expires_ms: u64,
    ) {
        let h = self.hdr(slot);
        let v = self.map.u64_at(h + S_VERSION).load(Ordering::Relaxed);
        // Versions are read from shared memory: wrap, never overflow.
        let odd = v.wrapping_add(if v & 1 == 1 { 2 } else { 1 });
        self.map.u64_at(h + S_VERSION).store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        self.map.u64_at(h + S_STATE).store(0, Ordering::Relaxed);
        for i in 0..4 {
            let w = u64::from_le_bytes(id[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            self.map
                .u64_at(h + S_ID + 8 * i)
                .store(w, Ordering::Relaxed);
        }
        for (j, t) in tokens.iter().enumerate() {
            self.map
                .u32_at(h + S_TOKENS + 4 * j)
                .store(*t, Ordering::Relaxed);
        }
        let (base, run) = (self.data(slot), self.chunk_bytes);
        let crc = slot_crc(chunks.len(), |i, lane| {
            self.map.write(base + i * run, chunks[i]);
            crate::crc::append(lane, chunks[i])
        });
        self.map.u64_at(h + S_CRC).store(crc, Ordering::Relaxed);
        self.map
            .u64_at(h + S_PRIORITY)
            .store(priority, Ordering::Relaxed);
        self.map
            .u64_at(h + S_EXPIRES)
            .store(expires_ms, Ordering::Relaxed);
        self.map
            .u64_at(h + S_LAST_USED)
            .store(self.tick(), Ordering::Relaxed);
        self.map.u64_at(h + S_STATE).store(1, Ordering::Relaxed);
        self.map
            .u64_at(h + S_VERSION)
            .store(odd.wrapping_add(1), Ordering::Release);
    }

    fn raise_pin(&self, slot: usize, priority: u64, expires_ms: u64) {
        if priority == 0 {
            return;
        }
        let h = self.hdr(slot);
        let p = self.map.u64_at(h + S_PRIORITY);
        let e = self.map.u64_at(h + S_EXPIRES);
        if priority >= p.load(Ordering::Relaxed) {
            p.store(priority, Ordering::Relaxed);
            e.store(expires_ms, Ordering::Relaxed);
        }
    }

    /// Pins a block already in the arena (raising, never lowering, its pin);
    /// false if it is not there.
    pub fn pin(&self, id: &BlockId, priority: u64, expires_ms: u64) -> Result<bool> {
        self.with_slot(id, |slot| self.raise_pin(slot, priority, expires_ms))
    }

    /// Makes a block evictable again; false if it is not there.
    pub fn unpin(&self, id: &BlockId) -> Result<bool> {
        self.with_slot(id, |slot| {
            self.map
                .u64_at(self.hdr(slot) + S_PRIORITY)
                .store(0, Ordering::Relaxed);
            self.map
                .u64_at(self.hdr(slot) + S_EXPIRES)
                .store(0, Ordering::Relaxed);
        })
    }

    fn with_slot(&self, id: &BlockId, f: impl FnOnce(usize)) -> Result<bool> {
        // Under the write lock no version can change: `holding` is exact here.
        self.write_locked(Instant::now() + WRITE_WAIT, false, || {
            self.holding(id).map(|(slot, _)| f(slot)).is_some()
        })?
        .ok_or_else(|| self.writers_locked_error())
    }

    pub fn stats(&self, now_ms: u64) -> ArenaStats {
        let mut used = 0;
        let mut pinned = 0;
        let mut torn = 0;
        for slot in 0..self.nslots {
            let h = self.hdr(slot);
            if self.map.u64_at(h + S_VERSION).load(Ordering::Relaxed) & 1 == 1 {
                torn += 1;
            } else if self.map.u64_at(h + S_STATE).load(Ordering::Relaxed) == 1 {
                used += 1;
                let p = self.map.u64_at(h + S_PRIORITY).load(Ordering::Relaxed);
                let e = self.map.u64_at(h + S_EXPIRES).load(Ordering::Relaxed);
                if p > 0 && (e == 0 || e > now_ms) {
                    pinned += 1;
                }
            }
        }
        ArenaStats {
            path: self.path.display().to_string(),
            bytes: self.map.len() as u64,
            slots: self.nslots as u64,
            slots_used: used,
            slots_pinned: pinned,
            evictions: self.map.u64_at(H_EVICTIONS).load(Ordering::Relaxed),
            inserts: self.map.u64_at(H_INSERTS).load(Ordering::Relaxed),
            slots_torn: torn,
            page_kind: self.page_kind.name().to_string(),
            mapped: true,
            lock_timeouts: self.lock_timeouts.load(Ordering::Relaxed),
            fills_skipped: self.fills_skipped.load(Ordering::Relaxed),
        }
    }
}

/// Names the store's current path in the header (it changes when the store
/// directory is renamed or moved), under the arena lock.
fn write_owner_path(map: &SharedMap, owner: &Owner) {
    let bytes = owner.path_bytes();
    let mut current = vec![0u8; bytes.len()];
    map.read(H_PATH, &mut current);
    if map.u64_at(H_PATH_LEN).load(Ordering::Relaxed) == bytes.len() as u64 && current == bytes {
        return;
    }
    map.u64_at(H_PATH_LEN).store(0, Ordering::Relaxed);
    map.write(H_PATH, bytes);
    map.u64_at(H_PATH_LEN)
        .store(bytes.len() as u64, Ordering::Release);
}

/// Whether `path` names the file `file` is open on (not removed or replaced).
pub(crate) fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The header words of an existing arena file, read (not mapped: on
/// hugetlbfs a mapping shorter than a huge page cannot be unmapped).
/// Stable while we hold the arena lock.
pub(crate) fn read_header(file: &File, path: &Path) -> Result<impl Fn(usize) -> u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut buf, 0)
        .ctx(|| format!("reading {}", path.display()))?;
    Ok(move |off: usize| u64::from_le_bytes(buf[off..off + 8].try_into().expect("8 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::DType;

    /// A small layout, and the owner and path of an arena in `dir`.
    fn small_arena(dir: &Path) -> (Layout, Owner, PathBuf) {
        let layout = Layout::new(2, 2, 16, DType::Float16, 16).unwrap();
        let owner = Owner {
            store_id: "0".repeat(32),
            store_path: dir.to_path_buf(),
        };
        (layout, owner, dir.join("arena"))
    }

    /// An opener gives up on a held arena after its wait, with `StoreLocked`
    /// naming the holder: the writers' `flock` (here held by this process,
    /// through another description), then a pruner's exclusive lifetime lock;
    /// once they are released, the open succeeds.
    #[test]
    fn an_opener_gives_up_on_a_held_arena() {
        let dir = tempfile::tempdir().unwrap();
        let (layout, owner, path) = small_arena(dir.path());
        let open = |wait| Arena::open_waiting(&path, &layout, &[7; 32], 4 << 20, &owner, wait);
        drop(open(Duration::ZERO).unwrap());
        let wait = Duration::from_millis(50);

        let writer = File::open(&path).unwrap();
        writer.lock().unwrap();
        let start = Instant::now();
        let e = open(wait).err().expect("the writers' lock is held");
        assert!(start.elapsed() >= wait);
        let msg = e.to_string();
        assert!(matches!(e, Error::StoreLocked(_)), "{msg}");
        assert!(
            msg.contains("not free within 0.05s; held now (this process, through another handle)"),
            "{msg}"
        );
        drop(writer);

        let pruner = File::options().read(true).write(true).open(&path).unwrap();
        assert!(ofd_lock(&pruner, OfdLock::ExclusiveTry).unwrap());
        let e = open(wait).err().expect("a pruner holds it");
        assert!(
            matches!(e, Error::StoreLocked(ref m) if m.contains("a pruner")),
            "{e}"
        );
        drop(pruner);
        open(wait).unwrap();
    }

    /// A writer gives up on the writers' lock held by a stopped process (here
    /// this process, through another description) `WRITE_WAIT` after it
    /// started: cache fills with `Busy` (three threads at once in one wait,
    /// not three), a pin and an unpin with `StoreLocked` naming the holder;
    /// after that, fills try once while a pinned insert still waits. Once the
    /// lock is free, all of them go through.
    #[test]
    fn writers_give_up_on_a_held_lock() {
        let dir = tempfile::tempdir().unwrap();
        let (layout, owner, path) = small_arena(dir.path());
        let a = Arena::open(&path, &layout, &[7; 32], 4 << 20, &owner).unwrap();
        let block: Vec<u8> = (0..a.block_bytes).map(|i| (i * 13) as u8).collect();
        let runs: Vec<&[u8]> = block.chunks(a.chunk_bytes).collect();
        let tokens = vec![5u32; 16];
        let ids: Vec<BlockId> = (1..=4u8).map(|i| [i; 32]).collect();
        let insert = |id, priority| a.insert(id, &tokens, &runs, priority, 0, 10).unwrap();
        assert_eq!(insert(&ids[0], 0), Inserted::Stored);

        let writer = File::open(&path).unwrap();
        writer.lock().unwrap();
        let start = Instant::now();
        std::thread::scope(|s| {
            let fills: Vec<_> = ids[1..]
                .iter()
                .map(|id| s.spawn(move || insert(id, 0)))
                .collect();
            for f in fills {
                assert_eq!(f.join().unwrap(), Inserted::Busy);
            }
        });
        let took = start.elapsed();
        assert!(took >= WRITE_WAIT && took < WRITE_WAIT * 3 / 2, "{took:?}");

        let timed = |f: &dyn Fn() -> Result<bool>| {
            let start = Instant::now();
            (f(), start.elapsed())
        };
        for (what, (res, took)) in [
            ("pin", timed(&|| a.pin(&ids[0], 5, 0))),
            ("unpin", timed(&|| a.unpin(&ids[0]))),
        ] {
            assert!(took >= WRITE_WAIT, "{what} gave up after {took:?}");
            let e = res.expect_err(what);
            assert!(
                matches!(e, Error::StoreLocked(ref m) if m.contains(
                    "writers' lock was not free within 2s; held now (this process, through another handle)"
                )),
                "{what}: {e}"
            );
        }
        let start = Instant::now();
        assert_eq!(insert(&ids[1], 0), Inserted::Busy);
        assert!(start.elapsed() < WRITE_WAIT / 2, "{:?}", start.elapsed());
        let start = Instant::now();
        assert_eq!(insert(&ids[2], 3), Inserted::Busy);
        assert!(start.elapsed() >= WRITE_WAIT);
        assert!(ids[1..].iter().all(|id| !a.contains(id)));

        drop(writer);
        // A fill tries once, and takes the lock: the fills wait again after it.
        assert_eq!(insert(&ids[1], 0), Inserted::Stored);
        assert!(a.writers.lock().unwrap().is_none());
        assert!(a.pin(&ids[0], 5, 0).unwrap());
        assert!(a.unpin(&ids[0]).unwrap());
        assert_eq!(insert(&ids[2], 3), Inserted::Stored);
        assert_eq!(insert(&ids[3], 0), Inserted::Stored);
        assert!(ids.iter().all(|id| a.contains(id)));
    }

    /// A 128 KiB mapping of a temporary file, and the bytes written there.
    fn mapped_bytes() -> (SharedMap, Vec<u8>) {
        let file = tempfile::tempfile().unwrap();
        file.set_len(1 << 17).unwrap();
        let map = SharedMap::new(&file, 1 << 17).unwrap();
        let bytes: Vec<u8> = (0..1u32 << 17)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        map.write(0, &bytes);
        (map, bytes)
    }

    /// `read_crc32c` copies and gives the `crc32c` crate's
    /// `crc32c_append` of what it copied, for any length (tails and several
    /// pieces included), offset and seed.
    #[test]
    fn read_crc32c_is_copy_then_crc32c() {
        let (map, bytes) = mapped_bytes();
        for len in [0, 1, 7, 8, 9, 63, 64, 1000, 4099, 16_384, 16_385, 40_000] {
            for (skew, seed) in [(0, 0), (1, 1), (5, 0xdead_beef), (8, u32::MAX)] {
                let off = skew + 3 * len % 7000;
                let mut buf = vec![0u8; len + 3];
                let dst = &mut buf[skew % 3..skew % 3 + len];
                let got = map.read_crc32c(off, dst, seed);
                let want = &bytes[off..off + len];
                assert_eq!(dst, want, "{len} {skew}");
                assert_eq!(got, crc32c::crc32c_append(seed, want), "{len} {skew}");
            }
        }
    }

    /// `read_rows_crc32c` lands each run's rows where its `Rows` say
    /// (strided, streamed or not, aligned or not) and returns the crc32c of
    /// each run appended to its seed, for one to four runs: against a
    /// plain copy and the `crc32c` crate.
    #[test]
    fn read_rows_crc32c_is_a_strided_copy_and_crc32c() {
        if !crate::os::has_fused_rows() {
            // `RunReader` reads through a piece there (tested below).
            eprintln!("no AVX2 and SSE4.2 here: the fused copy is not run");
            return;
        }
        let (map, bytes) = mapped_bytes();
        let (shape, row) = ([5, 3], 64);
        let run = shape[0] * shape[1] * row;
        for n in 1..=4 {
            for (skew, stream) in [(0, true), (0, false), (8, true), (32, true)] {
                // Run s: at 1000 * s + 3 (unaligned), into its own buffer,
                // token-major with a gap, heads 2 rows apart.
                let strides = [3 * 2 * row + 32, 2 * row];
                let src: Vec<usize> = (0..n).map(|s| 1000 * s + 3 + 7 * run * s).collect();
                let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 4 * run + 128]).collect();
                let seeds: Vec<u32> = (0..n).map(|s| 0x1234_5678 * s as u32).collect();
                let mut crcs = seeds.clone();
                {
                    let mut outs: Vec<Rows<'_>> = bufs
                        .iter_mut()
                        .map(|b| {
                            let at = (32 - b.as_ptr() as usize % 32) % 32 + skew;
                            Rows {
                                dst: &mut b[..],
                                at,
                                strides,
                                stream,
                            }
                        })
                        .collect();
                    map.read_rows_crc32c(&src, &mut outs, shape, row, &mut crcs);
                }
                crate::os::stream_fence();
                for s in 0..n {
                    let want = &bytes[src[s]..src[s] + run];
                    let at = (32 - bufs[s].as_ptr() as usize % 32) % 32 + skew;
                    let mut got = Vec::new();
                    for t in 0..shape[0] {
                        for h in 0..shape[1] {
                            let o = at + t * strides[0] + h * strides[1];
                            got.extend_from_slice(&bufs[s][o..o + row]);
                            bufs[s][o..o + row].fill(0);
                        }
                    }
                    // Nothing written between or around the rows.
                    assert!(
                        bufs[s].iter().all(|&x| x == 0),
                        "n {n} run {s}: a stray write"
                    );
                    assert!(got == want, "n {n} run {s} skew {skew} stream {stream}");
                    assert_eq!(
                        crcs[s],
                        crc32c::crc32c_append(seeds[s], want),
                        "n {n} run {s}"
                    );
                }
            }
        }
    }

    /// `read_runs` lands the bytes it checksummed, never a second read of
    /// the slot: a byte flipped in the slot after its run was read does not
    /// reach what landed (the read is right and is served), one flipped in a
    /// run not read yet fails the check, and so does a reader that stops
    /// before the last run. Rows of 32 bytes (the fused copy, where the CPU
    /// has it) and of 16 (row by row).
    #[test]
    fn read_runs_lands_what_it_checksummed() {
        for head_dim in [16, 8] {
            let dir = tempfile::tempdir().unwrap();
            let layout = Layout::new(3, 2, head_dim, DType::Float16, 16).unwrap();
            let owner = Owner {
                store_id: "0".repeat(32),
                store_path: dir.path().to_path_buf(),
            };
            let a = Arena::open(
                &dir.path().join("arena"),
                &layout,
                &[7; 32],
                4 << 20,
                &owner,
            )
            .unwrap();
            let run = a.chunk_bytes;
            let block: Vec<u8> = (0..a.block_bytes).map(|i| (i * 31 + i / 7) as u8).collect();
            let runs: Vec<&[u8]> = block.chunks(run).collect();
            let (id, tokens) = ([3u8; 32], vec![5u32; 16]);
            assert_eq!(
                a.insert(&id, &tokens, &runs, 0, 0, 0).unwrap(),
                Inserted::Stored
            );
            let (slot, _) = a.holding(&id).unwrap();
            // Runs 0-3 are read at once, then 4-5; or 0-2, then 3-5 (lanes
            // 3, 0, 1: the lanes wrap within a read).
            let cases = [
                (0, 4, 6, true),
                (4, 4, 6, false),
                (5, 4, 4, false),
                (1, 3, 6, true),
                (3, 3, 6, false),
            ];
            for (flip_run, first, stop, served) in cases {
                let at = a.data(slot) + flip_run * run + 5;
                let mut landed = vec![0u8; a.block_bytes];
                let ok = a.read_runs(&id, &tokens, |reader| {
                    let ([_, heads], row) = reader.shape();
                    let mut chunks = landed.chunks_exact_mut(run);
                    for g in [0..first, first..stop] {
                        let mut outs: Vec<Rows<'_>> = chunks
                            .by_ref()
                            .take(g.len())
                            .map(|dst| Rows {
                                dst,
                                at: 0,
                                strides: [heads * row, row],
                                stream: false,
                            })
                            .collect();
                        reader.read(&mut outs);
                        if g.start == 0 {
                            // Another process, without the seqlock.
                            let mut b = [0u8];
                            a.map.read(at, &mut b);
                            a.map.write(at, &[!b[0]]);
                        }
                    }
                });
                assert_eq!(
                    ok, served,
                    "D {head_dim}: flip in run {flip_run}, runs 0..{first}..{stop}"
                );
                if served {
                    assert!(landed == block, "wrong bytes served");
                }
                let mut b = [0u8];
                a.map.read(at, &mut b);
                a.map.write(at, &[!b[0]]);
            }
        }
    }

    /// An existing arena is checked against the geometry its own size gives:
    /// that must be the geometry it was created with, for any `hot_bytes`.
    #[test]
    fn geometry_is_recovered_from_the_size_alone() {
        let layouts = [
            Layout::new(2, 2, 64, DType::Float16, 16).unwrap(),
            Layout::new(1, 1, 8, DType::Float16, 16).unwrap(),
            Layout::new(32, 8, 128, DType::Float16, 16).unwrap(),
            Layout::new(3, 1, 24, DType::Float32, 7).unwrap(),
        ];
        for layout in &layouts {
            let mut hot = 1u64 << 20;
            while hot < 1 << 36 {
                for h in [hot - 1, hot, hot + 4097, hot * 3 / 2 + 12345] {
                    if let Some(g) = Geometry::for_size(layout, h) {
                        assert!(g.total as u64 <= h);
                        assert!(g.nslots.is_multiple_of(g.ways));
                        assert!(g.data_off >= HEADER_LEN + g.nslots * g.slot_hdr);
                        assert!(g.total >= g.data_off + g.nslots * g.slot_size);
                        assert_eq!(Geometry::for_size(layout, g.total as u64), Some(g), "{h}");
                    }
                }
                hot = hot * 5 / 4;
            }
            // Sizes no arena has: no overflow, no panic.
            for h in [0, 1, 4096, u64::MAX, u64::MAX / 2, (1 << 63) + 12345] {
                let _ = Geometry::for_size(layout, h);
            }
        }
    }
}
