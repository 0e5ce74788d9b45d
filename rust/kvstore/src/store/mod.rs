//! The store: a handle on one store directory, and the state it shares
//! between threads. Each step of the data flow has its own room:
//!
//! - [`put`]: check, dedupe, keep within `disk_bytes`, append, commit.
//! - [`writer`]: the segment writer (append, roll, seal, sync, publish).
//! - [`read`]: find a block, read and check its record, quarantine damage.
//! - [`pin`], [`session`]: pins and named sessions.
//! - [`recover`]: what open does after a crash.
//! - [`evict`], [`compact`]: freeing space (`gc`, `compact`).
//! - [`verify`], [`stats`]: inspection.
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

mod compact;
mod evict;
mod lookup;
mod options;
mod paged;
mod pin;
mod put;
mod read;
mod readers;
mod recover;
mod remote;
mod session;
mod stats;
mod touch;
mod verify;
mod writer;

pub use compact::CompactReport;
pub use evict::GcReport;
pub use options::{Durability, Options};
pub use stats::{SegmentReport, Stats};
pub use verify::{Damage, VerifyReport};

use crate::arena::{Arena, Owner};
use crate::arenas;
use crate::dir::StoreDir;
use crate::error::{Error, IoContext, Result};
use crate::format::{self, Manifest};
use crate::fs;
use crate::id::{BlockId, Keyer};
use crate::index::Index;
use crate::known::Known;
use crate::layout::Layout;
use crate::paged::PagedLayout;
use crate::progress::Progress;
use stats::Counters;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;
use touch::Touched;
use writer::Writer;

/// A read snapshot of the index and the generation it saw (`Inner::snapshot`).
struct Snap<'s> {
    txn: heed::RoTxn<'s, heed::WithoutTls>,
    generation: u64,
}

/// The state of an open handle, shared by its threads and its flusher.
struct Inner {
    dir: StoreDir,
    /// The MANIFEST as read at open; its format version is `format_version`.
    manifest: Manifest,
    /// The MANIFEST's format version as this handle last read or wrote it
    /// (raised by the first segment it writes into a version-1 store).
    format_version: AtomicU32,
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
    readers: RwLock<HashMap<u64, Arc<crate::segfile::SegmentFile>>>,
    known: Known,
    /// Last-use times of blocks this handle served, not yet in the index.
    touched: Mutex<Touched>,
    arena: Option<Arena>,
    counters: Counters,
    remote: Option<crate::remote::Remote>,
    /// This handle marks the store open, which keeps `rebuild_index` away.
    _open: crate::dir::OpenMark,
}

/// A handle on a store directory. `Sync`: share it between threads.
pub struct Store {
    inner: RwLock<Option<Arc<Inner>>>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    pid: u32,
}

impl Store {
    /// Opens (or creates) the store at `dir`.
    pub fn open(dir: &Path, opts: Options) -> Result<Store> {
        opts.check()?;
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

    /// The layout the store was created with.
    pub fn layout(&self) -> Result<Layout> {
        Ok(self.live()?.layout)
    }
    /// The store's MANIFEST.
    pub fn manifest(&self) -> Result<Manifest> {
        let inner = self.live()?;
        Ok(Manifest {
            format_version: inner.format_version.load(Ordering::SeqCst),
            ..inner.manifest.clone()
        })
    }
    /// The durability mode this handle was opened with.
    pub fn durability(&self) -> Result<Durability> {
        Ok(self.live()?.opts.durability)
    }
    /// Whether `close` has run on this handle.
    pub fn is_closed(&self) -> bool {
        self.inner.read().expect("store lock").is_none()
    }

    /// Stores every full block of `tokens` not stored yet. `kv` is a contiguous
    /// `[L, 2, kv_tokens, H, D]` buffer. Returns the tokens covered (full blocks).
    pub fn put(&self, tokens: &[u32], kv: &[u8], kv_tokens: usize, extra: &[u8]) -> Result<usize> {
        self.live()?.put_from(tokens, 0, kv, kv_tokens, extra)
    }

    /// `put` of the blocks from token `start` on (a multiple of the block
    /// size): `kv` is `[L, 2, kv_tokens, H, D]` holding `tokens[start..]`, so a
    /// chunked prefill hands over only its new blocks. Blocks before `start`
    /// are not written (a block whose parent is not stored is unreachable until
    /// it is). Returns the tokens covered, counted from token 0.
    pub fn put_from(
        &self,
        tokens: &[u32],
        start: usize,
        kv: &[u8],
        kv_tokens: usize,
        extra: &[u8],
    ) -> Result<usize> {
        self.live()?.put_from(tokens, start, kv, kv_tokens, extra)
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
        self.live()?.get_from(tokens, 0, extra, out, out_tokens)
    }

    /// `get_into` from token `start` on (a multiple of the block size): fills
    /// `out` (`[L, 2, out_tokens, H, D]`) with the KV of `tokens[start..m]`,
    /// where `m` is the longest stored prefix of `tokens` (blocks before
    /// `start` are checked, not read). Returns `m`, counted from token 0; less
    /// than `start` when the prefix ends before it (then `out` is untouched).
    pub fn get_from(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        out: &mut [u8],
        out_tokens: usize,
    ) -> Result<usize> {
        self.live()?.get_from(tokens, start, extra, out, out_tokens)
    }

    /// `get_from` straight into a serving engine's paged cache: `layers` (one
    /// span per layer, each the layer's whole cache memory, laid out as
    /// `paged` says) receive block `start / B + k` of `tokens` in cache block
    /// `blocks[k]`, each block checked before it lands. Returns the stored
    /// prefix in tokens, counted from 0, at most `start + blocks.len() * B`.
    pub fn get_paged(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        paged: &PagedLayout,
        layers: &mut [&mut [u8]],
        blocks: &[usize],
    ) -> Result<usize> {
        self.live()?
            .get_paged(tokens, start, extra, paged, layers, blocks)
    }

    /// `put_from` straight out of a serving engine's paged cache: the full
    /// blocks of `tokens` from `start` on are cache blocks `blocks` of
    /// `layers` (see `get_paged`). Returns the tokens covered, from 0.
    pub fn put_paged(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        paged: &PagedLayout,
        layers: &[&[u8]],
        blocks: &[usize],
    ) -> Result<usize> {
        self.live()?
            .put_paged(tokens, start, extra, paged, layers, blocks)
    }

    /// Adds `counts` to clients' named counters (a connector's figures),
    /// saved with the store's hit and miss totals at flush and close and
    /// shown by `stats` (`Stats::counters`). Names: 1 to 64 characters of
    /// `a-z 0-9 _ . -`.
    pub fn add_counters(&self, counts: &[(&str, u64)]) -> Result<()> {
        self.live()?.add_counters(counts)
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
        Ok(self.live()?.arena.as_ref().map(super::arena::Arena::region))
    }

    /// Stores the full blocks of `tokens` (as `put`) and binds `name` to all of `tokens`,
    /// durably, for this tenant. Returns the tokens covered by stored blocks.
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
        self.live()?.session_tokens(name)
    }

    /// This tenant's sessions: (name, token count).
    pub fn sessions(&self) -> Result<Vec<(String, usize)>> {
        self.live()?.sessions()
    }

    /// Forgets a session (its blocks stay, shared with others). Returns
    /// whether it existed.
    pub fn delete_session(&self, name: &str) -> Result<bool> {
        self.live()?.delete_session(name)
    }

    /// Everything put so far is durable (and visible to others) when this returns.
    pub fn flush(&self) -> Result<()> {
        let inner = self.live()?;
        let mut w = inner.writer.lock().expect("writer lock");
        inner.commit_pending(&mut w)?;
        drop(w);
        inner.save_advisory();
        inner.remote_flush();
        Ok(())
    }

    /// Counters of this handle and figures of the store (see [`Stats`]).
    pub fn stats(&self) -> Result<Stats> {
        self.live()?.stats()
    }

    /// Every node of the remote tier: round trip and `INFO` figures, or the
    /// error; `InvalidInput` without a remote tier.
    pub fn remote_nodes(&self) -> Result<Vec<crate::remote::NodeReport>> {
        Ok(self.live()?.remote_required()?.nodes())
    }

    /// Uploads the store's blocks that the remote tier lacks (`kvstore
    /// remote push`); `InvalidInput` without a remote tier.
    pub fn remote_push(&self, progress: Progress<'_>) -> Result<crate::remote::PushReport> {
        self.live()?.remote_push(progress)
    }

    /// Every segment, as `kvstore stats` lists it.
    pub fn segments(&self) -> Result<Vec<SegmentReport>> {
        self.live()?.segment_reports()
    }

    /// Re-reads every indexed record and checks it; lists what is damaged. Read-only.
    pub fn verify(&self, progress: Progress<'_>) -> Result<VerifyReport> {
        self.live()?.verify(progress, false)
    }

    /// `verify`, and every damaged record found is taken out of the index
    /// (a miss from now on, stored again by the next put of its tokens).
    /// For an index that cannot be opened, see [`crate::repair`].
    pub fn repair(&self, progress: Progress<'_>) -> Result<VerifyReport> {
        self.live()?.verify(progress, true)
    }

    /// Rewrites the live records of segments holding dead bytes and deletes the old files
    /// (`kvstore compact`). `StoreLocked` if another compaction or gc runs.
    pub fn compact(&self, progress: Progress<'_>) -> Result<CompactReport> {
        self.live()?.compact(progress, false)
    }

    /// Evicts the least recently used unpinned blocks, those unused for `older_than` and then
    /// more until live bytes fit `max_bytes`, and compacts (`kvstore gc`).
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
        let res = res.and_then(|()| inner.seal_active(&mut w));
        w.active = None;
        drop(w);
        inner.save_advisory();
        // The remote tier last: its drain waits on a server (up to
        // close_timeout), which must not hold back the local commit, or
        // lose it if the process is killed meanwhile.
        inner.remote_close();
        res
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child must not touch the parent's LMDB environment or
            // segment: leak its copy of the state instead of tearing it down.
            if let Some(inner) = self
                .inner
                .get_mut()
                .ok()
                .and_then(std::option::Option::take)
            {
                std::mem::forget(inner);
            }
            if let Some(t) = self
                .flusher
                .get_mut()
                .ok()
                .and_then(std::option::Option::take)
            {
                std::mem::forget(t);
            }
            return;
        }
        let _ = self.close();
    }
}

impl Inner {
    fn open(root: &Path, opts: Options) -> Result<Inner> {
        let dir = StoreDir::new(root);
        if opts.create {
            fs::ensure_dir(root).ctx(|| format!("store directory {}", root.display()))?;
        } else if !root.is_dir() {
            return Err(Error::InvalidInput(format!(
                "no store at {}",
                root.display()
            )));
        }
        fs::check_private_dir(root).map_err(|e| Error::InvalidInput(e.to_string()))?;
        // Creation and recovery run under an exclusive lock so two processes
        // opening a new store at once agree on one MANIFEST.
        let lock = dir.lock()?;
        let open_mark = dir.mark_open()?;
        // A version-1 MANIFEST stays as it is until this handle writes its
        // first segment (`upgrade_manifest`): opening and reading change
        // nothing an older build would refuse.
        let manifest = if let Some(m) = dir.read_manifest()? {
            m
        } else {
            let (Some(fp), Some(layout), true) = (&opts.fingerprint, &opts.layout, opts.create)
            else {
                return Err(Error::InvalidInput(format!(
                    "no kvstore at {} (no MANIFEST); create it by opening with a layout and a model",
                    root.display()
                )));
            };
            dir.create_manifest(fp, layout)?
        };
        let layout = manifest
            .layout()
            .map_err(|e| Error::corrupt(dir.manifest_path(), e.to_string()))?;
        let fingerprint = opts
            .fingerprint
            .clone()
            .unwrap_or_else(|| manifest.fingerprint.clone());
        let asked_layout = opts.layout.unwrap_or(layout);
        format::check_identity(&manifest, &fingerprint, &asked_layout)?;

        for sub in [dir.index_dir(), dir.segments_dir()] {
            fs::ensure_dir(&sub).ctx(|| sub.display().to_string())?;
            fs::check_private_dir(&sub).map_err(|e| Error::InvalidInput(e.to_string()))?;
        }
        let index = Index::open(
            &dir.index_dir(),
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
        if fresh && dir.has_segment_files() {
            return Err(Error::corrupt(
                dir.index_dir(),
                "the index knows no segments but segments/ holds segment files (index lost or \
                 replaced); run `kvstore rebuild-index` to rebuild it from them",
            ));
        }
        let keyer = Keyer::new(&fingerprint, &layout, opts.salt.as_deref());
        let arena = match opts.hot_bytes {
            None => None,
            Some(bytes) => Some(open_arena(root, &opts, &manifest, &layout, bytes)?),
        };
        let remote = opts
            .remote
            .as_ref()
            .map(|r| crate::remote::Remote::open(r, &keyer.tenant_tag(), keyer.remote_mac_key()))
            .transpose()?;
        let inner = Inner {
            remote,
            dir,
            tag: keyer.tenant_tag(),
            keyer,
            format_version: AtomicU32::new(manifest.format_version),
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
            _open: open_mark,
        };
        inner.recover()?;
        drop(lock);
        inner.resend_tombstones()?;
        Ok(inner)
    }

    pub(super) fn hot_tier(&self) -> Result<&Arena> {
        self.arena.as_ref().ok_or_else(|| {
            Error::InvalidInput("this store was opened without a hot tier (hot_bytes)".into())
        })
    }

    /// Upgrades a version-1 MANIFEST before this handle writes its first
    /// segment (see [`StoreDir::upgrade_manifest`]); a no-op after that.
    pub(super) fn before_first_segment(&self) -> Result<()> {
        if self.format_version.load(Ordering::SeqCst) < format::FORMAT_VERSION {
            let m = self.dir.upgrade_manifest()?;
            self.format_version
                .store(m.format_version, Ordering::SeqCst);
        }
        Ok(())
    }

    pub(super) fn durable(&self) -> bool {
        self.opts.durability != Durability::None
    }
}

/// Opens (or creates) the store's hot tier: one arena file per store, named
/// by the store id, in `hot_dir`, `$KVSTORE_HOT_DIR`, or the default place.
/// First prunes orphaned arenas in that directory (bounded; see `arenas`).
fn open_arena(
    root: &Path,
    opts: &Options,
    manifest: &Manifest,
    layout: &Layout,
    bytes: u64,
) -> Result<Arena> {
    let dir = opts
        .hot_dir
        .clone()
        .or_else(|| std::env::var_os("KVSTORE_HOT_DIR").map(PathBuf::from))
        .unwrap_or_else(|| crate::pages::default_dir(bytes));
    let path = dir.join(format!("kvstore-{}.arena", manifest.store_id));
    arenas::prune_dir(&dir, &path, arenas::OPEN_PRUNE_LIMIT);
    let owner = Owner {
        store_id: manifest.store_id.clone(),
        store_path: std::fs::canonicalize(root).ctx(|| format!("resolving {}", root.display()))?,
    };
    let mut tag_input = manifest.store_id.as_bytes().to_vec();
    tag_input.extend_from_slice(&layout.canonical_bytes());
    Arena::open(
        &path,
        layout,
        blake3::hash(&tag_input).as_bytes(),
        bytes,
        &owner,
    )
}
