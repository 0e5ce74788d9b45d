//! The one error type of the engine. The Python binding maps each variant to
//! one exception class (`kvstore.errors`), so every variant here is a promise
//! to users: add variants with care.

use std::path::PathBuf;

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the engine can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store exists but was created for another model fingerprint or layout.
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),

    /// The caller passed something unusable (shape, dtype, token range, option).
    /// Raised before anything is written.
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// A configured capacity (`disk_bytes`, the index map) would be exceeded.
    #[error("store full: {0}")]
    StoreFull(String),

    /// The handle was closed, or is used in a process forked after it was opened.
    #[error("store closed: {0}")]
    StoreClosed(String),

    /// Another process holds a lock this operation needs.
    #[error("store locked: {0}")]
    StoreLocked(String),

    /// The store's own metadata (MANIFEST, index) is damaged or not a kvstore.
    /// Never raised for a damaged block: that is a miss.
    #[error("corrupt store at {path}: {reason}")]
    CorruptStore {
        /// The damaged file or directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A session name that does not exist.
    #[error("no session named {0:?}")]
    SessionNotFound(String),

    /// An fdatasync failed earlier on this handle. The kernel may have dropped
    /// the dirty pages, so retrying and trusting a later success would lie
    /// about durability: every later write on this handle fails.
    #[error("writes disabled after a failed fdatasync ({0}); reopen the store")]
    Poisoned(String),

    /// An operating-system I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        #[source]
        /// The operating system's error.
        source: std::io::Error,
    },

    /// The remote tier could not be opened: no node reachable, authentication,
    /// permission or TLS failure. Names the node and the user, never the
    /// password. After open, remote failures are misses, never this.
    #[error("{0}")]
    Remote(String),

    /// An LMDB error not covered by a more specific variant.
    #[error("index: {0}")]
    Index(String),
}

impl Error {
    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::CorruptStore {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// Attach context to an `io::Error`.
pub(crate) trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::from_io(context(), source))
    }
}

impl Error {
    /// An I/O error with what was being done; a full device or quota is
    /// `StoreFull`, so callers can free space and retry.
    pub(crate) fn from_io(context: String, source: std::io::Error) -> Self {
        let full = [rustix::io::Errno::NOSPC, rustix::io::Errno::DQUOT]
            .iter()
            .any(|e| source.raw_os_error() == Some(e.raw_os_error()));
        if full {
            return Error::StoreFull(format!("{context}: {source}"));
        }
        Error::Io { context, source }
    }
}

impl From<heed::Error> for Error {
    fn from(e: heed::Error) -> Self {
        match e {
            heed::Error::Mdb(heed::MdbError::MapFull) => {
                Error::StoreFull("the index map is full (LMDB MDB_MAP_FULL)".into())
            }
            heed::Error::Mdb(
                e @ (heed::MdbError::Corrupted
                | heed::MdbError::PageNotFound
                | heed::MdbError::Invalid
                | heed::MdbError::BadValSize
                | heed::MdbError::Incompatible),
            ) => Error::corrupt("index", format!("LMDB reports damage: {e}")),
            heed::Error::Io(source) => Error::from_io("index".into(), source),
            heed::Error::Mdb(heed::MdbError::Other(code))
                if code == rustix::io::Errno::NOSPC.raw_os_error() =>
            {
                Error::StoreFull("index: no space left on the device".into())
            }
            other => Error::Index(other.to_string()),
        }
    }
}
