//! The segment scanner against what the store really writes: the v1 fixture
//! and a fresh store's segments scan clean, record for record. Also keeps the
//! fuzz targets' seed corpus (`fuzz/seeds`) in step with the format.

use kvstore::format::{self, Manifest};
use kvstore::index::Location;
use kvstore::record;
use kvstore::scan::{scan_segment, ScanReport, ScannedRecord};
use kvstore::{Codec, DType, Durability, Layout, Options, Store};
use std::path::{Path, PathBuf};

fn segment_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvseg"))
        .map(|p| {
            let stem = p.file_stem().unwrap().to_str().unwrap();
            (u64::from_str_radix(stem, 16).unwrap(), p)
        })
        .collect();
    v.sort();
    v
}

fn scan_file(path: &Path, layout: &Layout) -> (ScanReport, Vec<ScannedRecord>) {
    let f = std::fs::File::open(path).unwrap();
    let mut found = Vec::new();
    let report = scan_segment(&f, layout, |r| found.push(r)).unwrap();
    (report, found)
}

#[test]
fn v1_fixture_scans_clean() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    let m = Manifest::decode(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    let layout = m.layout().unwrap();
    let mut records = 0;
    let mut compressed = 0;
    for (n, path) in segment_files(&dir) {
        let (report, found) = scan_file(&path, &layout);
        assert!(report.is_clean(), "{}: {report:?}", path.display());
        assert_eq!(report.segment, Some(n));
        assert_eq!(report.valid_len, std::fs::metadata(&path).unwrap().len());
        records += found.len();
        compressed += found
            .iter()
            .filter(|r| r.header.flags & record::FLAG_ZSTD != 0)
            .count();
    }
    assert_eq!(records, 2 + 3 + 4);
    assert!(compressed > 0, "the fixture holds compressed records");
}

#[test]
fn store_segments_scan_clean() {
    let layout = Layout::new(2, 2, 8, DType::BFloat16, 4).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let opts = |codec| Options {
        fingerprint: Some("scan-test".into()),
        layout: Some(layout),
        durability: Durability::Sync,
        codec,
        ..Options::default()
    };
    let mut blocks = 0;
    // Raw records, then (other handles, other segments) compressed ones of
    // each codec, where the data compresses.
    let codecs = [Codec::Raw, Codec::Zstd(3), Codec::Exponent];
    for (c, codec) in codecs.into_iter().enumerate() {
        let s = Store::open(tmp.path(), opts(codec)).unwrap();
        for seq in 0..6u32 {
            let tokens: Vec<u32> = (0..16)
                .map(|i| c as u32 * 100_000 + seq * 1000 + i)
                .collect();
            let kv: Vec<u8> = (0..layout.kv_bytes(tokens.len()).unwrap())
                .map(|i| {
                    if seq % 2 == 0 {
                        (i % 5) as u8
                    } else {
                        (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8
                    }
                })
                .collect();
            s.put(&tokens, &kv, tokens.len(), b"").unwrap();
        }
        blocks = s.stats().unwrap().blocks;
    }
    let files = segment_files(tmp.path());
    let (mut records, mut raw, mut zstd, mut exponent) = (0, 0, 0, 0);
    for (n, path) in &files {
        let (report, found) = scan_file(path, &layout);
        assert!(report.is_clean(), "{}: {report:?}", path.display());
        assert_eq!(report.segment, Some(*n));
        for r in &found {
            assert_eq!(r.tokens.len(), 4);
            if r.header.flags & record::FLAG_ZSTD != 0 {
                zstd += 1;
            } else if r.header.flags == record::FLAG_EXPONENT {
                exponent += 1;
            } else {
                raw += 1;
            }
        }
        records += found.len() as u64;
    }
    assert_eq!(records, blocks);
    assert!(
        raw > 0 && zstd > 0 && exponent > 0,
        "raw {raw}, zstd {zstd}, exponent {exponent}"
    );
}

/// The layout the fuzz targets use (`fuzz/src/lib.rs`): 32-byte blocks.
fn fuzz_layout() -> Layout {
    Layout::new(1, 1, 4, DType::Float16, 2).unwrap()
}

fn record(layout: &Layout, k: u8, compressed: bool) -> Vec<u8> {
    let raw: Vec<u8> = (0..layout.block_bytes() as u8).map(|i| i ^ k).collect();
    let stored = if compressed {
        zstd::bulk::compress(&[k; 32], 3).unwrap()
    } else {
        raw.clone()
    };
    assert!(stored.len() < raw.len() || !compressed);
    let flags = if compressed { record::FLAG_ZSTD } else { 0 };
    let mut r = record::encode_meta(
        flags,
        &[k; 32],
        &[u32::from(k), 7],
        stored.len() as u64,
        raw.len() as u64,
        crc32c::crc32c(&stored),
        crc32c::crc32c(&raw),
    );
    r.extend_from_slice(&stored);
    r
}

fn fuzz_seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let l = fuzz_layout();
    let mut segment = format::encode_segment_header(1).to_vec();
    segment.extend(record(&l, 1, false));
    segment.extend(record(&l, 2, true));
    let manifest = Manifest {
        format_version: format::FORMAT_VERSION,
        fingerprint: "fuzz".into(),
        num_layers: l.num_layers,
        num_kv_heads: l.num_kv_heads,
        head_dim: l.head_dim,
        dtype: l.dtype.name().into(),
        block_size: l.block_size,
        created_unix: 1,
        store_id: "00".into(),
        storage: None,
        kind: None,
    };
    let location = Location {
        segment: 1,
        offset: 32,
        record_len: 120,
        stored_len: 32,
        used_us: 1_700_000_000_000_000,
    };
    vec![
        ("segment_scan", "two_records", segment),
        // `damaged_segment`'s reading: 4 records, a bit flip, a zeroed range.
        (
            "segment_scan",
            "structured",
            vec![4, 1, 0, 2, 1, 3, 7, 4, 0, 0, 200, 0, 3, 1, 64, 1, 9],
        ),
        (
            "segment_header",
            "valid",
            format::encode_segment_header(1).to_vec(),
        ),
        (
            "segment_header",
            "valid_v1",
            format::encode_segment_header_of(1, 1).to_vec(),
        ),
        ("record_header", "raw", record(&l, 3, false)),
        ("record_header", "zstd", record(&l, 4, true)),
        ("manifest", "valid", manifest.encode()),
        ("index_values", "location", location.encode().to_vec()),
    ]
}

/// The fuzz seeds on disk are the ones this format writes. To regenerate:
/// `KVSTORE_WRITE_FUZZ_SEEDS=1 cargo test -p kvstore --test scan`.
#[test]
fn fuzz_seeds_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let write = std::env::var_os("KVSTORE_WRITE_FUZZ_SEEDS").is_some();
    for (target, name, bytes) in fuzz_seeds() {
        let path = root.join(target).join(name);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        } else {
            let on_disk = std::fs::read(&path).unwrap_or_default();
            assert!(
                on_disk == bytes,
                "{} is stale: KVSTORE_WRITE_FUZZ_SEEDS=1 cargo test -p kvstore --test scan",
                path.display()
            );
        }
    }
}
