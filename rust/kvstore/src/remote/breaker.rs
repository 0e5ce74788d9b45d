//! A circuit breaker per server node: a node whose request timed out (or
//! could not be reached) is skipped for a cool-down, so a frozen node costs
//! one timeout, not one per request. After the cool-down one request goes
//! through; its outcome closes the breaker or opens it again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Open breakers by node address.
pub(crate) struct Breaker {
    cool_down: Duration,
    open_until: Mutex<HashMap<String, Instant>>,
}

impl Breaker {
    pub(crate) fn new(cool_down: Duration) -> Breaker {
        Breaker {
            cool_down,
            open_until: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a request to `node` may go now. When the cool-down has passed,
    /// lets one request through and holds the others for another cool-down.
    pub(crate) fn allow(&self, node: &str) -> bool {
        self.allow_at(node, Instant::now())
    }

    fn allow_at(&self, node: &str, now: Instant) -> bool {
        let mut m = self.open_until.lock().expect("breaker lock");
        match m.get_mut(node) {
            None => true,
            Some(until) if now >= *until => {
                // Half-open: this request probes the node.
                *until = now + self.cool_down;
                true
            }
            Some(_) => false,
        }
    }

    /// Whether `node` failed and has not answered since (no side effect).
    pub(crate) fn is_open(&self, node: &str) -> bool {
        self.open_until
            .lock()
            .expect("breaker lock")
            .contains_key(node)
    }

    /// The node failed (timeout, unreachable): skip it for a while.
    pub(crate) fn trip(&self, node: &str) {
        self.open_until
            .lock()
            .expect("breaker lock")
            .insert(node.to_string(), Instant::now() + self.cool_down);
    }

    /// The node answered: close its breaker.
    pub(crate) fn reset(&self, node: &str) {
        let mut m = self.open_until.lock().expect("breaker lock");
        if !m.is_empty() {
            m.remove(node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_probes_and_resets() {
        let b = Breaker::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(b.allow_at("a", t0));
        b.trip("a");
        assert!(!b.allow_at("a", t0), "open right after a failure");
        assert!(b.allow_at("b", t0), "other nodes unaffected");
        let later = t0 + Duration::from_secs(11);
        assert!(b.allow_at("a", later), "one probe after the cool-down");
        assert!(!b.allow_at("a", later), "only one");
        b.reset("a");
        assert!(b.allow_at("a", later));
    }
}
