//! Hash collisions, forced (feature `test-short-ids`: block ids keep 16 bits).
//!
//! With 65,536 possible ids, a few thousand blocks collide by the dozen. The
//! model: the first block stored under an id owns it; any other token
//! sequence mapping to that id must be a miss (never the owner's KV), through
//! the hot tier and the disk alike, and a collision is not damage.

use kvstore::{DType, Durability, Keyer, Layout, Options, Store};
use std::collections::HashMap;

mod support;
use support::{kv_for, prefix_matches, NO_PROGRESS};

fn layout() -> Layout {
    Layout::new(1, 1, 8, DType::Float16, 4).unwrap()
}

fn check(hot: bool) {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let l = layout();
    let opts = Options {
        fingerprint: Some("collide@1".into()),
        layout: Some(l),
        durability: Durability::None,
        hot_bytes: hot.then_some(8 << 20),
        hot_dir: hot.then(|| shm.path().to_path_buf()),
        ..Options::default()
    };
    let store = Store::open(dir.path(), opts.clone()).unwrap();
    let keyer = Keyer::new("collide@1", &l, None);
    // Two-block sequences: the second block's id depends on the first's.
    let seqs: Vec<Vec<u32>> = (0..3000u32)
        .map(|i| (0..8).map(|j| i * 8 + j).collect())
        .collect();
    let mut owner: HashMap<[u8; 32], (usize, usize)> = HashMap::new();
    // Expected stored prefix (in blocks) of each sequence: a block is stored
    // unless its id is already owned by another (sequence, block).
    let mut expect = Vec::new();
    for (s, tokens) in seqs.iter().enumerate() {
        store.put(tokens, &kv_for(&l, tokens), 8, b"").unwrap();
        let ids = keyer.chain(tokens, 4, b"");
        // put stores every block whose id is free, colliding ones or not.
        let owned: Vec<bool> = ids
            .iter()
            .enumerate()
            .map(|(b, id)| *owner.entry(*id).or_insert((s, b)) == (s, b))
            .collect();
        expect.push(owned.iter().take_while(|o| **o).count());
    }
    let collided = expect.iter().filter(|n| **n < 2).count();
    assert!(
        collided > 10,
        "16-bit ids over 6000 blocks should collide, {collided} did"
    );
    for round in 0..2 {
        // Round 1 reads again: promoted (hot) copies must behave the same.
        for (s, tokens) in seqs.iter().enumerate() {
            let mut out = vec![0u8; l.kv_bytes(8).unwrap()];
            let m = store.get_into(tokens, b"", &mut out, 8).unwrap();
            assert_eq!(
                m,
                expect[s] * 4,
                "sequence {s}, round {round}: served {m} tokens, the model says {}",
                expect[s] * 4
            );
            assert!(
                prefix_matches(&l, &out, 8, tokens, m),
                "sequence {s}: wrong bytes"
            );
        }
    }
    let report = store.verify(NO_PROGRESS).unwrap();
    assert!(report.damaged.is_empty(), "collisions are not damage");
    eprintln!(
        "hot={hot}: {} sequences, {collided} hit a collision, every one a miss",
        seqs.len()
    );
    store.close().unwrap();
    if hot {
        let _ = std::fs::remove_dir_all(shm.path());
    }
}

#[test]
fn colliding_ids_are_misses_on_disk() {
    check(false);
}

#[test]
fn colliding_ids_are_misses_through_the_hot_tier() {
    check(true);
}

/// Chains long enough for `lookup`'s chunked walk (64 blocks and more):
/// with colliding ids, it counts exactly the leading blocks whose ids are
/// indexed (probed one by one here), and `get` serves exactly the leading
/// blocks this chain owns.
#[test]
fn long_chains_with_colliding_ids_are_counted_block_by_block() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let opts = Options {
        fingerprint: Some("collide@1".into()),
        layout: Some(l),
        durability: Durability::None,
        ..Options::default()
    };
    let store = Store::open(dir.path(), opts).unwrap();
    let keyer = Keyer::new("collide@1", &l, None);
    let blocks = 80;
    let seqs: Vec<Vec<u32>> = (0..60u32)
        .map(|i| (0..blocks * 4).map(|j| i * 1000 + j).collect())
        .collect();
    let mut owner: HashMap<[u8; 32], (usize, usize)> = HashMap::new();
    let mut owned_prefix = Vec::new();
    for (s, tokens) in seqs.iter().enumerate() {
        let n = tokens.len();
        store.put(tokens, &kv_for(&l, tokens), n, b"").unwrap();
        let ids = keyer.chain(tokens, 4, b"");
        owned_prefix.push(
            ids.iter()
                .enumerate()
                .take_while(|&(b, id)| *owner.entry(*id).or_insert((s, b)) == (s, b))
                .count(),
        );
        // Blocks past the first not owned still take their ids if free.
        for (b, id) in ids.iter().enumerate() {
            owner.entry(*id).or_insert((s, b));
        }
    }
    assert!(
        owned_prefix.iter().any(|&n| n < blocks as usize),
        "16-bit ids over 4800 blocks should collide"
    );
    let index = kvstore::index::Index::open(
        &dir.path().join("index"),
        true,
        kvstore::DEFAULT_INDEX_BYTES,
    )
    .unwrap();
    let txn = index.read().unwrap();
    for (s, tokens) in seqs.iter().enumerate() {
        let ids = keyer.chain(tokens, 4, b"");
        let indexed = ids
            .iter()
            .take_while(|id| index.get_block(&txn, id).unwrap().is_some())
            .count();
        assert_eq!(
            store.lookup(tokens, b"").unwrap(),
            indexed * 4,
            "sequence {s}"
        );
        let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
        let m = store.get_into(tokens, b"", &mut out, tokens.len()).unwrap();
        assert_eq!(m, owned_prefix[s] * 4, "sequence {s}");
        assert!(prefix_matches(&l, &out, tokens.len(), tokens, m));
    }
}
