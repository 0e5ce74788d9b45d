//! The hot tier: one shared-memory arena per store, mapped by every process
//! that opens the store with a hot tier.
//!
//! # Layout
//!
//! ```text
//! 0            header (4 KiB): magic, version, geometry, store tag, ready flag, counters
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
//!
//! Each slot has a version counter used as a seqlock. A writer makes it odd,
//! fills id, tokens and data, then makes it even. Readers take no lock: they
//! read an even version, compare the id and token ids, copy the data, and
//! read the version again; a change means the copy may be torn or the slot
//! reused, and the copy is thrown away (the caller falls back to the segment
//! files). A writer that died mid-write leaves an odd version: readers skip
//! the slot, and the next writer to visit the set reclaims it. No slot leaks.
//!
//! Eviction within a set: empty or torn slots first, then blocks whose pin
//! has expired or was never set, lowest priority first, least recently used
//! first. A block pinned with a priority at least the newcomer's stays.

use crate::error::{Error, IoContext, Result};
use crate::id::BlockId;
use crate::layout::Layout;
use crate::os::SharedMap;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::sync::Mutex;

const MAGIC: u64 = u64::from_le_bytes(*b"KVARENA\x01");
const VERSION: u64 = 1;
const HEADER_LEN: usize = 4096;
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
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_NSLOTS: usize = 16;
const H_WAYS: usize = 24;
const H_SLOT_HDR: usize = 32;
const H_SLOT_SIZE: usize = 40;
const H_DATA_OFF: usize = 48;
const H_TOTAL: usize = 56;
const H_TAG: usize = 64; // 4 words
const H_READY: usize = 96;
const H_EVICTIONS: usize = 104;
const H_INSERTS: usize = 112;
const H_TICK: usize = 120;

// Slot header offsets.
const S_VERSION: usize = 0;
const S_ID: usize = 8; // 4 words
const S_STATE: usize = 40; // 0 empty, 1 holds a block
const S_PRIORITY: usize = 48;
const S_EXPIRES: usize = 56; // ms since the epoch; 0 = never
const S_LAST_USED: usize = 64; // value of the arena's tick
const S_TOKENS: usize = 72; // block_size × u32

/// What kind of pages back the arena, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageKind {
    HugeTlb,
    TransparentHuge,
    Normal,
}

impl PageKind {
    pub fn name(&self) -> &'static str {
        match self {
            PageKind::HugeTlb => "hugetlb",
            PageKind::TransparentHuge => "thp",
            PageKind::Normal => "normal",
        }
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
}

/// Figures of the hot tier.
#[derive(Clone, Debug, Default)]
pub struct ArenaStats {
    pub path: String,
    pub bytes: u64,
    pub slots: u64,
    pub slots_used: u64,
    pub slots_pinned: u64,
    pub evictions: u64,
    pub inserts: u64,
    /// Slots a writer is filling right now, or that one left half-written
    /// when it died (reclaimed by the next open or insert in their set).
    pub slots_torn: u64,
    pub page_kind: String,
}

pub struct Arena {
    map: SharedMap,
    file: File,
    path: PathBuf,
    lock: Mutex<()>,
    nslots: usize,
    ways: usize,
    slot_hdr: usize,
    slot_size: usize,
    data_off: usize,
    block_size: usize,
    chunk_bytes: usize,
    page_kind: PageKind,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Geometry of an arena of at most `hot_bytes` for `layout`.
fn geometry(layout: &Layout, hot_bytes: u64) -> Result<(usize, usize, usize, usize, usize)> {
    let slot_hdr = round_up(S_TOKENS + 4 * layout.block_size as usize, 64);
    let slot_size = round_up(layout.block_bytes(), 64);
    let per_slot = slot_hdr + slot_size;
    let data_off_for = |n: usize| round_up(HEADER_LEN + n * slot_hdr, DATA_ALIGN) + DATA_SKEW;
    let total_for = |n: usize| round_up(data_off_for(n) + n * slot_size, DATA_ALIGN);
    let mut nslots = (hot_bytes as usize).saturating_sub(HEADER_LEN) / per_slot;
    // The mapping, rounding included, must fit in `hot_bytes`.
    while nslots > 0 && total_for(nslots) as u64 > hot_bytes {
        nslots -= 1;
    }
    if nslots >= WAYS {
        nslots -= nslots % WAYS;
    }
    if nslots == 0 {
        return Err(Error::InvalidInput(format!(
            "hot_bytes: expected at least {} bytes (one {}-byte block, headers, 2 MiB alignment \
             for huge pages), got {hot_bytes}",
            total_for(1),
            layout.block_bytes()
        )));
    }
    Ok((
        nslots,
        slot_hdr,
        slot_size,
        data_off_for(nslots),
        total_for(nslots),
    ))
}

/// Where arenas live when the user names no directory: a hugetlbfs mount
/// with enough free huge pages, else `/dev/shm`.
pub fn default_dir(bytes: u64) -> PathBuf {
    if let Ok(mounts) = std::fs::read_to_string("/proc/mounts") {
        for line in mounts.lines() {
            let mut f = line.split_whitespace();
            let (_, dir, fs) = (f.next(), f.next(), f.next());
            if fs == Some("hugetlbfs") {
                if let Some(dir) = dir {
                    let free = rustix::fs::statvfs(dir)
                        .map(|s| s.f_bavail * s.f_bsize)
                        .unwrap_or(0);
                    if free >= bytes {
                        return PathBuf::from(dir);
                    }
                }
            }
        }
    }
    PathBuf::from("/dev/shm")
}

fn refuse(path: &Path, reason: impl Into<String>) -> Error {
    Error::corrupt(path, format!("hot-tier arena refused: {}", reason.into()))
}

impl Arena {
    /// Opens the arena at `path`, creating it (of at most `hot_bytes`) if it
    /// does not exist. An existing arena of this store is adopted at its own
    /// size; anything else at that path is refused, never followed.
    pub fn open(path: &Path, layout: &Layout, tag: &[u8; 32], hot_bytes: u64) -> Result<Arena> {
        let (nslots, slot_hdr, slot_size, data_off, total) = geometry(layout, hot_bytes)?;
        let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
        let (file, created) = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nofollow)
            .open(path)
        {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                match std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(nofollow)
                    .open(path)
                {
                    Ok(f) => (f, false),
                    Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
                        return Err(refuse(path, "it is a symlink"))
                    }
                    Err(e) => {
                        return Err(Error::Io {
                            context: format!("opening arena {}", path.display()),
                            source: e,
                        })
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
                return Err(refuse(path, "it is a symlink"))
            }
            Err(e) => {
                return Err(Error::Io {
                    context: format!("creating arena {}", path.display()),
                    source: e,
                })
            }
        };
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
        // Creation and adoption run under the arena lock: a second process
        // waits here until the creator has filled the header.
        file.lock()
            .ctx(|| format!("locking arena {}", path.display()))?;
        let res = Self::init_or_adopt(
            file,
            path,
            layout,
            tag,
            (nslots, slot_hdr, slot_size, data_off, total),
        );
        if let Err(e) = &res {
            if created && !matches!(e, Error::CorruptStore { .. }) {
                let _ = std::fs::remove_file(path);
            }
        }
        res
    }

    fn init_or_adopt(
        file: File,
        path: &Path,
        layout: &Layout,
        tag: &[u8; 32],
        geo: (usize, usize, usize, usize, usize),
    ) -> Result<Arena> {
        // Decided here, under the lock, from the file itself (not from who
        // created it): the first process to hold the lock initialises it.
        let mut len = file
            .metadata()
            .ctx(|| format!("stat {}", path.display()))?
            .len() as usize;
        if len >= HEADER_LEN {
            let head = read_header(&file, path)?;
            if head(H_MAGIC) == MAGIC && head(H_READY) != 1 {
                // Its creator died before finishing it, and nobody can have
                // used it (adopters refuse an arena that is not ready).
                file.set_len(0)
                    .ctx(|| format!("resetting {}", path.display()))?;
                len = 0;
            }
        }
        let fresh = len == 0;
        let (nslots, slot_hdr, slot_size, data_off, total) = if fresh {
            // Reserve every page now: on a full tmpfs or an empty huge-page
            // pool this fails here, cleanly, instead of a SIGBUS on first touch.
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, geo.4 as u64)
                .map_err(|e| {
                    Error::StoreFull(format!(
                        "cannot reserve {} bytes for the hot tier at {}: {e}",
                        geo.4,
                        path.display()
                    ))
                })?;
            geo
        } else {
            if len < HEADER_LEN {
                return Err(refuse(
                    path,
                    format!("it is {len} bytes, smaller than an arena header"),
                ));
            }
            let head = read_header(&file, path)?;
            let word = |off| head(off) as usize;
            if word(H_MAGIC) as u64 != MAGIC || word(H_VERSION) as u64 != VERSION {
                return Err(refuse(
                    path,
                    "it is not a kvstore arena (bad magic or version)",
                ));
            }
            let their_tag: Vec<u8> = (0..4)
                .flat_map(|i| (word(H_TAG + 8 * i) as u64).to_le_bytes())
                .collect();
            if their_tag != tag {
                return Err(refuse(path, "it belongs to another store or layout"));
            }
            let g = (
                word(H_NSLOTS),
                word(H_SLOT_HDR),
                word(H_SLOT_SIZE),
                word(H_DATA_OFF),
                word(H_TOTAL),
            );
            let sane = g.0 > 0
                && word(H_WAYS) >= 1
                && g.1 == geo.1
                && g.2 == geo.2
                && g.3 >= HEADER_LEN + g.0 * g.1
                && g.4 >= g.3 + g.0 * g.2
                && g.4 == len;
            if !sane {
                return Err(refuse(
                    path,
                    format!("its size ({len} bytes) or geometry does not match its header"),
                ));
            }
            g
        };
        let map = SharedMap::new(&file, total).ctx(|| format!("mapping {}", path.display()))?;
        map.advise_huge_pages();
        let ways = if fresh {
            WAYS.min(nslots)
        } else {
            map.u64_at(H_WAYS).load(Ordering::Acquire) as usize
        };
        if fresh {
            for (off, v) in [
                (H_MAGIC, MAGIC),
                (H_VERSION, VERSION),
                (H_NSLOTS, nslots as u64),
                (H_WAYS, ways as u64),
                (H_SLOT_HDR, slot_hdr as u64),
                (H_SLOT_SIZE, slot_size as u64),
                (H_DATA_OFF, data_off as u64),
                (H_TOTAL, total as u64),
            ] {
                map.u64_at(off).store(v, Ordering::Relaxed);
            }
            for i in 0..4 {
                let w = u64::from_le_bytes(tag[8 * i..8 * i + 8].try_into().expect("8 bytes"));
                map.u64_at(H_TAG + 8 * i).store(w, Ordering::Relaxed);
            }
            map.u64_at(H_READY).store(1, Ordering::Release);
        }
        let page_kind = page_kind_of(map.addr());
        let arena = Arena {
            map,
            file,
            path: path.to_path_buf(),
            lock: Mutex::new(()),
            nslots,
            ways,
            slot_hdr,
            slot_size,
            data_off,
            block_size: layout.block_size as usize,
            chunk_bytes: layout.chunk_bytes(),
            page_kind,
        };
        if !nslots.is_multiple_of(ways) {
            return Err(refuse(
                path,
                "its slot count is not a multiple of its set size",
            ));
        }
        arena.reclaim_torn();
        arena
            .file
            .unlock()
            .ctx(|| format!("unlocking {}", path.display()))?;
        Ok(arena)
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
                v.store(version + 1, Ordering::Release);
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn page_kind(&self) -> &PageKind {
        &self.page_kind
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
    /// block's `2L` runs. Lock-free; false on a miss or a concurrent change
    /// (then `out` holds garbage and the caller reads the segments instead).
    pub fn get(&self, id: &BlockId, tokens: &[u32], out: &mut [&mut [u8]]) -> bool {
        let Some((slot, version)) = self.holding(id) else {
            return false;
        };
        if !self.tokens_match(slot, tokens) {
            return false; // same id, other tokens: a collision is a miss
        }
        let base = self.data(slot);
        for (i, chunk) in out.iter_mut().enumerate() {
            self.map.read(base + i * self.chunk_bytes, chunk);
        }
        self.confirm(slot, version)
    }

    /// Where block `id` (with `tokens`) lies: `(slot, version, data offset)`,
    /// for a caller that copies it straight out of the mapping (a DMA). The
    /// copy is good only if `unchanged(slot, version)` still holds after it.
    pub fn locate(&self, id: &BlockId, tokens: &[u32]) -> Option<(usize, u64, usize)> {
        let (slot, version) = self.holding(id)?;
        (self.tokens_match(slot, tokens) && self.confirm(slot, version))
            .then(|| (slot, version, self.data(slot)))
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

    fn write_locked<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _guard = self.lock.lock().expect("arena lock");
        self.file
            .lock()
            .ctx(|| format!("locking arena {}", self.path.display()))?;
        let out = f();
        self.file
            .unlock()
            .ctx(|| format!("unlocking arena {}", self.path.display()))?;
        Ok(out)
    }

    /// Stores a block (its `2L` runs), evicting per the policy above.
    /// `priority` 0 = unpinned; `expires_ms` 0 = never.
    pub fn insert(
        &self,
        id: &BlockId,
        tokens: &[u32],
        chunks: &[&[u8]],
        priority: u64,
        expires_ms: u64,
        now_ms: u64,
    ) -> Result<Inserted> {
        if tokens.len() != self.block_size || chunks.iter().any(|c| c.len() != self.chunk_bytes) {
            return Err(Error::InvalidInput(
                "arena insert: block of the wrong shape".into(),
            ));
        }
        self.write_locked(|| {
            let mut victim: Option<(usize, (u8, u64, u64))> = None;
            for slot in self.set_of(id) {
                let h = self.hdr(slot);
                let version = self.map.u64_at(h + S_VERSION).load(Ordering::Relaxed);
                let used = self.map.u64_at(h + S_STATE).load(Ordering::Relaxed) == 1;
                if version & 1 == 0
                    && used
                    && self.id_matches(slot, id)
                    && self.tokens_match(slot, tokens)
                {
                    self.raise_pin(slot, priority, expires_ms);
                    return Inserted::Present;
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
            let h = self.hdr(slot);
            let v = self.map.u64_at(h + S_VERSION).load(Ordering::Relaxed);
            let odd = if v & 1 == 1 { v + 2 } else { v + 1 };
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
            let base = self.data(slot);
            for (i, c) in chunks.iter().enumerate() {
                self.map.write(base + i * self.chunk_bytes, c);
            }
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
                .store(odd + 1, Ordering::Release);
            if rank.0 == 1 {
                self.map.u64_at(H_EVICTIONS).fetch_add(1, Ordering::Relaxed);
            }
            self.map.u64_at(H_INSERTS).fetch_add(1, Ordering::Relaxed);
            Inserted::Stored
        })
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
        self.write_locked(|| self.holding(id).map(|(slot, _)| f(slot)).is_some())
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
        }
    }
}

/// The header words of an existing arena file, read (not mapped: on
/// hugetlbfs a mapping shorter than a huge page cannot be unmapped).
/// Stable while we hold the arena lock.
fn read_header(file: &File, path: &Path) -> Result<impl Fn(usize) -> u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut buf, 0)
        .ctx(|| format!("reading {}", path.display()))?;
    Ok(move |off: usize| u64::from_le_bytes(buf[off..off + 8].try_into().expect("8 bytes")))
}

/// Reads the page kind of the mapping at `addr` from `/proc/self/smaps`: what
/// the kernel gave, not what was asked for.
fn page_kind_of(addr: usize) -> PageKind {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return PageKind::Normal;
    };
    let prefix = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&prefix));
    lines.next();
    let mut kind = PageKind::Normal;
    for line in lines {
        if line
            .split_whitespace()
            .next()
            .is_some_and(|w| w.contains('-') && !w.ends_with(':'))
        {
            break; // next mapping
        }
        let mut f = line.split_whitespace();
        let (key, value) = (
            f.next().unwrap_or(""),
            f.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0),
        );
        match key {
            "KernelPageSize:" if value >= 2048 => return PageKind::HugeTlb,
            "ShmemPmdMapped:" | "FilePmdMapped:" if value > 0 => kind = PageKind::TransparentHuge,
            _ => {}
        }
    }
    kind
}
