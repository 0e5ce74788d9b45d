//! A get large enough to be split among reader threads returns exactly what
//! the one-thread walk returns: the first block not served (damaged, or its
//! segment file gone) ends the prefix, wherever the ranges are cut, and no
//! block after it is reported served. Checked against KV recomputed from the
//! token ids, with 1 to 4 reader threads forced (`get_readers`) whatever the
//! machine's cores.

use kvstore::format;
use kvstore::{DType, Durability, Error, Layout, Options, Store};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod support;
use support::{kv_for, prefix_matches, seq, NO_PROGRESS};

/// 128 KiB blocks: 64 of them (8 MiB) are split among every core's reader.
fn layout() -> Layout {
    Layout::new(2, 8, 128, DType::Float16, 16).unwrap()
}

const BLOCKS: usize = 64;
/// Reader counts each test runs with: 64 blocks cut at 32; 22 and 44; 16,
/// 32 and 48.
const READERS: [usize; 4] = [1, 2, 3, 4];
const SEGMENT_HEADER: u64 = 32;
const RECORD_HEADER: u64 = 80;

fn opts(segment_bytes: u64, readers: usize) -> Options {
    Options {
        fingerprint: Some("test-model@1".into()),
        layout: Some(layout()),
        durability: Durability::Sync,
        segment_bytes,
        get_readers: Some(readers),
        ..Options::default()
    }
}

/// [`opts`] with a hot tier in `hot_dir`, room for every block.
fn hot_opts(readers: usize, hot_dir: &Path) -> Options {
    Options {
        hot_bytes: Some(32 << 20),
        hot_dir: Some(hot_dir.to_path_buf()),
        ..opts(64 << 20, readers)
    }
}

/// Bytes of a record after the first of a segment (version 2: its padding,
/// meta and payload; the payloads of this layout are whole pages, so every
/// record but the first takes the same room).
fn record_len(l: &Layout) -> u64 {
    format::PAYLOAD_ALIGN + l.block_bytes() as u64
}

/// Offset of record k's payload in a segment of this layout.
fn payload_at(l: &Layout, k: usize) -> u64 {
    let meta = (RECORD_HEADER + 4 * u64::from(l.block_size)) as usize;
    let first = SEGMENT_HEADER
        + format::pad_before(2, SEGMENT_HEADER, meta, l.block_bytes() as u64)
        + meta as u64;
    first + k as u64 * record_len(l)
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
    let s = Store::open(dir, opts(segment_bytes, 1)).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    t
}

/// Writes a byte into the payload of each of blocks `damaged`.
fn damage(dir: &Path, damaged: &[usize]) {
    let l = layout();
    let seg = segments(dir).pop().unwrap();
    let f = OpenOptions::new().write(true).open(&seg).unwrap();
    for &k in damaged {
        f.write_all_at(&[0x55], payload_at(&l, k) + 1000).unwrap();
    }
}

/// (tokens served, exact, blocks counted as hits) of a get of all of `t`
/// into a buffer that starts out all 0xAA.
fn get(dir: &Path, o: Options, t: &[u32]) -> (usize, bool, u64) {
    let l = layout();
    let s = Store::open(dir, o).unwrap();
    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
    let m = s.get_into(t, b"", &mut out, t.len()).unwrap();
    let exact = prefix_matches(&l, &out, t.len(), t, m);
    (m, exact, s.stats().unwrap().hit_blocks)
}

#[test]
fn whole_get_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let t = stored(dir.path(), 64 << 20);
    for readers in READERS {
        let (m, exact, hits) = get(dir.path(), opts(64 << 20, readers), &t);
        assert_eq!((m, hits), (t.len(), BLOCKS as u64), "{readers} readers");
        assert!(exact, "wrong bytes with {readers} readers");
    }
    // More readers than blocks is fine; none is not.
    let (m, exact, _) = get(dir.path(), opts(64 << 20, 1000), &t);
    assert!(m == t.len() && exact);
    assert!(matches!(
        Store::open(dir.path(), opts(64 << 20, 0)),
        Err(Error::InvalidInput(_))
    ));
}

#[test]
fn damaged_blocks_end_the_prefix_in_any_range() {
    let b = layout().block_size as usize;
    // At the start, within the first range, at each cut of two, three or
    // four ranges, within a later range, the last block; and two damaged
    // blocks, the later one met first by its own reader.
    let cases: &[&[usize]] = &[
        &[0],
        &[5],
        &[16],
        &[22],
        &[32],
        &[40],
        &[44],
        &[63],
        &[10, 40],
        &[33, 48],
        &[23, 45],
    ];
    for readers in READERS {
        for damaged in cases {
            let dir = tempfile::tempdir().unwrap();
            let t = stored(dir.path(), 64 << 20);
            damage(dir.path(), damaged);
            let first = *damaged.iter().min().unwrap();
            let what = format!("damaged blocks {damaged:?}, {readers} readers");
            let (m, exact, hits) = get(dir.path(), opts(64 << 20, readers), &t);
            assert_eq!(m, first * b, "{what}");
            assert_eq!(hits, first as u64, "{what}");
            assert!(exact, "wrong bytes before {what}");
            // The damage was quarantined: the same get again is the same miss.
            let (again, exact, _) = get(dir.path(), opts(64 << 20, readers), &t);
            assert_eq!(again, m, "{what}");
            assert!(exact, "{what}");
        }
    }
}

#[test]
fn a_missing_segment_file_ends_the_prefix_at_its_first_block() {
    let l = layout();
    let segment_bytes = 1 << 20;
    for readers in READERS {
        let dir = tempfile::tempdir().unwrap();
        let t = stored(dir.path(), segment_bytes);
        let files = segments(dir.path());
        assert!(files.len() >= 6, "{} segment files", files.len());
        // Lose a file holding blocks of the second half (another reader's range).
        let lost = files.len() * 2 / 3;
        let before: u64 = files[..lost]
            .iter()
            .map(|p| p.metadata().unwrap().len() / record_len(&l))
            .sum();
        std::fs::remove_file(&files[lost]).unwrap();
        let (m, exact, hits) = get(dir.path(), opts(segment_bytes, readers), &t);
        assert_eq!(
            m,
            before as usize * l.block_size as usize,
            "{readers} readers"
        );
        assert_eq!(hits, before, "{readers} readers");
        assert!(exact, "wrong bytes before the lost file, {readers} readers");
    }
}

/// Once a damaged block is out of the index, a get finds it missing before
/// it reads anything: no block past it is read into the hot tier, whichever
/// reader's range they are in.
#[test]
fn nothing_past_a_known_miss_is_promoted() {
    let b = layout().block_size as usize;
    let bad = 20;
    for readers in READERS {
        let dir = tempfile::tempdir().unwrap();
        let hot = tempfile::tempdir().unwrap();
        // Stored without a hot tier: every block is promoted by a get.
        let t = stored(dir.path(), 64 << 20);
        damage(dir.path(), &[bad]);
        // One reader stops at the damage: it quarantines block `bad` and
        // promotes the blocks before it, no others.
        let (m, exact, _) = get(dir.path(), hot_opts(1, hot.path()), &t);
        assert!(m == bad * b && exact, "{m} tokens");
        let (m, exact, _) = get(dir.path(), hot_opts(readers, hot.path()), &t);
        assert_eq!(m, bad * b, "{readers} readers");
        assert!(exact, "{readers} readers");
        let s = Store::open(dir.path(), hot_opts(readers, hot.path())).unwrap();
        let in_hot: Vec<bool> = s
            .hot_blocks(&t, b"")
            .unwrap()
            .iter()
            .map(Option::is_some)
            .collect();
        let expect: Vec<bool> = (0..BLOCKS).map(|i| i < bad).collect();
        assert_eq!(in_hot, expect, "{readers} readers");
    }
}

/// Gets split among readers while another handle evicts and compacts: a
/// block found before its record moved is looked up again by its reader
/// (a snapshot of its own), never served wrong and never taken for damage.
#[test]
fn reads_racing_compaction_are_exact_and_never_damage() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let o = || opts(1 << 20, 4);
    let seqs: Vec<Vec<u32>> = (0..12).map(|i| seq(500 + i, 16 * 16)).collect();
    {
        let w = Store::open(dir.path(), o()).unwrap();
        for t in &seqs {
            w.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
        }
    }
    let reader = Store::open(dir.path(), o()).unwrap();
    let maint = Store::open(dir.path(), o()).unwrap();
    let done = AtomicBool::new(false);
    let reads = std::thread::scope(|scope| {
        let r = scope.spawn(|| {
            let mut reads = 0;
            while !done.load(Ordering::Relaxed) {
                for t in &seqs {
                    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
                    let m = reader.get_into(t, b"", &mut out, t.len()).unwrap();
                    assert!(prefix_matches(&l, &out, t.len(), t, m), "wrong bytes");
                    reads += 1;
                }
            }
            reads
        });
        // Evict a little, compact, store the evicted again: records keep
        // moving under the reader's feet.
        for _ in 0..10 {
            let live = maint.stats().unwrap().live_bytes;
            maint.gc(Some(live - live / 10), None, NO_PROGRESS).unwrap();
            maint.compact(NO_PROGRESS).unwrap();
            for t in &seqs {
                maint.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
            }
        }
        done.store(true, Ordering::Relaxed);
        r.join().unwrap()
    });
    assert!(reads > 0);
    assert_eq!(reader.stats().unwrap().damaged_blocks, 0);
    let mut kept = 0;
    for t in &seqs {
        let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
        let m = reader.get_into(t, b"", &mut out, t.len()).unwrap();
        assert!(prefix_matches(&l, &out, t.len(), t, m));
        kept += m;
    }
    assert!(kept > 0);
}
