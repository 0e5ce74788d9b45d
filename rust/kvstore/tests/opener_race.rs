//! Recovery (run by every open) must never touch a live writer's segment.

use kvstore::{DType, Durability, Layout, Options, Store};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn opts() -> Options {
    Options {
        fingerprint: Some("race@1".into()),
        layout: Some(Layout::new(2, 8, 128, DType::Float16, 16).unwrap()),
        durability: Durability::None,
        segment_bytes: 1 << 20,
        ..Options::default()
    }
}

/// Puts per writer: 2 blocks of 128 KiB each, so a segment rolls every few
/// puts and each writer rolls about ten.
const PUTS: u32 = 40;

/// Counts the opener's completed opens; says when it has stopped (done or
/// panicked), so that writers waiting for it do not wait for ever.
struct Opens {
    done: AtomicU64,
    stopped: AtomicBool,
}

impl Opens {
    /// Waits until an open that started after this call has completed: the
    /// count must grow by two (the open under way may have started before).
    fn wait_for_one(&self) {
        let seen = self.done.load(Ordering::SeqCst);
        while self.done.load(Ordering::SeqCst) < seen + 2 {
            assert!(
                !self.stopped.load(Ordering::SeqCst),
                "the opener stopped (an open failed?)"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Sets `stopped` however the opener's thread ends.
struct StopGuard(Arc<Opens>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
    }
}

/// Two writers roll segments while a third thread opens the store over and
/// over. Each writer waits, after every put, for a whole open (and so a whole
/// recovery) to run: recovery meets every state a live writer's segments go
/// through, by construction rather than by how many opens a time window held.
#[test]
fn opening_while_others_write_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let l = opts().layout.unwrap();
    Store::open(dir.path(), opts()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let opens = Arc::new(Opens {
        done: AtomicU64::new(0),
        stopped: AtomicBool::new(false),
    });
    let opener = {
        let (path, stop, opens) = (dir.path().to_path_buf(), stop.clone(), opens.clone());
        std::thread::spawn(move || {
            let _guard = StopGuard(opens.clone());
            while !stop.load(Ordering::SeqCst) {
                Store::open(&path, opts()).unwrap().close().unwrap();
                opens.done.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let (path, opens) = (dir.path().to_path_buf(), opens.clone());
            std::thread::spawn(move || {
                let s = Store::open(&path, opts()).unwrap();
                let mut acked = Vec::new();
                for i in 0..PUTS {
                    let toks: Vec<u32> = (0..32).map(|j| w * 10_000_000 + i * 32 + j).collect();
                    let kv = vec![(i % 251) as u8; l.kv_bytes(32).unwrap()];
                    s.put(&toks, &kv, 32, b"").unwrap();
                    acked.push(toks);
                    opens.wait_for_one();
                }
                s.close().unwrap();
                acked
            })
        })
        .collect();
    let acked: Vec<Vec<u32>> = writers
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    stop.store(true, Ordering::SeqCst);
    opener.join().unwrap();
    assert_eq!(acked.len(), 2 * PUTS as usize);
    assert!(opens.done.load(Ordering::SeqCst) >= 2 * u64::from(PUTS));
    let s = Store::open(dir.path(), opts()).unwrap();
    let report = s.verify(&|_, _| {}).unwrap();
    let lost: Vec<_> = acked
        .iter()
        .filter(|t| s.lookup(t, b"").unwrap() != 32)
        .collect();
    assert!(
        report.damaged.is_empty() && report.problems.is_empty(),
        "{} damaged, {:?}",
        report.damaged.len(),
        report.problems
    );
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged puts lost",
        lost.len(),
        acked.len()
    );
}
