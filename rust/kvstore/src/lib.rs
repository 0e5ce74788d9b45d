//! kvstore engine: a persistent, content-addressed store for transformer KV
//! cache blocks.
//!
//! A block is the KV of `block_size` consecutive tokens for every layer
//! (`[L, 2, B, H, D]`). Its id is a keyed BLAKE3 chain over the token ids
//! ([`id`]), so equal prefixes share blocks and different models, layouts or
//! tenants never do. Blocks are appended to checksummed segment files
//! ([`format`]) and indexed in LMDB ([`index`]); [`store::Store`] ties it
//! together. This crate knows nothing of Python: `kvstore-py` binds it.

pub mod arena;
pub mod error;
pub mod fault;
pub mod format;
pub mod id;
pub mod index;
mod io;
mod known;
pub mod layout;
mod os;
pub mod repair;
pub mod scan;
pub mod store;

pub use error::{Error, Result};
pub use id::{BlockId, Keyer};
pub use layout::{DType, Layout};
pub use store::{
    CompactReport, Damage, Durability, GcReport, Options, SegmentReport, Stats, Store, VerifyReport,
};
