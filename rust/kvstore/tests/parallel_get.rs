//! A get large enough to be split among reader threads returns exactly what
//! the one-thread walk returns: the first block not served (damaged, or its
//! segment file gone) ends the prefix, wherever the ranges are cut, and no
//! block after it is reported served. Checked against KV recomputed from the
//! token ids.

use kvstore::{DType, Durability, Layout, Options, Store};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod support;
use support::{kv_for, prefix_matches, seq};

/// 128 KiB blocks: 64 of them (8 MiB) are split among every core's reader.
fn layout() -> Layout {
    Layout::new(2, 8, 128, DType::Float16, 16).unwrap()
}

const BLOCKS: usize = 64;
const SEGMENT_HEADER: u64 = 32;
const RECORD_HEADER: u64 = 80;

fn opts(segment_bytes: u64) -> Options {
    Options {
        fingerprint: Some("test-model@1".into()),
        layout: Some(layout()),
        durability: Durability::Sync,
        segment_bytes,
        ..Options::default()
    }
}

fn record_len(l: &Layout) -> u64 {
    RECORD_HEADER + 4 * u64::from(l.block_size) + l.block_bytes() as u64
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

/// A store of one `BLOCKS`-block sequence, written in order.
fn stored(dir: &Path, segment_bytes: u64) -> Vec<u32> {
    let l = layout();
    let t = seq(11, BLOCKS * l.block_size as usize);
    let s = Store::open(dir, opts(segment_bytes)).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    t
}

/// (tokens served, exact, blocks counted as hits) of a get of all of `t`
/// into a buffer that starts out all 0xAA.
fn get(dir: &Path, segment_bytes: u64, t: &[u32]) -> (usize, bool, u64) {
    let l = layout();
    let s = Store::open(dir, opts(segment_bytes)).unwrap();
    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
    let m = s.get_into(t, b"", &mut out, t.len()).unwrap();
    let exact = prefix_matches(&l, &out, t.len(), t, m);
    (m, exact, s.stats().unwrap().hit_blocks)
}

#[test]
fn whole_get_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let t = stored(dir.path(), 64 << 20);
    let (m, exact, hits) = get(dir.path(), 64 << 20, &t);
    assert_eq!((m, hits), (t.len(), BLOCKS as u64));
    assert!(exact, "wrong bytes");
}

#[test]
fn damaged_blocks_end_the_prefix_in_any_range() {
    let l = layout();
    let b = l.block_size as usize;
    // At the start, within the first range, at the cut of two or four
    // ranges, within a later range, the last block; and two damaged blocks,
    // the later one met first by its own reader.
    let cases: &[&[usize]] = &[&[0], &[5], &[16], &[32], &[40], &[63], &[10, 40], &[33, 48]];
    for damaged in cases {
        let dir = tempfile::tempdir().unwrap();
        let t = stored(dir.path(), 64 << 20);
        let seg = segments(dir.path()).pop().unwrap();
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        for &k in *damaged {
            let payload = SEGMENT_HEADER + k as u64 * record_len(&l) + RECORD_HEADER + 4 * b as u64;
            f.write_all_at(&[0x55], payload + 1000).unwrap();
        }
        drop(f);
        let first = *damaged.iter().min().unwrap();
        let (m, exact, hits) = get(dir.path(), 64 << 20, &t);
        assert_eq!(m, first * b, "damaged blocks {damaged:?}");
        assert_eq!(hits, first as u64, "damaged blocks {damaged:?}");
        assert!(exact, "wrong bytes before damaged blocks {damaged:?}");
        // The damage was quarantined: the same get again is the same miss.
        let (again, exact, _) = get(dir.path(), 64 << 20, &t);
        assert_eq!(again, m);
        assert!(exact);
    }
}

#[test]
fn a_missing_segment_file_ends_the_prefix_at_its_first_block() {
    let l = layout();
    let segment_bytes = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let t = stored(dir.path(), segment_bytes);
    let files = segments(dir.path());
    assert!(files.len() >= 6, "{} segment files", files.len());
    // Lose a file holding blocks of the second half (another reader's range).
    let lost = files.len() * 2 / 3;
    let before: u64 = files[..lost]
        .iter()
        .map(|p| (p.metadata().unwrap().len() - SEGMENT_HEADER) / record_len(&l))
        .sum();
    std::fs::remove_file(&files[lost]).unwrap();
    let (m, exact, hits) = get(dir.path(), segment_bytes, &t);
    assert_eq!(m, before as usize * l.block_size as usize);
    assert_eq!(hits, before);
    assert!(exact, "wrong bytes before the lost file");
}
