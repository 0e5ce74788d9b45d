//! A failed fdatasync poisons the handle (feature `fault-injection`): the
//! kernel may have dropped the dirty pages, so a retry that succeeds proves
//! nothing. Every later write on that handle fails; a new handle recovers.
//! A failed index commit does not poison: the synced records stay pending
//! and the next commit publishes them.

use kvstore::fault::{self, Mode, Op};
use kvstore::{DType, Durability, Error, Layout, Options, Store};
use std::sync::Mutex;

/// The fault plan is one per process: these tests take turns with it.
static FAULTS: Mutex<()> = Mutex::new(());

fn opts() -> Options {
    Options {
        fingerprint: Some("poison@1".into()),
        layout: Some(Layout::new(1, 1, 8, DType::Float16, 4).unwrap()),
        durability: Durability::Sync,
        ..Options::default()
    }
}

/// `[1, 2, T, 1, 8]` float16: 32 bytes per token, a function of the tokens.
fn kv(tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|t| {
            let b = t.to_le_bytes();
            (0..32).map(move |j| b[j % 4] ^ j as u8)
        })
        .collect()
}

#[test]
fn failed_fdatasync_poisons_the_handle() {
    let _turn = FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), opts()).unwrap();
    let a: Vec<u32> = (0..8).collect();
    store.put(&a, &kv(&a), 8, b"").unwrap();

    // Find the put's fdatasync: count the steps of an identical put first.
    let b: Vec<u32> = (100..108).collect();
    fault::count_only();
    store.put(&b, &kv(&b), 8, b"").unwrap();
    let sync_at = fault::trace()
        .iter()
        .position(|op| *op == Op::Sync)
        .unwrap() as u64
        + 1;

    let c: Vec<u32> = (200..208).collect();
    fault::arm(sync_at, Mode::Fail);
    match store.put(&c, &kv(&c), 8, b"") {
        Err(Error::Poisoned(_)) => {}
        other => panic!("expected Poisoned, got {other:?}"),
    }
    fault::count_only(); // nothing fails from here on
    let d: Vec<u32> = (300..308).collect();
    assert!(matches!(
        store.put(&d, &kv(&d), 8, b""),
        Err(Error::Poisoned(_))
    ));
    assert!(matches!(store.flush(), Err(Error::Poisoned(_))));
    // Reads still work on the poisoned handle.
    let mut out = vec![0u8; kv(&a).len()];
    assert_eq!(store.get_into(&a, b"", &mut out, 8).unwrap(), 8);
    assert_eq!(out, kv(&a));
    drop(store);

    let store = Store::open(dir.path(), opts()).unwrap();
    for (t, stored) in [(&a, 8), (&b, 8), (&c, 0), (&d, 0)] {
        assert_eq!(store.stored_prefix(t, b"").unwrap(), stored, "{t:?}");
    }
    store.put(&c, &kv(&c), 8, b"").unwrap();
    let mut out = vec![0u8; kv(&c).len()];
    assert_eq!(store.get_into(&c, b"", &mut out, 8).unwrap(), 8);
    assert_eq!(out, kv(&c));
    assert!(store.verify(&|_, _| {}).unwrap().damaged.is_empty());
}

/// A group commit whose index transaction fails keeps the batch's records:
/// their puts have returned, so `flush` reports the failure, and the next
/// commit publishes them (it used to drop them, and the next `flush` said
/// everything was durable).
#[test]
fn a_failed_group_commit_keeps_the_batch() {
    let _turn = FAULTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let opts = || Options {
        durability: Durability::Batch,
        batch_window: std::time::Duration::from_secs(3600),
        ..opts()
    };
    let store = Store::open(dir.path(), opts()).unwrap();
    // Find a flush's index commit: count the steps of an identical one first.
    let a: Vec<u32> = (0..8).collect();
    store.put(&a, &kv(&a), 8, b"").unwrap();
    fault::count_only();
    store.flush().unwrap();
    let commit_at = fault::trace()
        .iter()
        .position(|op| *op == Op::Commit)
        .unwrap() as u64
        + 1;

    let b: Vec<u32> = (100..108).collect();
    store.put(&b, &kv(&b), 8, b"").unwrap();
    fault::arm(commit_at, Mode::Fail);
    assert!(
        store.flush().is_err(),
        "a failed commit must not read as durable"
    );
    fault::count_only(); // nothing fails from here on
    store.flush().unwrap();
    drop(store);

    let store = Store::open(dir.path(), opts()).unwrap();
    assert_eq!(store.stored_prefix(&b, b"").unwrap(), 8);
    let mut out = vec![0u8; kv(&b).len()];
    assert_eq!(store.get_into(&b, b"", &mut out, 8).unwrap(), 8);
    assert_eq!(out, kv(&b));
}
