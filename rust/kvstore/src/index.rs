//! The LMDB index: block id → location, sessions, segment table, meta.
//!
//! Tables (named LMDB databases, all keys and values explicit little-endian
//! except where a big-endian key keeps numeric order):
//! - `blocks`:   block id (32 B) → [`Location`] (40 B)
//! - `segments`: segment number (u64 **big-endian**, so iteration is in order) → [`SegmentInfo`] (32 B)
//! - `sessions`: tenant tag (16 B) ‖ name (UTF-8) → token ids (u32 LE each)
//! - `session_versions`: keyed as `sessions` → version (u64 LE) ‖ state (1 B:
//!   1 live, 0 deleted): the version of a session's last save or delete
//!   here (see `store::session`). A deletion is kept only until the server
//!   has it. A session without an entry (a store older than this table, or
//!   a copy of the older server format) is at version 0
//! - `damaged`:  block id → [`Location`] ‖ reason (UTF-8): blocks found damaged on read
//! - `pins`:     block id → priority (u64 LE) ‖ expiry in ms since the epoch (u64 LE, 0 = never)
//! - `meta`:     ASCII name → u64 LE (`next_segment`, `generation`,
//!   `chains_generation`, `session_clock`, hit/miss totals, clients' named counters as
//!   `counter.<name>`)
//! - `parents`:  block id → parent id (32 B) ‖ mark (1 B: [`CLOSED`] for
//!   closed, anything else not): the block's parent when it was published
//!   by a put that knew it
//! - `children`: parent id → child id (32 B), sorted duplicates: the inverse of
//!   `parents`, one pair per `parents` entry
//!
//! ## Prefix-closed chains (`parents`, `children`)
//!
//! A block is *closed* when its whole ancestry is indexed, so that `lookup`
//! can gallop over a chain with a few probes instead of one per block. In
//! every committed state, while the marks are trusted (below):
//!
//! 1. a `parents` entry exists only for a block in `blocks`;
//! 2. a block is marked closed only if its parent is [`ROOT`] or is itself
//!    marked closed;
//! 3. `children` holds the pair (p, c) exactly when `parents[c]` names p.
//!
//! By (1) and (2), a closed block's ancestors, back to the root, are all in
//! `blocks`; along one chain the closed blocks form a prefix. What keeps it:
//! [`Index::insert_child`] and [`Index::link_child`] (a put's publish, and a
//! put meeting a block already stored without a closed mark) record the
//! parent and mark the block closed when its parent is, then mark the
//! descendants that waited for it (a hole filled again);
//! [`Index::delete_block_if_at`], the only removal from `blocks` (eviction,
//! quarantine, `verify --repair`, compaction's drops), drops the block's
//! entry and unmarks its closed descendants in the same transaction. Moves
//! keep both (the block stays). Blocks without an entry or a mark (stores
//! older than these tables, a rebuild from segments, which does not know
//! parents) are not closed until a put of their chain meets them: `lookup`
//! finds them one probe at a time meanwhile.
//!
//! Both walks stop after [`MARK_WALK_MAX`] blocks, so that removing a prefix
//! shared by a million chains (a system prompt's first block) does not hold
//! the write lock for a million rewrites. Marking stops short safely (fewer
//! blocks closed: `lookup` probes them); unmarking stopped short would
//! leave closed marks over a hole, so it stops trusting the marks instead,
//! in the same transaction.
//!
//! Trust: binaries older than these tables remove blocks without unmarking
//! anything. Every bump of `generation` by this code advances
//! `chains_generation` with it while the two are equal; an older binary's
//! bump leaves them apart. The marks count only while they are equal, and
//! [`Index::open`] empties both tables and realigns the two when they are
//! not (also after a capped unmarking walk, or a `verify` that found the
//! invariants broken). This relies on every older binary bumping
//! `generation` when it removes a block: true from commit 00f4b27 on.
//! Binaries from 39b437d to 9890d5e delete blocks without a bump; one of
//! them writing to a store that has marks can leave a stale closed mark
//! (`verify` finds it and stops trusting the marks).

use crate::error::{Error, Result};
use crate::fault;
use crate::id::{BlockId, ROOT};
use crate::os;
use heed::types::Bytes;
use heed::{Database, DatabaseFlags, Env, RoTxn, RwTxn, WithoutTls};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

type Db = Database<Bytes, Bytes>;

/// Where a block's record lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub segment: u64,
    pub offset: u64,
    pub record_len: u64,
    pub stored_len: u64,
    /// Last use, in µs since the epoch: set by the put, refreshed by reads.
    /// Within one request, block i is stamped i µs earlier than the first,
    /// so eviction (least recently used first) takes chains from the tail
    /// and keeps their prefixes whole.
    pub used_us: u64,
}

pub const LOCATION_LEN: usize = 40;

impl Location {
    /// Whether two entries name the same record (the last-use time aside).
    pub fn same_record(&self, other: &Location) -> bool {
        (self.segment, self.offset, self.record_len)
            == (other.segment, other.offset, other.record_len)
    }

    pub fn encode(&self) -> [u8; LOCATION_LEN] {
        let mut b = [0u8; LOCATION_LEN];
        b[0..8].copy_from_slice(&self.segment.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.record_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.stored_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.used_us.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < LOCATION_LEN {
            return None;
        }
        let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Some(Location {
            segment: u(0),
            offset: u(8),
            record_len: u(16),
            stored_len: u(24),
            used_us: u(32),
        })
    }
}

/// State of a segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentState {
    /// A writer may still append (it holds the file's lock while alive).
    Active = 0,
    /// Read-only from now on.
    Sealed = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub state: SegmentState,
    /// Bytes of the file covered by committed index entries (header included);
    /// anything past it is a torn or uncommitted tail.
    pub committed_len: u64,
    pub live_bytes: u64,
    pub live_records: u64,
}

impl Default for SegmentInfo {
    fn default() -> Self {
        Self::new()
    }
}

impl SegmentInfo {
    pub fn new() -> Self {
        SegmentInfo {
            state: SegmentState::Active,
            committed_len: crate::format::SEGMENT_HEADER_LEN as u64,
            live_bytes: 0,
            live_records: 0,
        }
    }

    fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0] = self.state as u8;
        b[8..16].copy_from_slice(&self.committed_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.live_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.live_records.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 32 {
            return None;
        }
        let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Some(SegmentInfo {
            state: if b[0] == 0 {
                SegmentState::Active
            } else {
                SegmentState::Sealed
            },
            committed_len: u(8),
            live_bytes: u(16),
            live_records: u(24),
        })
    }
}

/// One LMDB environment and its tables, shared by every handle of this
/// process on the same store (LMDB forbids opening an environment twice in
/// one process).
pub struct Index {
    pub env: Env<WithoutTls>,
    blocks: Db,
    segments: Db,
    sessions: Db,
    session_versions: Db,
    damaged: Db,
    pins: Db,
    meta: Db,
    parents: Db,
    children: Db,
    nosync: bool,
    /// The process that opened the environment.
    pid: u32,
}

/// LMDB trusts its data file: a page size, last page or root out of range
/// makes it fault (SIGBUS past the end of the file) rather than fail. So the
/// two meta pages are checked before LMDB maps the file: magic, version, page
/// size, and that the newest meta's pages all lie inside the file. (Damage
/// deeper in the tree LMDB reports itself, as `MDB_CORRUPTED` or
/// `MDB_PAGE_NOTFOUND`, which become `CorruptStore`.)
fn check_lmdb_file(path: &Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    const MAGIC: u32 = 0xBEEF_C0DE;
    const DATA_VERSION: u32 = 1;
    const P_META: u16 = 0x08;
    const P_INVALID: u64 = u64::MAX;
    let file = match crate::fs::open_existing(path, false) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()), // LMDB creates it
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len == 0 {
        return Ok(()); // created but never written: LMDB initialises it
    }
    let psize = rustix::param::page_size() as u64;
    if len < 2 * psize {
        return Err(format!("{len} bytes, shorter than its two meta pages"));
    }
    let mut newest: Option<(u64, u64, [u64; 2])> = None; // (txnid, last page, roots)
    for i in 0..2u64 {
        let mut p = [0u8; 152];
        file.read_exact_at(&mut p, i * psize)
            .map_err(|e| format!("reading meta page {i}: {e}"))?;
        let u16_at = |at: usize| u16::from_le_bytes([p[at], p[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"));
        // MDB_page header (16 bytes), then MDB_meta: magic, version, address,
        // map size, two MDB_db of 48 bytes (md_pad of the first = page size,
        // md_root at +40), last page, txn id.
        if u16_at(10) & P_META == 0 || u32_at(16) != MAGIC || u32_at(20) != DATA_VERSION {
            return Err(format!(
                "meta page {i} is damaged (flags, magic or version)"
            ));
        }
        if u64::from(u32_at(40)) != psize {
            return Err(format!(
                "meta page {i} gives a page size of {}, this system's is {psize}",
                u32_at(40)
            ));
        }
        if u64_at(32) > 1 << 46 {
            return Err(format!(
                "meta page {i} gives an absurd map size {}",
                u64_at(32)
            ));
        }
        let (last, txn) = (u64_at(136), u64_at(144));
        if newest.is_none_or(|(t, _, _)| txn > t) {
            newest = Some((txn, last, [u64_at(80), u64_at(128)]));
        }
    }
    let (_, last, roots) = newest.expect("two meta pages read");
    // The length after the meta pages: a commit by another process between
    // the two reads only grows the file (LMDB writes its pages, then the meta).
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let need = last
        .checked_add(1)
        .and_then(|n| n.checked_mul(psize))
        .ok_or_else(|| format!("last page {last} is absurd"))?;
    if need > len {
        return Err(format!(
            "its last page ends at byte {need}, past the end of the file ({len} bytes): truncated"
        ));
    }
    if roots.iter().any(|&r| r != P_INVALID && (r < 2 || r > last)) {
        return Err(format!(
            "a root page {roots:?} lies outside pages 2..={last}"
        ));
    }
    Ok(())
}

/// A `parents` value: the parent, and whether the mark is [`CLOSED`];
/// None if it is not 33 bytes.
fn decode_link(v: &[u8]) -> Option<(BlockId, bool)> {
    let v: &[u8; 33] = v.try_into().ok()?;
    Some((v[..32].try_into().expect("32 bytes"), v[32] == CLOSED))
}

/// Index bytes kept back from puts, at the least (see `nearly_full`).
pub const INDEX_RESERVE: u64 = 1 << 20;

/// Default virtual size reserved for the index map. LMDB grows the file only
/// as needed; 64 GiB covers ~200M blocks (~130 B each in `blocks`, as much
/// again in `parents` and `children`, pages part full; a quarter of the map
/// is kept back, see `nearly_full`).
pub const DEFAULT_MAP_SIZE: u64 = 64 << 30;

/// The mark byte of a closed block. Any other value is not closed, so one
/// flipped bit cannot close a block over a hole (0 and 1 included: stores
/// written before this tag read as unmarked, and are marked again by puts).
pub const CLOSED: u8 = 0xC5;

/// The mark byte of a block recorded but not closed.
const OPEN: u8 = 0x00;

/// Most blocks one marking or unmarking walk rewrites (see "Prefix-closed
/// chains").
pub const MARK_WALK_MAX: usize = 4096;

fn registry() -> &'static Mutex<HashMap<PathBuf, Weak<Index>>> {
    static R: OnceLock<Mutex<HashMap<PathBuf, Weak<Index>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

impl Index {
    /// Opens (creating tables if needed) or reuses this process's environment.
    pub fn open(dir: &Path, nosync: bool, map_size: u64) -> Result<Arc<Index>> {
        let key = dir.canonicalize().map_err(|source| Error::Io {
            context: format!("index directory {}", dir.display()),
            source,
        })?;
        let mut reg = registry().lock().expect("index registry");
        if let Some(idx) = reg.get(&key).and_then(Weak::upgrade) {
            if idx.pid != std::process::id() {
                // Inherited through fork(): LMDB's in-memory state may be
                // mid-transaction (another thread of the parent was writing),
                // and heed will not open the path twice in one process.
                return Err(Error::StoreClosed(format!(
                    "{} was open in the parent process when it forked: an LMDB \
                     environment cannot cross fork(). Open the store only after forking \
                     (or close every handle before), or start workers with 'spawn'",
                    dir.display()
                )));
            }
            return Ok(idx);
        }
        // LMDB follows symlinks; we do not: a planted link could point the
        // index at any file.
        for name in ["data.mdb", "lock.mdb"] {
            match std::fs::symlink_metadata(key.join(name)) {
                Ok(m) if !m.is_file() => {
                    return Err(Error::corrupt(
                        key.join(name),
                        "not a regular file (a symlink?); refusing to follow it",
                    ))
                }
                _ => {}
            }
        }
        // Other processes may be committing as we read (a meta page read
        // half-written): a verdict of damage must repeat before it counts.
        let mut verdict = check_lmdb_file(&key.join("data.mdb"));
        for _ in 0..3 {
            if verdict.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            verdict = check_lmdb_file(&key.join("data.mdb"));
        }
        if let Err(reason) = verdict {
            return Err(Error::corrupt(key.join("data.mdb"), reason));
        }
        // LMDB wants a multiple of the OS page size.
        let map_size =
            usize::try_from(map_size.div_ceil(4096).max(16) * 4096).unwrap_or(usize::MAX);
        let env = os::open_lmdb(&key, map_size, nosync).map_err(|e| match e {
            heed::Error::Mdb(heed::MdbError::Invalid | heed::MdbError::Corrupted) => {
                Error::corrupt(&key, format!("index cannot be opened: {e}"))
            }
            // Another LMDB version holds the lock file: the `lmdb` Python
            // package (LMDB 0.9) opened with lock=True, most likely.
            heed::Error::Mdb(heed::MdbError::VersionMismatch) => Error::StoreLocked(format!(
                "{}: the index is open in another LMDB version (the `lmdb` Python package? \
                 open it with lock=False, read-only): {e}",
                key.display()
            )),
            other => other.into(),
        })?;
        // Reader slots of processes killed mid-read would pin old pages forever.
        env.clear_stale_readers()?;
        let mut wtxn = env.write_txn()?;
        let mut create =
            |name: &str| -> Result<Db> { Ok(env.create_database(&mut wtxn, Some(name))?) };
        let blocks = create("blocks")?;
        let segments = create("segments")?;
        let sessions = create("sessions")?;
        let session_versions = create("session_versions")?;
        let damaged = create("damaged")?;
        let pins = create("pins")?;
        let meta = create("meta")?;
        let parents = create("parents")?;
        let children = env
            .database_options()
            .types::<Bytes, Bytes>()
            .name("children")
            .flags(DatabaseFlags::DUP_SORT)
            .create(&mut wtxn)?;
        let idx = Index {
            env: env.clone(),
            blocks,
            segments,
            sessions,
            session_versions,
            damaged,
            pins,
            meta,
            parents,
            children,
            nosync,
            pid: std::process::id(),
        };
        if !idx.chains_trusted(&wtxn)? {
            // An older binary removed blocks without unmarking their
            // descendants: start the marks afresh.
            idx.parents.clear(&mut wtxn)?;
            idx.children.clear(&mut wtxn)?;
            let g = idx.meta_u64(&wtxn, "generation")?;
            idx.set_meta_u64(&mut wtxn, "chains_generation", g)?;
        }
        wtxn.commit()?;
        let idx = Arc::new(idx);
        reg.insert(key, Arc::downgrade(&idx));
        Ok(idx)
    }

    /// Whether the map is too full to take more entries. LMDB copies pages
    /// on write, so even a delete needs free pages, and deletes free few
    /// (half-empty pages stay): a quarter of the map, at least 1 MiB, is kept
    /// back for gc, eviction, compaction and quarantines.
    pub fn nearly_full(&self) -> Result<bool> {
        let info = self.env.info();
        let map = info.map_size as u64;
        let limit = map - (map / 4).max(INDEX_RESERVE).min(map);
        let psize = rustix::param::page_size() as u64;
        if (info.last_page_number as u64 + 1) * psize <= limit {
            return Ok(false); // never grew that far
        }
        Ok(self.env.non_free_pages_size()? > limit)
    }

    /// Whether this process has the environment at `dir` open.
    pub fn is_open_here(dir: &Path) -> bool {
        let Ok(key) = dir.canonicalize() else {
            return false;
        };
        registry()
            .lock()
            .expect("index registry")
            .get(&key)
            .is_some_and(|w| w.strong_count() > 0)
    }

    pub fn read(&self) -> Result<RoTxn<'_, WithoutTls>> {
        Ok(self.env.read_txn()?)
    }

    pub fn write(&self) -> Result<RwTxn<'_>> {
        Ok(self.env.write_txn()?)
    }

    /// Commits; when the environment was opened without sync (durability
    /// "none" by the first handle of this process) but this commit must be
    /// durable, forces the sync explicitly.
    pub fn commit(&self, txn: RwTxn<'_>, durable: bool) -> Result<()> {
        fault::before(fault::Op::Commit, None)
            .map_err(|e| Error::from_io("index commit".into(), e))?;
        txn.commit()?;
        if durable && self.nosync {
            self.env.force_sync()?;
        }
        Ok(())
    }

    // ---- blocks ----

    pub fn get_block(&self, txn: &RoTxn<'_>, id: &BlockId) -> Result<Option<Location>> {
        Ok(self.blocks.get(txn, id)?.and_then(Location::decode))
    }

    pub fn get_block_rw(&self, txn: &RwTxn<'_>, id: &BlockId) -> Result<Option<Location>> {
        Ok(self.blocks.get(txn, id)?.and_then(Location::decode))
    }

    /// Publishes the record at `loc` as block `id`'s entry, if the block has
    /// none, and counts it live in its segment. Returns false, changing
    /// nothing, when the block already has an entry (another writer stored it
    /// first; this copy is dead bytes). A block stored again after being found
    /// damaged is no longer listed as damage.
    pub fn insert_block(&self, txn: &mut RwTxn<'_>, id: &BlockId, loc: &Location) -> Result<bool> {
        if self.get_block_rw(txn, id)?.is_some() {
            return Ok(false);
        }
        self.blocks.put(txn, id, &loc.encode())?;
        self.clear_damaged(txn, id)?;
        self.add_live(txn, loc.segment, loc.record_len.cast_signed(), 1)?;
        Ok(true)
    }

    /// Removes block `id`'s entry if it still names the record at `at` (a
    /// writer may have moved or replaced it since `at` was read), and counts
    /// the record dead; its descendants are no longer closed. Bumps the
    /// generation: cached locations are stale.
    pub fn delete_block_if_at(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        at: &Location,
    ) -> Result<bool> {
        if !self.get_block_rw(txn, id)?.is_some_and(|l| l.same_record(at)) {
            return Ok(false);
        }
        self.blocks.delete(txn, id)?;
        self.unlink(txn, id)?;
        self.bump_generation(txn)?;
        self.add_live(txn, at.segment, -at.record_len.cast_signed(), -1)?;
        Ok(true)
    }

    /// [`Index::insert_block`] for a block whose parent is known (a put's
    /// publish), then [`Index::link_child`].
    pub fn insert_child(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        loc: &Location,
        parent: &BlockId,
    ) -> Result<bool> {
        let inserted = self.insert_block(txn, id, loc)?;
        self.link_child(txn, id, parent)?;
        Ok(inserted)
    }

    /// Records `parent` as the parent of block `id`, if it is indexed, and
    /// marks it closed if its parent is (see "Prefix-closed chains"), then
    /// marks the descendants that were waiting for it. For a block
    /// published now, and for one already stored without an entry (an older
    /// store, a realign) or unclosed while its parent is now closed.
    pub fn link_child(&self, txn: &mut RwTxn<'_>, id: &BlockId, parent: &BlockId) -> Result<()> {
        if self.get_block_rw(txn, id)?.is_none() {
            return Ok(()); // (1)
        }
        let closed = *parent == ROOT || self.link(txn, parent)?.is_some_and(|(_, c)| c);
        match self.link(txn, id)? {
            // An entry for another parent: ids collide (only with test-short-ids).
            Some((p, _)) if p != *parent => return Ok(()),
            Some((_, was)) if was || !closed => return Ok(()),
            Some(_) => {}
            None => {
                // A malformed entry is replaced; its pair, if any, stays
                // behind and names no entry (harmless, `verify` lists it).
                self.children.put(txn, parent, id)?;
            }
        }
        self.put_link(txn, id, parent, closed)?;
        if closed {
            self.set_closed_below(txn, id, true)?;
        }
        Ok(())
    }

    /// Whether block `id` is closed with `parent` as its parent: it and its
    /// whole ancestry are indexed (in the snapshot `txn`). False for every
    /// block while the marks are not trusted.
    pub fn is_closed(&self, txn: &RoTxn<'_>, id: &BlockId, parent: &BlockId) -> Result<bool> {
        Ok(self
            .link(txn, id)?
            .is_some_and(|(p, closed)| closed && p == *parent))
    }

    /// Whether the closed marks may be relied on (no older binary has
    /// removed blocks since they were last made consistent).
    pub fn chains_trusted(&self, txn: &RoTxn<'_>) -> Result<bool> {
        Ok(self.meta_u64(txn, "generation")? == self.meta_u64(txn, "chains_generation")?)
    }

    /// Stops trusting the closed marks until the next [`Index::open`]
    /// empties them: `generation` only grows, so it never meets
    /// `chains_generation` again.
    pub fn distrust_chains(&self, txn: &mut RwTxn<'_>) -> Result<()> {
        let g = self.meta_u64(txn, "generation")?;
        self.set_meta_u64(txn, "chains_generation", g.wrapping_sub(1))
    }

    /// Checks invariants (1)-(3) of "Prefix-closed chains" and that every
    /// entry is well formed, while the marks are trusted; returns what is
    /// wrong (the first `limit` findings). One pass over each table.
    pub fn check_chains(&self, txn: &RoTxn<'_>, limit: usize) -> Result<Vec<String>> {
        let mut out = Vec::new();
        if !self.chains_trusted(txn)? {
            return Ok(out);
        }
        let mut entries = 0u64;
        for item in self.parents.iter(txn)? {
            if out.len() >= limit {
                return Ok(out);
            }
            let (k, v) = item?;
            let (Ok(id), Some((parent, closed))) = (BlockId::try_from(k), decode_link(v)) else {
                out.push(format!(
                    "parents: a malformed entry ({} B key, {} B value)",
                    k.len(),
                    v.len()
                ));
                continue;
            };
            entries += 1;
            let name = crate::id::hex(&id);
            // 1 is what the version before the tag wrote for closed: not
            // closed now, and not damage.
            if ![CLOSED, OPEN, 1].contains(&v[32]) {
                out.push(format!("parents: block {name} has mark byte {:#04x}", v[32]));
            }
            if self.get_block(txn, &id)?.is_none() {
                out.push(format!("parents: block {name} has an entry but is not indexed"));
            }
            if closed && parent != ROOT && !self.link(txn, &parent)?.is_some_and(|(_, c)| c) {
                out.push(format!("parents: block {name} is closed, its parent is not"));
            }
        }
        let mut pairs = 0u64;
        for item in self.children.iter(txn)? {
            if out.len() >= limit {
                return Ok(out);
            }
            let (p, c) = item?;
            pairs += 1;
            let named = BlockId::try_from(c)
                .ok()
                .map(|c| self.link(txn, &c))
                .transpose()?
                .flatten()
                .is_some_and(|(cp, _)| cp[..] == *p);
            if !named {
                out.push("children: a pair whose child's entry names another parent".into());
            }
        }
        // Every pair names an entry and no two pairs name the same one (an
        // entry names one parent): equal counts make the two tables inverse.
        if pairs != entries && out.len() < limit {
            out.push(format!(
                "children: {pairs} pairs for {entries} parents entries"
            ));
        }
        Ok(out)
    }

    /// Block `id`'s parent and closed mark, if it has a well-formed entry.
    fn link(&self, txn: &RoTxn<'_>, id: &BlockId) -> Result<Option<(BlockId, bool)>> {
        Ok(self.parents.get(txn, id)?.and_then(decode_link))
    }

    fn put_link(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        parent: &BlockId,
        closed: bool,
    ) -> Result<()> {
        let mut v = [0u8; 33];
        v[..32].copy_from_slice(parent);
        v[32] = if closed { CLOSED } else { OPEN };
        Ok(self.parents.put(txn, id, &v)?)
    }

    /// Drops a removed block's entry and pair, and unmarks its closed
    /// descendants: their ancestry is no longer whole. The pairs to its
    /// children stay, so a put that stores it again closes them again. A
    /// malformed entry is dropped too, and its descendants unmarked all the
    /// same (its mark cannot be read).
    fn unlink(&self, txn: &mut RwTxn<'_>, id: &BlockId) -> Result<()> {
        let link = match self.parents.get(txn, id)? {
            None => return Ok(()),
            Some(v) => decode_link(v),
        };
        self.parents.delete(txn, id)?;
        if let Some((parent, _)) = link {
            self.children.delete_one_duplicate(txn, &parent, id)?;
        }
        if link.is_none_or(|(_, closed)| closed) {
            self.set_closed_below(txn, id, false)?;
        }
        Ok(())
    }

    /// Marks the descendants of `top` closed or not, as `closed` says,
    /// descending only through children whose mark changes (when unmarking,
    /// also through malformed entries). By (2) nothing is lost: when
    /// unmarking, below a child that is not closed nothing is; when marking,
    /// `top` was not closed, so none of its children was. Stops after
    /// [`MARK_WALK_MAX`] rewrites: marking just stops (fewer blocks closed),
    /// unmarking stops trusting the marks.
    fn set_closed_below(&self, txn: &mut RwTxn<'_>, top: &BlockId, closed: bool) -> Result<()> {
        let mut stack = vec![*top];
        let mut rewrites = 0;
        while let Some(p) = stack.pop() {
            let mut kids = Vec::new();
            if let Some(iter) = self.children.get_duplicates(txn, &p)? {
                for item in iter {
                    if let Ok(kid) = <BlockId>::try_from(item?.1) {
                        kids.push(kid);
                    }
                }
            }
            for kid in kids {
                let change = match self.parents.get(txn, &kid)?.map(decode_link) {
                    None => false,
                    Some(Some((kp, c))) => kp == p && c != closed,
                    Some(None) => !closed,
                };
                if !change {
                    continue;
                }
                if rewrites == MARK_WALK_MAX {
                    return if closed {
                        Ok(())
                    } else {
                        self.distrust_chains(txn)
                    };
                }
                rewrites += 1;
                self.put_link(txn, &kid, &p, closed)?;
                stack.push(kid);
            }
        }
        Ok(())
    }

    /// [`Index::delete_block_if_at`], and the record is listed as damaged
    /// with `reason` (a miss from now on; the next put stores it again).
    pub fn quarantine_if_at(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        at: &Location,
        reason: &str,
    ) -> Result<bool> {
        let removed = self.delete_block_if_at(txn, id, at)?;
        if removed {
            self.put_damaged(txn, id, at, reason)?;
        }
        Ok(removed)
    }

    /// Points block `id` at its new copy `new` if it still names the record
    /// at `old` (compaction), keeping its last-use time; live counts move
    /// with it. Bumps the generation: cached locations are stale.
    pub fn move_block_if_at(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        old: &Location,
        new: &Location,
    ) -> Result<bool> {
        let Some(now) = self.get_block_rw(txn, id)?.filter(|l| l.same_record(old)) else {
            return Ok(false);
        };
        let new = Location {
            used_us: now.used_us,
            ..*new
        };
        self.blocks.put(txn, id, &new.encode())?;
        self.bump_generation(txn)?;
        self.add_live(txn, old.segment, -old.record_len.cast_signed(), -1)?;
        self.add_live(txn, new.segment, new.record_len.cast_signed(), 1)?;
        Ok(true)
    }

    /// Refreshes a block's last-use time (never moves it back). The record
    /// stays where it is, so cached locations stay valid: no generation bump.
    pub fn touch(&self, txn: &mut RwTxn<'_>, id: &BlockId, used_us: u64) -> Result<()> {
        if let Some(mut loc) = self.get_block_rw(txn, id)? {
            if used_us > loc.used_us {
                loc.used_us = used_us;
                self.blocks.put(txn, id, &loc.encode())?;
            }
        }
        Ok(())
    }


    /// Counts changes that remove or move block entries, or delete segment
    /// files; see `known.rs` for why readers rely on it.
    pub fn generation(&self, txn: &RoTxn<'_>) -> Result<u64> {
        self.meta_u64(txn, "generation")
    }

    /// Advances `generation`, and `chains_generation` with it while the two
    /// are equal (see "Prefix-closed chains").
    pub fn bump_generation(&self, txn: &mut RwTxn<'_>) -> Result<()> {
        let g = self.meta_u64(txn, "generation")?;
        if self.chains_trusted(txn)? {
            self.set_meta_u64(txn, "chains_generation", g + 1)?;
        }
        self.set_meta_u64(txn, "generation", g + 1)
    }

    pub fn block_count(&self, txn: &RoTxn<'_>) -> Result<u64> {
        Ok(self.blocks.len(txn)?)
    }

    /// Every block entry (for verify, compact, gc).
    pub fn all_blocks(&self, txn: &RoTxn<'_>) -> Result<Vec<(BlockId, Location)>> {
        let mut out = Vec::new();
        for item in self.blocks.iter(txn)? {
            let (k, v) = item?;
            if let (Ok(id), Some(loc)) = (<[u8; 32]>::try_from(k), Location::decode(v)) {
                out.push((id, loc));
            }
        }
        Ok(out)
    }

    // ---- damaged ----

    pub fn put_damaged(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        loc: &Location,
        reason: &str,
    ) -> Result<()> {
        let mut v = loc.encode().to_vec();
        v.extend_from_slice(reason.as_bytes());
        Ok(self.damaged.put(txn, id, &v)?)
    }

    pub fn all_damaged(&self, txn: &RoTxn<'_>) -> Result<Vec<(BlockId, Location, String)>> {
        let mut out = Vec::new();
        for item in self.damaged.iter(txn)? {
            let (k, v) = item?;
            if let (Ok(id), Some(loc)) = (<[u8; 32]>::try_from(k), Location::decode(v)) {
                let reason = String::from_utf8_lossy(&v[LOCATION_LEN..]).into_owned();
                out.push((id, loc, reason));
            }
        }
        Ok(out)
    }

    pub fn clear_damaged(&self, txn: &mut RwTxn<'_>, id: &BlockId) -> Result<()> {
        self.damaged.delete(txn, id)?;
        Ok(())
    }

    pub fn clear_damaged_in(&self, txn: &mut RwTxn<'_>, segment: u64) -> Result<()> {
        let ids: Vec<BlockId> = {
            let mut ids = Vec::new();
            for item in self.damaged.iter(txn)? {
                let (k, v) = item?;
                if let (Ok(id), Some(loc)) = (<[u8; 32]>::try_from(k), Location::decode(v)) {
                    if loc.segment == segment {
                        ids.push(id);
                    }
                }
            }
            ids
        };
        for id in ids {
            self.damaged.delete(txn, &id)?;
        }
        Ok(())
    }

    // ---- segments ----

    pub fn get_segment(&self, txn: &RwTxn<'_>, seg: u64) -> Result<Option<SegmentInfo>> {
        Ok(self
            .segments
            .get(txn, &seg.to_be_bytes())?
            .and_then(SegmentInfo::decode))
    }

    pub fn put_segment(&self, txn: &mut RwTxn<'_>, seg: u64, info: &SegmentInfo) -> Result<()> {
        Ok(self.segments.put(txn, &seg.to_be_bytes(), &info.encode())?)
    }

    pub fn delete_segment(&self, txn: &mut RwTxn<'_>, seg: u64) -> Result<()> {
        self.segments.delete(txn, &seg.to_be_bytes())?;
        Ok(())
    }

    pub fn all_segments(&self, txn: &RoTxn<'_>) -> Result<Vec<(u64, SegmentInfo)>> {
        let mut out = Vec::new();
        for item in self.segments.iter(txn)? {
            let (k, v) = item?;
            if let (Ok(k), Some(info)) = (<[u8; 8]>::try_from(k), SegmentInfo::decode(v)) {
                out.push((u64::from_be_bytes(k), info));
            }
        }
        Ok(out)
    }

    /// Sets how much of a segment file its committed entries cover,
    /// registering the segment if it is not yet.
    pub fn set_committed_len(&self, txn: &mut RwTxn<'_>, seg: u64, len: u64) -> Result<()> {
        let mut info = self.get_segment(txn, seg)?.unwrap_or_default();
        info.committed_len = len;
        self.put_segment(txn, seg, &info)
    }

    /// Adjusts a segment's live accounting; only the block mutations above
    /// call it, so the counts always follow the `blocks` table.
    fn add_live(&self, txn: &mut RwTxn<'_>, seg: u64, bytes: i64, records: i64) -> Result<()> {
        if let Some(mut info) = self.get_segment(txn, seg)? {
            info.live_bytes = info.live_bytes.saturating_add_signed(bytes);
            info.live_records = info.live_records.saturating_add_signed(records);
            self.put_segment(txn, seg, &info)?;
        }
        Ok(())
    }

    // ---- meta ----

    pub fn meta_u64(&self, txn: &RoTxn<'_>, name: &str) -> Result<u64> {
        Ok(self
            .meta
            .get(txn, name.as_bytes())?
            .and_then(|v| v.try_into().ok())
            .map_or(0, u64::from_le_bytes))
    }

    pub fn set_meta_u64(&self, txn: &mut RwTxn<'_>, name: &str, v: u64) -> Result<()> {
        Ok(self.meta.put(txn, name.as_bytes(), &v.to_le_bytes())?)
    }

    /// The `u64` meta values whose names start with `prefix`: (the rest of
    /// the name, value), in name order.
    pub fn meta_u64_prefixed(&self, txn: &RoTxn<'_>, prefix: &str) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for item in self.meta.prefix_iter(txn, prefix.as_bytes())? {
            let (k, v) = item?;
            let name = std::str::from_utf8(&k[prefix.len()..]);
            if let (Ok(name), Ok(v)) = (name, <[u8; 8]>::try_from(v)) {
                out.push((name.to_owned(), u64::from_le_bytes(v)));
            }
        }
        Ok(out)
    }

    // ---- pins ----

    pub fn put_pin(
        &self,
        txn: &mut RwTxn<'_>,
        id: &BlockId,
        priority: u64,
        expires_ms: u64,
    ) -> Result<()> {
        let mut v = [0u8; 16];
        v[..8].copy_from_slice(&priority.to_le_bytes());
        v[8..].copy_from_slice(&expires_ms.to_le_bytes());
        Ok(self.pins.put(txn, id, &v)?)
    }

    pub fn delete_pin(&self, txn: &mut RwTxn<'_>, id: &BlockId) -> Result<()> {
        self.pins.delete(txn, id)?;
        Ok(())
    }

    /// Whether block `id` is pinned and not expired at `now_ms`.
    pub fn is_pinned(&self, txn: &RoTxn<'_>, id: &BlockId, now_ms: u64) -> Result<bool> {
        Ok(self
            .pins
            .get(txn, id)?
            .is_some_and(|v| pin_live(v, now_ms)))
    }

    /// Blocks pinned and not expired at `now_ms`.
    pub fn live_pins(
        &self,
        txn: &RoTxn<'_>,
        now_ms: u64,
    ) -> Result<std::collections::HashSet<BlockId>> {
        let mut out = std::collections::HashSet::new();
        for item in self.pins.iter(txn)? {
            let (k, v) = item?;
            let Ok(id) = <[u8; 32]>::try_from(k) else {
                continue;
            };
            if pin_live(v, now_ms) {
                out.insert(id);
            }
        }
        Ok(out)
    }

    // ---- sessions ----

    fn session_key(tag: &[u8; 16], name: &str) -> Vec<u8> {
        let mut k = tag.to_vec();
        k.extend_from_slice(name.as_bytes());
        k
    }

    /// Binds `name` to `tokens` at `version` (0: none recorded, as a copy
    /// of the server's older format).
    pub fn put_session(
        &self,
        txn: &mut RwTxn<'_>,
        tag: &[u8; 16],
        name: &str,
        tokens: &[u32],
        version: u64,
    ) -> Result<()> {
        let key = Self::session_key(tag, name);
        let v: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.sessions.put(txn, &key, &v)?;
        self.set_session_version(txn, &key, version, true)
    }

    fn set_session_version(
        &self,
        txn: &mut RwTxn<'_>,
        key: &[u8],
        version: u64,
        live: bool,
    ) -> Result<()> {
        if version == 0 {
            self.session_versions.delete(txn, key)?;
            return Ok(());
        }
        let mut v = version.to_le_bytes().to_vec();
        v.push(u8::from(live));
        Ok(self.session_versions.put(txn, key, &v)?)
    }

    /// Session `name` here: its tokens (`None`: none, or deleted) and the
    /// version of its last save or delete here (0: none recorded).
    pub fn get_session_versioned(
        &self,
        txn: &RoTxn<'_>,
        tag: &[u8; 16],
        name: &str,
    ) -> Result<LocalSession> {
        let key = Self::session_key(tag, name);
        let tokens = self.sessions.get(txn, &key)?.map(|v| {
            v.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        });
        // A value of another length reads as none recorded (version 0).
        let version = self
            .session_versions
            .get(txn, &key)?
            .and_then(|v| v.get(..8)?.try_into().ok())
            .map_or(0, u64::from_le_bytes);
        Ok(LocalSession { version, tokens })
    }

    /// Removes session `name`; `tombstone`: the version of this delete, kept
    /// (as deleted) until [`Index::forget_tombstone`]; `None`: no version
    /// kept. Returns whether it was there.
    pub fn delete_session(
        &self,
        txn: &mut RwTxn<'_>,
        tag: &[u8; 16],
        name: &str,
        tombstone: Option<u64>,
    ) -> Result<bool> {
        let key = Self::session_key(tag, name);
        let found = self.sessions.delete(txn, &key)?;
        self.set_session_version(txn, &key, tombstone.unwrap_or(0), false)?;
        Ok(found)
    }

    /// Drops the tombstone of session `name` if it is still the one of
    /// `version` (no save or delete since); whether it did.
    pub fn forget_tombstone(
        &self,
        txn: &mut RwTxn<'_>,
        tag: &[u8; 16],
        name: &str,
        version: u64,
    ) -> Result<bool> {
        let key = Self::session_key(tag, name);
        let mut want = version.to_le_bytes().to_vec();
        want.push(0);
        if self.session_versions.get(txn, &key)? != Some(&want[..]) {
            return Ok(false);
        }
        Ok(self.session_versions.delete(txn, &key)?)
    }

    /// This tenant's tombstones: (name, version) of each delete not known
    /// to have reached the server.
    pub fn session_tombstones(&self, txn: &RoTxn<'_>, tag: &[u8; 16]) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for item in self.session_versions.prefix_iter(txn, tag)? {
            let (k, v) = item?;
            if let (Ok(name), Ok(v)) = (std::str::from_utf8(&k[16..]), <[u8; 9]>::try_from(v)) {
                if v[8] == 0 {
                    out.push((name.to_owned(), u64::from_le_bytes(v[..8].try_into().expect("8"))));
                }
            }
        }
        Ok(out)
    }

    /// The version of a save or delete now: later than the wall clock's
    /// `now_ns` and than every version this store wrote or took from the
    /// server (`session_clock`), which it becomes.
    pub fn next_session_version(&self, txn: &mut RwTxn<'_>, now_ns: u64) -> Result<u64> {
        let v = now_ns.max(self.meta_u64(txn, SESSION_CLOCK)?.saturating_add(1));
        self.set_meta_u64(txn, SESSION_CLOCK, v)?;
        Ok(v)
    }

    /// A version taken from the server: later saves and deletes here order
    /// after it, whatever the wall clock says.
    pub fn see_session_version(&self, txn: &mut RwTxn<'_>, version: u64) -> Result<()> {
        if version > self.meta_u64(txn, SESSION_CLOCK)? {
            self.set_meta_u64(txn, SESSION_CLOCK, version)?;
        }
        Ok(())
    }

    /// Session names of one tenant, and their token counts.
    pub fn sessions(&self, txn: &RoTxn<'_>, tag: &[u8; 16]) -> Result<Vec<(String, usize)>> {
        let mut out = Vec::new();
        for item in self.sessions.prefix_iter(txn, tag)? {
            let (k, v) = item?;
            out.push((String::from_utf8_lossy(&k[16..]).into_owned(), v.len() / 4));
        }
        Ok(out)
    }
}

/// The meta entry above every session version this store wrote or took.
const SESSION_CLOCK: &str = "session_clock";

/// A session as this store holds it ([`Index::get_session_versioned`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalSession {
    /// Of the last save or delete here; 0: none recorded.
    pub version: u64,
    /// `None`: no session by that name (deleted, if `version` is not 0).
    pub tokens: Option<Vec<u32>>,
}

/// Whether a pin's value (`put_pin`: priority, then expiry in ms, 0 for
/// none) holds at `now_ms`; a value of another length is no pin.
fn pin_live(v: &[u8], now_ms: u64) -> bool {
    <[u8; 16]>::try_from(v).is_ok_and(|v| {
        let expires = u64::from_le_bytes(v[8..].try_into().expect("8 bytes"));
        expires == 0 || expires > now_ms
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_versions_and_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Index::open(dir.path(), false, 1 << 24).unwrap();
        let (tag, other) = ([1u8; 16], [2u8; 16]);
        let get = |name: &str| {
            let txn = idx.read().unwrap();
            idx.get_session_versioned(&txn, &tag, name).unwrap()
        };
        let mut txn = idx.write().unwrap();
        // Versions follow the wall clock, and pass every version seen.
        assert_eq!(idx.next_session_version(&mut txn, 100).unwrap(), 100);
        assert_eq!(idx.next_session_version(&mut txn, 50).unwrap(), 101);
        idx.see_session_version(&mut txn, 1000).unwrap();
        idx.see_session_version(&mut txn, 900).unwrap();
        assert_eq!(idx.next_session_version(&mut txn, 200).unwrap(), 1001);
        // A session without a version entry (older stores) is at version 0.
        idx.put_session(&mut txn, &tag, "old", &[1, 2], 0).unwrap();
        idx.put_session(&mut txn, &tag, "a", &[3], 7).unwrap();
        idx.put_session(&mut txn, &other, "a", &[4], 8).unwrap();
        assert!(idx.delete_session(&mut txn, &tag, "a", Some(9)).unwrap());
        assert!(!idx.delete_session(&mut txn, &tag, "b", None).unwrap());
        idx.commit(txn, true).unwrap();
        let live = |version, t: &[u32]| LocalSession {
            version,
            tokens: Some(t.to_vec()),
        };
        assert_eq!(get("old"), live(0, &[1, 2]));
        assert_eq!(get("a"), LocalSession { version: 9, tokens: None });
        assert_eq!(get("b"), LocalSession::default());
        let txn = idx.read().unwrap();
        assert_eq!(idx.session_tombstones(&txn, &tag).unwrap(), [("a".into(), 9)]);
        assert!(idx.session_tombstones(&txn, &other).unwrap().is_empty());
        assert_eq!(idx.sessions(&txn, &tag).unwrap(), [("old".into(), 2)]);
        drop(txn);
        // Only the tombstone of that version goes: not one a later delete or
        // save replaced.
        let mut txn = idx.write().unwrap();
        assert!(!idx.forget_tombstone(&mut txn, &tag, "a", 8).unwrap());
        assert!(idx.forget_tombstone(&mut txn, &tag, "a", 9).unwrap());
        idx.put_session(&mut txn, &tag, "c", &[5], 11).unwrap();
        assert!(!idx.forget_tombstone(&mut txn, &tag, "c", 11).unwrap(), "live");
        idx.commit(txn, true).unwrap();
        assert_eq!(get("a"), LocalSession::default());
        assert_eq!(get("c"), live(11, &[5]));
        let txn = idx.read().unwrap();
        assert!(idx.session_tombstones(&txn, &tag).unwrap().is_empty());
    }
}
