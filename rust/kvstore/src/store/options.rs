//! How a store is opened: durability mode, bounds, compression, hot tier.

use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::layout::Layout;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Parses `"sync"`, `"batch"` or `"none"`.
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
    /// The mode's name, as `parse` takes it.
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
    /// Layout of a new store, or the one expected of an existing store (`None`: as its
    /// MANIFEST says).
    pub layout: Option<Layout>,
    /// Tenant secret: handles with different salts never see each other's blocks or sessions.
    pub salt: Option<Vec<u8>>,
    /// When a put is durable.
    pub durability: Durability,
    /// Bound on segment bytes on disk; `None` for unbounded.
    pub disk_bytes: Option<u64>,
    /// How payloads are stored (raw, zstd, or the exponent plane coded).
    pub codec: Codec,
    /// A segment file is sealed and a new one started past this size.
    pub segment_bytes: u64,
    /// With `Batch`: how long a put may wait for its group commit.
    pub batch_window: Duration,
    /// With `Batch`: pending bytes that commit at once, without waiting for the window.
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
    /// A Redis/Valkey server or cluster behind the local store (`None`: none).
    pub remote: Option<crate::remote::RemoteOptions>,
    /// Reader threads one get splits its blocks among (and the threads of a
    /// paged get's or put's copies), the calling one included (never more
    /// than the blocks); `None`: one per core, at most 4, each with 1 MiB or
    /// more to read, or `KVSTORE_GET_READERS`. For tests and tuning.
    pub get_readers: Option<usize>,
    /// Read payloads the page cache does not hold with `O_DIRECT` where the
    /// file system allows it (version-2 segments): `Some(on)` for every read,
    /// `None` (the default, unless the environment variable
    /// `KVSTORE_DIRECT_READS` is `1` or `0`) for the reads that promote what
    /// they read into a hot tier (gets, restores, pins) when the handle has
    /// one. That tier, shared by every process of the store, keeps those
    /// blocks warm; the page cache would hold a second copy, and filling it
    /// made cold restores slower (a direct one took 0.35-1.04x the time,
    /// benches/README.md, "Cold restores into a hot tier"). Reads that
    /// promote nothing (a serving engine's paged loads, `verify`,
    /// compaction), and every read of a handle without a hot tier, go
    /// through the page cache, the only cache they warm. A hot tier much
    /// smaller than the blocks read again keeps fewer of them than the page
    /// cache would: there, `Some(false)`.
    pub direct_reads: Option<bool>,
    /// With direct reads: reads a get's reader thread keeps in flight
    /// (`io_uring`), each a record read whole into a buffer of the ring;
    /// 0: one synchronous read at a time. Default: 2, or
    /// `KVSTORE_READ_DEPTH`. For tests and tuning.
    pub read_depth: usize,
}

impl Options {
    /// The size past which a segment rolls: `segment_bytes`, and under a
    /// `disk_bytes` bound at most a sixteenth of it. Compaction copies a
    /// segment's live records before it deletes the segment, so a put keeps
    /// about that much of the bound free (`Inner::ensure_disk_room`): small
    /// segments keep that reserve small. A segment holds one record at
    /// least, whatever this says.
    pub(crate) fn segment_limit(&self) -> u64 {
        match self.disk_bytes {
            Some(limit) => self.segment_bytes.min(limit / 16),
            None => self.segment_bytes,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            fingerprint: None,
            layout: None,
            salt: None,
            durability: Durability::Batch,
            disk_bytes: None,
            codec: Codec::Raw,
            segment_bytes: 1 << 30,
            batch_window: Duration::from_millis(20),
            batch_bytes: 256 << 20,
            create: true,
            hot_bytes: None,
            hot_dir: None,
            index_bytes: crate::index::DEFAULT_MAP_SIZE,
            remote: None,
            get_readers: std::env::var("KVSTORE_GET_READERS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n| n > 0),
            direct_reads: match std::env::var("KVSTORE_DIRECT_READS").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            },
            read_depth: std::env::var("KVSTORE_READ_DEPTH")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(2),
        }
    }
}

impl Options {
    /// Refuses values no store can work with, before anything is touched.
    pub(crate) fn check(&self) -> Result<()> {
        if let Codec::Zstd(level) = self.codec {
            if !(1..=22).contains(&level) {
                return Err(Error::InvalidInput(format!(
                    "compression level: expected 1 to 22, got {level}"
                )));
            }
        }
        if self.segment_bytes < 1 << 20 {
            return Err(Error::InvalidInput(format!(
                "segment_bytes: expected at least 1 MiB, got {}",
                self.segment_bytes
            )));
        }
        if self.index_bytes < 2 * crate::index::INDEX_RESERVE {
            // At least as much for entries as is kept back for gc.
            return Err(Error::InvalidInput(format!(
                "index_bytes: expected at least 2 MiB, got {}",
                self.index_bytes
            )));
        }
        if self.get_readers == Some(0) {
            return Err(Error::InvalidInput(
                "get_readers: expected at least 1, got 0".into(),
            ));
        }
        Ok(())
    }
}
