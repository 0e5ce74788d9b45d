//! Version-2 segments read right whichever way their payloads are read:
//! with `O_DIRECT` when the page cache does not hold them, buffered when it
//! does, when direct reads are off, or on a file system without them
//! (tmpfs); direct reads one at a time or queued several deep (`io_uring`,
//! each record read whole into a ring's buffer); right after a put too,
//! synced or not. A torn, damaged or misplaced record is a miss. Every get
//! is checked against KV recomputed from the token ids.

use kvstore::format;
use kvstore::index::Index;
use kvstore::record;
use kvstore::{DType, Durability, Keyer, Layout, Options, Store};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod support;
use support::{kv_for, prefix_matches, seq};

/// 128 KiB blocks: whole pages, the size `O_DIRECT` reads in place.
fn layout() -> Layout {
    Layout::new(2, 8, 128, DType::Float16, 16).unwrap()
}

/// 80-byte blocks: payloads of no whole page, read through the bounce buffer.
fn small_layout() -> Layout {
    Layout::new(1, 1, 10, DType::Float16, 2).unwrap()
}

const MODEL: &str = "v2-model@1";

/// How a handle reads: (direct reads on, reads queued per reader thread).
type Reads = (bool, usize);

/// Direct reads queued, direct reads one at a time, buffered reads.
const READS: [Reads; 3] = [(true, 2), (true, 0), (false, 0)];

fn opts(l: Layout, durability: Durability, (direct, depth): Reads) -> Options {
    Options {
        fingerprint: Some(MODEL.into()),
        layout: Some(l),
        durability,
        direct_reads: direct,
        read_depth: depth,
        ..Options::default()
    }
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

/// Drops the segment files' pages from the page cache (written back first,
/// so every page can go).
fn drop_cache(dir: &Path) {
    for p in segment_files(dir) {
        let f = File::open(&p).unwrap();
        f.sync_data().unwrap();
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    }
}

/// Bytes of the segment files in the page cache, per `fincore`, if it runs.
fn resident(dir: &Path) -> Option<u64> {
    let mut total = 0;
    for p in segment_files(dir) {
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
            .arg(&p)
            .output()
            .ok()?;
        total += String::from_utf8(out.stdout)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()?;
    }
    Some(total)
}

/// Tokens served by a get of all of `t` on a fresh handle, and whether they
/// are exactly the reference KV.
fn get(dir: &Path, o: Options, l: &Layout, t: &[u32]) -> (usize, bool) {
    let s = Store::open(dir, o).unwrap();
    let mut out = vec![0xAAu8; l.kv_bytes(t.len()).unwrap()];
    let m = s.get_into(t, b"", &mut out, t.len()).unwrap();
    (m, prefix_matches(l, &out, t.len(), t, m))
}

#[test]
fn direct_and_buffered_reads_agree_cold_and_warm() {
    for l in [layout(), small_layout()] {
        for durability in [Durability::Sync, Durability::None] {
            for reads in READS {
                let direct = reads.0;
                let dir = tempfile::tempdir().unwrap();
                let t = seq(7, 24 * l.block_size as usize);
                let s = Store::open(dir.path(), opts(l, durability, reads)).unwrap();
                assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
                let case = format!("{l:?} {durability:?} reads={reads:?}");
                // At once, the writer's handle still open (with "none" its
                // pages may not be on the device yet).
                let o = || opts(l, durability, reads);
                assert_eq!(get(dir.path(), o(), &l, &t), (t.len(), true), "warm {case}");
                drop_cache(dir.path());
                assert_eq!(get(dir.path(), o(), &l, &t), (t.len(), true), "cold {case}");
                // Direct reads leave the page cache as it was; buffered
                // ones fill it (so the check can tell them apart).
                if let (Some(res), true) = (resident(dir.path()), l.block_bytes() % 4096 == 0) {
                    let payloads = 24 * l.block_bytes() as u64;
                    if direct {
                        assert!(res < payloads / 4, "{case}: {res} bytes cached");
                    } else {
                        assert!(res >= payloads, "{case}: {res} bytes cached");
                    }
                }
                drop(s);
            }
        }
    }
}

#[test]
fn a_file_system_without_direct_io_reads_buffered() {
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        return; // no tmpfs here: nothing to check
    };
    for l in [layout(), small_layout()] {
        let t = seq(9, 8 * l.block_size as usize);
        let o = || opts(l, Durability::Sync, READS[0]);
        let s = Store::open(dir.path(), o()).unwrap();
        assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
        drop(s);
        assert_eq!(get(dir.path(), o(), &l, &t), (t.len(), true));
        std::fs::remove_dir_all(dir.path().join("segments")).unwrap();
        std::fs::remove_dir_all(dir.path().join("index")).unwrap();
        std::fs::remove_file(dir.path().join("MANIFEST")).unwrap();
    }
}

/// A store of one 3-block chain; its ids.
fn three_blocks(dir: &Path, l: Layout) -> (Vec<u32>, Vec<[u8; 32]>) {
    let t = seq(5, 3 * l.block_size as usize);
    let s = Store::open(dir, opts(l, Durability::Sync, READS[0])).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    let ids = Keyer::new(MODEL, &l, None).chain(&t, l.block_size as usize, b"");
    (t, ids)
}

/// Copies block `id`'s record (meta and payload, no padding) to the end of
/// its segment after `gap` zero bytes, with `pad` of them its padding, and
/// points the index at the copy.
fn move_record(dir: &Path, l: &Layout, id: &[u8; 32], gap: u64, pad: u64) {
    let index = Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap();
    let mut txn = index.write().unwrap();
    let old = index.get_block_rw(&txn, id).unwrap().expect("indexed");
    let path = dir.join(format!("segments/{:016x}.kvseg", old.segment));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let body = record::meta_len(l) as u64 + old.stored_len;
    let mut rec = vec![0u8; body as usize];
    f.read_exact_at(&mut rec, old.offset + old.record_len - body)
        .unwrap();
    let end = f.metadata().unwrap().len();
    f.write_all_at(&vec![0u8; gap as usize], end).unwrap();
    f.write_all_at(&rec, end + gap).unwrap();
    let new = kvstore::index::Location {
        offset: end + gap - pad,
        record_len: pad + body,
        ..old
    };
    assert!(index.move_block_if_at(&mut txn, id, &old, &new).unwrap());
    index
        .set_committed_len(&mut txn, old.segment, end + gap + body)
        .unwrap();
    index.commit(txn, true).unwrap();
}

#[test]
fn a_misplaced_v2_record_is_a_miss() {
    let l = layout();
    let meta = record::meta_len(&l);
    for reads in READS {
        // Control: the copy placed as version 2 places it is served.
        let dir = tempfile::tempdir().unwrap();
        let (t, ids) = three_blocks(dir.path(), l);
        let end = segment_files(dir.path())[0].metadata().unwrap().len();
        let pad = format::pad_before(2, end, meta, l.block_bytes() as u64);
        move_record(dir.path(), &l, &ids[1], pad, pad);
        let o = || opts(l, Durability::Sync, reads);
        drop_cache(dir.path());
        assert_eq!(
            get(dir.path(), o(), &l, &t),
            (t.len(), true),
            "aligned copy"
        );
        // Misplaced: its payload 8 or 512 bytes past a page boundary (512:
        // where O_DIRECT would still read it on this disk), without padding
        // (as a version-1 record would lie) or with padding that says
        // otherwise.
        for (gap, claimed_pad) in [(pad + 8, 0), (pad + 8, 8), (pad + 512, 0)] {
            let dir = tempfile::tempdir().unwrap();
            let (t, ids) = three_blocks(dir.path(), l);
            move_record(dir.path(), &l, &ids[1], gap, claimed_pad);
            drop_cache(dir.path());
            let b = l.block_size as usize;
            assert_eq!(
                get(dir.path(), o(), &l, &t),
                (b, true),
                "gap {gap}, padding {claimed_pad}, reads={reads:?}"
            );
        }
    }
}

#[test]
fn a_torn_v2_record_is_a_miss() {
    for l in [layout(), small_layout()] {
        let meta = record::meta_len(&l) as u64;
        let b = l.block_size as usize;
        for reads in READS {
            for cut_in in ["padding", "meta", "payload", "last byte", "flip"] {
                let dir = tempfile::tempdir().unwrap();
                let (t, ids) = three_blocks(dir.path(), l);
                let loc = {
                    let index = Index::open(
                        &dir.path().join("index"),
                        true,
                        kvstore::DEFAULT_INDEX_BYTES,
                    )
                    .unwrap();
                    let txn = index.read().unwrap();
                    index.get_block(&txn, &ids[2]).unwrap().unwrap()
                };
                let pad = loc.record_len - meta - loc.stored_len;
                let cut = loc.offset
                    + match cut_in {
                        "padding" => pad / 2,
                        "meta" => pad + meta / 2,
                        "payload" | "flip" => pad + meta + loc.stored_len / 2,
                        _ => loc.record_len - 1,
                    };
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&segment_files(dir.path())[0])
                    .unwrap();
                if cut_in == "flip" {
                    // Not torn but damaged: one payload bit flipped.
                    let mut byte = [0u8];
                    f.read_exact_at(&mut byte, cut).unwrap();
                    f.write_all_at(&[byte[0] ^ 0x10], cut).unwrap();
                } else {
                    f.set_len(cut).unwrap();
                }
                drop(f);
                // Cold, so that direct reads read it.
                drop_cache(dir.path());
                let o = opts(l, Durability::Sync, reads);
                let (m, exact) = get(dir.path(), o, &l, &t);
                assert_eq!(
                    (m, exact),
                    (2 * b, true),
                    "{cut_in}, reads={reads:?}, {l:?}"
                );
            }
        }
    }
}
