//! `lookup` is exact on long chains (hashed and probed a chunk at a time,
//! in key order, see `store/lookup.rs`): holes in the middle of a chain
//! (blocks removed from the index as eviction does, damaged records found
//! by a read, pinned blocks removed) end the prefix exactly where a model
//! of the expected state says, on the handle that saw the chain and on
//! fresh handles.

use kvstore::index::Index;
use kvstore::{DType, Durability, Keyer, Layout, Options, Store};
use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

mod support;
use support::{kv_for, prefix_matches, seq};

/// Small blocks (4 tokens, 64 bytes of KV), so chains of thousands of
/// blocks (several of the walk's 1024-block chunks) stay small.
fn layout() -> Layout {
    Layout::new(1, 1, 4, DType::Float16, 4).unwrap()
}

fn opts() -> Options {
    Options {
        fingerprint: Some("lookup-model@1".into()),
        layout: Some(layout()),
        durability: Durability::None,
        ..Options::default()
    }
}

/// The model: the longest prefix of `ids` whose blocks are all present.
fn expected(ids: &[[u8; 32]], removed: &BTreeSet<usize>) -> usize {
    (0..ids.len())
        .find(|i| removed.contains(i))
        .unwrap_or(ids.len())
        * 4
}

/// Removes block `i` of the chain from the index, as eviction does.
fn remove(dir: &Path, id: &[u8; 32]) {
    let index = Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap();
    let mut txn = index.write().unwrap();
    let loc = index
        .get_block_rw(&txn, id)
        .unwrap()
        .expect("block indexed");
    assert!(index.delete_block_if_at(&mut txn, id, &loc).unwrap());
    index.commit(txn, false).unwrap();
}

/// Both the handle that has the chain's locations cached and a fresh one
/// agree with the model.
fn check(dir: &Path, s: &Store, tokens: &[u32], want: usize) {
    assert_eq!(s.lookup(tokens, b"").unwrap(), want, "same handle");
    let fresh = Store::open(dir, opts()).unwrap();
    assert_eq!(fresh.lookup(tokens, b"").unwrap(), want, "fresh handle");
    assert_eq!(fresh.stored_prefix(tokens, b"").unwrap(), want);
    // Past the end of the stored prefix by one token: the same answer.
    let mut longer = tokens.to_vec();
    longer.push(7);
    assert_eq!(fresh.lookup(&longer, b"").unwrap(), want);
}

#[test]
fn holes_end_the_prefix_where_the_model_says() {
    let l = layout();
    // Chains below the chunked walk's threshold (64 blocks) and of several
    // 1024-block chunks; holes at chunk edges, at the start, at the end, and
    // several at once.
    let cases: &[(usize, &[usize])] = &[
        (40, &[]),
        (40, &[17]),
        (100, &[]),
        (100, &[37]),
        (1500, &[]),
        (1500, &[0]),
        (1500, &[511]),
        (1500, &[512]),
        (1500, &[1023, 7]),
        (2500, &[1024]),
        (1500, &[1499]),
        (2048, &[1600, 900, 1601]),
    ];
    for (seed, &(blocks, holes)) in cases.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = seq(seed as u32 + 1, blocks * 4 + 3);
        let s = Store::open(dir.path(), opts()).unwrap();
        assert_eq!(
            s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
                .unwrap(),
            blocks * 4
        );
        let ids = Keyer::new("lookup-model@1", &l, None).chain(&tokens, 4, b"");
        let mut removed = BTreeSet::new();
        check(dir.path(), &s, &tokens, expected(&ids, &removed));
        for &h in holes {
            remove(dir.path(), &ids[h]);
            removed.insert(h);
            check(dir.path(), &s, &tokens, expected(&ids, &removed));
        }
        // A put of the same tokens fills the holes again.
        s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
            .unwrap();
        check(dir.path(), &s, &tokens, blocks * 4);
    }
}

/// A store at `dir` holding a chain of `blocks` blocks: the open handle,
/// the tokens and the chain's ids.
fn stored_chain(dir: &Path, seed: u32, blocks: usize) -> (Store, Vec<u32>, Vec<[u8; 32]>) {
    let l = layout();
    let tokens = seq(seed, blocks * 4);
    let s = Store::open(dir, opts()).unwrap();
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    let ids = Keyer::new("lookup-model@1", &l, None).chain(&tokens, 4, b"");
    (s, tokens, ids)
}

#[test]
fn a_damaged_block_found_by_a_read_ends_the_prefix() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1300;
    let (s, tokens, ids) = stored_chain(dir.path(), 77, blocks);
    let bad = 700;
    let loc = {
        let index = Index::open(
            &dir.path().join("index"),
            true,
            kvstore::DEFAULT_INDEX_BYTES,
        )
        .unwrap();
        let txn = index.read().unwrap();
        index.get_block(&txn, &ids[bad]).unwrap().unwrap()
    };
    // The payload's last byte, flipped.
    let seg = dir
        .path()
        .join("segments")
        .join(format!("{:016x}.kvseg", loc.segment));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap_or_else(|e| {
            panic!("{}: {e}", seg.display());
        });
    let at = loc.offset + loc.record_len - 1;
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0xff], at).unwrap();
    // Not yet read: the index still lists it.
    check(dir.path(), &s, &tokens, blocks * 4);
    let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
    let m = s.get_into(&tokens, b"", &mut out, tokens.len()).unwrap();
    assert_eq!(m, bad * 4, "the read stops at the damaged block");
    assert!(prefix_matches(&l, &out, tokens.len(), &tokens, m));
    // Quarantined by that read: a hole from now on.
    check(dir.path(), &s, &tokens, bad * 4);
}

#[test]
fn a_pinned_block_removed_from_the_middle_ends_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1100;
    let (s, tokens, ids) = stored_chain(dir.path(), 5, blocks);
    assert_eq!(s.pin(&tokens, b"", 5, None).unwrap(), blocks * 4);
    remove(dir.path(), &ids[600]);
    check(dir.path(), &s, &tokens, 600 * 4);
}

#[test]
fn pending_blocks_past_the_committed_ones_count_on_their_handle() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let committed = seq(9, 700 * 4);
    let mut tokens = committed.clone();
    tokens.extend(seq(10, 800 * 4));
    let batch = || Options {
        durability: Durability::Batch,
        batch_window: std::time::Duration::from_secs(3600),
        batch_bytes: 1 << 30,
        ..opts()
    };
    let s = Store::open(dir.path(), batch()).unwrap();
    s.put(&committed, &kv_for(&l, &committed), committed.len(), b"")
        .unwrap();
    s.flush().unwrap();
    // The rest waits for its group commit: only this handle sees it.
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    assert_eq!(s.lookup(&tokens, b"").unwrap(), tokens.len());
    let other = Store::open(dir.path(), opts()).unwrap();
    assert_eq!(other.lookup(&tokens, b"").unwrap(), committed.len());
    s.flush().unwrap();
    assert_eq!(other.lookup(&tokens, b"").unwrap(), tokens.len());
}
