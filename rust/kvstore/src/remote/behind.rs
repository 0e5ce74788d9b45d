//! Sessions whose server copy may be older than this handle's: saved here
//! while their upload is still queued, or after it failed. Every other host's
//! save sets the server's copy, so a load asks the server first, except for
//! these, where this handle's own copy is the newer one.

use std::collections::HashMap;
use std::sync::Mutex;

/// Most sessions tracked; past it the failed ones are forgotten (their
/// loads then ask the server first again).
const BEHIND_MAX: usize = 1 << 16;

#[derive(Default)]
struct Pending {
    /// Uploads queued or in flight.
    queued: u32,
    /// The last one that finished failed (or was dropped).
    failed: bool,
}

/// By session key.
#[derive(Default)]
pub(crate) struct Behind(Mutex<HashMap<String, Pending>>);

impl Behind {
    /// An upload of `key` is queued.
    pub(crate) fn queued(&self, key: &str) {
        let mut m = self.0.lock().expect("behind lock");
        if m.len() >= BEHIND_MAX {
            m.retain(|_, p| p.queued > 0);
        }
        m.entry(key.to_string()).or_default().queued += 1;
    }

    /// An upload of `key` finished: sent (`ok`), failed or dropped.
    pub(crate) fn done(&self, key: &str, ok: bool) {
        let mut m = self.0.lock().expect("behind lock");
        if let Some(p) = m.get_mut(key) {
            p.queued = p.queued.saturating_sub(1);
            p.failed = !ok;
            if p.queued == 0 && ok {
                m.remove(key);
            }
        }
    }

    /// Whether the server's copy of `key` may be older than this handle's.
    pub(crate) fn is_behind(&self, key: &str) -> bool {
        self.0.lock().expect("behind lock").contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::Behind;

    #[test]
    fn behind_until_the_last_queued_upload_is_sent() {
        let b = Behind::default();
        assert!(!b.is_behind("s"));
        b.queued("s");
        b.queued("s");
        b.done("s", true); // the older value is on the server, the newer queued
        assert!(b.is_behind("s"));
        b.done("s", false); // the newer one failed
        assert!(b.is_behind("s"));
        b.queued("s");
        b.done("s", true);
        assert!(!b.is_behind("s"));
        b.done("s", true); // a stray completion changes nothing
        assert!(!b.is_behind("s"));
    }
}
