//! Gets and puts straight between the store and a serving engine's paged KV
//! cache (`crate::paged`): a hot-tier block goes from its slot into the
//! engine's cache in one pass, four runs at a time, each checksummed as it
//! is copied (`Arena::read_runs`, `PagedLayout::land`); a block from disk is
//! read and checked in a one-block scratch
//! (in the CPU's cache too), then permuted, and not promoted into the hot
//! tier (`Inner::read_block`), unless the hot tier held it in a slot that
//! failed its check: that slot is rewritten. A put gathers a few blocks at a
//! time. One pass over main memory each way instead of a canonical staging
//! copy of the whole request, over several threads where the request is
//! large enough, each writing only its own cache blocks.

use super::put::check_start;
use super::readers::{in_ranges, range_bounds, reader_threads};
use super::{Inner, Snap};
use crate::arena::LANES;
use crate::error::{Error, Result};
use crate::id::BlockId;
use crate::paged::PagedLayout;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of canonical KV a paged put gathers before handing it to `put_from`
/// (and a paged get fetches from the remote tier at once): bounded memory,
/// and few enough calls that a synced put does not commit per block.
const GROUP_BYTES: usize = 4 << 20;

impl Inner {
    /// `get_from` into cache blocks `blocks` of `layers` (one span per layer,
    /// laid out as `paged` says): block `start / B + k` of `tokens` lands in
    /// cache block `blocks[k]`. Returns the stored prefix in tokens, counted
    /// from 0, at most `start + blocks.len() * B`.
    pub(super) fn get_paged(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        paged: &PagedLayout,
        layers: &mut [&mut [u8]],
        blocks: &[usize],
    ) -> Result<usize> {
        let b = self.layout.block_size as usize;
        check_start(start, b, tokens.len())?;
        let spans: Vec<usize> = layers.iter().map(|l| l.len()).collect();
        paged.check(&self.layout, &spans, blocks)?;
        let first = start / b;
        let usable = (tokens.len() / b).min(first + blocks.len());
        let ids = self.keyer.chain(&tokens[..usable * b], b, extra);
        let bb = self.layout.block_bytes();
        // One snapshot per call, so the cache notices a newer generation.
        let mut snap = Some(self.snapshot()?);
        let mut served = self.held_prefix(&mut snap, &ids[..first])?;
        if served < first && self.remote.is_some() {
            // As in `get_from`: the server may fill the prefix before
            // `start`, and then the blocks from `start` are read here first.
            drop(snap);
            served += self.remote_extend(&ids[..first], tokens, served, None);
            snap = Some(self.snapshot()?);
        }
        if served == first && first < usable {
            let (ids, tokens) = (&ids[first..], &tokens[first * b..usable * b]);
            served += self.read_paged(&mut snap, ids, tokens, paged, layers, blocks)?;
        }
        drop(snap);
        if served >= first && served < ids.len() && self.remote.is_some() {
            // The remote tier lands whole groups in canonical order: through
            // a bounded buffer, then permuted like a local block.
            let group = (GROUP_BYTES / bb).max(1);
            let mut buf = vec![0u8; group.min(ids.len() - served) * bb];
            while served < ids.len() {
                let n = group.min(ids.len() - served);
                let kv = &mut buf[..n * bb];
                let got = self.remote_extend(
                    &ids[..served + n],
                    tokens,
                    served,
                    Some((kv, n * b, served)),
                );
                for k in 0..got {
                    let runs = self.layout.block_runs(kv, n * b, k);
                    paged.scatter(&self.layout, &runs, layers, blocks[served + k - first]);
                }
                served += got;
                if got < n {
                    break;
                }
            }
        }
        self.count_hits(served, tokens.len() / b);
        self.touch(&ids[..served]);
        Ok(served * b)
    }

    /// Reads blocks `ids` (of `tokens`, the ones after the held prefix) into
    /// cache blocks `blocks` (in order) of `layers`: how many were served
    /// before the first that was not, as a one-thread walk would say. Over
    /// several threads, each with a consecutive range of the blocks, its own
    /// scratch and snapshot (the first range: `snap`), writing only its own
    /// cache blocks' bytes (`PagedLayout::block_spans`); on one thread where
    /// those cannot be cut apart.
    fn read_paged<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        ids: &[BlockId],
        tokens: &[u32],
        paged: &PagedLayout,
        layers: &mut [&mut [u8]],
        blocks: &[usize],
    ) -> Result<usize> {
        let (n, lay) = (ids.len(), &self.layout);
        let threads = reader_threads(n, lay.block_bytes(), self.opts.get_readers, false);
        let stop = AtomicUsize::new(n);
        let spans = if threads > 1 {
            paged.block_spans(lay, layers, &blocks[..n])
        } else {
            None
        };
        let Some(mut spans) = spans else {
            let with_block = |k: usize, f: &mut dyn FnMut(&mut [&mut [u8]], usize)| {
                f(layers, blocks[k]);
            };
            return self.read_paged_range(snap, ids, tokens, paged, 0, n, &stop, with_block);
        };
        let bounds = range_bounds(n, threads);
        let mut parts = Vec::new();
        let mut rest = &mut spans[..];
        for w in bounds.windows(2) {
            let (part, tail) = rest.split_at_mut(w[1] - w[0]);
            parts.push((w[0], w[1], part));
            rest = tail;
        }
        let range = |snap: &mut Option<Snap<'s>>,
                     (at, end, part): (usize, usize, &mut [Vec<&mut [u8]>])| {
            let with_block = |k: usize, f: &mut dyn FnMut(&mut [&mut [u8]], usize)| {
                f(&mut part[k - at], 0);
            };
            self.read_paged_range(snap, ids, tokens, paged, at, end, &stop, with_block)
        };
        let parts = parts.into_iter().map(|p| (p.1 - p.0, p));
        in_ranges(snap, "kvstore-paged", parts, &range)
    }

    /// Blocks `at..end` of `read_paged`, in order, block `k` landed in the
    /// layers and cache block that `with_block(k, f)` hands to `f`: how many
    /// were served before the first that was not. A block in the hot tier
    /// goes from the slot to the cache (`Arena::read_runs`,
    /// `PagedLayout::land`); one whose check fails there after some runs
    /// landed (changed by another process, or damaged) is read again the
    /// ordinary way, which places all of its runs afresh or ends the prefix
    /// before it, so a torn cache block is never counted as served. Others
    /// are read whole into a scratch block. Stops early at a block past
    /// `stop` (the first one found missing by any range).
    #[allow(clippy::too_many_arguments)]
    fn read_paged_range<'s>(
        &'s self,
        snap: &mut Option<Snap<'s>>,
        ids: &[BlockId],
        tokens: &[u32],
        paged: &PagedLayout,
        at: usize,
        end: usize,
        stop: &AtomicUsize,
        mut with_block: impl FnMut(usize, &mut dyn FnMut(&mut [&mut [u8]], usize)),
    ) -> Result<usize> {
        let (b, lay) = (self.layout.block_size as usize, &self.layout);
        let lanes = if self.arena.is_some() { LANES } else { 0 };
        let mut pieces = vec![0u8; lanes * lay.chunk_bytes()];
        let (mut block, mut scratch) = (Vec::new(), Vec::new());
        for k in at..end {
            if stop.load(Ordering::Relaxed) < k {
                return Ok(k - at);
            }
            let block_tokens = &tokens[k * b..(k + 1) * b];
            let mut failed_slot = false;
            if let Some(arena) = &self.arena {
                let mut hit = false;
                with_block(k, &mut |layers, block| {
                    hit = arena.read_runs(&ids[k], block_tokens, |reader| {
                        paged.land(lay, reader, layers, block, &mut pieces);
                    });
                });
                if hit {
                    self.counters.hot_hit_blocks.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                failed_slot = arena.contains(&ids[k]);
            }
            block.resize(self.layout.block_bytes(), 0);
            let mut runs = self.layout.block_runs_mut(&mut block, b, 0);
            let served = self.read_block(snap, &ids[k], block_tokens, &mut runs, &mut scratch);
            if !matches!(served, Ok(true)) {
                stop.fetch_min(k, Ordering::Relaxed);
                return served.map(|_| k - at);
            }
            if failed_slot {
                // The hot tier holds the block but its slot failed the check
                // (damaged, or rewritten meanwhile): the checked bytes go
                // back into it (`Arena::insert` rewrites a damaged slot and
                // leaves a sound one), so later loads do not fail there and
                // read the disk again, each time.
                self.promote_block(&ids[k], block_tokens, &runs)?;
            }
            with_block(k, &mut |layers, block| {
                paged.scatter(lay, &runs, layers, block);
            });
        }
        Ok(end - at)
    }

    /// `put_from` out of cache blocks `blocks` of `layers`: block `start / B +
    /// k` of `tokens` is cache block `blocks[k]`, one for each full block from
    /// `start` on. Returns the tokens covered (full blocks, counted from 0).
    pub(super) fn put_paged(
        &self,
        tokens: &[u32],
        start: usize,
        extra: &[u8],
        paged: &PagedLayout,
        layers: &[&[u8]],
        blocks: &[usize],
    ) -> Result<usize> {
        let b = self.layout.block_size as usize;
        check_start(start, b, tokens.len())?;
        let first = start / b;
        let n = tokens.len() / b - first;
        if blocks.len() != n {
            return Err(Error::InvalidInput(format!(
                "blocks: expected {n} cache blocks (the full blocks of {} token ids from \
                 {start}), got {}",
                tokens.len(),
                blocks.len()
            )));
        }
        let spans: Vec<usize> = layers.iter().map(|l| l.len()).collect();
        paged.check(&self.layout, &spans, blocks)?;
        // One cache block for two token blocks would store its KV under the
        // other's tokens too. (A load may name one twice: the last lands.)
        let mut distinct = blocks.to_vec();
        distinct.sort_unstable();
        if let Some(&[twice, _]) = distinct.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::InvalidInput(format!(
                "blocks: cache block {twice} is named twice"
            )));
        }
        let bb = self.layout.block_bytes();
        let group = (GROUP_BYTES / bb).max(1);
        let mut buf = vec![0u8; group.min(n) * bb];
        if n == 0 {
            return self.put_from(tokens, start, &[], 0, extra);
        }
        let mut covered = 0;
        for g in (0..n).step_by(group) {
            let m = group.min(n - g);
            let kv = &mut buf[..m * bb];
            self.gather_paged(paged, layers, &blocks[g..g + m], kv);
            let (from, to) = ((first + g) * b, (first + g + m) * b);
            covered = self.put_from(&tokens[..to], from, kv, m * b, extra)?;
        }
        Ok(covered)
    }

    /// Gathers cache blocks `blocks` of `layers` into `kv` (their canonical
    /// runs, `blocks.len()` blocks), over several threads where they are
    /// enough bytes, each writing its own blocks' part of every run.
    fn gather_paged(&self, paged: &PagedLayout, layers: &[&[u8]], blocks: &[usize], kv: &mut [u8]) {
        let (m, lay) = (blocks.len(), &self.layout);
        let (b, chunk) = (lay.block_size as usize, lay.chunk_bytes());
        let threads = reader_threads(m, lay.block_bytes(), self.opts.get_readers, false);
        let bounds = range_bounds(m, threads);
        let groups = lay.split_runs_mut(kv, m * b, &bounds);
        let range = |at: usize, end: usize, mut runs: Vec<&mut [u8]>| {
            for (j, &block) in blocks[at..end].iter().enumerate() {
                let mut chunks: Vec<&mut [u8]> = runs
                    .iter_mut()
                    .map(|r| &mut r[j * chunk..(j + 1) * chunk])
                    .collect();
                paged.gather(lay, layers, block, &mut chunks);
            }
        };
        let range = &range;
        let lost: Vec<(usize, usize)> = std::thread::scope(|scope| {
            let mut work = bounds.windows(2).zip(groups);
            let first = work.next();
            let lost = work
                .filter_map(|(w, runs)| {
                    let (at, end) = (w[0], w[1]);
                    let spawned = std::thread::Builder::new()
                        .name("kvstore-paged".into())
                        .spawn_scoped(scope, move || range(at, end, runs));
                    spawned.is_err().then_some((at, end))
                })
                .collect();
            if let Some((w, runs)) = first {
                range(w[0], w[1], runs);
            }
            lost
        });
        // No thread to be had for these: gathered here, after the others.
        for (at, end) in lost {
            let runs = lay.split_runs_mut(kv, m * b, &[at, end]);
            range(at, end, runs.into_iter().next().expect("one group"));
        }
    }
}
