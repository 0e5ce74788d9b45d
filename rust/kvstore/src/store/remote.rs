//! The store's side of the remote tier (`crate::remote`): what a put sends,
//! how a lookup or get continues past the local prefix, and how a block read
//! from the server is checked exactly like a local record and promoted into
//! the local tiers through the normal write path.

use super::Inner;
use crate::error::{Error, Result};
use crate::id::{BlockId, ROOT};
use crate::index::Location;
use crate::layout::Layout;
use crate::progress::Progress;
use crate::record::{self, Mismatch};
use crate::remote::keys::{
    decode_session, encode_session, SessionFrame, GROUP, MAC_LEN, SESSION_VALUE_MAX,
};
use crate::remote::{Item, Kind, PushReport, Remote, Sent};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Most block-id hashes `remote_push` spends looking for the parents of
/// blocks whose parent is not the record before them in the log (about a
/// minute of one core); blocks still unplaced then are reported as such.
const PARENT_SEARCH_HASHES: usize = 300_000_000;

/// Where a block stands in its chain, as `remote_push` finds out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Not known yet.
    Todo,
    /// The first block of a chain.
    First,
    /// The child of the block at this index (of the log-ordered list).
    After(usize),
    /// At `depth` in its chain; its hash-tag group starts at block `head`.
    At { depth: usize, head: usize },
    /// Unknown (see `PushReport::unplaced`).
    Lost,
    /// Its record could not be read.
    Unreadable,
}

/// How long `flush` waits for uploads to drain.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest valid value of a block on the server: its record, raw (a
/// compressed payload is stored only when smaller), and the MAC.
fn block_value_max(layout: &Layout) -> usize {
    record::meta_len(layout) + layout.block_bytes() + MAC_LEN
}

/// Checks `payload` (a record read from the server) against block `id`, its
/// `tokens` and the layout, and lands its KV in `out`. Any failure: `false`.
fn land(
    layout: &Layout,
    payload: &[u8],
    id: &BlockId,
    tokens: &[u32],
    out: &mut [&mut [u8]],
) -> bool {
    let meta_len = record::meta_len(layout);
    let Some(stored_len) = payload.len().checked_sub(meta_len) else {
        return false;
    };
    if stored_len > layout.block_bytes() {
        return false;
    }
    let (meta, stored) = payload.split_at(meta_len);
    let header = match record::check_read(layout, meta, id, stored_len as u64, Some(tokens)) {
        Ok(h) => h,
        Err(Mismatch::Damaged(_) | Mismatch::OtherTokens) => return false,
    };
    if stored_len == layout.block_bytes() {
        for (dst, src) in out.iter_mut().zip(stored.chunks(layout.chunk_bytes())) {
            dst.copy_from_slice(src);
        }
        record::check_raw(&header, out).is_ok()
    } else {
        let mut scratch = Vec::new();
        record::decode_compressed(layout, &header, stored, out, &mut scratch).is_ok()
    }
}

impl Inner {
    fn remote(&self) -> Option<&Remote> {
        self.remote.as_ref()
    }

    /// The remote tier, for calls that need one: `InvalidInput` without.
    pub(super) fn remote_required(&self) -> Result<&Remote> {
        self.remote().ok_or_else(|| {
            Error::InvalidInput("this store was opened without a remote tier".into())
        })
    }

    /// After a local put: sends the blocks the server is not known to hold.
    pub(super) fn remote_put(
        &self,
        ids: &[BlockId],
        tokens: &[u32],
        first: usize,
        kv: &[u8],
        kv_tokens: usize,
    ) {
        let Some(r) = self.remote() else { return };
        let b = self.layout.block_size as usize;
        let mut batch = Vec::new();
        for i in first..ids.len() {
            if i % GROUP == 0 {
                r.upload(std::mem::take(&mut batch));
            }
            if r.knows(&ids[i]) {
                continue;
            }
            let chunks = self.layout.block_runs(kv, kv_tokens, i - first);
            let Ok(rec) = record::encode(
                &self.layout,
                self.opts.codec,
                &ids[i],
                &tokens[i * b..(i + 1) * b],
                &chunks,
            ) else {
                continue;
            };
            let mut value = Vec::with_capacity(rec.record_len() as usize + 32);
            for s in rec.slices() {
                value.extend_from_slice(&s);
            }
            let key = r.keys().block(ids, i);
            let value = r.keys().seal(&key, value);
            batch.push(Item {
                key,
                value,
                kind: Kind::Block(ids[i]),
            });
        }
        r.upload(batch);
    }

    /// Continues a prefix of `from` local blocks into the server: fetches
    /// the next blocks in chain order (one pipeline per hash-tag group), stops
    /// at the first miss or bad value, lands them in `out` (`[L, 2,
    /// out_tokens, H, D]` whose first block is block `out_first`, which is
    /// at most `from`) if given, and promotes them into the local tiers.
    /// Returns the blocks added.
    pub(super) fn remote_extend(
        &self,
        ids: &[BlockId],
        tokens: &[u32],
        from: usize,
        mut out: Option<(&mut [u8], usize, usize)>,
    ) -> usize {
        let Some(r) = self.remote() else {
            return 0;
        };
        let b = self.layout.block_size as usize;
        let mut at = from;
        while at < ids.len() {
            let end = (at - at % GROUP + GROUP).min(ids.len());
            let keys: Vec<String> = (at..end).map(|j| r.keys().block(ids, j)).collect();
            let vals = r.fetch(&keys, block_value_max(&self.layout));
            // Without `out`, the group lands in a scratch buffer of its own.
            let mut scratch = Vec::new();
            let landed = out.is_some();
            let (buf, total, base) = if let Some((o, t, f)) = out.as_mut() {
                (&mut **o, *t, *f)
            } else {
                scratch.resize(self.layout.block_bytes() * (end - at), 0);
                (&mut scratch[..], (end - at) * b, at)
            };
            let mut good = 0;
            let mut invalid = 0;
            for (k, v) in vals.iter().enumerate() {
                let j = at + k;
                let Some(v) = v else { break };
                let mut dst = self.layout.block_runs_mut(buf, total, j - base);
                let ok = r.keys().open(&keys[k], v).is_some_and(|p| {
                    land(
                        &self.layout,
                        p,
                        &ids[j],
                        &tokens[j * b..(j + 1) * b],
                        &mut dst,
                    )
                });
                if !ok {
                    // Replaced by this handle's next upload of the block.
                    r.found_invalid(&keys[k], Some(&ids[j]));
                    invalid = 1;
                    break;
                }
                good += 1;
            }
            let missed = usize::from(good < end - at) - invalid;
            r.count(good, missed);
            r.mark(&ids[at..at + good], true);
            if good < end - at {
                // Not there (evicted, lost with a node, or an empty value):
                // upload it again next time.
                r.mark(&ids[at + good..=at + good], false);
            }
            if good > 0 {
                let promoted = self.promote(
                    &ids[..at + good],
                    &tokens[..(at + good) * b],
                    at,
                    (buf, total, base),
                );
                if promoted.is_err() && !landed {
                    // Nowhere to keep it: a lookup must not claim it.
                    return at - from;
                }
            }
            at += good;
            if at < end {
                break;
            }
        }
        at - from
    }

    /// Writes blocks `skip..` of `ids` through the normal write path and the
    /// hot tier; their KV is in `kv` (`[L, 2, kv_tokens, H, D]` whose first
    /// block is block `kv_first`).
    fn promote(
        &self,
        ids: &[BlockId],
        tokens: &[u32],
        skip: usize,
        (kv, kv_tokens, kv_first): (&[u8], usize, usize),
    ) -> Result<()> {
        let b = self.layout.block_size as usize;
        let mut w = self.writer.lock().expect("writer lock");
        // Kept nowhere, then: a lookup must not claim these blocks.
        if let Some(p) = &w.poisoned {
            return Err(Error::Poisoned(p.clone()));
        }
        if self.closing.load(Ordering::SeqCst) {
            return Err(Error::StoreClosed("the store handle is closed".into()));
        }
        let block = |i: usize| (&ids[i], &tokens[i * b..(i + 1) * b]);
        let runs = |i: usize| self.layout.block_runs(kv, kv_tokens, i - kv_first);
        self.store_blocks(&mut w, ids, skip, &block, &runs)?;
        Ok(())
    }

    /// A session saved here (`Some` tokens) or deleted here (`None`) at
    /// `version` goes to the server too, a delete as a tombstone, so that no
    /// host takes an older copy from the server for the newer one. Once a
    /// tombstone is there, this store's is dropped (unless a save or delete
    /// replaced it meanwhile). A session too large for any host to read
    /// back leaves an empty value there (read as missing: each host keeps
    /// its own copy).
    pub(super) fn remote_save_session(&self, name: &str, version: u64, tokens: Option<&[u32]>) {
        let Some(r) = self.remote() else { return };
        let key = r.keys().session(name);
        let mut value = r.keys().seal(&key, encode_session(name, version, tokens));
        if value.len() > SESSION_VALUE_MAX {
            value = Vec::new();
        }
        let sent: Option<Sent> = tokens.is_none().then(|| {
            let (index, tag, name) = (self.index.clone(), self.tag, name.to_string());
            let forget = move || {
                // Best effort: a tombstone left here is sent again later.
                let Ok(mut txn) = index.write() else { return };
                if matches!(
                    index.forget_tombstone(&mut txn, &tag, &name, version),
                    Ok(true)
                ) {
                    let _ = index.commit(txn, false);
                }
            };
            Box::new(forget) as Sent
        });
        r.upload(vec![Item {
            key,
            value,
            kind: Kind::Session { version, sent },
        }]);
    }

    /// Session `name`'s frame from the server (checked): `None` where the
    /// server has none (or an empty value), or could not be asked.
    pub(super) fn remote_session(&self, name: &str) -> Option<SessionFrame> {
        let r = self.remote()?;
        let key = r.keys().session(name);
        let v = r.get(&key, SESSION_VALUE_MAX)?;
        let frame = r
            .keys()
            .open(&key, &v)
            .and_then(|p| decode_session(name, p));
        if frame.is_none() {
            r.found_invalid(&key, None);
        }
        frame
    }

    /// `kvstore remote push`: uploads every block of the store that the
    /// server lacks, one hash-tag group at a time (memory: the block list,
    /// and one group's records).
    ///
    /// A block's key names its group, the block at the start of its group
    /// in its chain, and records do not name their parents: the chains are
    /// found again from the ids (a block's id is the keyed hash of its
    /// parent's id and its tokens). In log order, a block's parent is most
    /// often the record before it (one put appends a chain's new blocks in
    /// order), or it is the first block of a chain; the rest (the first new
    /// block of a put that continued a stored prefix) are matched against
    /// every block, within [`PARENT_SEARCH_HASHES`].
    pub(super) fn remote_push(&self, progress: Progress<'_>) -> Result<PushReport> {
        let r = self.remote_required()?;
        let mut blocks = {
            let txn = self.index.read()?;
            self.index.all_blocks(&txn)?
        };
        blocks.sort_by_key(|(_, l)| (l.segment, l.offset));
        let n = blocks.len();
        let total = 2 * n as u64;
        let mut rep = PushReport {
            blocks: n as u64,
            ..PushReport::default()
        };
        let mut place = vec![Place::Todo; n];
        let mut search: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, (id, loc)) in blocks.iter().enumerate() {
            let Some(tokens) = self.record_tokens(id, loc) else {
                place[i] = Place::Unreadable;
                continue;
            };
            place[i] = if self.keyer.block_id(&ROOT, &tokens, &[]) == *id {
                Place::First
            } else if i > 0 && self.keyer.block_id(&blocks[i - 1].0, &tokens, &[]) == *id {
                Place::After(i - 1)
            } else {
                search.push((i, tokens));
                Place::Lost
            };
            progress(i as u64 + 1, total);
        }
        let mut budget = PARENT_SEARCH_HASHES;
        for (i, tokens) in search {
            if budget < n {
                break;
            }
            budget -= n;
            if let Some(j) = (0..n)
                .find(|&j| j != i && self.keyer.block_id(&blocks[j].0, &tokens, &[]) == blocks[i].0)
            {
                place[i] = Place::After(j);
            }
        }
        for i in 0..n {
            settle(&mut place, i);
        }
        // One group at a time: its blocks in chain order.
        let mut order: Vec<(usize, usize, usize)> = place
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match *p {
                Place::At { depth, head } => Some((head, depth, i)),
                _ => None,
            })
            .collect();
        rep.unplaced = place.iter().filter(|p| matches!(p, Place::Lost)).count() as u64;
        rep.unreadable = place
            .iter()
            .filter(|p| matches!(p, Place::Unreadable))
            .count() as u64;
        order.sort_unstable();
        let mut done = n as u64 + rep.unplaced + rep.unreadable;
        progress(done, total);
        for group in order.chunk_by(|a, b| a.0 == b.0) {
            // Branches from one group head can make a group longer than GROUP.
            for part in group.chunks(4 * GROUP) {
                let head = &blocks[part[0].0].0;
                let ids: Vec<BlockId> = part.iter().map(|&(_, _, i)| blocks[i].0).collect();
                let keys: Vec<String> = ids
                    .iter()
                    .map(|id| r.keys().block_under(head, id))
                    .collect();
                let got = r.push_group(&keys, &ids, |k| {
                    let (id, loc) = &blocks[part[k].2];
                    self.record_bytes(id, loc)
                });
                rep.add(&got);
                done += part.len() as u64;
                progress(done, total);
            }
        }
        Ok(rep)
    }

    /// The token ids of block `id`'s record at `loc` (header checked).
    fn record_tokens(&self, id: &BlockId, loc: &Location) -> Option<Vec<u32>> {
        let meta = self.record_meta(loc).ok()?;
        record::check_read(&self.layout, &meta, id, loc.stored_len, None).ok()?;
        Some(record::tokens(&meta).collect())
    }

    /// Block `id`'s whole record at `loc` as in its segment, checked like a
    /// record read from the server (header and payload: a record with bit
    /// rot is not spread to other hosts).
    fn record_bytes(&self, id: &BlockId, loc: &Location) -> Option<Vec<u8>> {
        let meta_len = record::meta_len(&self.layout);
        // Without the padding of a version-2 segment: a record on the
        // server is meta then payload.
        let mut rec = self.record_meta(loc).ok()?;
        if rec.len() != meta_len || loc.stored_len > self.layout.block_bytes() as u64 {
            return None;
        }
        let at = loc.offset + (loc.record_len - loc.stored_len);
        rec.resize(meta_len + loc.stored_len as usize, 0);
        let file = self.reader(loc.segment).ok()?;
        file.read_buffered(&mut rec[meta_len..], &mut [], at).ok()?;
        let tokens: Vec<u32> = record::tokens(&rec[..meta_len]).collect();
        let b = self.layout.block_size as usize;
        let mut scratch = vec![0u8; self.layout.block_bytes()];
        let mut out = self.layout.block_runs_mut(&mut scratch, b, 0);
        land(&self.layout, &rec, id, &tokens, &mut out).then_some(rec)
    }

    /// Waits for queued uploads (bounded).
    pub(super) fn remote_flush(&self) {
        if let Some(r) = self.remote() {
            r.flush(FLUSH_TIMEOUT);
        }
    }

    /// Drains (bounded) and stops the uploader.
    pub(super) fn remote_close(&self) {
        if let Some(r) = self.remote() {
            r.close();
        }
    }
}

/// Resolves block `i`'s depth and group head from its parent's, walking up
/// to the first block (or to a block whose place is lost) without recursion.
fn settle(place: &mut [Place], i: usize) {
    let mut path = Vec::new();
    let mut at = i;
    // Parents come first in the log, so the walk ends; the bound guards
    // against a cycle all the same.
    let base = loop {
        match place[at] {
            Place::At { depth, head } => break Some((depth, head)),
            Place::First => {
                place[at] = Place::At { depth: 0, head: at };
                break Some((0, at));
            }
            Place::After(p) if path.len() <= place.len() => {
                path.push(at);
                at = p;
            }
            _ => break None,
        }
    };
    for &b in path.iter().rev() {
        place[b] = match (base, place[b]) {
            (Some(_), Place::After(p)) => match place[p] {
                Place::At { depth, head } => {
                    let d = depth + 1;
                    Place::At {
                        depth: d,
                        head: if d % GROUP == 0 { b } else { head },
                    }
                }
                _ => Place::Lost,
            },
            _ => Place::Lost,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settle_finds_depths_and_group_heads() {
        // A chain of 20 in log order, a branch off its block 17, a block whose
        // parent was not found, an unreadable one and a child of that.
        let mut place = vec![Place::Todo; 24];
        place[0] = Place::First;
        for (i, p) in place.iter_mut().enumerate().take(20).skip(1) {
            *p = Place::After(i - 1);
        }
        place[20] = Place::After(17);
        place[21] = Place::Lost;
        place[22] = Place::Unreadable;
        place[23] = Place::After(22);
        // From the last: every walk goes up to the chain's first block.
        for i in (0..place.len()).rev() {
            settle(&mut place, i);
        }
        for (i, p) in place.iter().enumerate().take(20) {
            let head = if i < GROUP { 0 } else { GROUP };
            assert_eq!(*p, Place::At { depth: i, head }, "block {i}");
        }
        assert_eq!(
            place[20],
            Place::At {
                depth: 18,
                head: GROUP
            }
        );
        assert_eq!(place[21], Place::Lost);
        assert_eq!(place[22], Place::Unreadable);
        assert_eq!(place[23], Place::Lost);
    }
}
