//! The write path: check the KV, derive the block ids, skip blocks already
//! stored (dedupe), keep the store within `disk_bytes` (evicting and
//! compacting first), append each new record, commit per the durability
//! mode, then show the blocks in the hot tier.

use super::writer::Writer;
use super::{Durability, Inner};
use crate::clock::{now_ms, now_us};
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format;
use crate::id::{BlockId, ROOT};
use crate::index::Location;
use crate::record;
use std::collections::HashSet;
use std::sync::atomic::Ordering;

/// Blocks encoded at once by a put: enough to keep every core busy, few
/// enough that their encoded bytes stay small next to the put's own KV.
const ENCODE_WINDOW: usize = 16;

impl Inner {
    /// Checks a put's arguments; returns the tokens of its full blocks.
    fn check_kv(&self, tokens: &[u32], start: usize, kv: &[u8], kv_tokens: usize) -> Result<usize> {
        let b = self.layout.block_size as usize;
        let full = tokens.len() / b * b;
        check_start(start, b, tokens.len())?;
        if kv_tokens < full - start.min(full) {
            return Err(Error::InvalidInput(format!(
                "kv: expected at least {} tokens (the full blocks of {} token ids from {start}), \
                 got {kv_tokens}",
                full - start.min(full),
                tokens.len()
            )));
        }
        let want = self
            .layout
            .kv_bytes(kv_tokens)
            .ok_or_else(|| Error::InvalidInput(format!("kv: {kv_tokens} tokens overflow")))?;
        if kv.len() != want {
            return Err(Error::InvalidInput(format!(
                "kv: expected {want} bytes for [L={}, 2, T={kv_tokens}, H={}, D={}] of {}, got {}",
                self.layout.num_layers,
                self.layout.num_kv_heads,
                self.layout.head_dim,
                self.layout.dtype.name(),
                kv.len()
            )));
        }
        Ok(full)
    }

    /// Stores the full blocks of `tokens` from token `start` (a multiple of
    /// the block size) that are not stored yet; `kv` holds `tokens[start..]`.
    /// Returns the tokens covered (full blocks, counted from token 0).
    pub(super) fn put_from(
        &self,
        tokens: &[u32],
        start: usize,
        kv: &[u8],
        kv_tokens: usize,
        extra: &[u8],
    ) -> Result<usize> {
        let full = self.check_kv(tokens, start, kv, kv_tokens)?;
        let b = self.layout.block_size as usize;
        let ids = self.keyer.chain(&tokens[..full], b, extra);
        let first = start / b;
        let mut w = self.writer.lock().expect("writer lock");
        if let Some(p) = &w.poisoned {
            return Err(Error::Poisoned(p.clone()));
        }
        if self.closing.load(Ordering::SeqCst) {
            // `close` ran while this call waited for the lock.
            return Err(Error::StoreClosed("the store handle is closed".into()));
        }
        // Block i: its id, its tokens and its runs in `kv`.
        let block = |i: usize| (&ids[i], &tokens[i * b..(i + 1) * b]);
        let runs = |i: usize| self.layout.block_runs(kv, kv_tokens, i - first);
        let fresh = self.store_blocks(&mut w, &ids, first, &block, &runs)?;
        self.counters.blocks_deduped.fetch_add(
            (ids.len().saturating_sub(first) - fresh) as u64,
            Ordering::Relaxed,
        );
        drop(w);
        self.remote_put(&ids, tokens, first, kv, kv_tokens);
        Ok(full)
    }

    /// Stores blocks `first..` of `ids` that are not stored yet, under the
    /// writer lock `w`: dedupe against the index and this handle's pending
    /// records, append, commit per the durability mode, then show them in
    /// the hot tier. `put` and the remote tier's promotion both come here.
    /// Returns how many blocks were written.
    pub(super) fn store_blocks<'t>(
        &self,
        w: &mut Writer,
        ids: &[BlockId],
        first: usize,
        block: &dyn Fn(usize) -> (&'t BlockId, &'t [u32]),
        runs: &dyn Fn(usize) -> Vec<&'t [u8]>,
    ) -> Result<usize> {
        if w.commit_failed {
            // Records of returned puts wait for a commit that failed: this
            // put adds none until one succeeds.
            self.commit_pending(w)?;
        }
        // Under the writer lock: a group commit between this check and the
        // writes would otherwise move blocks from `pending` to the index
        // unseen, and they would be written twice.
        // Blocks before `first` are not this call's to write: count them present.
        let present: Vec<bool> = {
            // One snapshot per call, so the cache notices a newer generation.
            let mut snap = Some(self.snapshot()?);
            ids.iter()
                .enumerate()
                .map(|(i, id)| Ok(i < first || self.committed(&mut snap, id)?.is_some()))
                .collect::<Result<_>>()?
        };
        let fresh = self.write_blocks(w, ids, &present, block, runs)?;
        self.counters
            .blocks_written
            .fetch_add(fresh.len() as u64, Ordering::Relaxed);
        if self.opts.durability != Durability::Batch || w.pending_bytes >= self.opts.batch_bytes {
            if let Err(e) = self.commit_pending(w) {
                // This put fails and publishes nothing; the records of puts
                // that returned before it stay pending for the next commit.
                let mine: HashSet<&BlockId> = fresh.iter().map(|&i| &ids[i]).collect();
                w.drop_pending(&mine);
                return Err(e);
            }
        }
        self.link_present(ids, &present)?;
        // Into the hot tier only once written (a failed put publishes nothing)
        // and, unless a batch commit is still due, committed: other processes
        // must not see a block a crash could take back. A batch put shows its
        // blocks before the group commit, as it does to this handle. A fill
        // the arena refuses (full, or `Busy`: its writers' lock held by a
        // stopped process) leaves the block where it is durable, the segments.
        if let Some(arena) = &self.arena {
            for &i in &fresh {
                let (id, block_tokens) = block(i);
                arena.insert(id, block_tokens, &runs(i), 0, 0, now_ms())?;
            }
        }
        Ok(fresh.len())
    }

    /// Closes the blocks of the chain `ids` that were already stored but
    /// are not marked closed while their parent is, or will be once this
    /// put's blocks are published (see "Prefix-closed chains" in
    /// `index.rs`): blocks stored before a realign emptied the marks, or
    /// left unmarked by a capped marking walk. At most one `parents` probe
    /// per present block; a write only when one is due.
    fn link_present(&self, ids: &[BlockId], present: &[bool]) -> Result<()> {
        let due = {
            let snap = self.snapshot()?;
            let txn = &snap.txn;
            if !self.index.chains_trusted(txn)? {
                return Ok(());
            }
            let parent_of = |i: usize| if i == 0 { &ROOT } else { &ids[i - 1] };
            // Closed marks form a prefix: when the last of the leading
            // present blocks is closed, so are those before it (a re-put,
            // or a put continuing a stored conversation, probes once).
            let lead = present.iter().take_while(|&&p| p).count();
            let skip = lead > 0
                && self
                    .index
                    .is_closed(txn, &ids[lead - 1], parent_of(lead - 1))?;
            let mut due = Vec::new();
            // Whether the previous block is or will be closed.
            let mut parent_closes = true;
            for (i, id) in ids.iter().enumerate().skip(if skip { lead } else { 0 }) {
                let parent = parent_of(i);
                parent_closes = if !present[i] {
                    parent_closes // published by this put: closed if its parent is
                } else if self.index.is_closed(txn, id, parent)? {
                    true
                } else if self.index.get_block(txn, id)?.is_some() {
                    if parent_closes {
                        due.push(i);
                    }
                    parent_closes
                } else {
                    false // before `first`, and not stored
                };
            }
            due
        };
        if due.is_empty() || self.index.nearly_full()? {
            return Ok(());
        }
        let mut txn = self.index.write()?;
        for i in due {
            let parent = if i == 0 { &ROOT } else { &ids[i - 1] };
            self.index.link_child(&mut txn, &ids[i], parent)?;
        }
        // The marks only speed lookups up: a commit lost in a crash costs
        // probes, not KV.
        self.index.commit(txn, false)
    }

    /// Encodes and appends the blocks that are neither `present` nor
    /// pending as pending records, making room under `disk_bytes` before
    /// each; returns their indices. On failure the records written so far are
    /// forgotten (dead bytes): a failed put publishes nothing. Blocks
    /// committed by a segment roll inside this put stay: they are durable and
    /// sound.
    fn write_blocks<'t>(
        &self,
        w: &mut Writer,
        ids: &[BlockId],
        present: &[bool],
        block: &dyn Fn(usize) -> (&'t BlockId, &'t [u32]),
        runs: &dyn Fn(usize) -> Vec<&'t [u8]>,
    ) -> Result<Vec<usize>> {
        // One time for the whole put: block i is stamped i µs earlier.
        let t0 = now_us();
        // Making room must not evict this put's own blocks.
        let keep: HashSet<BlockId> = ids.iter().copied().collect();
        let todo: Vec<usize> = (0..present.len())
            .filter(|&i| !present[i] && !w.pending_ids.contains_key(block(i).0))
            .collect();
        let all_runs: Vec<Vec<&[u8]>> = todo.iter().map(|&i| runs(i)).collect();
        let jobs: Vec<record::Job<'_>> = todo
            .iter()
            .zip(&all_runs)
            .map(|(&i, r)| {
                let (id, block_tokens) = block(i);
                (id, block_tokens, &r[..])
            })
            .collect();
        let (layout, codec) = (self.layout, self.opts.codec);
        let mut fresh = Vec::new();
        // A window of blocks is encoded (across the cores, in the background)
        // while the one before it is appended, in order: the put costs about
        // the larger of the two, not their sum, and at most two windows of
        // encoded records are held at once.
        std::thread::scope(|scope| -> Result<()> {
            let mut windows = jobs.chunks(ENCODE_WINDOW).zip(todo.chunks(ENCODE_WINDOW));
            let Some((first_jobs, mut window)) = windows.next() else {
                return Ok(());
            };
            let mut encoded = record::encode_many(&layout, codec, first_jobs);
            loop {
                let next = windows.next().map(|(j, ix)| {
                    let bg = (codec != Codec::Raw)
                        .then(|| scope.spawn(move || record::encode_many(&layout, codec, j)));
                    (bg, j, ix)
                });
                for (&i, rec) in window.iter().zip(encoded) {
                    let res = rec.and_then(|rec| {
                        let room = w.room_for(&rec);
                        self.ensure_disk_room(w, room, &keep)?;
                        let loc = self.append(w, &rec)?;
                        rec.recycle();
                        Ok(loc)
                    });
                    match res {
                        Ok(loc) => {
                            let loc = Location {
                                used_us: t0.saturating_sub(i as u64),
                                ..loc
                            };
                            let parent = if i == 0 { &ROOT } else { &ids[i - 1] };
                            w.add_pending(&ids[i], parent, loc);
                            fresh.push(i);
                        }
                        Err(e) => {
                            let mine: HashSet<&BlockId> = fresh.iter().map(|&j| &ids[j]).collect();
                            w.drop_pending(&mine);
                            return Err(e);
                        }
                    }
                }
                self.start_writeback(w);
                let Some((bg, j, ix)) = next else {
                    return Ok(());
                };
                encoded = match bg {
                    Some(h) => h.join().expect("encoder thread panicked"),
                    None => record::encode_many(&layout, codec, j),
                };
                window = ix;
            }
        })?;
        Ok(fresh)
    }

    /// Keeps the store within `disk_bytes` with room for a record of
    /// `record_len` bytes, its padding included (and a new segment's
    /// header, if one starts),
    /// evicting and compacting first if needed, sparing `keep`.
    fn ensure_disk_room(
        &self,
        w: &mut Writer,
        record_len: u64,
        keep: &HashSet<BlockId>,
    ) -> Result<()> {
        let Some(limit) = self.opts.disk_bytes else {
            return Ok(());
        };
        let header = if w.active.is_none() {
            format::SEGMENT_HEADER_LEN as u64
        } else {
            0
        };
        let need = record_len + header;
        // Compaction copies a segment's live records before it frees the
        // segment, and its copies may pad differently: a segment's worth and
        // a sixteenth is kept free, so that making room stays within the
        // bound too. Records larger than a segment's limit sit one to a
        // segment, which compaction never copies (live whole, or dead).
        let limit_seg = self.opts.segment_limit();
        let reserve = if need <= limit_seg {
            limit_seg + limit_seg / 16
        } else {
            0
        };
        if self.disk_used(w)? + need + reserve > limit {
            let need = need + reserve + format::SEGMENT_HEADER_LEN as u64;
            self.make_room(w, limit, need, keep)?;
        }
        Ok(())
    }

    /// Bytes of segment files: committed lengths in the index plus this
    /// handle's uncommitted tail.
    fn disk_used(&self, w: &Writer) -> Result<u64> {
        let txn = self.index.read()?;
        let committed: u64 = self
            .index
            .all_segments(&txn)?
            .iter()
            .map(|(_, i)| i.committed_len)
            .sum();
        Ok(committed + w.pending_bytes)
    }

    /// Frees room for `need` more bytes under `limit` (`disk_bytes`): evicts
    /// the oldest unpinned blocks but `keep` down to three quarters of the
    /// limit (so the next puts do not compact again at once) and compacts.
    /// `StoreFull` when what is left is pinned, or another process is
    /// compacting.
    fn make_room(
        &self,
        w: &mut Writer,
        limit: u64,
        need: u64,
        keep: &HashSet<BlockId>,
    ) -> Result<()> {
        self.commit_pending(w)?;
        // Seal ours, so its dead bytes can go too; the next append starts a
        // new one.
        self.seal_active(w)?;
        let full = |detail: String| {
            Error::StoreFull(format!(
                "disk_bytes limit of {limit} bytes reached: {detail}"
            ))
        };
        let _lock = self
            .dir
            .compaction_lock()
            .map_err(|_| full("another process is compacting; retry".into()))?;
        self.evict(Some(limit.saturating_sub(need) / 4 * 3), None, keep)?;
        self.compact_locked(&|_, _| {}, false, false)?;
        let used = self.disk_used(w)?;
        if used + need > limit {
            return Err(full(format!(
                "{used} bytes are still in use by pinned blocks or other writers' segments"
            )));
        }
        Ok(())
    }
}

/// Checks that `start` is a block boundary within the sequence.
pub(super) fn check_start(start: usize, block_size: usize, tokens: usize) -> Result<()> {
    if !start.is_multiple_of(block_size) || start > tokens {
        return Err(Error::InvalidInput(format!(
            "start: expected a multiple of the block size {block_size} from 0 to {tokens} \
             (the token ids given), got {start}"
        )));
    }
    Ok(())
}
