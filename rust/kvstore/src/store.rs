//! The store: put/get/lookup over segments and the index, sessions, flush,
//! recovery, verify, compact and gc.
//!
//! Write order (the durability contract): a record is appended to this
//! handle's own segment file, then `fdatasync` (per put with `Sync`, grouped
//! with `Batch`, never with `None`), then the index entry commits, and only
//! then is the block visible to other handles. A handle sees its own
//! not-yet-committed blocks through its pending list.
//!
//! Many processes: LMDB serialises index writers; each writing handle appends
//! to a segment file it created and holds an exclusive `flock` on, so records
//! never interleave. A segment whose lock is free belongs to nobody alive:
//! recovery truncates it to its committed length and seals it.
//!
//! Reads check every hit against the request: record header and token
//! checksums, the block id, the token ids, the payload checksums. Anything
//! off is a miss, the entry moves to the `damaged` table, and a later put of
//! the same block stores it again.

use crate::arena::{self, Arena, ArenaStats, Inserted};
use crate::error::{Error, IoContext, Result};
use crate::fault;
use crate::format::{self, Manifest, RecordHeader};
use crate::id::{self, BlockId, Keyer};
use crate::index::{Index, Location, SegmentInfo, SegmentState};
use crate::io;
use crate::known::Known;
use crate::layout::Layout;
use std::collections::HashMap;
use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// When a put is durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `fdatasync` + index commit before each `put` returns.
    Sync,
    /// Group commit: records are written at once, synced and committed together
    /// within `batch_window` (or sooner when `batch_bytes` pile up).
    Batch,
    /// Commit at once, never `fdatasync`: survives a process crash, not power loss.
    None,
}

impl Durability {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "sync" => Ok(Durability::Sync),
            "batch" => Ok(Durability::Batch),
            "none" => Ok(Durability::None),
            other => Err(Error::InvalidInput(format!(
                "durability: expected \"sync\", \"batch\" or \"none\", got {other:?}"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Durability::Sync => "sync",
            Durability::Batch => "batch",
            Durability::None => "none",
        }
    }
}

/// How to open a store.
#[derive(Clone, Debug)]
pub struct Options {
    /// Model fingerprint. `None` with `layout: None` opens an existing store as
    /// its MANIFEST says (the CLI does this).
    pub fingerprint: Option<String>,
    pub layout: Option<Layout>,
    pub salt: Option<Vec<u8>>,
    pub durability: Durability,
    /// Bound on segment bytes on disk; `None` for unbounded.
    pub disk_bytes: Option<u64>,
    /// zstd level for payloads; 0 stores them raw.
    pub compression_level: i32,
    /// A segment file is sealed and a new one started past this size.
    pub segment_bytes: u64,
    pub batch_window: Duration,
    pub batch_bytes: u64,
    /// Create the store if it does not exist.
    pub create: bool,
    /// Capacity of the shared-memory hot tier; `None`: no hot tier.
    pub hot_bytes: Option<u64>,
    /// Directory of the arena file (a hugetlbfs mount, or tmpfs); `None`: the
    /// `KVSTORE_HOT_DIR` environment variable, else a hugetlbfs mount with
    /// room, else `/dev/shm`.
    pub hot_dir: Option<PathBuf>,
    /// Virtual size of the LMDB index map (at least 2 MiB): a bound on index
    /// bytes. Puts are `StoreFull` past three quarters of it (or past all but
    /// 1 MiB, if less); the rest is kept for gc and eviction. The first handle of a process to open the store
    /// sets it.
    pub index_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            fingerprint: None,
            layout: None,
            salt: None,
            durability: Durability::Batch,
            disk_bytes: None,
            compression_level: 0,
            segment_bytes: 1 << 30,
            batch_window: Duration::from_millis(20),
            batch_bytes: 256 << 20,
            create: true,
            hot_bytes: None,
            hot_dir: None,
            index_bytes: crate::index::DEFAULT_MAP_SIZE,
        }
    }
}

#[derive(Default)]
struct Counters {
    hit_blocks: AtomicU64,
    miss_blocks: AtomicU64,
    /// Hits and misses already added to the store-wide totals in `meta`.
    saved_hits: AtomicU64,
    saved_misses: AtomicU64,
    blocks_written: AtomicU64,
    blocks_deduped: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    damaged_found: AtomicU64,
    hot_hit_blocks: AtomicU64,
    disk_hit_blocks: AtomicU64,
}

/// Figures of `Store::stats`.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub blocks: u64,
    pub sessions: u64,
    pub segments: u64,
    pub disk_bytes: u64,
    pub live_bytes: u64,
    pub dead_bytes: u64,
    /// Raw (decoded) bytes of the live blocks; `/ live_bytes` is the compression ratio.
    pub raw_live_bytes: u64,
    pub damaged_blocks: u64,
    pub pending_blocks: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    /// Hits and misses of every handle since the store was created, as of each
    /// handle's last flush or close.
    pub total_hit_blocks: u64,
    pub total_miss_blocks: u64,
    pub blocks_written: u64,
    pub blocks_deduped: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub block_bytes: u64,
    /// Blocks this handle served from the hot tier, and from the segments.
    pub hot_hit_blocks: u64,
    pub disk_hit_blocks: u64,
    /// The hot tier, if this handle has one.
    pub arena: Option<ArenaStats>,
}

/// One segment, as `kvstore stats` lists it.
#[derive(Clone, Debug)]
pub struct SegmentReport {
    pub segment: u64,
    pub sealed: bool,
    pub file_bytes: Option<u64>,
    pub committed_bytes: u64,
    pub live_bytes: u64,
    pub live_records: u64,
    pub dead_bytes: u64,
}

/// One damaged record found by `verify` (or by a read before it).
#[derive(Clone, Debug)]
pub struct Damage {
    pub block_id: String,
    pub segment: u64,
    pub offset: u64,
    pub reason: String,
}

#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub records_checked: u64,
    pub bytes_checked: u64,
    pub damaged: Vec<Damage>,
    /// Problems that are not one block: missing or short segment files, orphans.
    pub problems: Vec<String>,
}

#[derive(Clone, Debug, Default)]
pub struct CompactReport {
    pub segments_rewritten: u64,
    pub records_moved: u64,
    pub records_dropped: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    pub blocks_evicted: u64,
    pub bytes_evicted: u64,
    pub compact: CompactReport,
}

/// Progress callback: (done, total).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// The segment this handle appends to.
struct Active {
    segment: u64,
    file: File,
    len: u64,
}

struct Pending {
    id: BlockId,
    loc: Location,
}

/// A writer: one active segment and the records not yet committed.
struct Writer {
    active: Option<Active>,
    pending: Vec<Pending>,
    pending_ids: HashMap<BlockId, Location>,
    pending_bytes: u64,
    oldest_pending: Option<Instant>,
    poisoned: Option<String>,
    /// Blocks of the put in progress, which eviction must leave alone.
    protect: std::collections::HashSet<BlockId>,
}

impl Writer {
    fn new() -> Self {
        Writer {
            active: None,
            pending: Vec::new(),
            pending_ids: HashMap::new(),
            pending_bytes: 0,
            oldest_pending: None,
            poisoned: None,
            protect: std::collections::HashSet::new(),
        }
    }
}

struct Inner {
    dir: PathBuf,
    manifest: Manifest,
    layout: Layout,
    keyer: Keyer,
    tag: [u8; 16],
    opts: Options,
    index: Arc<Index>,
    writer: Mutex<Writer>,
    wake: Condvar,
    closing: AtomicBool,
    /// Open segment files for reads, dropped when the generation advances
    /// (a compaction may have deleted some: their space must be freed).
    readers: RwLock<HashMap<u64, Arc<File>>>,
    known: Known,
    /// Last-use times of blocks this handle served, not yet in the index.
    touched: Mutex<Touched>,
    arena: Option<Arena>,
    counters: Counters,
}

/// Buffered last-use times: written to the index at flush, close, eviction,
/// or when there are many or they are old (a read must not write each time).
struct Touched {
    times: HashMap<BlockId, u64>,
    since: Instant,
}

impl Default for Touched {
    fn default() -> Self {
        Touched {
            times: HashMap::new(),
            since: Instant::now(),
        }
    }
}

const TOUCHED_MAX: usize = 16384;
const TOUCHED_MAX_AGE: Duration = Duration::from_secs(5);

/// A read snapshot of the index and the generation it saw.
struct Snap<'s> {
    txn: heed::RoTxn<'s, heed::WithoutTls>,
    generation: u64,
}

/// A handle on a store directory. `Sync`: share it between threads.
pub struct Store {
    inner: RwLock<Option<Arc<Inner>>>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    pid: u32,
}

/// Why a record could not be served.
enum ReadFail {
    /// The segment file is gone (compacted away): look the block up again.
    Gone,
    Damaged(String),
    /// A sound record of another token sequence under the same id (a hash
    /// collision, or a misplaced record): a miss, and not damage, since the
    /// record is right for its own tokens.
    OtherTokens,
}

impl ReadFail {
    /// Why the record is unusable for its block (the reason `verify` lists
    /// and the index keeps); `None` when it is sound but for other tokens.
    fn damage(self) -> Option<String> {
        match self {
            ReadFail::Gone => Some("segment file is missing".into()),
            ReadFail::Damaged(r) => Some(r),
            ReadFail::OtherTokens => None,
        }
    }
}

/// Segment files a handle keeps open for reads.
const MAX_OPEN_SEGMENTS: usize = 256;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn has_segment_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".kvseg"))
    })
}

/// A MANIFEST is a few hundred bytes; anything past this is not one.
const MANIFEST_MAX: u64 = 64 << 10;

/// Reads and checks a store's MANIFEST; `None` if there is none. A symlink,
/// a FIFO or an absurd size is not a MANIFEST we wrote: `CorruptStore`.
pub(crate) fn read_manifest(path: &Path) -> Result<Option<Manifest>> {
    match io::read_small(path, MANIFEST_MAX) {
        Ok(bytes) => Manifest::decode(&bytes)
            .map(Some)
            .map_err(|r| Error::corrupt(path, r)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e)
            if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error())
                || matches!(
                    e.kind(),
                    std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput
                ) =>
        {
            Err(Error::corrupt(path, e.to_string()))
        }
        Err(e) => Err(Error::Io {
            context: format!("reading {}", path.display()),
            source: e,
        }),
    }
}

/// The number of a segment file from its name (`<16 hex digits>.kvseg`).
pub(crate) fn segment_number(name: &std::ffi::OsStr) -> Option<u64> {
    name.to_str()?
        .strip_suffix(".kvseg")
        .and_then(|s| u64::from_str_radix(s, 16).ok())
}

pub(crate) fn segment_path(dir: &Path, segment: u64) -> PathBuf {
    dir.join("segments").join(format!("{segment:016x}.kvseg"))
}

/// Splits a contiguous `[L, 2, T, H, D]` byte buffer into the `2L` runs of block `i`.
fn block_chunks<'a>(layout: &Layout, kv: &'a [u8], total_tokens: usize, i: usize) -> Vec<&'a [u8]> {
    let tb = layout.token_bytes();
    let cb = layout.chunk_bytes();
    let b = layout.block_size as usize;
    (0..layout.num_layers as usize * 2)
        .map(|lk| {
            let start = (lk * total_tokens + i * b) * tb;
            &kv[start..start + cb]
        })
        .collect()
}

fn block_chunks_mut<'a>(
    layout: &Layout,
    kv: &'a mut [u8],
    total_tokens: usize,
    i: usize,
) -> Vec<&'a mut [u8]> {
    let tb = layout.token_bytes();
    let cb = layout.chunk_bytes();
    let b = layout.block_size as usize;
    let stride = total_tokens * tb;
    kv.chunks_mut(stride)
        .take(layout.num_layers as usize * 2)
        .map(|run| &mut run[i * b * tb..i * b * tb + cb])
        .collect()
}

fn crc_of(chunks: &[&[u8]]) -> u32 {
    chunks.iter().fold(0, |c, ch| crc32c::crc32c_append(c, ch))
}

impl Store {
    /// Opens (or creates) the store at `dir`.
    pub fn open(dir: &Path, opts: Options) -> Result<Store> {
        if opts.compression_level < 0 || opts.compression_level > 22 {
            return Err(Error::InvalidInput(format!(
                "compression level: expected 0 (off) to 22, got {}",
                opts.compression_level
            )));
        }
        if opts.segment_bytes < 1 << 20 {
            return Err(Error::InvalidInput(format!(
                "segment_bytes: expected at least 1 MiB, got {}",
                opts.segment_bytes
            )));
        }
        if opts.index_bytes < 2 * crate::index::INDEX_RESERVE {
            // At least as much for entries as is kept back for gc.
            return Err(Error::InvalidInput(format!(
                "index_bytes: expected at least 2 MiB, got {}",
                opts.index_bytes
            )));
        }
        let inner = Arc::new(Inner::open(dir, opts)?);
        let flusher = (inner.opts.durability == Durability::Batch).then(|| {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("kvstore-flush".into())
                .spawn(move || inner.flush_loop())
                .expect("spawn flusher thread")
        });
        Ok(Store {
            inner: RwLock::new(Some(inner)),
            flusher: Mutex::new(flusher),
            pid: std::process::id(),
        })
    }

    /// The open state, or `StoreClosed` (closed, or used across `fork()`).
    fn live(&self) -> Result<Arc<Inner>> {
        if std::process::id() != self.pid {
            return Err(Error::StoreClosed(format!(
                "this handle was opened in process {} and cannot be used after fork() (this is process {}); \
                 open the store again in the child",
                self.pid,
                std::process::id()
            )));
        }
        self.inner
            .read()
            .expect("store lock")
            .clone()
            .ok_or_else(|| Error::StoreClosed("the store handle is closed".into()))
    }

    pub fn layout(&self) -> Result<Layout> {
        Ok(self.live()?.layout)
    }
    pub fn manifest(&self) -> Result<Manifest> {
        Ok(self.live()?.manifest.clone())
    }
    pub fn durability(&self) -> Result<Durability> {
        Ok(self.live()?.opts.durability)
    }
    pub fn is_closed(&self) -> bool {
        self.inner.read().expect("store lock").is_none()
    }

    /// Stores every full block of `tokens` not stored yet. `kv` is a contiguous
    /// `[L, 2, kv_tokens, H, D]` buffer. Returns the tokens covered (full blocks).
    pub fn put(&self, tokens: &[u32], kv: &[u8], kv_tokens: usize, extra: &[u8]) -> Result<usize> {
        self.live()?.put(tokens, kv, kv_tokens, extra)
    }

    /// The ids of the full blocks of `tokens` (keyed by this handle's model,
    /// layout and salt), as connectors and block pools name blocks.
    pub fn block_ids(&self, tokens: &[u32], extra: &[u8]) -> Result<Vec<BlockId>> {
        let inner = self.live()?;
        Ok(inner
            .keyer
            .chain(tokens, inner.layout.block_size as usize, extra))
    }

    /// Longest stored prefix of `tokens`, in tokens; counted as hits and misses.
    pub fn lookup(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let inner = self.live()?;
        let n = inner.stored_blocks(tokens, extra)?;
        inner.count_hits(n, tokens.len() / inner.layout.block_size as usize);
        Ok(n * inner.layout.block_size as usize)
    }

    /// Like `lookup`, without counting (to size a buffer before `get_into`).
    pub fn stored_prefix(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let inner = self.live()?;
        Ok(inner.stored_blocks(tokens, extra)? * inner.layout.block_size as usize)
    }

    /// Fills `out`, a contiguous `[L, 2, out_tokens, H, D]` buffer, with the KV of
    /// the longest stored prefix (at most `out_tokens`). Returns its length in tokens.
    pub fn get_into(
        &self,
        tokens: &[u32],
        extra: &[u8],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        self.live()?.get_into(tokens, extra, out, out_tokens)
    }

    /// Keeps the longest stored prefix of `tokens` warm: held in the hot tier
    /// ahead of blocks pinned lower or not at all, and kept by `gc`, until
    /// `ttl` passes (`None`: until unpinned). Returns the tokens pinned.
    /// `StoreFull` if the hot tier cannot hold them at this priority.
    pub fn pin(
        &self,
        tokens: &[u32],
        extra: &[u8],
        priority: u64,
        ttl: Option<Duration>,
    ) -> Result<usize> {
        self.live()?.pin(tokens, extra, priority, ttl)
    }

    /// Undoes `pin` for the blocks of `tokens`. Returns the tokens unpinned.
    pub fn unpin(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        self.live()?.unpin(tokens, extra)
    }

    /// For each full block of `tokens`: where it lies in the hot tier, as
    /// `(slot, version, offset in the arena file)`, or `None`. A caller may
    /// copy a block straight out of its own mapping of the arena file, then
    /// must check `hot_unchanged` before trusting the copy.
    pub fn hot_blocks(&self, tokens: &[u32], extra: &[u8]) -> Result<Vec<Option<(u64, u64, u64)>>> {
        let inner = self.live()?;
        let arena = inner.hot_tier()?;
        let b = inner.layout.block_size as usize;
        let ids = inner.keyer.chain(tokens, b, extra);
        Ok(ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                arena
                    .locate(id, &tokens[i * b..(i + 1) * b])
                    .map(|(slot, v, off)| (slot as u64, v, off as u64))
            })
            .collect())
    }

    /// Whether each `(slot, version)` from `hot_blocks` still holds that block.
    pub fn hot_unchanged(&self, slots: &[(u64, u64)]) -> Result<Vec<bool>> {
        let inner = self.live()?;
        let arena = inner.hot_tier()?;
        Ok(slots
            .iter()
            .map(|(slot, v)| usize::try_from(*slot).is_ok_and(|s| arena.unchanged(s, *v)))
            .collect())
    }

    /// `(path, device, inode, length)` of the hot tier's file, if any.
    pub fn arena_file(&self) -> Result<Option<(PathBuf, u64, u64, u64)>> {
        let inner = self.live()?;
        let Some(arena) = &inner.arena else {
            return Ok(None);
        };
        let (dev, ino) = arena.file_id()?;
        Ok(Some((
            arena.path().to_path_buf(),
            dev,
            ino,
            arena.region().1 as u64,
        )))
    }

    /// Start address and length of the hot-tier mapping, if any (for
    /// registering it with CUDA as pinned host memory).
    pub fn arena_region(&self) -> Result<Option<(usize, usize)>> {
        Ok(self.live()?.arena.as_ref().map(|a| a.region()))
    }

    pub fn save_session(
        &self,
        name: &str,
        tokens: &[u32],
        kv: &[u8],
        kv_tokens: usize,
    ) -> Result<usize> {
        self.live()?.save_session(name, tokens, kv, kv_tokens)
    }

    /// Token ids of a session.
    pub fn session_tokens(&self, name: &str) -> Result<Vec<u32>> {
        let inner = self.live()?;
        let txn = inner.index.read()?;
        inner
            .index
            .get_session(&txn, &inner.tag, name)?
            .ok_or_else(|| Error::SessionNotFound(name.to_string()))
    }

    /// This tenant's sessions: (name, token count).
    pub fn sessions(&self) -> Result<Vec<(String, usize)>> {
        let inner = self.live()?;
        let txn = inner.index.read()?;
        inner.index.sessions(&txn, &inner.tag)
    }

    pub fn delete_session(&self, name: &str) -> Result<bool> {
        let inner = self.live()?;
        let mut txn = inner.index.write()?;
        let found = inner.index.delete_session(&mut txn, &inner.tag, name)?;
        inner
            .index
            .commit(txn, inner.opts.durability != Durability::None)?;
        Ok(found)
    }

    /// Everything put so far is durable (and visible to others) when this returns.
    pub fn flush(&self) -> Result<()> {
        let inner = self.live()?;
        let mut w = inner.writer.lock().expect("writer lock");
        inner.commit_pending(&mut w)?;
        drop(w);
        inner.save_advisory();
        Ok(())
    }

    pub fn stats(&self) -> Result<Stats> {
        self.live()?.stats()
    }

    pub fn segments(&self) -> Result<Vec<SegmentReport>> {
        self.live()?.segment_reports()
    }

    pub fn verify(&self, progress: Progress<'_>) -> Result<VerifyReport> {
        self.live()?.verify(progress, false)
    }

    /// `verify`, and every damaged record found is taken out of the index
    /// (a miss from now on, stored again by the next put of its tokens).
    /// For an index that cannot be opened, see [`crate::repair`].
    pub fn repair(&self, progress: Progress<'_>) -> Result<VerifyReport> {
        self.live()?.verify(progress, true)
    }

    pub fn compact(&self, progress: Progress<'_>) -> Result<CompactReport> {
        self.live()?.compact(progress, false)
    }

    pub fn gc(
        &self,
        max_bytes: Option<u64>,
        older_than: Option<Duration>,
        progress: Progress<'_>,
    ) -> Result<GcReport> {
        self.live()?.gc(max_bytes, older_than, progress)
    }

    /// Commits what is pending, seals this handle's segment and releases it.
    /// Later calls raise `StoreClosed`; closing twice is fine.
    pub fn close(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Ok(());
        }
        // Taking the write lock waits for every call in flight on this handle.
        let inner = self.inner.write().expect("store lock").take();
        let Some(inner) = inner else { return Ok(()) };
        inner.closing.store(true, Ordering::SeqCst);
        inner.wake.notify_all();
        if let Some(t) = self.flusher.lock().expect("flusher lock").take() {
            let _ = t.join();
        }
        let mut w = inner.writer.lock().expect("writer lock");
        let res = inner.commit_pending(&mut w);
        let res = res.and_then(|_| inner.seal_active(&mut w));
        w.active = None;
        drop(w);
        inner.save_advisory();
        res
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child must not touch the parent's LMDB environment or
            // segment: leak its copy of the state instead of tearing it down.
            if let Some(inner) = self.inner.get_mut().ok().and_then(|i| i.take()) {
                std::mem::forget(inner);
            }
            if let Some(t) = self.flusher.get_mut().ok().and_then(|f| f.take()) {
                std::mem::forget(t);
            }
            return;
        }
        let _ = self.close();
    }
}

impl Inner {
    fn open(dir: &Path, opts: Options) -> Result<Inner> {
        if opts.create {
            io::ensure_dir(dir).ctx(|| format!("store directory {}", dir.display()))?;
        } else if !dir.is_dir() {
            return Err(Error::InvalidInput(format!(
                "no store at {}",
                dir.display()
            )));
        }
        io::check_private_dir(dir).map_err(|e| Error::InvalidInput(e.to_string()))?;
        // Creation and recovery run under an exclusive lock so two processes
        // opening a new store at once agree on one MANIFEST.
        let lock = io::open_or_create(&dir.join("LOCK"))
            .ctx(|| format!("lock file in {}", dir.display()))?;
        lock_with_timeout(&lock, Duration::from_secs(30))?;
        let manifest_path = dir.join("MANIFEST");
        let manifest = match read_manifest(&manifest_path)? {
            Some(m) => m,
            None => {
                let (Some(fp), Some(layout), true) = (&opts.fingerprint, &opts.layout, opts.create)
                else {
                    return Err(Error::InvalidInput(format!(
                        "no kvstore at {} (no MANIFEST); create it by opening with a layout and a model",
                        dir.display()
                    )));
                };
                let mut rnd = [0u8; 16];
                getrandom::fill(&mut rnd).map_err(|e| Error::Io {
                    context: "store id".into(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                let m = Manifest {
                    format_version: format::FORMAT_VERSION,
                    fingerprint: fp.clone(),
                    num_layers: layout.num_layers,
                    num_kv_heads: layout.num_kv_heads,
                    head_dim: layout.head_dim,
                    dtype: layout.dtype.name().to_string(),
                    block_size: layout.block_size,
                    created_unix: now_ms() / 1000,
                    store_id: rnd.iter().map(|b| format!("{b:02x}")).collect(),
                };
                io::write_atomic(&manifest_path, &m.encode())
                    .ctx(|| format!("writing {}", manifest_path.display()))?;
                m
            }
        };
        let layout = manifest
            .layout()
            .map_err(|e| Error::corrupt(&manifest_path, e.to_string()))?;
        let fingerprint = opts
            .fingerprint
            .clone()
            .unwrap_or_else(|| manifest.fingerprint.clone());
        let asked_layout = opts.layout.unwrap_or(layout);
        format::check_identity(&manifest, &fingerprint, &asked_layout)?;

        for sub in ["index", "segments"] {
            io::ensure_dir(&dir.join(sub)).ctx(|| format!("{} in {}", sub, dir.display()))?;
            io::check_private_dir(&dir.join(sub))
                .map_err(|e| Error::InvalidInput(e.to_string()))?;
        }
        let index = Index::open(
            &dir.join("index"),
            opts.durability == Durability::None,
            opts.index_bytes,
        )?;
        // An index that never handed out a segment number, beside segment
        // files, was lost or replaced (an empty or new data.mdb). Opening it
        // would show an empty store and, later, count the files as orphans.
        let fresh = {
            let txn = index.read()?;
            index.meta_u64(&txn, "next_segment")? == 0
        };
        if fresh && has_segment_files(&dir.join("segments")) {
            return Err(Error::corrupt(
                dir.join("index"),
                "the index knows no segments but segments/ holds segment files (index lost or \
                 replaced); run `kvstore rebuild-index` to rebuild it from them",
            ));
        }
        let keyer = Keyer::new(&fingerprint, &layout, opts.salt.as_deref());
        let arena = match opts.hot_bytes {
            None => None,
            Some(bytes) => {
                let dir = opts
                    .hot_dir
                    .clone()
                    .or_else(|| std::env::var_os("KVSTORE_HOT_DIR").map(PathBuf::from))
                    .unwrap_or_else(|| arena::default_dir(bytes));
                let path = dir.join(format!("kvstore-{}.arena", manifest.store_id));
                let mut tag_input = manifest.store_id.as_bytes().to_vec();
                tag_input.extend_from_slice(&layout.canonical_bytes());
                Some(Arena::open(
                    &path,
                    &layout,
                    blake3::hash(&tag_input).as_bytes(),
                    bytes,
                )?)
            }
        };
        let inner = Inner {
            dir: dir.to_path_buf(),
            tag: keyer.tenant_tag(),
            keyer,
            manifest,
            layout,
            opts,
            index,
            writer: Mutex::new(Writer::new()),
            wake: Condvar::new(),
            closing: AtomicBool::new(false),
            readers: RwLock::new(HashMap::new()),
            known: Known::default(),
            touched: Mutex::new(Touched::default()),
            arena,
            counters: Counters::default(),
        };
        inner.recover()?;
        drop(lock);
        Ok(inner)
    }

    /// The hot tier, or `InvalidInput` for a store opened without one.
    fn hot_tier(&self) -> Result<&Arena> {
        self.arena.as_ref().ok_or_else(|| {
            Error::InvalidInput("this store was opened without a hot tier (hot_bytes)".into())
        })
    }

    fn durable(&self) -> bool {
        self.opts.durability != Durability::None
    }

    /// Seals every active segment whose writer is gone, truncating what lies
    /// past its committed length (a torn or never-committed tail).
    fn recover(&self) -> Result<()> {
        let segments = {
            let txn = self.index.read()?;
            self.index.all_segments(&txn)?
        };
        for (seg, info) in segments {
            if info.state != SegmentState::Active {
                continue;
            }
            let path = segment_path(&self.dir, seg);
            let file = match io::open_existing(&path, true) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(Error::Io {
                        context: format!("opening {}", path.display()),
                        source: e,
                    })
                }
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => continue, // its writer is alive
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::Io {
                        context: format!("locking {}", path.display()),
                        source: e,
                    })
                }
            }
            // We hold the lock, so its writer has closed it or died. Decide
            // from the entry as it is now, inside the write transaction: the
            // snapshot above may predate the writer's last commits.
            let mut txn = self.index.write()?;
            let Some(mut now) = self.index.get_segment(&txn, seg)? else {
                continue;
            };
            if now.state != SegmentState::Active {
                continue; // sealed by its writer meanwhile
            }
            let len = file
                .metadata()
                .ctx(|| format!("stat {}", path.display()))?
                .len();
            if now.live_records == 0 && now.committed_len <= format::SEGMENT_HEADER_LEN as u64 {
                // Its writer died before committing anything: nothing to keep.
                self.index.delete_segment(&mut txn, seg)?;
                self.index.commit(txn, self.durable())?;
                fault::remove_file(&path).ctx(|| format!("removing {}", path.display()))?;
                continue;
            }
            if len > now.committed_len {
                fault::set_len(&file, now.committed_len)
                    .ctx(|| format!("truncating {}", path.display()))?;
                fault::sync_all(&file).ctx(|| format!("fsync {}", path.display()))?;
            }
            now.state = SegmentState::Sealed;
            self.index.put_segment(&mut txn, seg, &now)?;
            self.index.commit(txn, self.durable())?;
        }
        self.remove_orphans()
    }

    // ---------------------------------------------------------------- writes

    fn check_kv(&self, tokens: &[u32], kv: &[u8], kv_tokens: usize) -> Result<usize> {
        let b = self.layout.block_size as usize;
        let full = tokens.len() / b * b;
        if kv_tokens < full {
            return Err(Error::InvalidInput(format!(
                "kv: expected at least {full} tokens (the full blocks of {} token ids), got {kv_tokens}",
                tokens.len()
            )));
        }
        let want = self
            .layout
            .kv_bytes(kv_tokens)
            .ok_or_else(|| Error::InvalidInput(format!("kv: {kv_tokens} tokens overflow")))?;
        if kv.len() != want {
            return Err(Error::InvalidInput(format!(
                "kv: expected {want} bytes for [L={}, 2, T={kv_tokens}, H={}, D={}] of {}, got {}",
                self.layout.num_layers,
                self.layout.num_kv_heads,
                self.layout.head_dim,
                self.layout.dtype.name(),
                kv.len()
            )));
        }
        Ok(full)
    }

    fn put(&self, tokens: &[u32], kv: &[u8], kv_tokens: usize, extra: &[u8]) -> Result<usize> {
        let full = self.check_kv(tokens, kv, kv_tokens)?;
        let b = self.layout.block_size as usize;
        let ids = self.keyer.chain(&tokens[..full], b, extra);
        let mut w = self.writer.lock().expect("writer lock");
        if let Some(p) = &w.poisoned {
            return Err(Error::Poisoned(p.clone()));
        }
        if self.closing.load(Ordering::SeqCst) {
            // `close` ran while this call waited for the lock.
            return Err(Error::StoreClosed("the store handle is closed".into()));
        }
        // Under the writer lock: a group commit between this check and the
        // writes would otherwise move blocks from `pending` to the index
        // unseen, and they would be written twice.
        let present: Vec<bool> = {
            // One snapshot per call, so the cache notices a newer generation.
            let mut snap = Some(self.snapshot()?);
            ids.iter()
                .map(|id| self.committed(&mut snap, id).map(|l| l.is_some()))
                .collect::<Result<_>>()?
        };
        let mut wrote = 0u64;
        let mut fresh = Vec::new();
        // One time for the whole put: block i is stamped i µs earlier.
        let t0 = now_us();
        // Making room must not evict this put's own blocks.
        w.protect = ids.iter().copied().collect();
        for (i, id) in ids.iter().enumerate() {
            if present[i] || w.pending_ids.contains_key(id) {
                self.counters.blocks_deduped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let chunks = block_chunks(&self.layout, kv, kv_tokens, i);
            let loc = match self.append(&mut w, id, &tokens[i * b..(i + 1) * b], &chunks, true) {
                Ok(loc) => loc,
                Err(e) => {
                    // A failed put publishes nothing: its records written so
                    // far become dead bytes. (Blocks committed by a segment
                    // roll inside this put stay: they are durable and sound.)
                    let mine: std::collections::HashSet<&BlockId> =
                        fresh.iter().map(|&j| &ids[j]).collect();
                    w.pending.retain(|p| !mine.contains(&p.id));
                    w.pending_ids.retain(|id, _| !mine.contains(id));
                    w.pending_bytes = w.pending.iter().map(|p| p.loc.record_len).sum();
                    if w.pending.is_empty() {
                        w.oldest_pending = None;
                    }
                    return Err(e);
                }
            };
            fresh.push(i);
            let loc = Location {
                used_us: t0.saturating_sub(i as u64),
                ..loc
            };
            wrote += 1;
            w.pending_bytes += loc.record_len;
            w.oldest_pending.get_or_insert_with(Instant::now);
            w.pending_ids.insert(*id, loc);
            w.pending.push(Pending { id: *id, loc });
        }
        self.counters
            .blocks_written
            .fetch_add(wrote, Ordering::Relaxed);
        match self.opts.durability {
            Durability::Sync | Durability::None => self.commit_pending(&mut w)?,
            Durability::Batch => {
                if w.pending_bytes >= self.opts.batch_bytes {
                    self.commit_pending(&mut w)?;
                }
            }
        }
        // Into the hot tier only once written (a failed put publishes nothing)
        // and, unless a batch commit is still due, committed: other processes
        // must not see a block a crash could take back. A batch put shows its
        // blocks before the group commit, as it does to this handle.
        if let Some(arena) = &self.arena {
            for i in fresh {
                let chunks = block_chunks(&self.layout, kv, kv_tokens, i);
                arena.insert(
                    &ids[i],
                    &tokens[i * b..(i + 1) * b],
                    &chunks,
                    0,
                    0,
                    now_ms(),
                )?;
            }
        }
        Ok(full)
    }

    /// Appends one record to the active segment (rolling it when full).
    fn append(
        &self,
        w: &mut Writer,
        id: &BlockId,
        tokens: &[u32],
        chunks: &[&[u8]],
        bounded: bool,
    ) -> Result<Location> {
        let raw_len = self.layout.block_bytes() as u64;
        let raw_crc = crc_of(chunks);
        let mut flags = 0u16;
        let mut compressed: Option<Vec<u8>> = None;
        if self.opts.compression_level > 0 {
            let plain = chunks.concat();
            let mut shuffled = Vec::new();
            let elem = self.layout.dtype.size();
            let src: &[u8] = if elem > 1 {
                format::shuffle(&plain, elem, &mut shuffled);
                flags |= format::FLAG_SHUFFLE;
                &shuffled
            } else {
                &plain
            };
            let z =
                zstd::bulk::compress(src, self.opts.compression_level).map_err(|e| Error::Io {
                    context: "zstd compress".into(),
                    source: e,
                })?;
            // Keep the raw bytes when compression does not pay: stored length
            // equal to the raw length then always means "raw" in the index.
            if (z.len() as u64) < raw_len {
                flags |= format::FLAG_ZSTD;
                compressed = Some(z);
            } else {
                flags = 0;
            }
        }
        let (stored_len, stored_crc) = match &compressed {
            Some(z) => (z.len() as u64, crc32c::crc32c(z)),
            None => (raw_len, raw_crc),
        };
        let meta =
            format::encode_record_meta(flags, id, tokens, stored_len, raw_len, stored_crc, raw_crc);
        let record_len = meta.len() as u64 + stored_len;
        self.ensure_room(w, record_len, bounded)?;
        let active = w.active.as_mut().expect("active segment");
        let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(chunks.len() + 1);
        bufs.push(IoSlice::new(&meta));
        match &compressed {
            Some(z) => bufs.push(IoSlice::new(z)),
            None => bufs.extend(chunks.iter().map(|c| IoSlice::new(c))),
        }
        let offset = active.len;
        if let Err(e) = io::write_all_at(&active.file, &mut bufs, offset) {
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
            stored_len,
            used_us: now_us(),
        })
    }

    /// Makes sure the active segment can take `record_len` more bytes, and that
    /// the store stays within `disk_bytes`.
    /// `bounded`: keep the store within `disk_bytes`, evicting and compacting
    /// if needed (compaction's own writes are not bounded: they free space).
    fn ensure_room(&self, w: &mut Writer, record_len: u64, bounded: bool) -> Result<()> {
        if let (Some(limit), true) = (self.opts.disk_bytes, bounded) {
            let header = if w.active.is_none() {
                format::SEGMENT_HEADER_LEN as u64
            } else {
                0
            };
            let need = record_len + header;
            if self.disk_used(w)? + need > limit {
                self.make_room(w, limit, need + format::SEGMENT_HEADER_LEN as u64)?;
            }
        }
        let roll = match &w.active {
            Some(a) => {
                a.len + record_len > self.opts.segment_bytes
                    && a.len > format::SEGMENT_HEADER_LEN as u64
            }
            None => true,
        };
        if roll {
            self.commit_pending(w)?;
            self.seal_active(w)?;
            w.active = Some(self.new_segment()?);
        }
        Ok(())
    }

    /// Bytes of segment files: committed lengths in the index plus this
    /// handle's uncommitted tail.
    fn disk_used(&self, w: &Writer) -> Result<u64> {
        let txn = self.index.read()?;
        let committed: u64 = self
            .index
            .all_segments(&txn)?
            .iter()
            .map(|(_, i)| i.committed_len)
            .sum();
        Ok(committed + w.pending_bytes)
    }

    fn new_segment(&self) -> Result<Active> {
        let mut txn = self.index.write()?;
        let segment = self.index.meta_u64(&txn, "next_segment")?.max(1);
        self.index
            .set_meta_u64(&mut txn, "next_segment", segment + 1)?;
        self.index.commit(txn, self.durable())?;
        // The file exists, locked and with its header, before the segment is
        // registered. So a registered segment whose lock is free has lost its
        // writer (recovery may seal it), and a file not registered is either
        // locked by a writer about to register it or an orphan (removable).
        let path = segment_path(&self.dir, segment);
        let file = io::create_new(&path).ctx(|| format!("creating {}", path.display()))?;
        // Blocking: an orphan scan may hold the new file's lock for an
        // instant (it leaves young files alone, see `remove_orphans`).
        file.lock().ctx(|| format!("locking {}", path.display()))?;
        let header = format::encode_segment_header(segment);
        io::write_all_at(&file, &mut [IoSlice::new(&header)], 0)
            .ctx(|| format!("writing {}", path.display()))?;
        if self.durable() {
            fault::sync_data(&file).ctx(|| format!("fdatasync {}", path.display()))?;
            io::sync_dir(&self.dir.join("segments"))
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
        })
    }

    fn seal_active(&self, w: &mut Writer) -> Result<()> {
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
    fn commit_pending(&self, w: &mut Writer) -> Result<()> {
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
            if let Err(e) = fault::sync_data(&active.file) {
                let msg = format!("fdatasync of segment {} failed: {e}", active.segment);
                w.poisoned = Some(msg.clone());
                return Err(Error::Poisoned(msg));
            }
        }
        let (segment, committed_len) = (active.segment, active.len);
        let res = self.publish_pending(w, segment, committed_len);
        // Published or not, these records are done with: after a failed
        // commit they are dead bytes, never published by a later commit
        // (their put has already reported the failure).
        w.pending.clear();
        w.pending_ids.clear();
        w.pending_bytes = 0;
        w.oldest_pending = None;
        res
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
        let mut live_bytes = 0i64;
        let mut live_records = 0i64;
        for p in &w.pending {
            // Another process may have committed the same block meanwhile; the
            // first one wins and this copy is dead bytes.
            if self.index.get_block_rw(&txn, &p.id)?.is_none() {
                self.index.put_block(&mut txn, &p.id, &p.loc)?;
                // Stored again after being found damaged: no longer damage.
                self.index.clear_damaged(&mut txn, &p.id)?;
                live_bytes += p.loc.record_len as i64;
                live_records += 1;
            }
        }
        let mut info = self
            .index
            .get_segment(&txn, segment)?
            .unwrap_or_else(SegmentInfo::new);
        info.committed_len = committed_len;
        info.live_bytes = info.live_bytes.saturating_add_signed(live_bytes);
        info.live_records = info.live_records.saturating_add_signed(live_records);
        self.index.put_segment(&mut txn, segment, &info)?;
        self.index.commit(txn, self.durable())
    }

    /// Group commit for `Batch`: commits whatever is older than the window.
    fn flush_loop(&self) {
        let window = self.opts.batch_window;
        let mut w = self.writer.lock().expect("writer lock");
        while !self.closing.load(Ordering::SeqCst) {
            let wait = match w.oldest_pending {
                Some(t) => window.saturating_sub(t.elapsed()),
                None => window,
            };
            w = self.wake.wait_timeout(w, wait).expect("writer lock").0;
            if w.oldest_pending.is_some_and(|t| t.elapsed() >= window) {
                // A failure poisons the writer; the next put reports it.
                let _ = self.commit_pending(&mut w);
            }
        }
    }

    fn save_session(
        &self,
        name: &str,
        tokens: &[u32],
        kv: &[u8],
        kv_tokens: usize,
    ) -> Result<usize> {
        if name.is_empty() || name.len() > 400 {
            return Err(Error::InvalidInput(format!(
                "session name: expected 1 to 400 bytes of UTF-8, got {} bytes",
                name.len()
            )));
        }
        // The KV may cover fewer tokens than the session binds (a cache that has
        // not seen the last generated token): store what it covers.
        let covered = tokens.len().min(kv_tokens);
        let n = self.put(&tokens[..covered], kv, kv_tokens, b"")?;
        let mut w = self.writer.lock().expect("writer lock");
        self.commit_pending(&mut w)?;
        let mut txn = self.index.write()?;
        self.index.put_session(&mut txn, &self.tag, name, tokens)?;
        self.index.commit(txn, self.durable())?;
        Ok(n)
    }

    fn pin(
        &self,
        tokens: &[u32],
        extra: &[u8],
        priority: u64,
        ttl: Option<Duration>,
    ) -> Result<usize> {
        if priority == 0 {
            return Err(Error::InvalidInput(
                "priority: expected a positive integer (0 means unpinned), got 0".into(),
            ));
        }
        let b = self.layout.block_size as usize;
        let expires = match ttl {
            Some(t) => now_ms()
                .saturating_add(t.as_millis().try_into().unwrap_or(u64::MAX))
                .max(1),
            None => 0,
        };
        let ids = self.keyer.chain(tokens, b, extra);
        let mut snap = Some(self.snapshot()?);
        let mut locs = Vec::new();
        for id in &ids {
            match self.find(&mut snap, id)? {
                Some(loc) => locs.push(loc),
                None => break,
            }
        }
        drop(snap);
        // Into the hot tier first; only what made it there is pinned in the
        // index (what keeps blocks out of gc): a refused pin pins nothing.
        let (pinned, refused) = match &self.arena {
            Some(arena) => self.pin_hot(arena, tokens, &ids, &locs, priority, expires)?,
            None => (locs.len(), None),
        };
        let mut txn = self.index.write()?;
        for id in &ids[..pinned] {
            self.index.put_pin(&mut txn, id, priority, expires)?;
        }
        self.index.commit(txn, self.durable())?;
        match refused {
            Some(e) => Err(e),
            None => Ok(pinned * b),
        }
    }

    /// Pins the blocks at `locs` in the hot tier, loading those not there.
    /// Returns how many of them are pinned (a prefix) and, if the hot tier
    /// refused one, the `StoreFull` to report.
    fn pin_hot(
        &self,
        arena: &Arena,
        tokens: &[u32],
        ids: &[BlockId],
        locs: &[Location],
        priority: u64,
        expires: u64,
    ) -> Result<(usize, Option<Error>)> {
        let b = self.layout.block_size as usize;
        let mut buf = vec![0u8; self.layout.block_bytes()];
        let mut scratch = Vec::new();
        for (i, (id, loc)) in ids.iter().zip(locs).enumerate() {
            if arena.pin(id, priority, expires)? {
                continue;
            }
            let block_tokens = &tokens[i * b..(i + 1) * b];
            let mut chunks: Vec<&mut [u8]> = buf.chunks_mut(self.layout.chunk_bytes()).collect();
            if self
                .read_record(loc, id, Some(block_tokens), &mut chunks, &mut scratch)?
                .is_err()
            {
                return Ok((i, None)); // damaged or compacted away: the pinned prefix ends here
            }
            let chunks: Vec<&[u8]> = buf.chunks(self.layout.chunk_bytes()).collect();
            if arena.insert(id, block_tokens, &chunks, priority, expires, now_ms())?
                == Inserted::Full
            {
                return Ok((
                    i,
                    Some(Error::StoreFull(format!(
                        "the hot tier has no room for block {i} of this sequence: its slots hold \
                         blocks pinned at priority {priority} or higher"
                    ))),
                ));
            }
        }
        Ok((locs.len(), None))
    }

    fn unpin(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let ids = self
            .keyer
            .chain(tokens, self.layout.block_size as usize, extra);
        let mut txn = self.index.write()?;
        for id in &ids {
            self.index.delete_pin(&mut txn, id)?;
        }
        self.index.commit(txn, self.durable())?;
        if let Some(arena) = &self.arena {
            for id in &ids {
                arena.unpin(id)?;
            }
        }
        Ok(ids.len() * self.layout.block_size as usize)
    }

    // ----------------------------------------------------------------- reads

    /// Number of leading full blocks of `tokens` that are stored.
    fn stored_blocks(&self, tokens: &[u32], extra: &[u8]) -> Result<usize> {
        let ids = self
            .keyer
            .chain(tokens, self.layout.block_size as usize, extra);
        // One snapshot per call, so the cache notices a newer generation.
        let mut snap = Some(self.snapshot()?);
        let mut n = 0;
        for id in &ids {
            let hot = self.arena.as_ref().is_some_and(|a| a.contains(id));
            if !hot && self.find(&mut snap, id)?.is_none() {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// A fresh index snapshot; advances the location cache (and drops open
    /// segment files) when the index generation moved on.
    fn snapshot(&self) -> Result<Snap<'_>> {
        let txn = self.index.read()?;
        let generation = self.index.generation(&txn)?;
        if self.known.advance(generation) {
            self.readers.write().expect("reader cache").clear();
        }
        Ok(Snap { txn, generation })
    }

    /// Where block `id`'s committed record is (cache, then index).
    fn committed<'s>(
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
    fn find<'s>(&'s self, snap: &mut Option<Snap<'s>>, id: &BlockId) -> Result<Option<Location>> {
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

    /// Records that the blocks of one request were used now (block i stamped
    /// i µs earlier: see `Location::used_us`).
    fn touch(&self, ids: &[BlockId]) -> Result<()> {
        let now = now_us();
        let due = {
            let mut t = self.touched.lock().expect("touched lock");
            if t.times.is_empty() {
                t.since = Instant::now();
            }
            for (i, id) in ids.iter().enumerate() {
                t.times.insert(*id, now.saturating_sub(i as u64));
            }
            t.times.len() >= TOUCHED_MAX || t.since.elapsed() >= TOUCHED_MAX_AGE
        };
        if due {
            self.save_advisory();
        }
        Ok(())
    }

    /// Saves last-use times and hit counters, if it can: they only inform
    /// eviction and statistics, so a full device or index map must not fail
    /// a read, a flush or a close over them.
    fn save_advisory(&self) {
        let _ = self.save_touches();
        let _ = self.save_counters();
    }

    /// Writes buffered last-use times to the index (not synced: losing them
    /// in a crash only makes eviction a little less informed).
    fn save_touches(&self) -> Result<()> {
        let times = std::mem::take(&mut self.touched.lock().expect("touched lock").times);
        if times.is_empty() {
            return Ok(());
        }
        let mut txn = self.index.write()?;
        for (id, t) in &times {
            self.index.touch(&mut txn, id, *t)?;
        }
        self.index.commit(txn, false)
    }

    /// Adds this handle's hits and misses since the last call to the store-wide
    /// totals (one small index write, at flush and close only).
    fn save_counters(&self) -> Result<()> {
        let c = &self.counters;
        let hits = c.hit_blocks.load(Ordering::Relaxed);
        let misses = c.miss_blocks.load(Ordering::Relaxed);
        let (dh, dm) = (
            hits - c.saved_hits.swap(hits, Ordering::Relaxed),
            misses - c.saved_misses.swap(misses, Ordering::Relaxed),
        );
        if dh == 0 && dm == 0 {
            return Ok(());
        }
        let mut txn = self.index.write()?;
        for (name, d) in [("hit_blocks", dh), ("miss_blocks", dm)] {
            let v = self.index.meta_u64(&txn, name)?;
            self.index.set_meta_u64(&mut txn, name, v + d)?;
        }
        self.index.commit(txn, false)
    }

    fn count_hits(&self, hit: usize, asked: usize) {
        self.counters
            .hit_blocks
            .fetch_add(hit as u64, Ordering::Relaxed);
        self.counters
            .miss_blocks
            .fetch_add((asked - hit) as u64, Ordering::Relaxed);
    }

    fn pending_loc(&self, id: &BlockId) -> Option<Location> {
        self.writer
            .lock()
            .expect("writer lock")
            .pending_ids
            .get(id)
            .copied()
    }

    fn get_into(
        &self,
        tokens: &[u32],
        extra: &[u8],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        let b = self.layout.block_size as usize;
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
        let usable = tokens.len().min(out_tokens) / b;
        let ids = self.keyer.chain(&tokens[..usable * b], b, extra);
        let mut scratch = Vec::new();
        let mut served = 0;
        // One snapshot per call, so the cache notices a newer generation.
        let mut snap = Some(self.snapshot()?);
        'blocks: for (i, id) in ids.iter().enumerate() {
            let block_tokens = &tokens[i * b..(i + 1) * b];
            if let Some(arena) = &self.arena {
                let mut chunks = block_chunks_mut(&self.layout, out, out_tokens, i);
                if arena.get(id, block_tokens, &mut chunks) {
                    self.counters.hot_hit_blocks.fetch_add(1, Ordering::Relaxed);
                    served += 1;
                    continue 'blocks;
                }
            }
            for attempt in 0..2 {
                let loc = match self.find(&mut snap, id)? {
                    Some(l) => l,
                    None => break 'blocks,
                };
                let mut chunks = block_chunks_mut(&self.layout, out, out_tokens, i);
                match self.read_record(&loc, id, Some(block_tokens), &mut chunks, &mut scratch)? {
                    Ok(()) => {
                        self.counters
                            .bytes_read
                            .fetch_add(loc.record_len, Ordering::Relaxed);
                        self.counters
                            .disk_hit_blocks
                            .fetch_add(1, Ordering::Relaxed);
                        if let Some(arena) = &self.arena {
                            // Promote: the next reader, in any process, gets it from memory.
                            let chunks: Vec<&[u8]> = chunks.iter().map(|c| &**c).collect();
                            arena.insert(id, block_tokens, &chunks, 0, 0, now_ms())?;
                        }
                        served += 1;
                        continue 'blocks;
                    }
                    Err(ReadFail::Gone) if attempt == 0 => {
                        // Compacted away since our snapshot: look it up afresh.
                        snap = None;
                        self.known.forget(id);
                        self.readers
                            .write()
                            .expect("reader cache")
                            .remove(&loc.segment);
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
                        break 'blocks;
                    }
                }
            }
        }
        self.count_hits(served, tokens.len() / b);
        self.touch(&ids[..served])?;
        Ok(served * b)
    }

    fn reader(&self, segment: u64) -> std::io::Result<Arc<File>> {
        if let Some(f) = self.readers.read().expect("reader cache").get(&segment) {
            return Ok(f.clone());
        }
        let f = Arc::new(io::open_existing(&segment_path(&self.dir, segment), false)?);
        let mut readers = self.readers.write().expect("reader cache");
        if readers.len() >= MAX_OPEN_SEGMENTS {
            // Bounded: reads in flight keep their own `Arc`.
            readers.clear();
        }
        readers.insert(segment, f.clone());
        Ok(f)
    }

    /// Reads the record at `loc` into `out` (the block's `2L` runs) and checks
    /// it against `id` and, when given, the requested `tokens`.
    /// The outer `Result` is an I/O failure of the store itself; the inner one
    /// says whether this block can be served.
    fn read_record(
        &self,
        loc: &Location,
        id: &BlockId,
        tokens: Option<&[u32]>,
        out: &mut [&mut [u8]],
        scratch: &mut Vec<u8>,
    ) -> Result<Result<(), ReadFail>> {
        let b = self.layout.block_size;
        let raw_len = self.layout.block_bytes() as u64;
        let meta_len = format::RECORD_HEADER_LEN + 4 * b as usize;
        if loc.stored_len > raw_len || loc.record_len != meta_len as u64 + loc.stored_len {
            return Ok(Err(ReadFail::Damaged(
                "index entry has impossible lengths".into(),
            )));
        }
        let file = match self.reader(loc.segment) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Err(ReadFail::Gone)),
            Err(e) => {
                return Ok(Err(ReadFail::Damaged(format!(
                    "segment {} unreadable: {e}",
                    loc.segment
                ))))
            }
        };
        let mut meta = vec![0u8; meta_len];
        let raw = loc.stored_len == raw_len;
        let read = if raw {
            let mut bufs: Vec<IoSliceMut<'_>> = Vec::with_capacity(out.len() + 1);
            bufs.push(IoSliceMut::new(&mut meta));
            bufs.extend(out.iter_mut().map(|c| IoSliceMut::new(c)));
            io::read_exact_at(&file, &mut bufs, loc.offset)
        } else {
            scratch.resize(loc.stored_len as usize, 0);
            io::read_exact_at(
                &file,
                &mut [IoSliceMut::new(&mut meta), IoSliceMut::new(scratch)],
                loc.offset,
            )
        };
        if let Err(e) = read {
            return Ok(Err(ReadFail::Damaged(format!("read failed: {e}"))));
        }
        let header = match format::decode_record_header(&meta, b, raw_len)
            .and_then(|h| format::check_meta(&h, &meta).map(|_| h))
        {
            Ok(h) => h,
            Err(r) => return Ok(Err(ReadFail::Damaged(r))),
        };
        if let Err(r) = self.check_header(&header, loc, id) {
            return Ok(Err(ReadFail::Damaged(r)));
        }
        if tokens.is_some_and(|t| !format::record_tokens(&meta).eq(t.iter().copied())) {
            return Ok(Err(ReadFail::OtherTokens));
        }
        if raw {
            let crc = out.iter().fold(0, |c, ch| crc32c::crc32c_append(c, ch));
            if crc != header.raw_crc || crc != header.stored_crc {
                return Ok(Err(ReadFail::Damaged("payload checksum mismatch".into())));
            }
            return Ok(Ok(()));
        }
        if crc32c::crc32c(scratch) != header.stored_crc {
            return Ok(Err(ReadFail::Damaged(
                "stored payload checksum mismatch".into(),
            )));
        }
        let mut decoded = vec![0u8; raw_len as usize];
        match zstd::bulk::decompress_to_buffer(scratch, &mut decoded[..]) {
            Ok(n) if n as u64 == raw_len => {}
            Ok(n) => {
                return Ok(Err(ReadFail::Damaged(format!(
                    "zstd frame decodes to {n} bytes, expected {raw_len}"
                ))))
            }
            Err(e) => return Ok(Err(ReadFail::Damaged(format!("zstd: {e}")))),
        }
        let elem = self.layout.dtype.size();
        let plain: &[u8] = if header.flags & format::FLAG_SHUFFLE != 0 {
            scratch.resize(decoded.len(), 0);
            format::unshuffle(&decoded, elem, scratch);
            scratch
        } else {
            &decoded
        };
        if crc32c::crc32c(plain) != header.raw_crc {
            return Ok(Err(ReadFail::Damaged(
                "decoded payload checksum mismatch".into(),
            )));
        }
        for (dst, src) in out.iter_mut().zip(plain.chunks(self.layout.chunk_bytes())) {
            dst.copy_from_slice(src);
        }
        Ok(Ok(()))
    }

    fn check_header(&self, h: &RecordHeader, loc: &Location, id: &BlockId) -> Result<(), String> {
        if &h.block_id != id {
            return Err("record holds another block (misplaced or colliding record)".into());
        }
        if h.n_tokens != self.layout.block_size {
            return Err(format!(
                "record has {} tokens, the layout {}",
                h.n_tokens, self.layout.block_size
            ));
        }
        if h.raw_len != self.layout.block_bytes() as u64 || h.stored_len != loc.stored_len {
            return Err("record lengths disagree with the layout or the index".into());
        }
        let compressed = h.flags & format::FLAG_ZSTD != 0;
        if compressed == (h.stored_len == h.raw_len) {
            return Err("record compression flag disagrees with its lengths".into());
        }
        Ok(())
    }

    /// Moves a damaged block's entry out of `blocks` (if it still points at the
    /// damaged record), so it is a miss and a later put stores it again.
    fn quarantine(&self, id: &BlockId, loc: &Location, reason: &str) -> Result<()> {
        self.counters.damaged_found.fetch_add(1, Ordering::Relaxed);
        let mut txn = self.index.write()?;
        if self
            .index
            .get_block_rw(&txn, id)?
            .is_some_and(|l| l.same_record(loc))
        {
            self.index.delete_block(&mut txn, id)?;
            self.index
                .add_live(&mut txn, loc.segment, -(loc.record_len as i64), -1)?;
            self.index.put_damaged(&mut txn, id, loc, reason)?;
        }
        self.index.commit(txn, self.durable())
    }

    // ------------------------------------------------------------ inspection

    fn stats(&self) -> Result<Stats> {
        // This handle's commits happen under the writer lock: holding it while
        // the snapshot is taken makes `blocks` and `pending_blocks` agree.
        let (txn, pending) = {
            let w = self.writer.lock().expect("writer lock");
            (self.index.read()?, w.pending.len() as u64)
        };
        let segs = self.index.all_segments(&txn)?;
        let blocks = self.index.block_count(&txn)?;
        let live_bytes: u64 = segs.iter().map(|(_, i)| i.live_bytes).sum();
        let committed: u64 = segs.iter().map(|(_, i)| i.committed_len).sum();
        let disk_bytes: u64 = segs
            .iter()
            .filter_map(|(s, _)| std::fs::symlink_metadata(segment_path(&self.dir, *s)).ok())
            .map(|m| m.len())
            .sum();
        let headers = segs.len() as u64 * format::SEGMENT_HEADER_LEN as u64;
        let c = &self.counters;
        Ok(Stats {
            blocks,
            sessions: self.index.sessions(&txn, &self.tag)?.len() as u64,
            segments: segs.len() as u64,
            disk_bytes,
            live_bytes,
            dead_bytes: committed.saturating_sub(live_bytes + headers),
            raw_live_bytes: blocks * self.layout.block_bytes() as u64,
            damaged_blocks: self.index.all_damaged(&txn)?.len() as u64,
            pending_blocks: pending,
            hit_blocks: c.hit_blocks.load(Ordering::Relaxed),
            miss_blocks: c.miss_blocks.load(Ordering::Relaxed),
            total_hit_blocks: self.index.meta_u64(&txn, "hit_blocks")?,
            total_miss_blocks: self.index.meta_u64(&txn, "miss_blocks")?,
            blocks_written: c.blocks_written.load(Ordering::Relaxed),
            blocks_deduped: c.blocks_deduped.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            block_bytes: self.layout.block_bytes() as u64,
            hot_hit_blocks: c.hot_hit_blocks.load(Ordering::Relaxed),
            disk_hit_blocks: c.disk_hit_blocks.load(Ordering::Relaxed),
            arena: self.arena.as_ref().map(|a| a.stats(now_ms())),
        })
    }

    fn segment_reports(&self) -> Result<Vec<SegmentReport>> {
        let txn = self.index.read()?;
        Ok(self
            .index
            .all_segments(&txn)?
            .into_iter()
            .map(|(s, i)| SegmentReport {
                segment: s,
                sealed: i.state == SegmentState::Sealed,
                file_bytes: std::fs::symlink_metadata(segment_path(&self.dir, s))
                    .ok()
                    .map(|m| m.len()),
                committed_bytes: i.committed_len,
                live_bytes: i.live_bytes,
                live_records: i.live_records,
                dead_bytes: i
                    .committed_len
                    .saturating_sub(i.live_bytes + format::SEGMENT_HEADER_LEN as u64),
            })
            .collect())
    }

    /// Re-reads every indexed record and checks it; lists what is damaged.
    /// Read-only unless `repair`: then damaged records are quarantined.
    fn verify(&self, progress: Progress<'_>, repair: bool) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let (blocks, segments, damaged) = {
            let txn = self.index.read()?;
            (
                self.index.all_blocks(&txn)?,
                self.index.all_segments(&txn)?,
                self.index.all_damaged(&txn)?,
            )
        };
        for (id, loc, reason) in damaged {
            report.damaged.push(Damage {
                block_id: id::hex(&id),
                segment: loc.segment,
                offset: loc.offset,
                reason: format!("{reason} (found on an earlier read)"),
            });
        }
        for (seg, info) in &segments {
            let path = segment_path(&self.dir, *seg);
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
                    let header = io::open_existing(&path, false).and_then(|f| {
                        let mut h = [0u8; format::SEGMENT_HEADER_LEN];
                        io::read_exact_at(&f, &mut [IoSliceMut::new(&mut h)], 0).map(|_| h)
                    });
                    match header.map(|h| format::decode_segment_header(&h)) {
                        Ok(Ok(n)) if n == *seg => {}
                        Ok(Ok(n)) => report
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
        let total = blocks.len() as u64;
        let mut buf = vec![0u8; self.layout.block_bytes()];
        let mut scratch = Vec::new();
        for (n, (id, loc)) in blocks.iter().enumerate() {
            let mut chunks: Vec<&mut [u8]> = buf.chunks_mut(self.layout.chunk_bytes()).collect();
            match self.read_record(loc, id, None, &mut chunks, &mut scratch)? {
                Ok(()) => {}
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
                    })
                }
            }
            report.records_checked += 1;
            report.bytes_checked += loc.record_len;
            progress(n as u64 + 1, total);
        }
        Ok(report)
    }

    /// Rewrites the live records of sealed segments that hold dead bytes into
    /// new segments, then deletes the old files. Deleting is safe while others
    /// read: a reader that has a segment open keeps reading it (POSIX unlink),
    /// and one that has not finds it gone and looks the block up again.
    fn compact(&self, progress: Progress<'_>, all: bool) -> Result<CompactReport> {
        let _lock = self.compaction_lock()?;
        {
            let mut w = self.writer.lock().expect("writer lock");
            self.commit_pending(&mut w)?;
        }
        self.compact_locked(progress, all)
    }

    /// The store-wide compaction lock (one compaction or gc at a time).
    fn compaction_lock(&self) -> Result<File> {
        let lock = io::open_or_create(&self.dir.join("COMPACT.lock"))
            .ctx(|| "compaction lock".to_string())?;
        lock.try_lock().map_err(|_| {
            Error::StoreLocked("another compaction or gc is running on this store".into())
        })?;
        Ok(lock)
    }

    /// Compaction proper: the caller holds the compaction lock and has
    /// committed its own pending blocks. Victims are rewritten one at a time,
    /// each deleted as soon as nothing points into it, so the disk holds at
    /// most one victim's live bytes twice.
    fn compact_locked(&self, progress: Progress<'_>, all: bool) -> Result<CompactReport> {
        let mut report = CompactReport::default();
        let (blocks, segments) = {
            let txn = self.index.read()?;
            (self.index.all_blocks(&txn)?, self.index.all_segments(&txn)?)
        };
        let victims: Vec<u64> = segments
            .iter()
            .filter(|(_, i)| i.state == SegmentState::Sealed)
            .filter(|(_, i)| {
                all || i.committed_len > i.live_bytes + format::SEGMENT_HEADER_LEN as u64
            })
            .map(|(s, _)| *s)
            .collect();
        report.bytes_before = segments.iter().map(|(_, i)| i.committed_len).sum();
        let mut by_segment: HashMap<u64, Vec<(BlockId, Location)>> =
            victims.iter().map(|s| (*s, Vec::new())).collect();
        for (id, loc) in blocks {
            if let Some(v) = by_segment.get_mut(&loc.segment) {
                v.push((id, loc));
            }
        }
        let total: u64 = by_segment.values().map(|v| v.len() as u64).sum();
        let mut done = 0;
        let mut out = Writer::new();
        let mut buf = vec![0u8; self.layout.block_bytes()];
        let mut scratch = Vec::new();
        for seg in &victims {
            let mut moved: Vec<(BlockId, Location, Location)> = Vec::new();
            let mut dropped: Vec<(BlockId, Location, String)> = Vec::new();
            for (id, loc) in &by_segment[seg] {
                let mut chunks: Vec<&mut [u8]> =
                    buf.chunks_mut(self.layout.chunk_bytes()).collect();
                match self.read_record(loc, id, None, &mut chunks, &mut scratch)? {
                    Ok(()) => {
                        let tokens = self.record_tokens_at(loc)?;
                        let chunks: Vec<&[u8]> = buf.chunks(self.layout.chunk_bytes()).collect();
                        let new = self.append(&mut out, id, &tokens, &chunks, false)?;
                        out.pending_bytes += new.record_len;
                        moved.push((*id, *loc, new));
                    }
                    Err(fail) => dropped.push((
                        *id,
                        *loc,
                        fail.damage().expect("compaction passes no tokens"),
                    )),
                }
                // Bounded transactions, as in `evict`.
                if out.pending_bytes >= 64 << 20 || moved.len() >= 1024 {
                    self.publish_moves(&mut out, &mut moved)?;
                }
                done += 1;
                progress(done, total);
            }
            self.publish_moves(&mut out, &mut moved)?;
            let mut txn = self.index.write()?;
            for (id, loc, reason) in &dropped {
                if self
                    .index
                    .get_block_rw(&txn, id)?
                    .is_some_and(|l| l.same_record(loc))
                {
                    self.index.delete_block(&mut txn, id)?;
                    self.index
                        .add_live(&mut txn, loc.segment, -(loc.record_len as i64), -1)?;
                    self.index.put_damaged(&mut txn, id, loc, reason)?;
                }
            }
            report.records_moved += by_segment[seg].len() as u64 - dropped.len() as u64;
            report.records_dropped += dropped.len() as u64;
            // Nothing points into it any more: every entry of our snapshot
            // moved or went, and dedupe never adds entries into a sealed
            // segment. The live count says so without a scan.
            let retire = self
                .index
                .get_segment(&txn, *seg)?
                .is_some_and(|i| i.live_records == 0);
            if retire {
                self.index.delete_segment(&mut txn, *seg)?;
                self.index.clear_damaged_in(&mut txn, *seg)?;
                // Readers must drop their open files of the retired segment.
                self.index.bump_generation(&mut txn)?;
            }
            self.index.commit(txn, self.durable())?;
            if retire {
                let path = segment_path(&self.dir, *seg);
                match fault::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(Error::Io {
                            context: format!("removing {}", path.display()),
                            source: e,
                        })
                    }
                }
                report.segments_rewritten += 1;
            }
        }
        self.seal_active(&mut out)?;
        self.remove_orphans()?;
        io::sync_dir(&self.dir.join("segments")).ctx(|| "fsync segments directory".to_string())?;
        let txn = self.index.read()?;
        report.bytes_after = self
            .index
            .all_segments(&txn)?
            .iter()
            .map(|(_, i)| i.committed_len)
            .sum();
        Ok(report)
    }

    fn record_tokens_at(&self, loc: &Location) -> Result<Vec<u32>> {
        let f = self
            .reader(loc.segment)
            .ctx(|| format!("segment {}", loc.segment))?;
        let mut meta = vec![0u8; format::RECORD_HEADER_LEN + 4 * self.layout.block_size as usize];
        io::read_exact_at(&f, &mut [IoSliceMut::new(&mut meta)], loc.offset)
            .ctx(|| "reading record".into())?;
        Ok(format::record_tokens(&meta).collect())
    }

    /// Syncs the compaction output and repoints each moved block whose entry
    /// still points at the old copy; a block evicted or rewritten meanwhile
    /// leaves its new copy dead.
    fn publish_moves(
        &self,
        out: &mut Writer,
        moved: &mut Vec<(BlockId, Location, Location)>,
    ) -> Result<()> {
        if moved.is_empty() {
            return Ok(());
        }
        let active = out.active.as_ref().expect("compaction segment");
        if self.durable() {
            fault::sync_data(&active.file)
                .ctx(|| format!("fdatasync segment {}", active.segment))?;
        }
        // Each move stands alone (its record is synced), so they may commit
        // in several transactions.
        self.in_batches(moved, |txn, batch| {
            for (id, old, new) in batch {
                if self
                    .index
                    .get_block_rw(txn, id)?
                    .is_some_and(|l| l.same_record(old))
                {
                    let new = Location {
                        used_us: old.used_us,
                        ..*new
                    };
                    self.index.move_block(txn, id, &new)?;
                    self.index
                        .add_live(txn, old.segment, -(old.record_len as i64), -1)?;
                    self.index
                        .add_live(txn, new.segment, new.record_len as i64, 1)?;
                }
            }
            if let Some(mut info) = self.index.get_segment(txn, active.segment)? {
                info.committed_len = active.len;
                self.index.put_segment(txn, active.segment, &info)?;
            }
            Ok((0, 0))
        })?;
        moved.clear();
        out.pending_bytes = 0;
        Ok(())
    }

    /// Deletes segment files the index does not know, nobody holds, and that
    /// nobody touched for a minute: left by a crash between creating a
    /// segment and registering it (or retiring one and unlinking it). A
    /// writer's brand-new file is young, and locked a moment after creation.
    fn remove_orphans(&self) -> Result<()> {
        const ORPHAN_AGE: Duration = Duration::from_secs(60);
        let (known, next): (std::collections::HashSet<u64>, u64) = {
            let txn = self.index.read()?;
            let known = self
                .index
                .all_segments(&txn)?
                .into_iter()
                .map(|(s, _)| s)
                .collect();
            (known, self.index.meta_u64(&txn, "next_segment")?)
        };
        let Ok(entries) = std::fs::read_dir(self.dir.join("segments")) else {
            return Ok(());
        };
        for e in entries.flatten() {
            let Some(n) = segment_number(&e.file_name()) else {
                continue;
            };
            let Ok(meta) = e.metadata() else { continue };
            let young = meta
                .modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_none_or(|age| age < ORPHAN_AGE);
            // An orphan's number was handed out (`next_segment` moved past
            // it) before its writer died. A file numbered beyond that is not
            // ours to judge: the index is older than the segments (restored
            // from a backup?); `verify` and `rebuild-index` deal with it.
            if known.contains(&n) || n >= next || !meta.is_file() || young {
                continue;
            }
            if let Ok(f) = io::open_existing(&e.path(), false) {
                if f.try_lock().is_ok() {
                    // Re-check under the lock: it may have been registered
                    // after our snapshot of the table.
                    let txn = self.index.read()?;
                    if !self.index.all_segments(&txn)?.iter().any(|(s, _)| *s == n) {
                        let _ = fault::remove_file(&e.path());
                    }
                }
            }
        }
        Ok(())
    }

    fn gc(
        &self,
        max_bytes: Option<u64>,
        older_than: Option<Duration>,
        progress: Progress<'_>,
    ) -> Result<GcReport> {
        let _lock = self.compaction_lock()?;
        {
            let mut w = self.writer.lock().expect("writer lock");
            self.commit_pending(&mut w)?;
        }
        let (blocks_evicted, bytes_evicted) =
            self.evict(max_bytes, older_than, &Default::default())?;
        Ok(GcReport {
            blocks_evicted,
            bytes_evicted,
            compact: self.compact_locked(progress, false)?,
        })
    }

    /// Drops the index entries of unpinned blocks, oldest first: those created
    /// more than `older_than` ago, then more until the live bytes fit
    /// `max_live`. Their records become dead bytes for compaction. Returns
    /// (blocks, bytes) evicted.
    fn evict(
        &self,
        max_live: Option<u64>,
        older_than: Option<Duration>,
        keep: &std::collections::HashSet<BlockId>,
    ) -> Result<(u64, u64)> {
        // Best effort: fresher last-use times make a better choice.
        let _ = self.save_touches();
        let (mut blocks, pinned) = {
            let txn = self.index.read()?;
            (
                self.index.all_blocks(&txn)?,
                self.index.live_pins(&txn, now_ms())?,
            )
        };
        let mut live: u64 = blocks.iter().map(|(_, l)| l.record_len).sum();
        blocks.retain(|(id, _)| !pinned.contains(id) && !keep.contains(id));
        blocks.sort_by_key(|(_, l)| l.used_us);
        let cutoff = older_than.map(|d| now_us().saturating_sub(d.as_micros() as u64));
        let mut evict = Vec::new();
        for (id, loc) in &blocks {
            let too_old = cutoff.is_some_and(|c| loc.used_us < c);
            let too_big = max_live.is_some_and(|m| live > m);
            if !(too_old || too_big) {
                break;
            }
            live -= loc.record_len;
            evict.push((*id, *loc));
        }
        self.in_batches(&evict, |txn, batch| {
            let (mut n, mut bytes) = (0, 0);
            for (id, loc) in batch {
                if self
                    .index
                    .get_block_rw(txn, id)?
                    .is_some_and(|l| l.same_record(loc))
                {
                    self.index.delete_block(txn, id)?;
                    self.index
                        .add_live(txn, loc.segment, -(loc.record_len as i64), -1)?;
                    n += 1;
                    bytes += loc.record_len;
                }
            }
            Ok((n, bytes))
        })
    }

    /// Applies `apply` to `items` in index transactions of up to 4096 items,
    /// halving the batch whenever the index map is full: LMDB copies every
    /// page a transaction touches, so a big delete or move can need more free
    /// pages than a full map has, while small ones free pages the next reuses.
    /// Returns the sums of what `apply` returned for the committed batches.
    fn in_batches<T>(
        &self,
        items: &[T],
        mut apply: impl FnMut(&mut heed::RwTxn<'_>, &[T]) -> Result<(u64, u64)>,
    ) -> Result<(u64, u64)> {
        let (mut sum, mut size, mut rest) = ((0, 0), 4096, items);
        while !rest.is_empty() {
            let batch = &rest[..size.min(rest.len())];
            let res = self.index.write().and_then(|mut txn| {
                let r = apply(&mut txn, batch)?;
                self.index.commit(txn, self.durable()).map(|_| r)
            });
            match res {
                Ok((a, b)) => {
                    sum = (sum.0 + a, sum.1 + b);
                    rest = &rest[batch.len()..];
                }
                Err(Error::StoreFull(_)) if batch.len() > 1 => size = batch.len() / 2,
                Err(e) => return Err(e),
            }
        }
        Ok(sum)
    }

    /// Frees room for `need` more bytes under `limit` (`disk_bytes`): evicts
    /// the oldest unpinned blocks down to three quarters of the limit (so the
    /// next puts do not compact again at once) and compacts. `StoreFull` when
    /// what is left is pinned, or another process is compacting.
    fn make_room(&self, w: &mut Writer, limit: u64, need: u64) -> Result<()> {
        self.commit_pending(w)?;
        // Seal ours, so its dead bytes can go too; the caller starts a new one.
        self.seal_active(w)?;
        let full = |detail: String| {
            Error::StoreFull(format!(
                "disk_bytes limit of {limit} bytes reached: {detail}"
            ))
        };
        let _lock = self
            .compaction_lock()
            .map_err(|_| full("another process is compacting; retry".into()))?;
        let keep = std::mem::take(&mut w.protect);
        let res = self.evict(Some(limit.saturating_sub(need) / 4 * 3), None, &keep);
        w.protect = keep;
        res?;
        self.compact_locked(&|_, _| {}, false)?;
        let used = self.disk_used(w)?;
        if used + need > limit {
            return Err(full(format!(
                "{used} bytes are still in use by pinned blocks or other writers' segments"
            )));
        }
        Ok(())
    }
}

/// Waits for the store's LOCK (held only while a process creates or recovers).
pub(crate) fn lock_with_timeout(f: &File, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        match f.try_lock() {
            Ok(()) => return Ok(()),
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::StoreLocked(format!(
                    "another process has held the store's LOCK for over {}s",
                    timeout.as_secs()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::Io {
                    context: "locking the store".into(),
                    source: e,
                })
            }
        }
    }
}
