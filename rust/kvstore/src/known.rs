//! A per-handle cache of block locations read from the index, so a lookup of
//! a long, already-seen prefix costs a hash-map probe per block instead of a
//! B-tree descent.
//!
//! Validity rests on the index's `generation` counter: every change that
//! removes or moves a block entry bumps it (`Index::delete_block_if_at`,
//! `Index::move_block_if_at`), and between bumps entries are only ever added. So
//! locations read at generation G stay true until the index reaches G + 1,
//! when the cache is cleared. An entry is inserted only if it was read at the
//! cache's own generation. Even a stale entry could never yield wrong KV:
//! every read re-checks the record's id, tokens and checksums.

use crate::id::BlockId;
use crate::index::Location;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;

/// At most this many entries (~10 MiB); the cache is cleared when full.
const CAPACITY: usize = 1 << 17;

/// Block ids are already uniform hashes: use their bytes, skip `SipHash`.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut word = [0u8; 8];
        let n = bytes.len().min(8);
        word[..n].copy_from_slice(&bytes[..n]);
        self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
    }
}

#[derive(Default)]
struct Inner {
    generation: u64,
    map: HashMap<BlockId, Location, BuildHasherDefault<IdHasher>>,
}

#[derive(Default)]
pub(crate) struct Known {
    inner: RwLock<Inner>,
}

impl Known {
    /// Moves the cache to `generation` if the index is past it; returns true
    /// when it did (everything cached before is dropped).
    pub fn advance(&self, generation: u64) -> bool {
        if self.inner.read().expect("known lock").generation >= generation {
            return false;
        }
        let mut w = self.inner.write().expect("known lock");
        if w.generation >= generation {
            return false;
        }
        w.map.clear();
        w.generation = generation;
        true
    }

    pub fn get(&self, id: &BlockId) -> Option<Location> {
        self.inner.read().expect("known lock").map.get(id).copied()
    }

    /// `get` of many ids under one lock: `out[i]` for `ids[i]`.
    pub fn get_many(&self, ids: &[BlockId], out: &mut [Option<Location>]) {
        let r = self.inner.read().expect("known lock");
        for (o, id) in out.iter_mut().zip(ids) {
            *o = r.map.get(id).copied();
        }
    }

    /// Remembers a location read from an index snapshot at `generation`.
    pub fn insert(&self, generation: u64, id: &BlockId, loc: Location) {
        self.insert_many(generation, &[(*id, loc)]);
    }

    /// `insert` of many locations under one lock.
    pub fn insert_many(&self, generation: u64, entries: &[(BlockId, Location)]) {
        let mut w = self.inner.write().expect("known lock");
        if w.generation != generation {
            return;
        }
        if w.map.len() + entries.len() > CAPACITY {
            w.map.clear();
        }
        w.map.extend(entries.iter().copied());
    }

    pub fn forget(&self, id: &BlockId) {
        self.inner.write().expect("known lock").map.remove(id);
    }
}
