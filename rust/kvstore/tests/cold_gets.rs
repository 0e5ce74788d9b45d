//! A small buffered get whose records the page cache does not hold reads
//! them on one thread, one sequential stream (`store::read`'s
//! `one_cold_stream`), and checks each record whole: the first that does not
//! check ends the prefix there, with every block before it served exactly,
//! whether the damage is in a payload, a record's token ids or the padding
//! between records, or the file ends mid-record. Checked against KV
//! recomputed from the token ids, on a fresh handle after the segment is
//! evicted from the page cache (and, for comparison, with it cached).

use kvstore::record::meta_len;
use kvstore::{DType, Durability, Layout, Options, Store};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod support;
use support::{kv_for, payload_offset, prefix_matches, record_end, seq};

/// 128 KiB blocks: 48 of them (6 MiB), two reader threads' worth of a
/// cached get on two cores or more.
fn layout() -> Layout {
    Layout::new(2, 8, 128, DType::Float16, 16).unwrap()
}

const BLOCKS: usize = 48;

fn opts(segment_bytes: u64) -> Options {
    Options {
        fingerprint: Some("test-model@1".into()),
        layout: Some(layout()),
        durability: Durability::Sync,
        segment_bytes,
        // The buffered path (direct reads have their own threads).
        direct_reads: Some(false),
        ..Options::default()
    }
}

fn segment(dir: &Path) -> PathBuf {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1);
    files.pop().unwrap()
}

/// A store of one `BLOCKS`-block sequence in one segment, written in order.
fn stored(dir: &Path) -> Vec<u32> {
    let l = layout();
    let t = seq(23, BLOCKS * l.block_size as usize);
    let s = Store::open(dir, opts(64 << 20)).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    t
}

/// Evicts the store's segment files from the page cache (as far as the
/// kernel does: a page in use stays, and the get is only as cold as that).
fn evict(dir: &Path) {
    for e in std::fs::read_dir(dir.join("segments")).unwrap() {
        let f = std::fs::File::open(e.unwrap().path()).unwrap();
        f.sync_all().unwrap();
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    }
}

/// (tokens served, exact, blocks counted as hits, damaged blocks) of a get
/// of all of `t` on a fresh handle into a buffer that starts out all 0xAA,
/// the segments evicted from the page cache first when `cold`.
fn get_as(dir: &Path, t: &[u32], cold: bool) -> (usize, bool, u64, u64) {
    let l = layout();
    if cold {
        evict(dir);
    }
    let s = Store::open(dir, opts(64 << 20)).unwrap();
    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
    let m = s.get_into(t, b"", &mut out, t.len()).unwrap();
    let exact = prefix_matches(&l, &out, t.len(), t, m);
    let st = s.stats().unwrap();
    (m, exact, st.hit_blocks, st.damaged_blocks)
}

fn get(dir: &Path, t: &[u32]) -> (usize, bool, u64, u64) {
    get_as(dir, t, true)
}

fn poke(dir: &Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(segment(dir))
        .unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0x5A], at).unwrap();
}

#[test]
fn whole_get_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let t = stored(dir.path());
    for cold in [true, false] {
        let (m, exact, hits, _) = get_as(dir.path(), &t, cold);
        assert_eq!((m, hits), (t.len(), BLOCKS as u64), "cold: {cold}");
        assert!(exact, "cold: {cold}");
    }
    // Records split over several segments.
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let s = Store::open(dir.path(), opts(1 << 20)).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    drop(s);
    evict(dir.path());
    let s = Store::open(dir.path(), opts(1 << 20)).unwrap();
    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
    assert_eq!(s.get_into(&t, b"", &mut out, t.len()).unwrap(), t.len());
    assert!(prefix_matches(&l, &out, t.len(), &t, t.len()));
}

#[test]
fn a_damaged_record_ends_the_prefix_there() {
    let l = layout();
    let b = l.block_size as usize;
    let meta = meta_len(&l) as u64;
    // (block, where in it): its payload, its token ids, its padding; the
    // first block, the second, in the middle, at the middle cut of a cached
    // get's two ranges, the last.
    let cases: Vec<(usize, &str, u64)> = [1, 7, 23, 24, 35, BLOCKS - 1]
        .into_iter()
        .flat_map(|k| {
            [
                (k, "payload", payload_offset(&l, k) + 5000),
                (k, "token ids", payload_offset(&l, k) - 8),
                (k, "padding", payload_offset(&l, k) - meta - 1),
            ]
        })
        .chain([(0, "payload", payload_offset(&l, 0) + 77)])
        .collect();
    for (k, what, at) in cases {
        let dir = tempfile::tempdir().unwrap();
        let t = stored(dir.path());
        poke(dir.path(), at);
        let case = format!("block {k}, {what}");
        let (m, exact, hits, damaged) = get(dir.path(), &t);
        assert_eq!((m, hits, damaged), (k * b, k as u64, 1), "{case}");
        assert!(exact, "wrong bytes before the damage: {case}");
        // Quarantined (once): the same get again ends at the same block.
        let (again, exact, _, damaged) = get(dir.path(), &t);
        assert_eq!((again, damaged), (m, 1), "{case}");
        assert!(exact, "{case}");
    }
}

#[test]
fn a_short_file_serves_the_records_before_the_cut() {
    let l = layout();
    let b = l.block_size as usize;
    for k in [1, 20, 33, BLOCKS - 1] {
        for (what, len) in [
            ("mid-payload", record_end(&l, k) - 100),
            ("mid-meta", payload_offset(&l, k) - 20),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let t = stored(dir.path());
            let f = OpenOptions::new()
                .write(true)
                .open(segment(dir.path()))
                .unwrap();
            f.set_len(len).unwrap();
            drop(f);
            let (m, exact, hits, _) = get(dir.path(), &t);
            assert_eq!((m, hits), (k * b, k as u64), "cut in block {k}, {what}");
            assert!(exact, "cut in block {k}, {what}");
        }
    }
}
