//! Recovery (run by every open) must never touch a live writer's segment.

use kvstore::{DType, Durability, Layout, Options, Store};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn opts() -> Options {
    Options {
        fingerprint: Some("race@1".into()),
        layout: Some(Layout::new(2, 8, 128, DType::Float16, 16).unwrap()),
        durability: Durability::None,
        segment_bytes: 1 << 20,
        ..Options::default()
    }
}

#[test]
fn opening_while_others_write_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let l = opts().layout.unwrap();
    Store::open(dir.path(), opts()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let path = dir.path().to_path_buf();
            std::thread::spawn(move || {
                let s = Store::open(&path, opts()).unwrap();
                let mut acked = Vec::new();
                let end = Instant::now() + Duration::from_secs(3);
                let mut i = 0u32;
                while Instant::now() < end {
                    let toks: Vec<u32> = (0..32).map(|j| w * 10_000_000 + i * 32 + j).collect();
                    let kv = vec![(i % 251) as u8; l.kv_bytes(32).unwrap()];
                    s.put(&toks, &kv, 32, b"").unwrap();
                    acked.push(toks);
                    i += 1;
                }
                s.close().unwrap();
                acked
            })
        })
        .collect();
    let opener = {
        let (path, stop) = (dir.path().to_path_buf(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                Store::open(&path, opts()).unwrap().close().unwrap();
                n += 1;
            }
            n
        })
    };
    let acked: Vec<Vec<u32>> = writers
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    stop.store(true, Ordering::Relaxed);
    assert!(opener.join().unwrap() > 10);
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
