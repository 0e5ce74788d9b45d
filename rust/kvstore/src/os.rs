//! The engine's only `unsafe` code: calls whose soundness rests on a promise
//! the type system cannot check.

#![allow(unsafe_code)]

use heed::{Env, EnvFlags, EnvOpenOptions, WithoutTls};
use std::path::Path;

/// Opens the LMDB environment of a store's `index/` directory.
///
/// `heed` marks this unsafe because LMDB maps the data file: modifying it
/// outside LMDB while mapped is undefined behaviour.
pub(crate) fn open_lmdb(
    path: &Path,
    map_size: usize,
    nosync: bool,
) -> heed::Result<Env<WithoutTls>> {
    let mut opts = EnvOpenOptions::new().read_txn_without_tls();
    opts.map_size(map_size).max_dbs(8).max_readers(1022);
    let flags = if nosync {
        EnvFlags::NO_SYNC
    } else {
        EnvFlags::empty()
    };
    // SAFETY: the index directory belongs to the store and is only ever
    // written through LMDB (ours or another LMDB client honouring its lock
    // file). `Index::open` keeps one Env per path per process, so the same
    // environment is never opened twice in a process, which LMDB forbids.
    unsafe {
        opts.flags(flags);
        opts.open(path)
    }
}
