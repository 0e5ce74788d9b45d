//! The bounded queue between `put` and the background uploader. A push never
//! waits: past the bound the item is dropped and counted.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// One value to upload.
pub(crate) struct Item {
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    pub(crate) kind: Kind,
}

/// What a value is, which decides how it is set.
pub(crate) enum Kind {
    /// Block `id`'s record: set where the server lacks it; forgotten as
    /// uploaded when the write fails.
    Block(crate::id::BlockId),
    /// A session's frame, saved or deleted at `version`: set unless the
    /// server holds one at least as new. A session is a batch of its own.
    Session {
        version: u64,
        /// Run once the server holds this version or a newer one (never if
        /// the upload fails or is dropped).
        sent: Option<Sent>,
    },
}

impl Kind {
    /// The block id, for a block.
    pub(crate) fn block(&self) -> Option<crate::id::BlockId> {
        match self {
            Kind::Block(id) => Some(*id),
            Kind::Session { .. } => None,
        }
    }
}

/// What to do once an item is on the server (a session's tombstone: drop
/// the local one).
pub(crate) type Sent = Box<dyn FnOnce() + Send>;

struct State {
    items: VecDeque<Vec<Item>>,
    bytes: usize,
    /// Batches taken by the uploader and not yet done.
    busy: usize,
    closed: bool,
}

/// Batches of items (one batch = one hash-tag group), bounded in bytes.
pub(crate) struct Queue {
    max_bytes: usize,
    state: Mutex<State>,
    cv: Condvar,
}

fn batch_bytes(b: &[Item]) -> usize {
    b.iter().map(|i| i.value.len() + i.key.len()).sum()
}

impl Queue {
    pub(crate) fn new(max_bytes: usize) -> Queue {
        Queue {
            max_bytes,
            state: Mutex::new(State {
                items: VecDeque::new(),
                bytes: 0,
                busy: 0,
                closed: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Queues a batch; gives it back if the queue is full or closed.
    pub(crate) fn push(&self, batch: Vec<Item>) -> Result<(), Vec<Item>> {
        let n = batch_bytes(&batch);
        let mut s = self.state.lock().expect("queue lock");
        if s.closed || s.bytes + n > self.max_bytes {
            return Err(batch);
        }
        s.bytes += n;
        s.items.push_back(batch);
        drop(s);
        self.cv.notify_all();
        Ok(())
    }

    /// The next batch, waiting for one; `None` once closed and empty.
    pub(crate) fn pop(&self) -> Option<Vec<Item>> {
        let mut s = self.state.lock().expect("queue lock");
        loop {
            if let Some(b) = s.items.pop_front() {
                s.bytes -= batch_bytes(&b);
                s.busy += 1;
                return Some(b);
            }
            if s.closed {
                return None;
            }
            s = self.cv.wait(s).expect("queue lock");
        }
    }

    /// The uploader finished a batch from `pop`.
    pub(crate) fn done(&self) {
        self.state.lock().expect("queue lock").busy -= 1;
        self.cv.notify_all();
    }

    /// Waits until every queued batch is done, or `deadline`; whether it drained.
    pub(crate) fn drain(&self, deadline: Instant) -> bool {
        let mut s = self.state.lock().expect("queue lock");
        loop {
            if s.items.is_empty() && s.busy == 0 {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .expect("queue lock")
                .0;
        }
    }

    /// No more pushes; `pop` returns `None` once empty. Returns the batches
    /// still queued after dropping them (the caller counts them).
    pub(crate) fn close(&self, discard: bool) -> usize {
        let mut s = self.state.lock().expect("queue lock");
        s.closed = true;
        let dropped = if discard {
            let n = s.items.iter().map(Vec::len).sum();
            s.items.clear();
            s.bytes = 0;
            n
        } else {
            0
        };
        drop(s);
        self.cv.notify_all();
        dropped
    }

    /// Bytes queued now.
    pub(crate) fn bytes(&self) -> usize {
        self.state.lock().expect("queue lock").bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn item(n: usize) -> Vec<Item> {
        vec![Item {
            key: String::new(),
            value: vec![0; n],
            kind: Kind::Session {
                version: 1,
                sent: None,
            },
        }]
    }

    #[test]
    fn bounded_in_bytes_and_drains() {
        let q = Queue::new(100);
        assert!(q.push(item(60)).is_ok());
        assert!(q.push(item(60)).is_err(), "over the bound: refused at once");
        assert!(q.push(item(40)).is_ok());
        assert_eq!(q.bytes(), 100);
        assert!(!q.drain(Instant::now() + Duration::from_millis(10)));
        let a = q.pop().unwrap();
        assert_eq!(a[0].value.len(), 60);
        q.done();
        let _ = q.pop().unwrap();
        assert!(!q.drain(Instant::now()), "a batch in flight is not drained");
        q.done();
        assert!(q.drain(Instant::now()));
        assert!(q.push(item(1)).is_ok());
        assert_eq!(q.close(true), 1);
        assert!(q.pop().is_none());
        assert!(q.push(item(1)).is_err());
    }
}
