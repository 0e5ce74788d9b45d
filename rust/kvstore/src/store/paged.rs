//! Gets and puts straight between the store and a serving engine's paged KV
//! cache (`crate::paged`): each block is read and checked in a one-block
//! scratch that stays in the CPU's cache, then permuted into the engine's
//! cache; a put gathers a few blocks at a time. One pass over main memory
//! each way instead of a canonical staging copy of the whole request.

use super::put::check_start;
use super::Inner;
use crate::error::{Error, Result};
use crate::paged::PagedLayout;

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
        let mut block = vec![0u8; bb];
        let mut scratch = Vec::new();
        // One snapshot per call, so the cache notices a newer generation.
        let mut snap = Some(self.snapshot()?);
        let mut served = self.held_prefix(&mut snap, &ids[..first])?;
        if served == first {
            for (i, id) in ids.iter().enumerate().skip(first) {
                let mut runs = self.layout.block_runs_mut(&mut block, b, 0);
                let block_tokens = &tokens[i * b..(i + 1) * b];
                if !self.read_block(&mut snap, id, block_tokens, &mut runs, &mut scratch)? {
                    break;
                }
                paged.scatter(&self.layout, &mut runs, layers, blocks[i - first]);
                served += 1;
            }
        }
        drop(snap);
        if served < first {
            served += self.remote_extend(&ids[..first], tokens, served, None);
        }
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
                    let mut runs = self.layout.block_runs_mut(kv, n * b, k);
                    paged.scatter(&self.layout, &mut runs, layers, blocks[served + k - first]);
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
            for k in 0..m {
                let mut runs = self.layout.block_runs_mut(kv, m * b, k);
                paged.gather(&self.layout, layers, blocks[g + k], &mut runs);
            }
            let (from, to) = ((first + g) * b, (first + g + m) * b);
            covered = self.put_from(&tokens[..to], from, kv, m * b, extra)?;
        }
        Ok(covered)
    }
}
