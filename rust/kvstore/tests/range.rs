//! Range puts and gets (`put_from`, `get_from`): the KV of `tokens[start..]`
//! only, as a chunked prefill or a connector hands it over, checked against
//! the same reference KV as whole puts and gets.

use kvstore::{DType, Durability, Error, Layout, Options, Store};

mod support;
use support::{kv_for, seq};

fn layout() -> Layout {
    Layout::new(2, 2, 4, DType::Float16, 4).unwrap()
}

fn open(dir: &std::path::Path) -> Store {
    Store::open(
        dir,
        Options {
            fingerprint: Some("range@1".into()),
            layout: Some(layout()),
            durability: Durability::Sync,
            ..Options::default()
        },
    )
    .unwrap()
}

/// Tokens `from..to` of a `[L, 2, t, H, D]` buffer, as a `[L, 2, to - from, H, D]` one.
fn rows(l: &Layout, kv: &[u8], t: usize, from: usize, to: usize) -> Vec<u8> {
    let tb = l.token_bytes();
    (0..l.num_layers as usize * 2)
        .flat_map(|lk| kv[(lk * t + from) * tb..(lk * t + to) * tb].iter().copied())
        .collect()
}

#[test]
fn chunked_puts_store_what_one_put_stores() {
    let l = layout();
    let tokens = seq(3, 26); // 6 full blocks of 4, and 2 tokens
    let kv = kv_for(&l, &tokens);
    let (whole_dir, chunk_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let whole = open(whole_dir.path());
    assert_eq!(whole.put(&tokens, &kv, 26, b"").unwrap(), 24);
    let chunked = open(chunk_dir.path());
    // A chunked prefill: 8, then 12 more, then the rest; each put gets only
    // its new tokens' KV.
    for (from, to) in [(0, 8), (8, 20), (20, 26)] {
        let part = rows(&l, &kv, 26, from, to);
        let covered = chunked
            .put_from(&tokens[..to], from, &part, to - from, b"")
            .unwrap();
        assert_eq!(covered, to / 4 * 4);
    }
    assert_eq!(chunked.stats().unwrap().blocks_written, 6);
    assert_eq!(
        chunked.block_ids(&tokens, b"").unwrap(),
        whole.block_ids(&tokens, b"").unwrap()
    );
    for s in [&whole, &chunked] {
        let mut out = vec![0u8; l.kv_bytes(26).unwrap()];
        assert_eq!(s.get_into(&tokens, b"", &mut out, 26).unwrap(), 24);
        assert_eq!(rows(&l, &out, 26, 0, 24), rows(&l, &kv, 26, 0, 24));
    }
}

#[test]
fn range_get_reads_from_start_and_returns_the_whole_prefix() {
    let l = layout();
    let tokens = seq(4, 24);
    let kv = kv_for(&l, &tokens);
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    s.put(&tokens[..16], &rows(&l, &kv, 24, 0, 16), 16, b"")
        .unwrap();
    for start in [0, 4, 8, 12, 16] {
        let room = 24 - start;
        let mut out = vec![0xAAu8; l.kv_bytes(room).unwrap()];
        let m = s.get_from(&tokens, start, b"", &mut out, room).unwrap();
        assert_eq!(m, 16, "start {start}");
        let got = rows(&l, &out, room, 0, 16 - start);
        assert_eq!(got, rows(&l, &kv, 24, start, 16), "start {start}");
    }
    // `out` shorter than the rest of the prefix: it bounds what is read.
    let mut out = vec![0u8; l.kv_bytes(4).unwrap()];
    assert_eq!(s.get_from(&tokens, 8, b"", &mut out, 4).unwrap(), 12);
    assert_eq!(out, rows(&l, &kv, 24, 8, 12));
}

#[test]
fn a_missing_block_before_start_ends_the_prefix_there() {
    let l = layout();
    let tokens = seq(5, 16);
    let kv = kv_for(&l, &tokens);
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    // Blocks 2 and 3 only: their parents are not stored.
    s.put_from(&tokens, 8, &rows(&l, &kv, 16, 8, 16), 8, b"")
        .unwrap();
    assert_eq!(s.stats().unwrap().blocks, 2);
    assert_eq!(s.lookup(&tokens, b"").unwrap(), 0);
    let mut out = vec![0x55u8; l.kv_bytes(8).unwrap()];
    assert_eq!(s.get_from(&tokens, 8, b"", &mut out, 8).unwrap(), 0);
    assert!(
        out.iter().all(|&b| b == 0x55),
        "out written past the prefix"
    );
    // Once the parents are stored, the whole chain is found.
    s.put_from(&tokens[..8], 0, &rows(&l, &kv, 16, 0, 8), 8, b"")
        .unwrap();
    assert_eq!(s.lookup(&tokens, b"").unwrap(), 16);
    assert_eq!(s.get_from(&tokens, 8, b"", &mut out, 8).unwrap(), 16);
    assert_eq!(out, rows(&l, &kv, 16, 8, 16));
}

#[test]
fn bad_ranges_are_invalid_input_and_write_nothing() {
    let l = layout();
    let tokens = seq(6, 16);
    let kv = kv_for(&l, &tokens);
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let part = rows(&l, &kv, 16, 4, 16);
    for start in [1, 6, 20] {
        let e = s.put_from(&tokens, start, &part, 12, b"").unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "start {start}: {e}");
        let mut out = vec![0u8; l.kv_bytes(4).unwrap()];
        let e = s.get_from(&tokens, start, b"", &mut out, 4).unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "start {start}: {e}");
    }
    // KV shorter than the blocks from `start` on.
    let e = s
        .put_from(&tokens, 4, &rows(&l, &kv, 16, 4, 12), 8, b"")
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    assert_eq!(s.stats().unwrap().blocks_written, 0);
}

#[test]
fn range_puts_dedupe_only_their_own_blocks() {
    let l = layout();
    let tokens = seq(7, 16);
    let kv = kv_for(&l, &tokens);
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    s.put(&tokens[..8], &rows(&l, &kv, 16, 0, 8), 8, b"")
        .unwrap();
    // From 4: block 1 is stored already (deduped), 2 and 3 are new; block 0
    // is before the range and not counted at all.
    s.put_from(&tokens, 4, &rows(&l, &kv, 16, 4, 16), 12, b"")
        .unwrap();
    let st = s.stats().unwrap();
    assert_eq!((st.blocks, st.blocks_written, st.blocks_deduped), (4, 4, 1));
}
