//! kvstore engine: a persistent, content-addressed store for transformer KV
//! cache blocks.
//!
//! A block is the KV of `block_size` consecutive tokens for every layer
//! (`[L, 2, B, H, D]`). Its id is a keyed BLAKE3 chain over the token ids
//! (`id`), so equal prefixes share blocks and different models, layouts or
//! tenants never do. Blocks are appended to checksummed segment files
//! (`format`, `record`) and indexed in LMDB (`index`); [`Store`] ties it
//! together. This crate knows nothing of Python: `kvstore-py` binds it.
//!
//! The modules follow the data flow, from the caller down to the disk:
//!
//! ```text
//! Store (store/)  put ─▶ writer ─▶ record ─▶ fs ─▶ segment files
//!                 read ◀─ record ◀─ fs       index (LMDB)   arena (shared memory)
//! ```
//!
//! Only the types of the public API are exported below. The decoders, the
//! index and the scanner are reachable by the crate's own tests and fuzz
//! targets through the hidden `__internal_whitebox` feature, never by users.

#![warn(missing_docs)]

/// Declares modules that are private, except with the `__internal_whitebox`
/// feature (tests and fuzz targets), where they are public and hidden.
macro_rules! internal_mods {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "__internal_whitebox")]
        #[doc(hidden)]
        #[allow(missing_docs)]
        pub mod $name;
        #[cfg(not(feature = "__internal_whitebox"))]
        mod $name;
    )*};
}

internal_mods!(codec, format, index, record, scan);

mod arena;
mod arenas;
mod checkpoint;
mod clock;
mod crc;
mod dir;
mod error;
#[cfg(feature = "fault-injection")]
#[allow(missing_docs)]
pub mod fault;
#[cfg(not(feature = "fault-injection"))]
mod fault;
mod fingerprint;
mod fs;
mod id;
mod known;
mod layout;
mod lockwait;
mod os;
mod paged;
mod pages;
mod progress;
mod readq;
mod remote;
mod repair;
mod segfile;
mod store;

pub use arena::ArenaStats;
pub use arenas::{arena_dirs, list_arenas, peek_arena, remove_arena_file, ArenaInfo};
pub use checkpoint::blake3_file;
pub use codec::Codec;
pub use error::{Error, Result};
pub use format::{Manifest, FORMAT_VERSION};
pub use id::{hex as block_id_hex, BlockId, Keyer};
pub use index::DEFAULT_MAP_SIZE as DEFAULT_INDEX_BYTES;
pub use layout::{DType, Kind, Layout, Storage};
pub use paged::{PagedLayout, PagedPart};
pub use pages::PageKind;
pub use progress::Progress;
pub use remote::{NodeReport, PushReport, RemoteOptions, RemoteStats, WriteMode};
pub use repair::{rebuild_index, RebuildReport};
pub use scan::DamagedRange;

pub use store::{
    CompactReport, Damage, Durability, GcReport, Options, SegmentReport, Stats, Store, VerifyReport,
};
