//! The last-use times reads leave behind for eviction: buffered per
//! handle, written to the index in one transaction now and then.

use super::Inner;
use crate::clock::now_us;
use crate::error::Result;
use crate::id::BlockId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Buffered last-use times: written to the index at flush, close, eviction,
/// or when there are many or they are old (a read must not write each time).
pub(super) struct Touched {
    times: HashMap<BlockId, u64>,
    since: Instant,
}

impl Default for Touched {
    fn default() -> Self {
        Touched {
            times: HashMap::new(),
            since: Instant::now(),
        }
    }
}

const TOUCHED_MAX: usize = 16384;
const TOUCHED_MAX_AGE: Duration = Duration::from_secs(5);

impl Inner {
    /// Records that the blocks of one request were used now (block i stamped
    /// i µs earlier: see `Location::used_us`).
    pub(super) fn touch(&self, ids: &[BlockId]) {
        let now = now_us();
        let due = {
            let mut t = self.touched.lock().expect("touched lock");
            if t.times.is_empty() {
                t.since = Instant::now();
            }
            for (i, id) in ids.iter().enumerate() {
                t.times.insert(*id, now.saturating_sub(i as u64));
            }
            t.times.len() >= TOUCHED_MAX || t.since.elapsed() >= TOUCHED_MAX_AGE
        };
        if due {
            self.save_advisory();
        }
    }

    /// Writes buffered last-use times to the index (not synced: losing them
    /// in a crash only makes eviction a little less informed).
    pub(super) fn save_touches(&self) -> Result<()> {
        let times = std::mem::take(&mut self.touched.lock().expect("touched lock").times);
        if times.is_empty() {
            return Ok(());
        }
        let mut txn = self.index.write()?;
        for (id, t) in &times {
            self.index.touch(&mut txn, id, *t)?;
        }
        self.index.commit(txn, false)
    }
}
