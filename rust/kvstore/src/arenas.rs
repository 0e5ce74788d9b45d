//! Every arena on the machine, seen from outside: where arenas live, which
//! store each belongs to, which are orphans, pruning them, and an arena's
//! figures read from its file without mapping (or creating) it.
//!
//! An orphan is an arena whose header names a store (id and path) that is
//! gone (no MANIFEST at that path) or no longer owns it (the MANIFEST there
//! has another store id). Pruning removes an orphan only if no process maps
//! it; the protocol that makes this race-free against processes opening and
//! using arenas is in `arena.rs` ("Lifetime and pruning"). Pruning never
//! touches: an arena whose store exists and owns it (even if its header is
//! damaged), an arena whose header names no store (foreign, another arena
//! format, unfinished, a path too long to record), an arena any process maps
//! or holds the lifetime lock of, a symlink or another user's file.

use crate::arena::{
    read_header, same_file, ArenaStats, Geometry, HEADER_LEN, H_DATA_OFF, H_EVICTIONS, H_INSERTS,
    H_LAST_USE, H_MAGIC, H_NSLOTS, H_PAGE_KIND, H_PATH, H_PATH_LEN, H_READY, H_SLOT_HDR,
    H_SLOT_SIZE, H_STORE_ID, H_TOTAL, H_VERSION, H_WAYS, MAGIC_WORD, PATH_MAX, S_EXPIRES,
    S_PRIORITY, S_STATE, S_VERSION, VERSION,
};
use crate::dir::StoreDir;
use crate::os::{ofd_lock, OfdLock};
use crate::pages::PageKind;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// How many arena files opening a store inspects in its arena directory.
pub(crate) const OPEN_PRUNE_LIMIT: usize = 64;

/// One arena file, as `kvstore arenas` lists it (a report: each flag is a
/// column of the listing, not a state to model).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[allow(clippy::struct_excessive_bools)]
pub struct ArenaInfo {
    /// The arena file.
    pub path: String,
    /// `ok`, `damaged` (names its store, but its geometry is not an
    /// arena's) or `foreign` (names no store: not a kvstore arena, another
    /// arena format, unfinished, or another store's id in its file name).
    pub header: String,
    /// What is wrong with the header (empty when `ok`).
    pub reason: String,
    /// The store id the header names.
    pub store_id: Option<String>,
    /// The store directory the header names (where it was last opened).
    pub store_path: Option<String>,
    /// Whether a store (a MANIFEST) exists at `store_path`.
    pub store_exists: bool,
    /// Whether that store's id is `store_id` (it still owns the arena).
    pub owned: bool,
    /// Whether the arena is an orphan: its store is gone or no longer owns it.
    pub orphan: bool,
    /// File size in bytes (memory it holds).
    pub bytes: u64,
    /// `hugetlb`, `thp`, `normal` (as its creator got them), or `unknown`.
    pub page_kind: String,
    /// Last open or insert, ms since the epoch (the file's mtime if the
    /// header does not say).
    pub last_used_ms: u64,
    /// Live processes that map the file (from `/proc/*/maps`).
    pub mapped_by: u64,
    /// Whether this call removed it.
    pub pruned: bool,
}

/// What an arena's header says about it.
struct Inspected {
    header: &'static str,
    reason: String,
    store_id: Option<String>,
    store_path: Option<PathBuf>,
    page_kind: Option<PageKind>,
    last_used_ms: u64,
    geo: Option<Geometry>,
}

impl Inspected {
    fn foreign(reason: impl Into<String>) -> Inspected {
        Inspected {
            header: "foreign",
            reason: reason.into(),
            store_id: None,
            store_path: None,
            page_kind: None,
            last_used_ms: 0,
            geo: None,
        }
    }
}

/// The store id a file name `kvstore-<id>.arena` carries.
fn name_id(path: &Path) -> Option<&str> {
    path.file_name()?
        .to_str()?
        .strip_prefix("kvstore-")?
        .strip_suffix(".arena")
}

/// Reads and checks the header of the arena file `file` at `path`, `len`
/// bytes long. Nothing read is trusted: every word is checked.
fn inspect(file: &File, path: &Path, len: u64) -> Inspected {
    use std::os::unix::ffi::OsStrExt;
    if len < HEADER_LEN as u64 {
        return Inspected::foreign(format!("{len} bytes, shorter than an arena header"));
    }
    let Ok(head) = read_header(file, path) else {
        return Inspected::foreign("its header cannot be read");
    };
    if head(H_MAGIC) != MAGIC_WORD {
        return Inspected::foreign("not a kvstore arena (bad magic)");
    }
    if head(H_VERSION) != VERSION {
        return Inspected::foreign(format!(
            "arena format {}; this kvstore reads format {VERSION}",
            head(H_VERSION)
        ));
    }
    if head(H_READY) != 1 {
        return Inspected::foreign("never finished by its creator");
    }
    let mut id = [0u8; 32];
    let mut raw_path = vec![0u8; PATH_MAX];
    if file.read_exact_at(&mut id, H_STORE_ID as u64).is_err()
        || file.read_exact_at(&mut raw_path, H_PATH as u64).is_err()
    {
        return Inspected::foreign("its header cannot be read");
    }
    let Some(id) = std::str::from_utf8(&id)
        .ok()
        .filter(|s| s.bytes().all(|b| b.is_ascii_hexdigit()))
    else {
        return Inspected::foreign("its store id is not 32 hex digits");
    };
    if name_id(path) != Some(id) {
        return Inspected::foreign(format!(
            "its header names store {id}, its file name another"
        ));
    }
    let path_len = usize::try_from(head(H_PATH_LEN)).unwrap_or(usize::MAX);
    let store_path = (path_len <= PATH_MAX)
        .then(|| PathBuf::from(std::ffi::OsStr::from_bytes(&raw_path[..path_len])))
        .filter(|p| p.is_absolute());
    let mut out = Inspected {
        header: "ok",
        reason: String::new(),
        store_id: Some(id.to_string()),
        store_path,
        page_kind: PageKind::from_code(head(H_PAGE_KIND)),
        last_used_ms: head(H_LAST_USE),
        geo: None,
    };
    match check_geometry(&head, len) {
        Ok(geo) => out.geo = Some(geo),
        Err(reason) => {
            out.header = "damaged";
            out.reason = reason;
        }
    }
    if out.store_path.is_none() {
        out.reason = join(&out.reason, "its store path is not recorded (too long)");
    }
    out
}

fn join(a: &str, b: &str) -> String {
    if a.is_empty() {
        b.to_string()
    } else {
        format!("{a}; {b}")
    }
}

/// The geometry the header's words describe, if they are consistent with
/// each other and with the file's length (the layout is not known here).
fn check_geometry(head: &impl Fn(usize) -> u64, len: u64) -> Result<Geometry, String> {
    let word = |off: usize| usize::try_from(head(off)).unwrap_or(usize::MAX);
    let (nslots, ways, slot_hdr) = (word(H_NSLOTS), word(H_WAYS), word(H_SLOT_HDR));
    let (slot_size, data_off, total) = (word(H_SLOT_SIZE), word(H_DATA_OFF), word(H_TOTAL));
    let consistent = nslots > 0
        && ways > 0
        && nslots.is_multiple_of(ways)
        && slot_hdr.is_multiple_of(64)
        && slot_hdr > 0
        && slot_size.is_multiple_of(64)
        && slot_size > 0
        && Geometry::data_off_for(nslots, slot_hdr) == Some(data_off)
        && Geometry::total_for(nslots, slot_hdr, slot_size) == Some(total)
        && total as u64 == len;
    if !consistent {
        return Err(format!(
            "its geometry words (slots {nslots}, ways {ways}, slot header {slot_hdr}, slot \
             {slot_size}, data at {data_off}, total {total}) do not describe a {len}-byte arena"
        ));
    }
    Ok(Geometry {
        nslots,
        ways,
        slot_hdr,
        slot_size,
        data_off,
        total,
    })
}

/// Where a store's MANIFEST is, and whether it names `store_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoreState {
    /// The store exists and its id is the arena's.
    Owns,
    /// A store exists there with another id.
    Replaced,
    /// No MANIFEST there.
    Gone,
    /// Cannot tell (unreadable or damaged MANIFEST, no path): never an orphan.
    Unknown,
}

fn store_state(store_path: Option<&Path>, store_id: Option<&str>) -> StoreState {
    let (Some(p), Some(id)) = (store_path, store_id) else {
        return StoreState::Unknown;
    };
    match StoreDir::new(p).read_manifest() {
        Ok(Some(m)) if m.store_id == id => StoreState::Owns,
        Ok(Some(_)) => StoreState::Replaced,
        Ok(None) => StoreState::Gone,
        Err(crate::error::Error::Io { source, .. })
            if source.raw_os_error() == Some(rustix::io::Errno::NOTDIR.raw_os_error()) =>
        {
            StoreState::Gone
        }
        Err(_) => StoreState::Unknown,
    }
}

/// Every process's mappings of files, by (device, inode): how many live
/// processes map each, from `/proc/*/maps`. Processes we may not inspect
/// (another user's) are not counted: they cannot map our 0600 arenas.
fn mappers() -> HashMap<(u64, u64), u64> {
    let mut count = HashMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return count;
    };
    for p in procs.flatten() {
        let name = p.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(maps) = std::fs::read_to_string(p.path().join("maps")) else {
            continue;
        };
        let mut files: Vec<(u64, u64)> = maps.lines().filter_map(mapped_file).collect();
        files.sort_unstable();
        files.dedup();
        for f in files {
            *count.entry(f).or_insert(0) += 1;
        }
    }
    count
}

/// The (device, inode) of one `/proc/<pid>/maps` line, if it maps a file.
fn mapped_file(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_whitespace();
    let dev = f.nth(3)?;
    let ino: u64 = f.next()?.parse().ok()?;
    let (major, minor) = dev.split_once(':')?;
    let major = u32::from_str_radix(major, 16).ok()?;
    let minor = u32::from_str_radix(minor, 16).ok()?;
    (ino != 0).then(|| (rustix::fs::makedev(major, minor), ino))
}

/// Where stores look for arenas: `hot_dir`, `$KVSTORE_HOT_DIR`, every
/// hugetlbfs mount, `/dev/shm` (each once, in that order).
pub fn arena_dirs(hot_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = hot_dir.map(Path::to_path_buf).into_iter().collect();
    if let Some(d) = std::env::var_os("KVSTORE_HOT_DIR").filter(|d| !d.is_empty()) {
        dirs.push(PathBuf::from(d));
    }
    dirs.extend(crate::pages::hugetlbfs_mounts());
    dirs.push(PathBuf::from("/dev/shm"));
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let new = !seen.contains(d);
        seen.push(d.clone());
        new
    });
    dirs
}

/// The arena files (`kvstore-*.arena`) in `dir`, at most `limit`: where
/// there are more, a window of them that starts at a different place each
/// call. A directory lists in a stable order, and a fixed first `limit`
/// never reached the others (their orphans stayed in memory).
fn arena_files(dir: &Path, limit: usize) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let all: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| name_id(p).is_some())
        .collect();
    if all.len() <= limit {
        return all;
    }
    let start = crate::clock::now_us() as usize % all.len();
    all.iter()
        .cycle()
        .skip(start)
        .take(limit)
        .cloned()
        .collect()
}

/// Opens an arena file for inspection or pruning: never a symlink, never
/// another user's, only a regular file.
fn open_arena_file(path: &Path, write: bool) -> Result<(File, std::fs::Metadata), String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        // Non-blocking: opening a FIFO planted under the name must not hang.
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) {
                "a symlink".to_string()
            } else {
                format!("cannot open it: {e}")
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?;
    if !meta.file_type().is_file() {
        return Err("not a regular file".into());
    }
    if meta.uid() != rustix::process::geteuid().as_raw() {
        return Err(format!("owned by uid {}, not by this user", meta.uid()));
    }
    Ok((file, meta))
}

/// Describes one arena file; `mapped` from one `/proc` scan.
fn describe(path: &Path, mapped: &HashMap<(u64, u64), u64>) -> ArenaInfo {
    let mut info = ArenaInfo {
        path: path.display().to_string(),
        page_kind: "unknown".into(),
        ..ArenaInfo::default()
    };
    let (file, meta) = match open_arena_file(path, false) {
        Ok(x) => x,
        Err(reason) => {
            info.header = "foreign".into();
            info.reason = reason;
            return info;
        }
    };
    info.bytes = meta.len();
    info.mapped_by = mapped.get(&(meta.dev(), meta.ino())).copied().unwrap_or(0);
    let ins = inspect(&file, path, meta.len());
    let state = store_state(ins.store_path.as_deref(), ins.store_id.as_deref());
    info.header = ins.header.into();
    info.reason = ins.reason;
    info.store_id = ins.store_id;
    info.store_path = ins.store_path.map(|p| p.display().to_string());
    info.store_exists = matches!(
        state,
        StoreState::Owns | StoreState::Replaced | StoreState::Unknown
    ) && info.store_path.is_some();
    info.owned = state == StoreState::Owns;
    info.orphan = matches!(state, StoreState::Gone | StoreState::Replaced);
    info.page_kind = ins.page_kind.map_or("unknown", |k| k.name()).to_string();
    info.last_used_ms = if ins.last_used_ms > 0 {
        ins.last_used_ms
    } else {
        u64::try_from(meta.mtime()).unwrap_or(0) * 1000
    };
    info
}

/// Removes the arena at `path` if it is an orphan no process maps, under
/// the exclusive lifetime lock (see `arena.rs`). Every check is made again
/// under the lock. `mapped` is the pass's one `/proc` scan, made when the
/// first orphan needs it. True if removed.
fn prune_one(path: &Path, mapped: &mut Option<HashMap<(u64, u64), u64>>) -> bool {
    let Ok((file, meta)) = open_arena_file(path, true) else {
        return false;
    };
    // Held (shared) by every process that has the arena open: keep.
    if !ofd_lock(&file, OfdLock::ExclusiveTry).unwrap_or(false) || !same_file(&file, path) {
        return false;
    }
    let ins = inspect(&file, path, meta.len());
    let state = store_state(ins.store_path.as_deref(), ins.store_id.as_deref());
    if !matches!(state, StoreState::Gone | StoreState::Replaced) {
        return false;
    }
    // Mapped by a process that holds no lock (an older kvstore): keep.
    if mapped
        .get_or_insert_with(mappers)
        .get(&(meta.dev(), meta.ino()))
        .copied()
        .unwrap_or(0)
        > 0
    {
        return false;
    }
    // Still under the lock: an opener waiting for it finds the path gone.
    std::fs::remove_file(path).is_ok()
}

/// Lists every arena in `dirs` (see `arena_dirs`); with `prune`, removes
/// the orphans no process maps and marks them `pruned`.
pub fn list_arenas(dirs: &[PathBuf], prune: bool) -> Vec<ArenaInfo> {
    let mut mapped = Some(mappers());
    let mut out = Vec::new();
    for dir in dirs {
        for path in arena_files(dir, usize::MAX) {
            let mut info = describe(&path, mapped.as_ref().expect("scanned"));
            if prune && info.orphan && info.mapped_by == 0 {
                info.pruned = prune_one(&path, &mut mapped);
            }
            out.push(info);
        }
    }
    out
}

/// Prunes orphans in `dir` (as a store opening its arena there does),
/// looking at `limit` arena files at most and never at `skip`. Cheap when
/// nothing is orphaned: a directory listing, and per arena an open, a lock
/// attempt, a 4 KiB read and a MANIFEST read; `/proc` is scanned only for
/// an orphan. Returns the paths removed.
pub(crate) fn prune_dir(dir: &Path, skip: &Path, limit: usize) -> Vec<PathBuf> {
    let mut mapped = None;
    arena_files(dir, limit)
        .into_iter()
        .filter(|p| p != skip && prune_one(p, &mut mapped))
        .collect()
}

/// The figures of the arena of store `store_id` in `dirs`, read from its
/// file without mapping or creating it; `None` if there is none (or it
/// cannot be read as an arena).
pub fn peek_arena(dirs: &[PathBuf], store_id: &str, now_ms: u64) -> Option<ArenaStats> {
    dirs.iter()
        .map(|d| d.join(format!("kvstore-{store_id}.arena")))
        .find_map(|p| peek(&p, now_ms))
}

fn peek(path: &Path, now_ms: u64) -> Option<ArenaStats> {
    let (file, meta) = open_arena_file(path, false).ok()?;
    let ins = inspect(&file, path, meta.len());
    let geo = ins.geo?;
    let head = read_header(&file, path).ok()?;
    let word = |h: &[u8], off: usize| u64::from_le_bytes(h[off..off + 8].try_into().expect("8"));
    let (mut used, mut pinned, mut torn) = (0, 0, 0);
    // Slot headers in bounded reads (about 1 MiB): the geometry comes from
    // the file, and an arena may be gigabytes.
    let per_read = (1usize << 20).div_ceil(geo.slot_hdr).max(1);
    let mut buf = Vec::new();
    for first in (0..geo.nslots).step_by(per_read) {
        let n = per_read.min(geo.nslots - first);
        buf.resize(n.checked_mul(geo.slot_hdr)?, 0);
        let at = HEADER_LEN.checked_add(first.checked_mul(geo.slot_hdr)?)?;
        file.read_exact_at(&mut buf, at as u64).ok()?;
        for h in buf.chunks_exact(geo.slot_hdr) {
            if word(h, S_VERSION) & 1 == 1 {
                torn += 1;
            } else if word(h, S_STATE) == 1 {
                used += 1;
                let (p, e) = (word(h, S_PRIORITY), word(h, S_EXPIRES));
                if p > 0 && (e == 0 || e > now_ms) {
                    pinned += 1;
                }
            }
        }
    }
    Some(ArenaStats {
        path: path.display().to_string(),
        bytes: geo.total as u64,
        slots: geo.nslots as u64,
        slots_used: used,
        slots_pinned: pinned,
        evictions: head(H_EVICTIONS),
        inserts: head(H_INSERTS),
        slots_torn: torn,
        page_kind: ins.page_kind.map_or("unknown", |k| k.name()).to_string(),
        mapped: false,
        lock_timeouts: 0,
        fills_skipped: 0,
    })
}

/// Removes one arena file named `kvstore-<id>.arena` (`kvstore
/// remove-arena` given the file): never a symlink or another user's file.
/// Processes that map it keep their mapping. False if there was none.
pub fn remove_arena_file(path: &Path) -> crate::error::Result<bool> {
    if name_id(path).is_none() {
        return Err(crate::error::Error::InvalidInput(format!(
            "{}: expected an arena file named kvstore-<store id>.arena",
            path.display()
        )));
    }
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(false);
    }
    if let Err(reason) = open_arena_file(path, false) {
        return Err(crate::error::Error::InvalidInput(format!(
            "{}: not removed: {reason}",
            path.display()
        )));
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(crate::error::Error::from_io(
            format!("removing {}", path.display()),
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_give_device_and_inode() {
        let line =
            "7f2c00000000-7f2c00200000 rw-s 00000000 00:1a 123456   /dev/shm/kvstore-ab.arena";
        assert_eq!(
            mapped_file(line),
            Some((rustix::fs::makedev(0, 0x1a), 123_456))
        );
        assert_eq!(
            mapped_file("7f2c0000-7f2c1000 r--p 00000000 00:00 0 "),
            None
        );
        assert_eq!(mapped_file("garbage"), None);
    }
}
