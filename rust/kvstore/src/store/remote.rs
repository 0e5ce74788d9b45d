//! The store's side of the remote tier (`crate::remote`): what a put sends,
//! how a lookup or get continues past the local prefix, and how a block read
//! from the server is checked exactly like a local record and promoted into
//! the local tiers through the normal write path.

use super::Inner;
use crate::error::Result;
use crate::id::BlockId;
use crate::layout::Layout;
use crate::record::{self, Mismatch};
use crate::remote::keys::{decode_session, encode_session, GROUP};
use crate::remote::{Item, Remote};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long `flush` waits for uploads to drain.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

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
                self.opts.compression_level,
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
            let key = r.keys.block(ids, i);
            let value = r.keys.seal(&key, value);
            batch.push(Item {
                key,
                value,
                id: Some(ids[i]),
            });
        }
        r.upload(batch);
    }

    /// Continues a prefix of `from` local blocks into the server: fetches
    /// the next blocks in chain order (one `MGET` per hash-tag group), stops
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
            let keys: Vec<String> = (at..end).map(|j| r.keys.block(ids, j)).collect();
            let vals = r.fetch(&keys);
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
                let ok = r.keys.open(&keys[k], v).is_some_and(|p| {
                    land(
                        &self.layout,
                        p,
                        &ids[j],
                        &tokens[j * b..(j + 1) * b],
                        &mut dst,
                    )
                });
                if !ok {
                    invalid = 1;
                    break;
                }
                good += 1;
            }
            let missed = usize::from(good < end - at) - invalid;
            r.count(good, missed, invalid);
            r.mark(&ids[at..at + good], true);
            if good < end - at {
                // Not there (evicted, lost with a node): upload it again next time.
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
        if w.poisoned.is_some() || self.closing.load(Ordering::SeqCst) {
            return Ok(());
        }
        let block = |i: usize| (&ids[i], &tokens[i * b..(i + 1) * b]);
        let runs = |i: usize| self.layout.block_runs(kv, kv_tokens, i - kv_first);
        self.store_blocks(&mut w, ids, skip, &block, &runs)?;
        Ok(())
    }

    /// A session saved here goes to the server too.
    pub(super) fn remote_save_session(&self, name: &str, tokens: &[u32]) {
        let Some(r) = self.remote() else { return };
        let key = r.keys.session(name);
        let value = r.keys.seal(&key, encode_session(name, tokens));
        r.upload(vec![Item {
            key,
            value,
            id: None,
        }]);
    }

    /// A session not saved here, from the server (checked).
    pub(super) fn remote_session(&self, name: &str) -> Option<Vec<u32>> {
        let r = self.remote()?;
        let key = r.keys.session(name);
        let v = r.get(&key)?;
        let tokens = r.keys.open(&key, &v).and_then(|p| decode_session(name, p));
        if tokens.is_none() {
            r.count(0, 0, 1);
        }
        tokens
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
