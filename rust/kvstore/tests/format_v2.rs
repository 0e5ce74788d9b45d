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
use kvstore::{DType, Durability, Keyer, Layout, Options, PagedLayout, PagedPart, Store};
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
        direct_reads: Some(direct),
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

/// Bytes of the segment files in the page cache, per `fincore` (util-linux),
/// which must run: without it these tests would check nothing.
fn resident(dir: &Path) -> u64 {
    let mut total = 0;
    for p in segment_files(dir) {
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
            .arg(&p)
            .output()
            .expect("fincore (util-linux) runs");
        assert!(out.status.success(), "fincore {}: {:?}", p.display(), out);
        total += String::from_utf8(out.stdout)
            .expect("fincore prints text")
            .trim()
            .parse::<u64>()
            .expect("fincore prints a byte count");
    }
    total
}

/// A directory for segments that eviction can empty: under Cargo's target
/// directory, not `TMPDIR`, which may be a tmpfs (whose pages never leave).
fn evictable_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
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
                let dir = evictable_dir();
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
                if l.block_bytes() % 4096 == 0 {
                    let res = resident(dir.path());
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

/// Cache blocks laid out `[K or V][head][token][dim]` for `l`.
fn paged_of(l: &Layout) -> PagedLayout {
    let (b, h, d) = (
        l.block_size as usize,
        l.num_kv_heads as usize,
        l.head_dim as usize,
    );
    let part = |offset| PagedPart {
        offset,
        strides: [d, b * d, 1],
    };
    PagedLayout {
        block_stride: 2 * b * h * d,
        parts: [part(0), part(b * h * d)],
    }
}

/// By default (`direct_reads: None`) a get reads cold payloads with
/// `O_DIRECT` exactly when its handle has a hot tier to promote them into:
/// then the page cache stays empty and the next get, on another handle, is
/// served from the hot tier. Without a hot tier, and for a paged load (an
/// engine's, which promotes nothing) with one, the page cache fills. Every
/// get is checked against the reference KV.
#[test]
fn by_default_only_reads_that_fill_a_hot_tier_are_direct() {
    let l = layout();
    let n = 24;
    let t = seq(11, n * l.block_size as usize);
    let payloads = (n * l.block_bytes()) as u64;
    let dir = evictable_dir();
    let o = |hot: Option<&Path>| Options {
        hot_bytes: hot.map(|_| 2 * payloads + (4 << 20)),
        hot_dir: hot.map(Path::to_path_buf),
        direct_reads: None,
        ..opts(l, Durability::Sync, READS[0])
    };
    let s = Store::open(dir.path(), o(None)).unwrap();
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    drop(s);
    drop_cache(dir.path());
    let before = resident(dir.path());
    assert!(before < payloads / 4, "evicted, yet {before} bytes cached");

    // Into a hot tier: direct, the page cache left as it was.
    let hot = tempfile::tempdir().unwrap();
    assert_eq!(
        get(dir.path(), o(Some(hot.path())), &l, &t),
        (t.len(), true)
    );
    let after = resident(dir.path());
    assert!(after < payloads / 4, "hot tier: {after} bytes cached");
    let s = Store::open(dir.path(), o(Some(hot.path()))).unwrap();
    let mut out = vec![0u8; l.kv_bytes(t.len()).unwrap()];
    assert_eq!(s.get_into(&t, b"", &mut out, t.len()).unwrap(), t.len());
    assert!(prefix_matches(&l, &out, t.len(), &t, t.len()));
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (n as u64, 0));

    // A paged load with an empty hot tier: buffered.
    drop(s);
    let hot = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path(), o(Some(hot.path()))).unwrap();
    let paged = paged_of(&l);
    let mut cache = vec![0xEEu8; l.num_layers as usize * n * paged.block_stride * 2];
    let blocks: Vec<usize> = (0..n).rev().collect();
    let mut layers: Vec<&mut [u8]> = cache.chunks_mut(n * paged.block_stride * 2).collect();
    assert_eq!(
        s.get_paged(&t, 0, b"", &paged, &mut layers, &blocks)
            .unwrap(),
        t.len()
    );
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (0, n as u64));
    // Each landed row of D elements (contiguous in both layouts) against the
    // reference KV, `[L, 2, T, H, D]`.
    let (b, h, d) = (
        l.block_size as usize,
        l.num_kv_heads as usize,
        l.head_dim as usize,
    );
    let want = kv_for(&l, &t);
    for (layer, cache) in layers.iter().enumerate() {
        for (kv, part) in paged.parts.iter().enumerate() {
            for (k, &blk) in blocks.iter().enumerate() {
                for tok in 0..b {
                    for head in 0..h {
                        let at = blk * paged.block_stride + part.offset + (head * b + tok) * d;
                        let src = (((layer * 2 + kv) * t.len() + k * b + tok) * h + head) * d;
                        assert_eq!(
                            cache[at * 2..(at + d) * 2],
                            want[src * 2..(src + d) * 2],
                            "paged load: layer {layer} part {kv} block {k} token {tok} head {head}"
                        );
                    }
                }
            }
        }
    }
    let after = resident(dir.path());
    assert!(after >= payloads, "paged load: {after} bytes cached");
    drop(s);

    // Without a hot tier: buffered.
    drop_cache(dir.path());
    assert_eq!(get(dir.path(), o(None), &l, &t), (t.len(), true));
    let after = resident(dir.path());
    assert!(after >= payloads, "no hot tier: {after} bytes cached");
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

/// Where block `id` lies, per the index (no handle open).
fn location(dir: &Path, id: &[u8; 32]) -> Option<kvstore::index::Location> {
    let index = Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap();
    let txn = index.read().unwrap();
    index.get_block(&txn, id).unwrap()
}

/// XORs `mask` into the byte at `at` of segment `seg`.
fn flip(dir: &Path, seg: u64, at: u64, mask: u8) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(format!("segments/{seg:016x}.kvseg")))
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ mask], at).unwrap();
}

/// A record whose padding alone is damaged (its meta and payload sound) is
/// damaged for every path: a get, `verify`, `repair`, and the scanner
/// behind `rebuild-index`, which must not put it back in the index. The
/// blocks before it are served, bit-exact, throughout.
#[test]
fn damaged_padding_is_a_damaged_record_everywhere() {
    let l = layout();
    let b = l.block_size as usize;
    let meta = record::meta_len(&l) as u64;
    for (at_in, repair_first) in [("first", false), ("middle", true), ("last", false)] {
        let dir = tempfile::tempdir().unwrap();
        let (t, ids) = three_blocks(dir.path(), l);
        let loc = location(dir.path(), &ids[1]).unwrap();
        let pad = loc.record_len - meta - loc.stored_len;
        assert!(pad > 0, "record 1 is padded");
        let at = loc.offset
            + match at_in {
                "first" => 0,
                "middle" => pad / 2,
                _ => pad - 1,
            };
        flip(dir.path(), loc.segment, at, 0x04);
        let case = format!("padding byte {at_in}");
        let o = || opts(l, Durability::Sync, READS[0]);
        // Read: a miss from the damaged block on.
        assert_eq!(get(dir.path(), o(), &l, &t), (b, true), "get, {case}");
        let s = Store::open(dir.path(), o()).unwrap();
        let hex = kvstore::block_id_hex(&ids[1]);
        let v = s.verify(&|_, _| {}).unwrap();
        assert!(
            v.damaged
                .iter()
                .any(|d| d.block_id == hex && d.reason.contains("padding")),
            "verify, {case}: {:?}",
            v.damaged
        );
        if repair_first {
            // Quarantined: the same miss, and nothing left to repair.
            let r = s.repair(&|_, _| {}).unwrap();
            assert!(
                r.damaged.iter().any(|d| d.block_id == hex),
                "repair, {case}"
            );
            assert_eq!(s.lookup(&t, b"").unwrap(), b, "after repair, {case}");
        }
        drop(s);
        // The scanner agrees: the rebuilt index names the block damaged
        // and does not serve it.
        let rebuilt = kvstore::rebuild_index(dir.path(), &|_, _| {}).unwrap();
        assert_eq!(rebuilt.blocks, 2, "rebuild, {case}: {rebuilt:?}");
        let named: Vec<_> = rebuilt
            .damaged
            .iter()
            .filter_map(|(_, d)| d.block_id)
            .collect();
        assert_eq!(named, vec![ids[1]], "rebuild, {case}: {rebuilt:?}");
        assert!(
            location(dir.path(), &ids[1]).is_none(),
            "re-indexed, {case}"
        );
        assert_eq!(
            get(dir.path(), o(), &l, &t),
            (b, true),
            "get after rebuild, {case}"
        );
        let s = Store::open(dir.path(), o()).unwrap();
        let v = s.verify(&|_, _| {}).unwrap();
        assert_eq!(
            v.damaged
                .iter()
                .map(|d| d.block_id.clone())
                .collect::<Vec<_>>(),
            vec![hex],
            "verify after rebuild, {case}"
        );
        // A put of the same tokens stores the block again.
        assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
        drop(s);
        assert_eq!(
            get(dir.path(), o(), &l, &t),
            (t.len(), true),
            "put again, {case}"
        );
    }
}

/// A version-1 store, made the way an older build left it: small blocks
/// (no record is padded, so the records are version-1 bytes), segment
/// headers of version 1, a MANIFEST of format 1. Returns the sequences.
fn v1_store(dir: &Path) -> Vec<Vec<u32>> {
    let l = small_layout();
    let seqs: Vec<Vec<u32>> = (0..3)
        .map(|s| seq(20 + s, 6 * l.block_size as usize))
        .collect();
    let s = Store::open(dir, opts(l, Durability::Sync, READS[0])).unwrap();
    for t in &seqs {
        assert_eq!(s.put(t, &kv_for(&l, t), t.len(), b"").unwrap(), t.len());
    }
    drop(s);
    for p in segment_files(dir) {
        let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        let mut h = [0u8; format::SEGMENT_HEADER_LEN];
        f.read_exact_at(&mut h, 0).unwrap();
        let (n, _) = format::decode_segment_header(&h).unwrap();
        f.write_all_at(&format::encode_segment_header_of(n, 1), 0)
            .unwrap();
    }
    let path = dir.join("MANIFEST");
    let m = format::Manifest::decode(&std::fs::read(&path).unwrap()).unwrap();
    let v1 = format::Manifest {
        format_version: 1,
        ..m
    };
    std::fs::write(&path, v1.encode()).unwrap();
    seqs
}

fn segment_versions(dir: &Path) -> Vec<u32> {
    segment_files(dir)
        .iter()
        .map(|p| {
            let b = std::fs::read(p).unwrap();
            format::decode_segment_header(&b).unwrap().1
        })
        .collect()
}

fn manifest_version(dir: &Path) -> u32 {
    format::Manifest::decode(&std::fs::read(dir.join("MANIFEST")).unwrap())
        .unwrap()
        .format_version
}

/// Every sequence reads back bit-exact on a fresh handle.
fn all_exact(dir: &Path, seqs: &[Vec<u32>]) -> bool {
    let l = small_layout();
    seqs.iter()
        .all(|t| get(dir, opts(l, Durability::Sync, READS[0]), &l, t) == (t.len(), true))
}

/// Reading a version-1 store leaves its MANIFEST as it was, byte for byte
/// (a format-1 build can still open it); the first segment this build
/// writes, by a put or by compaction, upgrades it first.
#[test]
fn a_v1_manifest_is_upgraded_by_the_first_segment_only() {
    let l = small_layout();
    let dir = tempfile::tempdir().unwrap();
    let seqs = v1_store(dir.path());
    let before = std::fs::read(dir.path().join("MANIFEST")).unwrap();
    {
        let s = Store::open(dir.path(), opts(l, Durability::Sync, READS[0])).unwrap();
        assert_eq!(s.manifest().unwrap().format_version, 1);
        for t in &seqs {
            assert_eq!(s.lookup(t, b"").unwrap(), t.len());
        }
        assert!(s.verify(&|_, _| {}).unwrap().damaged.is_empty());
        assert_eq!(s.stats().unwrap().blocks, 18);
        // A put of what the store holds writes nothing.
        assert_eq!(
            s.put(&seqs[0], &kv_for(&l, &seqs[0]), seqs[0].len(), b"")
                .unwrap(),
            seqs[0].len()
        );
    }
    // Opened without a layout too (as `kvstore info` does).
    let bare = Options {
        create: false,
        ..Options::default()
    };
    drop(Store::open(dir.path(), bare).unwrap());
    assert!(all_exact(dir.path(), &seqs));
    assert_eq!(
        std::fs::read(dir.path().join("MANIFEST")).unwrap(),
        before,
        "reads rewrote it"
    );
    let v1_segments = segment_versions(dir.path());
    assert!(!v1_segments.is_empty() && v1_segments.iter().all(|&v| v == 1));

    // The first put upgrades it; the rest of the MANIFEST is as it was.
    let s = Store::open(dir.path(), opts(l, Durability::Sync, READS[0])).unwrap();
    let t = seq(40, 4 * l.block_size as usize);
    assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
    assert_eq!(s.manifest().unwrap().format_version, format::FORMAT_VERSION);
    let old = format::Manifest::decode(&before).unwrap();
    let new =
        format::Manifest::decode(&std::fs::read(dir.path().join("MANIFEST")).unwrap()).unwrap();
    assert_eq!(
        new,
        format::Manifest {
            format_version: format::FORMAT_VERSION,
            ..old
        }
    );
    assert_eq!(
        segment_versions(dir.path()),
        [&v1_segments[..], &[2]].concat()
    );
    drop(s);
    assert!(all_exact(dir.path(), &[&seqs[..], &[t][..]].concat()));

    // Compaction writes a version-2 segment: it upgrades the MANIFEST too.
    let dir = tempfile::tempdir().unwrap();
    let seqs = v1_store(dir.path());
    let s = Store::open(dir.path(), opts(l, Durability::Sync, READS[0])).unwrap();
    s.compact(&|_, _| {}).unwrap();
    assert_eq!(manifest_version(dir.path()), format::FORMAT_VERSION);
    assert_eq!(segment_versions(dir.path()), vec![2]);
    drop(s);
    assert!(all_exact(dir.path(), &seqs));
}

/// A crash or power loss around the MANIFEST's upgrade (at each of its
/// steps: temp file written, synced, renamed, directory synced; and at the
/// first step of the segment after it) leaves a store that opens, reads its
/// version-1 segments bit-exact, verifies clean, says format 1 or 2, and
/// takes the put again.
#[cfg(feature = "fault-injection")]
mod upgrade_crash {
    use super::*;
    use kvstore::fault::{self, Mode, Op};

    const CHILD_ENV: &str = "KVSTORE_UPGRADE_CHILD";

    fn new_seq() -> Vec<u32> {
        seq(41, 4 * small_layout().block_size as usize)
    }

    /// The child: opens the store and puts one new sequence under the
    /// armed plan; with no plan, writes the trace of the put's steps.
    #[test]
    #[ignore = "the child process of upgrade_crash_points; it runs it"]
    fn upgrade_child() {
        let spec = std::env::var(CHILD_ENV)
            .unwrap_or_else(|_| panic!("run by upgrade_crash_points, which sets {CHILD_ENV}"));
        let (dir, plan) = spec.split_once(';').unwrap();
        let dir = Path::new(dir);
        let l = small_layout();
        let s = Store::open(dir, opts(l, Durability::Sync, READS[0])).unwrap();
        match plan.split_once(':') {
            Some(("crash", n)) => fault::arm(n.parse().unwrap(), Mode::Crash),
            Some(("power", n_seed)) => {
                let (n, seed) = n_seed.split_once(':').unwrap();
                let seed = seed.parse().unwrap();
                fault::arm(n.parse().unwrap(), Mode::PowerLoss { seed });
            }
            _ => fault::count_only(),
        }
        let t = new_seq();
        s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap();
        let trace: String = fault::trace()
            .iter()
            .map(|op| match op {
                Op::Write => 'W',
                Op::Sync => 'S',
                Op::Rename => 'R',
                Op::Unlink => 'U',
                Op::Commit => 'C',
            })
            .collect();
        std::fs::write(dir.with_extension("trace"), trace).unwrap();
    }

    fn run_child(dir: &Path, plan: &str) {
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "upgrade_crash::upgrade_child",
                "--test-threads=1",
                "-q",
            ])
            .env(CHILD_ENV, format!("{};{plan}", dir.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        // A plan kills the child; without one it ends well.
        assert_eq!(status.success(), plan == "count", "{plan}: {status}");
    }

    #[test]
    fn upgrade_crash_points() {
        let l = small_layout();
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("count");
        let seqs = v1_store(&dir);
        run_child(&dir, "count");
        let trace = std::fs::read_to_string(dir.with_extension("trace")).unwrap();
        // The MANIFEST's upgrade is the put's first rename: W S R S.
        let r = trace.find('R').expect("the upgrade renames") + 1;
        assert_eq!(&trace[r - 3..=r], "WSRS", "{trace}");
        assert_eq!(manifest_version(&dir), format::FORMAT_VERSION);
        // Power lost just before the directory's fsync may keep or undo
        // the rename (the old MANIFEST comes back): seeds that give both.
        let mut versions_after_rename = std::collections::BTreeSet::new();
        let plans = ["crash", "power"].into_iter().flat_map(|mode| {
            (r - 2..=r + 2).flat_map(move |nth| {
                let seeds = if mode == "power" && nth == r + 1 {
                    0..8
                } else {
                    7..8
                };
                seeds.map(move |seed| (mode, nth, seed))
            })
        });
        for (mode, nth, seed) in plans {
            let dir = root.path().join(format!("{mode}-{nth}-{seed}"));
            v1_store(&dir);
            let plan = match mode {
                "power" => format!("power:{nth}:{seed}"),
                _ => format!("{mode}:{nth}"),
            };
            run_child(&dir, &plan);
            let case = format!("{plan} ({})", &trace[nth - 1..nth]);
            let version = manifest_version(&dir);
            assert!((1..=format::FORMAT_VERSION).contains(&version), "{case}");
            if mode == "power" && nth == r + 1 {
                versions_after_rename.insert(version);
            }
            if mode == "crash" && nth > r {
                assert_eq!(version, format::FORMAT_VERSION, "{case}: renamed before");
            }
            assert!(all_exact(&dir, &seqs), "{case}");
            let s = Store::open(&dir, opts(l, Durability::Sync, READS[0])).unwrap();
            assert!(s.verify(&|_, _| {}).unwrap().damaged.is_empty(), "{case}");
            let t = new_seq();
            assert_eq!(s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap(), t.len());
            drop(s);
            assert_eq!(manifest_version(&dir), format::FORMAT_VERSION, "{case}");
            assert!(all_exact(&dir, &[&seqs[..], &[t][..]].concat()), "{case}");
        }
        assert_eq!(
            versions_after_rename.into_iter().collect::<Vec<_>>(),
            vec![1, format::FORMAT_VERSION],
            "power lost before the directory's fsync: the rename both kept and undone"
        );
    }
}
