//! The stored prefix of a long chain. Block ids are a hash chain (each id
//! keys the next), so hashing is serial and, at ~170 ns a block, as slow as
//! an index probe. For long chains the two overlap: a helper thread hashes
//! while this thread probes the ids already hashed, a chunk at a time, in
//! key order (neighbouring keys share B-tree pages: a third cheaper than
//! probing in chain order). The walk stays exact: each chunk's results are
//! read back in chain order, and the first block found nowhere ends it.

use super::read::Snap;
use super::Inner;
use crate::error::Result;
use crate::id::{BlockId, ROOT};
use crate::index::Location;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

/// Chains of at least this many blocks are walked in parallel (below, a
/// thread's start costs more than it saves).
pub(super) const PARALLEL_MIN_BLOCKS: usize = 512;

/// Blocks hashed, then probed, per step: small enough that the last step's
/// probes (after hashing ends) stay short, large enough to sort usefully.
const CHUNK: usize = 512;

impl Inner {
    /// Walks the chain of `tokens` while it is stored (hot tier, location
    /// cache, or the index as `snap` sees it). Returns the snapshot, the ids
    /// hashed, in chain order, and how many leading blocks are stored: the
    /// ids run at least one past that count unless every block is stored.
    ///
    /// This thread hashes and a helper probes: if the machine has no core
    /// to spare, the helper runs when this thread waits for it at the end,
    /// and the walk costs what a serial one does.
    pub(super) fn walk_stored<'s>(
        &'s self,
        snap: Snap<'s>,
        tokens: &[u32],
        extra: &[u8],
    ) -> Result<(Snap<'s>, Vec<BlockId>, usize)> {
        let b = self.layout.block_size as usize;
        let blocks = tokens.len() / b;
        let missed = AtomicBool::new(false);
        // Never full: at most one message per chunk.
        let (tx, rx) = mpsc::sync_channel::<Vec<BlockId>>(blocks.div_ceil(CHUNK));
        let mut ids = Vec::with_capacity(blocks);
        let (snap, stored) = std::thread::scope(|s| {
            let missed = &missed;
            let prober = s.spawn(move || {
                let mut stored = 0;
                let mut scratch = Probe::default();
                while let Ok(chunk) = rx.recv() {
                    let n = match self.stored_run(&snap, &chunk, &mut scratch) {
                        Ok(n) => n,
                        Err(e) => return (snap, Err(e)),
                    };
                    stored += n;
                    if n < chunk.len() {
                        missed.store(true, Ordering::Relaxed);
                        break;
                    }
                }
                (snap, Ok(stored))
            });
            let mut parent = ROOT;
            for piece in tokens[..blocks * b].chunks(CHUNK * b) {
                if missed.load(Ordering::Relaxed) {
                    break;
                }
                let chunk = self.keyer.chain_from(&parent, piece, b, extra);
                parent = *chunk.last().expect("a piece holds a block");
                ids.extend_from_slice(&chunk);
                if tx.send(chunk).is_err() {
                    break;
                }
            }
            drop(tx);
            prober.join().expect("lookup prober panicked")
        });
        Ok((snap, ids, stored?))
    }

    /// How many leading ids of `chunk` are stored; probes the index in key
    /// order and remembers what it found in the location cache.
    fn stored_run(&self, snap: &Snap<'_>, chunk: &[BlockId], p: &mut Probe) -> Result<usize> {
        p.locs.clear();
        p.locs.resize(chunk.len(), None);
        self.known.get_many(chunk, &mut p.locs);
        p.order.clear();
        p.order.extend((0..chunk.len() as u32).filter(|&i| {
            p.locs[i as usize].is_none()
                && !self
                    .arena
                    .as_ref()
                    .is_some_and(|a| a.contains(&chunk[i as usize]))
        }));
        p.order.sort_unstable_by_key(|&i| {
            u64::from_be_bytes(chunk[i as usize][..8].try_into().expect("8 bytes"))
        });
        p.found.clear();
        let mut hit = vec![true; chunk.len()];
        for &i in &p.order {
            let id = &chunk[i as usize];
            match self.index.get_block(&snap.txn, id)? {
                Some(loc) => p.found.push((*id, loc)),
                None => hit[i as usize] = false,
            }
        }
        self.known.insert_many(snap.generation, &p.found);
        Ok(hit.iter().position(|h| !h).unwrap_or(chunk.len()))
    }
}

/// Scratch of `stored_run`, kept across chunks.
#[derive(Default)]
struct Probe {
    locs: Vec<Option<Location>>,
    order: Vec<u32>,
    found: Vec<(BlockId, Location)>,
}
